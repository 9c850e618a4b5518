"""The sandbox a session's server and its tools run in (docs/security.md "What a tool can
reach"): bubblewrap found and noted on the machine, a start refused on the backend's own
machine without it, and the machine as a tool call sees it.
"""

from __future__ import annotations

from machines_app import actions as machine_actions
from machines_app.models import Machine
from machines_app.transports import ToolView, Transport, TransportError, transport_for

#: Why a server on the backend's own machine is not started without its sandbox.
UNCONTAINED_REFUSED = (
    "llama-server was not started: its tools would run next to Corral's own files on this machine (database, "
    "secret key, SSH keys). {reason}. An admin who accepts that can empty the machine's 'bubblewrap' field."
)


def sandbox_for(machine: Machine, transport: Transport) -> str:
    """bubblewrap's absolute path on the machine, for the server about to start there, or
    '' to start it without a sandbox; what was found is noted on the machine (the admin
    shows it). On the backend's own machine a missing or broken bubblewrap refuses the
    start (TransportError with the sentence): the tools would sit next to every secret
    Corral holds. On an SSH machine the server starts anyway, and its admin page says that
    tools there can read Corral's files (docs/security.md)."""
    bwrap = machine_actions.check_containment(machine, transport)
    if not bwrap and machine.bwrap_path.strip() and machine.transport == Machine.Transport.LOCAL:
        raise TransportError(UNCONTAINED_REFUSED.format(reason=machine.containment_reason))
    return bwrap


def tool_view(machine: Machine, transport: Transport | None = None) -> ToolView:
    """The machine as a tool call sees it (machines_app.transports.ToolView): commands in its
    tool sandbox, Corral's own files there invisible. Raises TransportError when the
    machine cannot be reached, or, on the backend's own machine, when there is no sandbox
    to run a tool in (as :func:`sandbox_for` refuses a server then)."""
    transport = transport or transport_for(machine)
    return ToolView(transport, sandbox_for(machine, transport))
