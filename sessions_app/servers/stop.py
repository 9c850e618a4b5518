"""Stopping a session's llama-server (docs/behaviour.md §4, §5): on purpose (Stop), to sleep
when idle, for a restart, or because the session is deleted. The slot is saved first;
SIGTERM, grace, SIGKILL; the record goes only once the process is gone, and a machine
that cannot be reached leaves the stop pending for the watch ("no orphans").
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from machines_app.llama_server import SLOT_IO_TIMEOUT
from machines_app.transports import ProcessId, Transport, TransportError, machine_place, transport_at, transport_for

from .. import dispatch, orphans, turns
from ..events import append, change_status, locked
from ..models import AgentSession
from ..server_state import idle_sessions
from ..transcript import Kind, TurnEnd
from .models import ServerRecord, SlotSave
from .records import key_file, proc_of
from .slots import save_before_stop

Status = AgentSession.Status
log = logging.getLogger(__name__)


def wait_for_stop(record: ServerRecord, transport: Transport) -> ServerRecord | None:
    """Wait for a stop under way (an idle stop saving the slot, then SIGTERM and grace) to
    remove the record; a stop that never ends (its worker died) is finished here. None
    once the record is gone."""
    deadline = time.monotonic() + SLOT_IO_TIMEOUT + settings.CORRAL_STOP_GRACE + 15
    while time.monotonic() < deadline:
        if not ServerRecord.objects.filter(pk=record.pk).exists():
            return None
        time.sleep(0.2)
    log.warning("session %s: the stop of pid %s never finished; finishing it", record.session_id, record.pid)
    try:
        transport.stop(proc_of(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError:
        return record  # cannot tell: the start's adoption (adopt.live_record) decides as for any record
    transport.release_port(record.port)
    ServerRecord.objects.filter(pk=record.pk).delete()
    return None


def stop_quietly(record: ServerRecord, transport: Transport) -> None:
    """Stop a server that is not to go on, saying nothing in the transcript (a start
    cancelled while its slot was restored, one started again cold): no slot saved; a
    machine that cannot be reached leaves the stop pending."""
    ServerRecord.objects.filter(pk=record.pk).update(stopping=True)
    try:
        transport.stop(proc_of(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError as exc:
        orphans.defer_stop(machine_place(record.machine), record.pid, record.start_time, record.port,
                           record.session_id, exc)
    transport.release_port(record.port)
    ServerRecord.objects.filter(pk=record.pk).delete()


def stop_process(session_id: int, *, stopped: dict | None = None, claimed: bool = False,
                 status: str | None = None) -> bool:
    """Save the slot (a ready server's prompt cache, docs/behaviour.md §5), then SIGTERM, a
    grace period, then SIGKILL, and only then clear the record (docs/behaviour.md C21).
    ``stopped``: a ``server_stopped`` payload to record before the record goes (so a start
    waiting for this stop follows it in the transcript), with ``status`` the session's
    status from then on (in the same transaction).

    One stop at a time: the record's ``stopping`` flag is claimed with a conditional
    UPDATE (``claimed``: the caller already did, as an idle stop does); a stop that finds
    another under way (a Restart clicked while Stop still saves) waits for it to finish
    instead of saving or signalling a second time. False when there was no server to stop
    here (none, or another stop stopped it)."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return False
    transport = transport_for(record.machine)
    if not claimed and not ServerRecord.objects.filter(pk=record.pk, stopping=False).update(stopping=True):
        wait_for_stop(record, transport)
        return False
    try:
        save_before_stop(record, transport)
        transport.stop(proc_of(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError as exc:
        # The machine cannot be reached to stop it: the stop stays pending and the watch
        # finishes it when the machine answers (docs/behaviour.md §5 "no orphans").
        orphans.defer_stop(machine_place(record.machine), record.pid, record.start_time, record.port, session_id, exc)
    transport.release_port(record.port)
    with transaction.atomic():
        try:
            session = locked(session_id)
        except AgentSession.DoesNotExist:
            return True  # deleted while it stopped: its record went with it, nobody is left to tell
        if stopped is not None:
            append(session, Kind.SERVER_STOPPED, stopped)
        if status is not None:
            change_status(session, status)
        record.delete()
    return True


def stop_server(session_id: int, *, reason: str = "stopped", by: dict | None = None) -> None:
    """Stop the session's server on purpose; status becomes ``stopped`` (not ``exited``,
    which says the server went away by itself: docs/behaviour.md §4). A running turn ends (its open
    questions closed as refusals); queued messages wait for a restart (docs/behaviour.md §8, §10).
    ``by`` is who asked (``actions.by``), None when Corral itself stops it.

    The status changes, with the ``server_stopped`` event, only once the process is gone:
    a Restart asked meanwhile follows the stop in the transcript, never precedes it
    (``actions.do_restart`` refuses while a stop is under way). The turn the stop breaks
    off hands nothing on meanwhile (``turns.finish_turn`` with ``stopped``).
    """
    stopped = {"reason": reason, **({"by": by} if by else {})}
    try:
        if not stop_process(session_id, stopped=stopped, status=Status.STOPPED):
            # No server here (it exited) or another stop stopped it: still stopped on purpose,
            # unless a restart took over meanwhile (loading).
            with transaction.atomic():
                session = locked(session_id)
                if session.status != Status.LOADING and session.status != Status.STOPPED:
                    append(session, Kind.SERVER_STOPPED, stopped)
                    change_status(session, Status.STOPPED)
        turns.finish_if_unheld(session_id, TurnEnd.STOPPED)
    except AgentSession.DoesNotExist:
        # Deleted meanwhile: its delete stops whatever still runs (stop_when_deleted).
        log.info("session %s: deleted while its server stopped", session_id)


def sleep_server(session_id: int, *, idle_for: timedelta | None = None, by: dict | None = None) -> bool:
    """Stop an idle session's server to free its memory (docs/behaviour.md §5 "sleep"): its
    slot is saved, status ``sleeping``, and the next message starts it again
    (``actions.do_send_message``). Only a session that is ``idle`` with no open turn and a
    ready server is put to sleep, and with ``idle_for`` only one quiet for that long; the
    check and the status change are one transaction under the session's lock, so a
    message arriving meanwhile either comes first (nothing sleeps) or finds it
    ``sleeping`` and waits for this stop. True when it was put to sleep."""
    with transaction.atomic():
        try:
            session = locked(session_id)
        except AgentSession.DoesNotExist:
            return False  # deleted since the watch found it idle
        if session.turn_active or session.status != Status.IDLE:
            return False
        if session.api_busy_until is not None and session.api_busy_until > timezone.now():
            return False  # an API server serving a request (api_app.serving)
        if idle_for is not None and session.last_activity_at > timezone.now() - idle_for:
            return False
        if not ServerRecord.objects.filter(session_id=session_id, ready_at__isnull=False, stopping=False).update(
            stopping=True
        ):
            return False
        change_status(session, Status.SLEEPING, by=by)
    stop_process(session_id, stopped={"reason": "idle", **({"by": by} if by else {})}, claimed=True)
    return True


def sleep_idle_servers() -> list[int]:
    """The health watch round's part: hand every server idle past its machine's idle time to
    the servers queue to be put to sleep (the sleep checks again under the lock)."""
    found = idle_sessions()
    for session_id in found:
        dispatch.enqueue(dispatch.SLEEP_SERVER, session_id, True)
    return found


def idle_seconds(session_id: int) -> timedelta | None:
    """The idle time of the session's machine, None when it has none."""
    seconds = (
        AgentSession.objects.filter(pk=session_id).values_list("machine__idle_stop_seconds", flat=True).first()
    )
    return timedelta(seconds=seconds) if seconds else None


def stop_when_deleted(session_id: int) -> None:
    """Hand the server of a session about to be deleted to the stop task, on commit.

    Called for every way a session row goes (its page, the admin's delete and bulk
    delete, the cascade from its owner or its machine, ``QuerySet.delete()``: the
    ``pre_delete`` receiver in :mod:`sessions_app.signals`), while its ServerRecord is
    still there to read. The task is given the process itself and where it runs
    (:func:`machines_app.transports.machine_place`), since the record, the session and
    perhaps the machine go with this delete (docs/behaviour.md §5). So is the removal of
    each of its saved slot files."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is not None:
        dispatch.enqueue_on_commit(
            dispatch.STOP_PROCESS, machine_place(record.machine), record.pid, record.start_time, record.port, session_id
        )
    # Its saved slots (docs/behaviour.md §5 warm prompts) go too, from the machines' disks.
    for save in SlotSave.objects.filter(session_id=session_id).select_related("machine"):
        dispatch.enqueue_on_commit(dispatch.REMOVE_SLOT, machine_place(save.machine), session_id, save.pk)
    # And its llama-server logs (one per start, the newest CORRAL_SERVER_LOGS_KEPT).
    session = AgentSession.objects.filter(pk=session_id).select_related("machine").first()
    if session is not None:
        dispatch.enqueue_on_commit(dispatch.REMOVE_LOGS, machine_place(session.machine), session_id)


def stop_orphan(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop the server of a deleted session (SIGTERM, grace, SIGKILL), let go of its
    port and remove its key file if a start left one. ``place`` is a
    :func:`machines_app.transports.machine_place`; no row is read."""
    try:
        transport = transport_at(place)
        transport.stop(ProcessId(pid, start_time), grace=settings.CORRAL_STOP_GRACE)
        transport.release_port(port)
        transport.remove(key_file(session_id, transport, port))
    except TransportError as exc:
        # Nobody is left to tell in a transcript; the stop stays pending for the watch.
        orphans.defer_stop(place, pid, start_time, port, session_id, exc)
