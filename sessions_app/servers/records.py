"""What a session's server record tells, and how a server's end is told (docs/behaviour.md §5):
the process (pid and start time), the URL and key this backend reaches it by, the key
file of one start, and the last log lines every watcher may read. Shared by the other
modules of :mod:`sessions_app.servers`; it starts, stops and watches nothing itself.
"""

from __future__ import annotations

from machines_app.llama_server import Endpoint
from machines_app.models import ModelFile
from machines_app.template_files import MAX_TEMPLATE_BYTES, without_template_lines
from machines_app.transports import ProcessId, Transport, TransportError, transport_for

from .. import orphans, turns
from ..events import record_error, set_status
from ..models import AgentSession
from ..transcript import TurnEnd
from .models import ServerRecord

Status = AgentSession.Status


def key_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """Where the server's API key waits for llama-server to read it at start, on the
    server's machine (mode 0600; removed once the server is ready or has failed). One file
    per start (the port tells starts apart), so a cancelled start never removes the key of
    the start that replaced it."""
    return key_file(session.pk, transport, port)


def key_file(session_id: int, transport: Transport, port: int) -> str:
    # Its name also tells Corral's servers apart on the machine (orphans.key_file).
    return orphans.key_file(transport, session_id, port)


def proc_of(record: ServerRecord) -> ProcessId:
    """The recorded process: its pid and start time together, so a reused pid is never taken for it."""
    return ProcessId(record.pid, record.start_time)


def endpoint_of(transport: Transport, record: ServerRecord) -> Endpoint:
    """How this backend reaches the recorded server through ``transport``: its URL and its own key."""
    return Endpoint(transport.base_url(record.port), record.api_key)


def server_endpoint(session: AgentSession) -> Endpoint | None:
    """How this backend reaches the session's server (URL and key), or None when it has none."""
    record = ServerRecord.objects.filter(session=session).select_related("machine").first()
    if record is None:
        return None
    return endpoint_of(transport_for(record.machine), record)


def template_safe(session: AgentSession, transport: Transport, log_tail: str) -> str:
    """A server's last log lines as every watcher of ``session`` may read them (and its
    export keeps them): without the lines that quote its model file's chat template file
    (docs/security.md), read back from the machine to know them. Unchanged for a model
    whose template is not a file."""
    model = ModelFile.objects.filter(machine_id=session.machine_id, key=session.model_key).first()
    if model is None or not model.chat_template_file or not log_tail.strip():
        return log_tail
    try:
        path = transport.real_path(model.chat_template_file)
        text = transport.read_head(path, MAX_TEMPLATE_BYTES).decode("utf-8", "replace")
    except (TransportError, OSError):
        text = None
    return without_template_lines(log_tail, text)


def fail(session: AgentSession, message: str, log: str = "") -> None:
    """The server is gone: say so (``log``: its last words, shown folded below the
    sentence), status ``exited``, and end an open turn."""
    record_error(session.pk, message, log=log)
    set_status(session.pk, Status.EXITED)
    if AgentSession.objects.filter(pk=session.pk, turn_active=True).exists():
        turns.finish_turn(session.pk, TurnEnd.ERROR)


def unknown_sentence(exc: TransportError) -> str:
    """What a session says when its machine cannot be asked whether its server runs."""
    return f"{exc} The session's server cannot be checked; its status is unknown until the machine answers again."
