"""Thin Celery tasks: ids in, actions / lifecycle / agent calls out.

Which queue each runs on is in ``project/queues.py``.
"""

from __future__ import annotations

import logging
import os
import time

from celery import shared_task
from celery.signals import worker_ready
from channels.layers import get_channel_layer

from machines_app.llama_server import tls_context
from project import heap

from . import agent, lifecycle, liveness, room, turns

log = logging.getLogger(__name__)
#: Seconds between recovery's two reads of the liveness keys: more than a beat, so a live
#: worker has written its key between them.
ROUND_GAP = liveness.BEAT_SECONDS * 1.25


@shared_task
def start_server(session_id: int) -> None:
    lifecycle.start_server(session_id)


@shared_task
def stop_server(session_id: int, by: dict | None = None) -> None:
    lifecycle.stop_server(session_id, by=by)


@shared_task
def restart_server(session_id: int) -> None:
    lifecycle.restart_server(session_id)


@shared_task
def sleep_server(session_id: int, idle: bool = True, by: dict | None = None) -> None:
    """Put an idle session's server to sleep: with ``idle`` only if it is still idle past
    its machine's idle time; without, whenever it is idle (staff's "stop all idle")."""
    lifecycle.sleep_server(session_id, idle_for=lifecycle.idle_seconds(session_id) if idle else None, by=by)


@shared_task
def remove_slot(place: dict, session_id: int, save_id: int) -> None:
    """Delete the saved slot file of a deleted session from its machine (``place``: a
    :func:`machines_app.transports.machine_place`, since the machine may be gone too)."""
    lifecycle.remove_slot_file(place, session_id, save_id)


@shared_task
def remove_logs(place: dict, session_id: int) -> None:
    """Delete every llama-server log of a deleted session from its machine (``place``)."""
    lifecycle.remove_server_logs(place, session_id)


@shared_task
def forget_old_slots() -> None:
    """Housekeeping: saved slots of sessions without a server for CORRAL_SLOT_KEEP_HOURS
    are deleted, each session told (docs/operations.md "Disk")."""
    lifecycle.forget_old_slots()


@shared_task
def stop_process(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop a server whose session is gone (deleted): SIGTERM, grace, SIGKILL."""
    lifecycle.stop_orphan(place, pid, start_time, port, session_id)


@shared_task
def watch_servers() -> None:
    """The housekeeping beat: dead servers, lost starts, servers idle past their time,
    starts waiting for memory."""
    lifecycle.watch_servers()
    lifecycle.recover_starts()
    lifecycle.sleep_idle_servers()
    room.admit_waiting()


@shared_task
def sample_machines() -> None:
    """Each machine's memory, every half minute (the machines page; docs/behaviour.md §5)."""
    room.sample_machines()


@shared_task(bind=True)
def run_turn(self, session_id: int) -> None:
    agent.run_turn_step(session_id, worker=self.request.hostname)


@shared_task(bind=True)
def recover_turns(self) -> None:
    """Take over the steps of workers that are gone (their liveness key lapsed:
    sessions_app/liveness.py), then re-enqueue the step of every open turn whose step is
    not running (a worker that died mid-step, or a step message that was lost); see
    turns.take_over_dead_steps, turns.recoverable.

    A worker counts as gone only when two reads of the keys, a beat and a quarter apart,
    both miss it, and a read counts only when it holds this worker's own key: a read just
    after Redis lost its keys (a restart) says nothing about the others, whose next beat
    is at most a beat away. The keys are read only when some step holds a lease
    (turns.held_leases): with none, there is no step to take over."""
    rounds = []
    if turns.held_leases():
        rounds.append(live_workers())
        time.sleep(ROUND_GAP)
        rounds.append(live_workers())
    if rounds and all(live is not None and self.request.hostname in live for live in rounds):
        taken = turns.take_over_dead_steps(live=rounds[0] | rounds[1])
        if taken:
            log.warning("took over the turns of sessions %s from workers that are gone", taken)
    for session_id in turns.recoverable():
        run_turn.delay(session_id)


def live_workers() -> set[str] | None:
    """Nodenames of the workers alive now; None when that cannot be read (Redis down)."""
    return liveness.live_workers()


@worker_ready.connect
def take_over_after_restart(sender, **_kwargs) -> None:
    """A worker that starts under a name that held steps in another process is that
    worker restarted: its earlier steps are dead; take them over at once."""
    restarted = (sender.hostname, os.getpid())
    for session_id in turns.take_over_dead_steps(restarted=restarted):
        log.warning("session %s: resuming a turn after the restart of %s", session_id, sender.hostname)
        run_turn.delay(session_id)


@worker_ready.connect
def keep_liveness_key(sender, **_kwargs) -> None:
    """Start this worker's liveness key (sessions_app/liveness.py), read by recover_turns."""
    liveness.Heartbeat(sender.hostname).start()


@worker_ready.connect
def warm_up(**_kwargs) -> None:
    """Build what every turn uses when the worker starts, then freeze the start-up heap
    (project/heap.py). Left to the first turn, they cost its reply about 0.2 s of CPU and
    of delay (docs/live-page.md "What it costs"): the channel layer (channels_redis and
    redis-py's asyncio client), the TLS context of every httpx call (certifi's CA bundle,
    ~30 ms) and a full collection of the start-up heap (50–140 ms). Connected last, so it
    runs after the other ``worker_ready`` receivers."""
    get_channel_layer()
    tls_context()
    heap.freeze_startup_objects()
