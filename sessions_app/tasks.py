"""Thin Celery tasks: ids in, actions / servers / agent calls out.

Which queue each runs on is in ``project/queues.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from celery import shared_task
from celery.signals import celeryd_after_setup, celeryd_init, worker_ready
from channels.layers import get_channel_layer
from django.conf import settings

from machines_app.llama_server import tls_context
from project import heap, queues

from . import agent, dispatch, images, liveness, room, turns
from .servers import logs, slots, start, stop, watch

log = logging.getLogger(__name__)
#: Seconds between recovery's two reads of the liveness keys: more than a beat, so a live
#: worker has written its key between them.
ROUND_GAP = liveness.BEAT_SECONDS * 1.25


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
    """The housekeeping sweep (hourly, beat): delete the stored images no transcript event
    refers to any more — leftovers of a deletion whose own clean-up did not run."""
    deleted = images.forget_unreferenced()
    if deleted:
        log.info("deleted %d stored image(s) no message refers to any more", deleted)


@shared_task
def remove_logs(place: dict, session_id: int) -> None:
    """Delete every llama-server log of a deleted session from its machine (``place``)."""
    logs.remove_server_logs(place, session_id)


#: Seconds a host's share of the slot clean-up stays worth running (it comes every 10 minutes).
SLOTS_TASK_EXPIRES = 300


@shared_task
def forget_old_slots() -> None:
    """Housekeeping: saved slots of sessions without a server for CORRAL_SLOT_KEEP_HOURS
    are deleted, each session told (docs/operations.md "Disk"): those on SSH machines
    here, those on a host's own local machine by that host (:func:`forget_host_slots`),
    handed to each host whose housekeeping worker is alive."""
    slots.forget_old_slots()
    for host in sorted(liveness.live_hosts() or ()):
        dispatch.enqueue_on_host(dispatch.FORGET_HOST_SLOTS, host, expires=SLOTS_TASK_EXPIRES)


@shared_task
def forget_host_slots() -> None:
    """This host's share of :func:`forget_old_slots`: the saved slots on its own local
    machine, whose files only it can reach."""
    slots.forget_old_slots(host=settings.CORRAL_HOST_ID)


@shared_task
def stop_process(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop a server whose session is gone (deleted): SIGTERM, grace, SIGKILL."""
    stop.stop_orphan(place, pid, start_time, port, session_id)


#: Seconds a watch or a sample handed to one host's own queue stays worth running: a host
#: that has fallen behind drops the stale ones instead of running each in turn.
HOST_TASK_EXPIRES = 10


def hand_to_live_hosts(task: str, here, alive: set[str] | None) -> None:
    """Each live host's share of a beat round (``alive``: liveness.live_hosts()): this
    host's is run here and now (``here()``), by the worker that took the round — it reads
    this host's own housekeeping queue too (:func:`read_this_hosts_own_queues`), so the
    share would only have come back to it through the broker, a send, a wake-up and a task
    every 2 s on an idle stack (docs/live-page.md, "What it costs"); every other live
    host's is sent to its own queue (``task``, dropped after HOST_TASK_EXPIRES)."""
    for host in sorted(alive or ()):
        if host == settings.CORRAL_HOST_ID:
            here()
        else:
            dispatch.enqueue_on_host(task, host, expires=HOST_TASK_EXPIRES)


#: Seconds between two looks for lost starts and for servers idle past their time, from
#: the watch (every 2 s): a lost start is taken for lost only once its claim has lapsed
#: (CORRAL_START_CLAIM_SECONDS, 30 s) and an idle time is minutes, so a look every 2 s
#: bought nothing, and its two queries were a third of an idle round (docs/live-page.md,
#: "What it costs"). Starts waiting for memory are still tried every round.
SLOW_LOOKS_EVERY = 10.0
_slow_looks_at: list[float] = []


def _slow_looks_due() -> bool:
    """Whether this round looks for lost starts and idle servers (per worker process: a
    pacing, not a state, like servers.watch's health pacing; a new worker looks at once)."""
    now = time.monotonic()
    if _slow_looks_at and now - _slow_looks_at[0] < SLOW_LOOKS_EVERY:
        return False
    _slow_looks_at[:] = [now]
    return True


@shared_task
def watch_servers() -> None:
    """The housekeeping beat: dead servers, lost starts, servers idle past their time,
    starts waiting for memory. Servers on SSH machines are watched here, by whichever host
    took the task; those on a host's own local machine by that host (:func:`watch_host`):
    this host's in the same pass (one query for both), each other host's handed to it while
    its housekeeping worker is alive (a host that is down has nobody who could look at its
    servers: they are left as they are). The host keys are read once per round; lost
    starts and idle servers are looked for every SLOW_LOOKS_EVERY seconds."""
    alive = liveness.live_hosts()
    here = settings.CORRAL_HOST_ID
    watch.watch_servers(hosts=(None, here) if here and here in (alive or ()) else (None,))
    for host in sorted(alive or ()):
        if host != here:
            dispatch.enqueue_on_host(dispatch.WATCH_HOST, host, expires=HOST_TASK_EXPIRES)
    if _slow_looks_due():
        watch.recover_starts(alive=alive)
        stop.sleep_idle_servers()
    room.admit_waiting()


@shared_task
def watch_host() -> None:
    """This host's share of the health watch: the servers of its own local machine
    (docs/operations.md, "More hosts")."""
    watch.watch_servers(host=settings.CORRAL_HOST_ID)


@shared_task
def sample_machines() -> None:
    """Each machine's memory, every half minute (the machines page; docs/behaviour.md §5):
    SSH machines here, each host's local machine by that host (:func:`sample_host`; this
    host's here too)."""
    room.sample_machines()
    hand_to_live_hosts(dispatch.SAMPLE_HOST, sample_host, liveness.live_hosts())


@shared_task
def sample_host() -> None:
    """This host's local machine's memory reading."""
    room.sample_machines(host=settings.CORRAL_HOST_ID)


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
    (turns.held_leases): with none, there is no step to take over. With no open turn at
    all (turns.any_open_turn), there is nothing to do: one query."""
    if not turns.any_open_turn():
        return
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
        dispatch.enqueue(dispatch.RUN_TURN, session_id)


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


@worker_ready.connect
def keep_liveness_key(sender, **_kwargs) -> None:
    """Start this worker's liveness key (sessions_app/liveness.py), read by recover_turns;
    and this host's key when it reads the host's own housekeeping queue (the health watch
    then hands it its share: :func:`watch_servers`)."""
    host = settings.CORRAL_HOST_ID
    own = host if host and queues.on_host(queues.HOUSEKEEPING, host) in consumed_queues(sender) else ""
    liveness.Heartbeat(sender.hostname, host=own).start()


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
