"""Watching the sessions' servers (docs/behaviour.md §5, the health watch, docs/ssh.md): the
watch round over every ready server (a dead one ``exited``, a frozen or unreachable one
``unknown`` until it answers), the questions a turn asks when a reply breaks off, and
the recovery of starts that were lost.
"""

from __future__ import annotations

import time
from types import EllipsisType

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from machines_app.llama_server import does_not_answer
from machines_app.models import reached_by
from machines_app.transports import ElsewhereError, TransportError, transport_for

from .. import dispatch, liveness, orphans
from ..events import record_error, record_event, set_status
from ..models import AgentSession
from ..transcript import Kind
from .models import ServerRecord
from .records import endpoint_of, fail, proc_of, template_safe, unknown_sentence
from .start import start_ttl

Status = AgentSession.Status


LOST_START = "The server's start was lost (a worker or the broker went away); starting it again."


def recover_starts(alive: set[str] | None | EllipsisType = ...) -> list[int]:
    """Sessions left ``loading`` by a start that was lost — its task never ran (the broker
    was down) or its worker died — are started again: no live start claim, and nothing
    recorded for a claim's lifetime. The notice it records keeps it from being re-queued
    more often than that (docs/behaviour.md §5). A start on the local machine of a host
    that is down is left waiting: only that host can start it, and a copy queued every
    round would pile up in its queue until it came back (its own copy still is there).

    ``alive``: the live hosts as the caller just read them (liveness.live_hosts(), None
    when Redis cannot say); read here when not given."""
    now = timezone.now()
    stale = now - start_ttl()
    lost = AgentSession.objects.filter(
        Q(start_owner="") | Q(start_expires__isnull=True) | Q(start_expires__lt=now),
        status=Status.LOADING, last_activity_at__lt=stale,
    ).exclude(memory_claim__granted=False).select_related("machine")  # waiting for memory: room.admit_waiting
    if isinstance(alive, EllipsisType):
        alive = liveness.live_hosts()  # None: Redis cannot say; every start is tried as before
    found = []
    for session in lost:
        owner = session.machine.owner_host
        if owner and alive is not None and owner not in alive:
            continue
        record_event(session.pk, Kind.NOTICE, {"message": LOST_START})
        dispatch.enqueue(dispatch.START_SERVER, session.pk)
        found.append(session.pk)
    return found


def watch_servers(host: str | None = None, *, hosts: tuple[str | None, ...] | None = None) -> None:
    """Check every ready server's process (docs/behaviour.md §5, the health watch): one that died
    without being stopped ends with "llama-server exited" and status ``exited``; one whose
    liveness cannot be told makes the session ``unknown`` until it can. A server whose
    machine was lost while it loaded (``unknown``, not ready) is checked too, so it is
    waited for again once the machine answers (docs/ssh.md). First, every stop left pending
    on a machine that could not be reached is tried again (docs/behaviour.md §5 "no orphans").

    ``host`` None: the servers any host reaches (SSH machines); a host id: that host's own
    local machine's, which only it may judge — on another host its loopback port refuses
    and its pid is not there (machines_app.models.reached_by).

    ``hosts``, when given, instead of ``host``: several of those shares in one pass, one
    query for each kind of row (the round's shared part and this host's own:
    sessions_app.rounds.watch_servers)."""
    hosts = (host,) if hosts is None else hosts
    if not hosts:
        return
    orphans.settle_pending_stops(hosts=hosts)
    reached = Q()
    for one in hosts:
        reached |= reached_by(one, "machine__")
    records = ServerRecord.objects.filter(
        Q(ready_at__isnull=False) | Q(session__status=Status.UNKNOWN), reached, stopping=False
    ).select_related("machine", "session")
    for record in records:
        check_server(record)


#: Seconds between two ``/health`` questions to one ready server from the watch (a session
#: already ``unknown`` is asked at every watch, so it is back as soon as it answers).
HEALTH_EVERY = 10.0


_asked_at: dict[int, float] = {}


def _health_due(record: ServerRecord) -> bool:
    """Whether the watch asks this server ``/health`` now. Kept per worker process (a
    pacing, not a state: a new worker asks at once)."""
    now = time.monotonic()
    if record.session.status != Status.UNKNOWN and now - _asked_at.get(record.pk, -HEALTH_EVERY) < HEALTH_EVERY:
        return False
    _asked_at[record.pk] = now
    return True


#: What a session says when its server's process runs but does not answer.
FROZEN = ("llama-server does not answer (nothing within {seconds}): its process is still there, but it may "
          "be frozen or overloaded. The status is unknown until it answers again; Stop server and Restart "
          "if it does not.")


def check_session_server(session_id: int) -> None:
    """Check one session's server now (a turn whose stream broke off asks this, so a dead
    server shows ``exited`` at once rather than ``idle`` until the next watch)."""
    record = (ServerRecord.objects.filter(session_id=session_id, stopping=False)
              .select_related("machine", "session").first())
    if record is not None:
        check_server(record)


def stop_under_way(session_id: int) -> bool:
    """Whether the session's server is being stopped on purpose (its record claimed
    ``stopping``) or was (status ``stopped``): a reply it breaks off was stopped, not failed."""
    return (ServerRecord.objects.filter(session_id=session_id, stopping=True).exists()
            or AgentSession.objects.filter(pk=session_id, status=Status.STOPPED).exists())


def link_broken(session_id: int) -> str | None:
    """Why the way to the session's machine is broken, in words, when a reply's connection
    just broke off because of it (an SSH link gone: docs/ssh.md), else None. Asks the
    machine whether the server's process runs; a machine that cannot be asked makes the
    session ``unknown`` (the watch brings it back once the machine answers)."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return None
    try:
        transport_for(record.machine).process_alive(proc_of(record))
    except ElsewhereError:
        return None  # another host's own server: nothing can be told from here
    except TransportError as exc:
        set_status(session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING))
        return f"The link to machine '{record.machine.name}' broke while llama-server was replying. {unknown_sentence(exc)}"
    return None


def server_gone(session_id: int) -> bool:
    """Whether the session's recorded server process is known to be gone (no record left,
    or its pid and start time no longer run); False while it runs or cannot be told. Reads
    only: :func:`check_session_server` is what records the death."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return True
    try:
        return not transport_for(record.machine).process_alive(proc_of(record))
    except TransportError:
        return False


def check_server(record: ServerRecord) -> None:
    try:
        transport = transport_for(record.machine)
        alive = transport.process_alive(proc_of(record))
    except ElsewhereError:
        return  # another host's own server: only that host can tell whether it runs
    except TransportError as exc:
        if set_status(record.session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING)):
            record_error(record.session_id, unknown_sentence(exc))
        return
    if alive:
        if record.ready_at is None:
            # Lost while loading, back now: wait for it again (start_server adopts it).
            if set_status(record.session_id, Status.LOADING, only_from=(Status.UNKNOWN,)):
                dispatch.enqueue(dispatch.START_SERVER, record.session_id)
            return
        # A frozen process keeps its pid: ask it, within a bound (docs/behaviour.md §5) —
        # every HEALTH_EVERY seconds, not every watch (an idle stack should cost nothing).
        if _health_due(record) and does_not_answer(endpoint_of(transport, record), settings.CORRAL_HEALTH_TIMEOUT):
            if set_status(record.session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING)):
                record_error(record.session_id, FROZEN.format(seconds=f"{settings.CORRAL_HEALTH_TIMEOUT:g} seconds"))
            return
        # Only an unknown session has anything to change (the lock checks again): a live
        # server's every-two-seconds check costs no transaction.
        if record.session.status == Status.UNKNOWN:
            set_status(record.session_id, Status.IDLE, only_from=(Status.UNKNOWN,))
        return
    # Delete first, conditionally, so two watchers never both report the death.
    if ServerRecord.objects.filter(pk=record.pk, stopping=False).delete()[0] == 0:
        return
    transport.release_port(record.port)
    try:
        tail = transport.log_tail(record.log_path)
    except TransportError:
        tail = ""
    # Corral knows only that it did not stop it: a crash and a kill from outside look alike.
    message = "llama-server exited, and Corral did not stop it. Restart it to go on."
    session = AgentSession.objects.select_related("machine").get(pk=record.session_id)
    fail(session, message, log=template_safe(session, transport, tail.strip()))
