"""Adopting a session's server that already runs (docs/behaviour.md §5): a start finds the
session's recorded process still there — a redelivered start task, a worker that died
after spawning it, a machine that answered again while it loaded — and takes it up
rather than start a second server holding the same model.
"""

from __future__ import annotations

import logging

from machines_app.transports import Transport, TransportError

from ..events import set_status
from ..models import AgentSession
from .models import ServerRecord
from .ready import go_on
from .records import proc_of
from .stop import wait_for_stop

Status = AgentSession.Status
log = logging.getLogger(__name__)


def live_record(session: AgentSession, transport: Transport) -> ServerRecord | None:
    """The session's recorded server when its process (same pid and start time) still runs
    on ``transport``'s machine, or cannot be told to be gone; None when there is nothing to
    adopt. A stop under way (an idle stop saving its slot) is waited for first; a record
    whose process is gone is deleted here."""
    record = ServerRecord.objects.filter(session=session).first()
    if record is not None and record.stopping:
        record = wait_for_stop(record, transport)
    if record is None:
        return None
    try:
        alive = transport.process_alive(proc_of(record))
    except TransportError:
        alive = True  # cannot tell: never risk two servers holding one model
    if alive:
        return record
    record.delete()
    return None


def adopt(session: AgentSession, record: ServerRecord) -> bool:
    """Take up the session's live server (``record``, from :func:`live_record`). True when
    it is still loading: the caller waits for it as for a server it started itself. A
    server that was ready, its start lost on the way to saying so, makes the session
    ``idle`` and its work go on."""
    log.info("session %s: adopting llama-server pid %s", session.pk, record.pid)
    if record.ready_at is None:
        return True
    if set_status(session.pk, Status.IDLE, only_from=(Status.LOADING,)):
        # Ready before, its start lost on the way to saying so (docs/behaviour.md §5).
        go_on(session.pk)
    return False
