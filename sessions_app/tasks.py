"""Thin Celery tasks: ids in, actions / lifecycle / agent calls out.

Which queue each runs on is in ``project/queues.py``.
"""

from __future__ import annotations

import logging
import os

from celery import current_app, shared_task
from celery.signals import worker_ready
from channels.layers import get_channel_layer

from . import agent, lifecycle, turns

log = logging.getLogger(__name__)
PING_TIMEOUT = 1.0  # seconds a ping waits for workers' answers


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
def stop_process(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop a server whose session is gone (deleted): SIGTERM, grace, SIGKILL."""
    lifecycle.stop_orphan(place, pid, start_time, port, session_id)


@shared_task
def watch_servers() -> None:
    """The housekeeping beat: dead servers, lost starts, servers idle past their time."""
    lifecycle.watch_servers()
    lifecycle.recover_starts()
    lifecycle.sleep_idle_servers()


@shared_task(bind=True)
def run_turn(self, session_id: int) -> None:
    agent.run_turn_step(session_id, worker=self.request.hostname)


@shared_task(bind=True)
def recover_turns(self) -> None:
    """Take over the steps of workers gone from Celery's view (a ping), then re-enqueue
    the step of every open turn whose step is not running (a worker that died mid-step,
    or a step message that was lost); see turns.take_over_dead_steps, turns.recoverable.

    A worker counts as gone only when two pings in a row miss it, and a ping counts only
    when this worker heard its own answer: a broken round says nothing about the others.

    The pings are broadcast and answered by every worker, so they are sent only when some
    step holds a lease (turns.held_leases): with none, there is no step to take over."""
    rounds = [live_workers(), live_workers()] if turns.held_leases() else []
    if rounds and all(live is not None and self.request.hostname in live for live in rounds):
        taken = turns.take_over_dead_steps(live=rounds[0] | rounds[1])
        if taken:
            log.warning("took over the turns of sessions %s from workers that are gone", taken)
    for session_id in turns.recoverable():
        run_turn.delay(session_id)


def live_workers() -> set[str] | None:
    """Nodenames of the workers that answer a ping within PING_TIMEOUT; None when the
    ping itself fails (the broker is unreachable)."""
    try:
        replies = current_app.control.ping(timeout=PING_TIMEOUT)
    except Exception as exc:  # kombu/redis raise many kinds
        log.warning("could not ping the workers: %s", exc)
        return None
    return {name for reply in replies for name in reply}


@worker_ready.connect
def take_over_after_restart(sender, **_kwargs) -> None:
    """A worker that starts under a name that held steps in another process is that
    worker restarted: its earlier steps are dead; take them over at once."""
    restarted = (sender.hostname, os.getpid())
    for session_id in turns.take_over_dead_steps(restarted=restarted):
        log.warning("session %s: resuming a turn after the restart of %s", session_id, sender.hostname)
        run_turn.delay(session_id)


@worker_ready.connect
def load_channel_layer(**_kwargs) -> None:
    """Build the channel layer (importing channels_redis and redis-py's asyncio client)
    when the worker starts: left to the first push, it cost a turn's first reply about
    0.16 s of CPU and of delay (docs/live-page.md "What it costs")."""
    get_channel_layer()
