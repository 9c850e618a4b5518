"""Thin Celery tasks: ids in, actions / servers / agent calls out.

Which queue each runs on is in ``project/queues.py``.
"""

from __future__ import annotations

import logging
import os
import sys

from celery import shared_task
from celery.signals import celeryd_after_setup, celeryd_init, worker_ready, worker_shutdown
from channels.layers import get_channel_layer
from django.conf import settings

from machines_app.llama_server import tls_context
from project import heap, queues

from . import agent, dispatch, liveness, rounds, turns
from .servers import logs, slots, start, stop

log = logging.getLogger(__name__)


@shared_task
def start_server(session_id: int) -> None:
    start.start_server(session_id)


@shared_task
def stop_server(session_id: int, by: dict | None = None) -> None:
    stop.stop_server(session_id, by=by)


@shared_task
def restart_server(session_id: int) -> None:
    start.restart_server(session_id)


@shared_task
def sleep_server(session_id: int, idle: bool = True, by: dict | None = None) -> None:
    """Put an idle session's server to sleep: with ``idle`` only if it is still idle past
    its machine's idle time; without, whenever it is idle (staff's "stop all idle")."""
    stop.sleep_server(session_id, idle_for=stop.idle_seconds(session_id) if idle else None, by=by)


@shared_task
def remove_slot(place: dict, session_id: int, save_id: int) -> None:
    """Delete the saved slot file of a deleted session from its machine (``place``: a
    :func:`machines_app.transports.machine_place`, since the machine may be gone too)."""
    slots.remove_slot_file(place, session_id, save_id)


@shared_task
def forget_images() -> None:
    """The hourly sweep of stored images no transcript event refers to any more
    (rounds.forget_images), run here and now: the rounds run it by themselves."""
    rounds.forget_images(_whole_round())


@shared_task
def remove_logs(place: dict, session_id: int) -> None:
    """Delete every llama-server log of a deleted session from its machine (``place``)."""
    logs.remove_server_logs(place, session_id)


@shared_task
def forget_old_slots() -> None:
    """The slot clean-up (rounds.forget_old_slots: SSH machines' and this host's), run
    here and now: the rounds run it every 10 minutes by themselves."""
    rounds.forget_old_slots(_whole_round())


@shared_task
def stop_process(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop a server whose session is gone (deleted): SIGTERM, grace, SIGKILL."""
    stop.stop_orphan(place, pid, start_time, port, session_id)


def _whole_round(worker: str = "") -> rounds.Share:
    """A round's run as a task does it: the shared part and this host's own share."""
    return rounds.Share(shared=True, host=settings.CORRAL_HOST_ID, worker=worker)


# The periodic checks run in threads of each housekeeping worker (sessions_app/rounds.py,
# started by keep_liveness_key below), not as tasks. These tasks run one round here and
# now, whole, for a test or an operator (``celery -A project call sessions_app.tasks.…``).

@shared_task
def watch_servers() -> None:
    """One health watch round here and now (rounds.watch_servers): SSH machines' servers
    and this host's own, starts waiting for memory; lost starts and idle servers when
    their look is due."""
    rounds.watch_servers(_whole_round())


@shared_task
def sample_machines() -> None:
    """One memory sampling round here and now (rounds.sample_machines)."""
    rounds.sample_machines(_whole_round())


@shared_task(bind=True)
def run_turn(self, session_id: int) -> None:
    agent.run_turn_step(session_id, worker=self.request.hostname)


@shared_task(bind=True)
def recover_turns(self) -> None:
    """One turn recovery round here and now (rounds.recover_turns), checked against this
    worker's own liveness key."""
    rounds.recover_turns(_whole_round(self.request.hostname))


@worker_ready.connect
def take_over_after_restart(sender, **_kwargs) -> None:
    """A worker that starts under a name that held steps in another process is that
    worker restarted: its earlier steps are dead; take them over at once."""
    restarted = (sender.hostname, os.getpid())
    for session_id in turns.take_over_dead_steps(restarted=restarted):
        log.warning("session %s: resuming a turn after the restart of %s", session_id, sender.hostname)
        dispatch.enqueue(dispatch.RUN_TURN, session_id)


@celeryd_init.connect
def refuse_a_live_name(sender: str, **_kwargs) -> None:
    """A worker started under the name of a live one would be taken for it restarted and
    let go of every turn that one runs (take_over_after_restart): refuse to start, naming
    the other, and exit non-zero (docs/operations.md, "More hosts")."""
    pid = liveness.name_in_use(sender)
    if pid is not None:
        print(f"corral: a worker named {sender} is already running (pid {pid} on its host, its liveness key is "
              "renewed); not starting a second one under that name. Stop that one first, or give this host an "
              "id of its own (CORRAL_HOST_ID, or delete data/host_id on a cloned machine).", file=sys.stderr,
              flush=True)
        sys.exit(1)


@celeryd_after_setup.connect
def read_this_hosts_own_queues(sender: str, instance, **_kwargs) -> None:
    """A worker that reads a shared queue reads this host's own of that kind too
    (``turns`` → ``turns.<host id>``: project/queues.py), whatever its command line says —
    a unit written before hosts had ids included — so no task meant for this host's own
    local machine waits in a queue nobody here reads."""
    host = settings.CORRAL_HOST_ID
    selected = instance.app.amqp.queues
    consumed = set(getattr(selected, "consume_from", None) or {})
    for kind in queues.ALL:
        if host and kind in consumed and queues.on_host(kind, host) not in consumed:
            selected.select_add(queues.on_host(kind, host))


def consumed_queues(consumer) -> set[str]:
    """The names of the queues the worker of ``consumer`` (worker_ready's sender) reads."""
    return set(getattr(consumer.app.amqp.queues, "consume_from", None) or {})


#: This worker process's housekeeping rounds (sessions_app/rounds.py), once started.
_rounds: list[rounds.Rounds] = []


@worker_ready.connect
def keep_liveness_key(sender, **_kwargs) -> None:
    """Start this worker's liveness key (sessions_app/liveness.py), read by the turn
    recovery, and this host's key when it reads the host's own housekeeping queue. A
    worker that reads a housekeeping queue (the shared one or this host's own) runs the
    housekeeping rounds too (sessions_app/rounds.py): the shared parts when it takes
    their claim, this host's own share when it reads this host's own queue."""
    host = settings.CORRAL_HOST_ID
    consumed = consumed_queues(sender)
    own = host if host and queues.on_host(queues.HOUSEKEEPING, host) in consumed else ""
    liveness.Heartbeat(sender.hostname, host=own).start()
    if own or queues.HOUSEKEEPING in consumed:
        _rounds.append(rounds.Rounds(sender.hostname, host=own).start())


@worker_shutdown.connect
def stop_rounds(**_kwargs) -> None:
    """Stop this worker's housekeeping rounds when it shuts down, after the run in
    progress (a run cut by the process's exit would leave nothing worse: the next one,
    on this host or another, does it again)."""
    while _rounds:
        _rounds.pop().stop()


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
