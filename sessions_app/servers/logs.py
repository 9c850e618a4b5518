"""A session's llama-server logs on the machine that runs it: one owner-only file per start,
the newest ``CORRAL_SERVER_LOGS_KEPT`` kept, all removed with the session
(docs/behaviour.md C08, docs/operations.md "Disk").
"""

from __future__ import annotations

import logging
import posixpath
import re

from machines_app.transports import Transport, TransportError, transport_at

from ..models import AgentSession

log = logging.getLogger(__name__)


def log_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """The owner-only log file of one start of the session's server, on the machine that
    runs it (a remote server writes its log there, read back by the tail: docs/ssh.md).
    One file per start (the port tells starts apart), so a failed start's last words are
    its own, never an earlier run's (docs/behaviour.md C08)."""
    return posixpath.join(transport.private_dir(), f"session-{session.pk}-{port}.log")


#: A server log's file name: ``session-<session id>-<port>.log`` (:func:`log_path_for`).
SERVER_LOG = re.compile(r"session-(\d+)-(\d+)\.log")


def prune_server_logs(transport: Transport, session_id: int, keep: int, *, current: str = "") -> int:
    """Delete the session's server logs on the machine of ``transport`` but the newest
    ``keep`` (by modification time), ``current`` — the log of the start under way — always
    among those kept; ``keep=0`` with no ``current`` deletes them all (the session is
    deleted). How many were deleted. Raises TransportError when the machine cannot be
    asked (``CORRAL_SERVER_LOGS_KEPT``, docs/operations.md "Disk")."""
    directory = transport.private_dir()
    logs = sorted(
        ((mtime, name) for name, mtime in transport.list_files(directory)
         if (m := SERVER_LOG.fullmatch(name)) and int(m.group(1)) == session_id
         and posixpath.join(directory, name) != current),
        reverse=True,
    )
    room = max(keep - (1 if current else 0), 0)
    for _, name in logs[room:]:
        transport.remove(posixpath.join(directory, name))
    return len(logs[room:])


def remove_server_logs(place: dict, session_id: int) -> None:
    """Delete every server log of a deleted session from its machine (``place``: a
    :func:`machines_app.transports.machine_place`, since the machine may be gone too)."""
    try:
        prune_server_logs(transport_at(place), session_id, 0)
    except TransportError as exc:
        log.warning("could not remove the server logs of session %s on %s: %s", session_id, place.get("name"), exc)
