"""How Corral acts on a machine: one Transport per kind of link (docs/behaviour.md §2, §11).

Every machine operation — list model files, read a file's head, start a process, check a
pid, reach a port, read a log tail, stop — goes through a :class:`Transport`. Tests that
need a fake replace this seam, never the domain code above it.

The package, one job a module (read them in this order):

* :mod:`.base` — the :class:`Transport` interface, what its operations answer and raise;
* :mod:`.commands` — following a tool command: output cap, timeout, cancel, its group ended;
* :mod:`.local` — :class:`LocalTransport`, the machine the backend runs on;
* :mod:`.remote` — :class:`SSHTransport`, a machine reached over SSH (:mod:`machines_app.ssh`);
* :mod:`.places` — which transport reaches a machine, and whether this host may reach it;
* :mod:`.relay` — :class:`RelayTransport`, another host's local machine as a page reads it
  (asked of that host: :func:`reader_for`);
* :mod:`.tool_view` — :class:`ToolView`, a machine as a tool call sees it.

Every public name is re-exported here: ``from machines_app.transports import X`` reaches
it wherever it lives. A test that replaces a name patches the module that looks it up.
"""

from .base import (
    CommandResult,
    ElsewhereError,
    FileInfo,
    ProcessId,
    Transport,
    TransportError,
    parse_proc_group,
    parse_proc_stat,
)
from .commands import COMMAND_GRACE, COMMAND_POLL
from .local import LocalTransport
from .places import is_here, machine_place, ssh_target, transport_at, transport_for
from .relay import RelayTransport, one_reader, reader_for
from .remote import LOG_TAIL_BYTES, MAX_LISTED_ENTRIES, LinkReport, SSHTransport
from .tool_view import ToolView

__all__ = [
    "COMMAND_GRACE",
    "COMMAND_POLL",
    "LOG_TAIL_BYTES",
    "MAX_LISTED_ENTRIES",
    "CommandResult",
    "ElsewhereError",
    "FileInfo",
    "LinkReport",
    "LocalTransport",
    "ProcessId",
    "RelayTransport",
    "SSHTransport",
    "ToolView",
    "Transport",
    "TransportError",
    "is_here",
    "machine_place",
    "one_reader",
    "parse_proc_group",
    "parse_proc_stat",
    "reader_for",
    "ssh_target",
    "transport_at",
    "transport_for",
]
