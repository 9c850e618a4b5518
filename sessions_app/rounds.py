"""The housekeeping rounds: the periodic checks, run by threads of every housekeeping
worker (docs/architecture.md; docs/operations.md, "More hosts").

Each round (:data:`ROUNDS`) comes every ``period`` seconds and has two parts:

- **this host's own share** — the servers of this host's own local machine, its memory,
  its saved slots: run by each host's housekeeping worker for its own host, the only one
  that can reach that machine's processes, loopback ports and files;
- **the shared part** — SSH machines' servers and memory, starts waiting for memory,
  lost starts, idle servers, turn recovery, old images and slots: run once per period
  by one housekeeping worker of the whole deployment, whichever first takes the round's
  claim, ``SET <prefix>round:<name> <worker> NX PX <period less a margin, ms>`` (the
  prefix is the channel layer's, as for the liveness keys), which the worker holding it
  renews at its next run. However many hosts and
  workers there are, no round is run twice for one period, and none is left undone
  while one housekeeping worker lives.

Why not Celery beat, as before: each run was a message sent by a process of its own
(beat), taken from Redis by the housekeeping worker, which then handed each other live
host its share through that host's own queue — 0.7 tasks a second on an idle stack, and
beat's and the broker hops' CPU were 5 of an idle stack's 8 ms a second (docs/live-page.md,
"What it costs"); and an operator had to run beat on exactly one host. A thread waiting
for its next due time costs nothing; a round costs one ``SET`` in Redis besides its work.

Each round runs in a thread of its own, so a slow one (an SSH machine that does not
answer, the turn recovery's pause between its two reads) never delays the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import close_old_connections, connections
from redis.commands.core import Script

from project.channel_layer import channel_prefix

from . import dispatch, images, liveness, room, turns
from .servers import slots, stop, watch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """What one run of a round does: ``shared`` — the shared part too (this worker took
    the round's claim for this period); ``host`` — this host's id, whose own share is run
    ("" when this worker runs none: the host has no id, or the worker does not read the
    host's own housekeeping queue); ``worker`` — the Celery node name of the worker
    running it (the turn recovery checks that its own liveness key is among those read)."""

    shared: bool
    host: str
    worker: str


@dataclass(frozen=True)
class Round:
    """A periodic check: ``name`` (its claim key's last part), ``period`` in seconds,
    ``run(share)`` the work (it decides what each part is: :class:`Share`)."""

    name: str
    period: float
    run: Callable[[Share], None]


# --- the rounds -------------------------------------------------------------------------------

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


def watch_servers(share: Share) -> None:
    """The health watch: dead servers, lost starts, servers idle past their time, starts
    waiting for memory. Shared part: servers on SSH machines, the starts waiting for
    memory, and every SLOW_LOOKS_EVERY seconds lost starts and idle servers; this host's
    own: the servers of its own local machine — in the same pass as the shared part when
    both run (one query for both)."""
    hosts: tuple[str | None, ...] = ((None,) if share.shared else ()) + ((share.host,) if share.host else ())
    watch.watch_servers(hosts=hosts)
    if not share.shared:
        return
    if _slow_looks_due():
        watch.recover_starts()
        stop.sleep_idle_servers()
    room.admit_waiting()


#: Seconds between recovery's two reads of the liveness keys: more than a liveness beat,
#: so a live worker has written its key between them.
ROUND_GAP = liveness.BEAT_SECONDS * 1.25


def recover_turns(share: Share) -> None:
    """Shared part only. Take over the steps of workers that are gone (their liveness key
    lapsed: sessions_app/liveness.py), then re-enqueue the step of every open turn whose
    step is not running (a worker that died mid-step, or a step message that was lost);
    see turns.take_over_dead_steps, turns.recoverable.

    A worker counts as gone only when two reads of the keys, ROUND_GAP seconds apart,
    both miss it, and a read counts only when it holds ``share.worker``'s own key: a read
    just after Redis lost its keys (a restart) says nothing about the others, whose next
    beat is at most a beat away. The keys are read only when some step holds a lease
    (turns.held_leases): with none, there is no step to take over. With no open turn at
    all (turns.any_open_turn), there is nothing to do: one query."""
    if not share.shared or not turns.any_open_turn():
        return
    if turns.held_leases():
        first = liveness.live_workers()
        time.sleep(ROUND_GAP)
        second = liveness.live_workers()
        if first is not None and second is not None and share.worker in first and share.worker in second:
            taken = turns.take_over_dead_steps(live=first | second)
            if taken:
                log.warning("took over the turns of sessions %s from workers that are gone", taken)
    for session_id in turns.recoverable():
        dispatch.enqueue(dispatch.RUN_TURN, session_id)


def sample_machines(share: Share) -> None:
    """Each machine's memory (the machines page; docs/behaviour.md §5): SSH machines in
    the shared part, this host's local machine in its own share."""
    if share.shared:
        room.sample_machines()
    if share.host:
        room.sample_machines(host=share.host)


def forget_images(share: Share) -> None:
    """Shared part only: delete the stored images no transcript event refers to any more
    — leftovers of a deletion whose own clean-up did not run."""
    if share.shared:
        deleted = images.forget_unreferenced()
        if deleted:
            log.info("deleted %d stored image(s) no message refers to any more", deleted)


def forget_old_slots(share: Share) -> None:
    """Saved slots of sessions without a server for CORRAL_SLOT_KEEP_HOURS are deleted,
    each session told (docs/operations.md "Disk"): those on SSH machines in the shared
    part, those on this host's own local machine in its own share."""
    if share.shared:
        slots.forget_old_slots()
    if share.host:
        slots.forget_old_slots(host=share.host)


#: The rounds every housekeeping worker runs. Periods: the watch every 2 s (a dead server
#: is seen within seconds); turn recovery every 5 s; memory as often as a machine is
#: sampled (room.SAMPLE_SECONDS: a round more often found the last sample too recent);
#: old slots every 10 minutes; unreferenced images hourly (a session's deletion removes
#: its own at once, this catches what that missed).
ROUNDS: tuple[Round, ...] = (
    Round("watch-servers", 2.0, watch_servers),
    Round("recover-turns", 5.0, recover_turns),
    Round("sample-machines", room.SAMPLE_SECONDS, sample_machines),
    Round("forget-old-slots", 600.0, forget_old_slots),
    Round("forget-images", 3600.0, forget_images),
)


# --- the threads ------------------------------------------------------------------------------

#: A round's claim lapses this much before its next run is due (at most; a tenth of the
#: period for short ones), so that a worker that died leaves it free in time for the
#: next period.
CLAIM_MARGIN_SECONDS = 0.2
#: The claim: ``SET key worker NX PX ms``; or, when the key still names this worker (its
#: claim of the last period, whose ``SET`` reached Redis later after its due time than
#: this one did), that claim renewed. One script, so no other worker's claim is ever
#: overwritten; without the renewal a worker alone would skip the shared part now and then.
_CLAIM = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
return 0
"""
#: A round thread keeps its database connection between runs (the worker's CONN_MAX_AGE,
#: project/celery.py) when its period is at most this; a rarer round closes it after each
#: run rather than hold a connection idle for minutes.
KEEP_CONNECTION_SECONDS = 60.0


def claim_key(name: str, redis_url: str | None = None) -> str:
    """The Redis key of the round ``name``'s claim (under the channel layer's prefix of
    ``redis_url``, the settings' REDIS_URL by default)."""
    return channel_prefix(redis_url or settings.REDIS_URL) + "round:" + name


def claim_ms(period: float) -> int:
    """How long a claim on a round of ``period`` seconds lives, in ms: the period less
    CLAIM_MARGIN_SECONDS (less a tenth of it when that is smaller), at least 1."""
    return max(1, int((period - min(CLAIM_MARGIN_SECONDS, period / 10)) * 1000))


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=liveness.BEAT_SECONDS,
                                socket_timeout=liveness.BEAT_SECONDS)


class Rounds:
    """The threads that run ``rounds`` (:data:`ROUNDS` by default) in this worker process,
    one a round, for the worker named ``worker``, running this host's own share when
    ``host`` is a host id. :meth:`start` starts them (each round's first run at once);
    :meth:`stop` ends them after the run in progress, waiting up to ``join`` seconds.

    A run: the round's claim is tried (:data:`_CLAIM`; Redis that cannot be reached: the
    shared part is left for a later run, logged once per outage), then ``round.run(share)`` with the
    database connections of the thread refreshed before and after, as for a task. A run
    that raises is logged and the thread goes on."""

    def __init__(self, worker: str, host: str = "", rounds: tuple[Round, ...] = ROUNDS) -> None:
        self.worker, self.host, self.rounds = worker, host, rounds
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(r,), name=f"corral-round-{r.name}", daemon=True)
                        for r in rounds]
        self._claim: Script | None = None
        self._failing = False
        self._lock = threading.Lock()  # the client made once, an outage said once

    def start(self) -> Rounds:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, join: float = 3.0) -> None:
        self.stopped.set()
        deadline = time.monotonic() + join
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def claim(self, round_: Round) -> bool:
        """Whether this worker takes ``round_``'s shared part for this period."""
        with self._lock:
            if self._claim is None:  # thread-safe: its client's pool hands each thread a connection
                self._claim = _client().register_script(_CLAIM)
            claim = self._claim
        try:
            taken = bool(claim(keys=[claim_key(round_.name)], args=[self.worker, claim_ms(round_.period)]))
        except redis.RedisError as exc:
            with self._lock:
                if not self._failing:  # once per outage, not every round
                    log.warning("housekeeping rounds: cannot reach Redis (%s); shared parts wait for it", exc)
                self._failing = True
            return False
        with self._lock:
            if self._failing:
                log.warning("housekeeping rounds: Redis answers again")
            self._failing = False
        return taken

    def run_once(self, round_: Round) -> None:
        """One run of ``round_`` now (what each thread does when it is due)."""
        close_old_connections()
        try:
            round_.run(Share(shared=self.claim(round_), host=self.host, worker=self.worker))
        except Exception:
            log.exception("housekeeping round %s failed; it runs again in %g s", round_.name, round_.period)
        finally:
            if round_.period > KEEP_CONNECTION_SECONDS:
                connections.close_all()
            else:
                close_old_connections()

    def _loop(self, round_: Round) -> None:
        due = time.monotonic()
        while not self.stopped.is_set():
            self.run_once(round_)
            # On a fixed grid, not a period after the run ended: the runs keep their
            # rhythm. One that overran its period is followed at once by the next (one
            # run, not one for each period missed).
            due = max(due + round_.period, time.monotonic())
            if self.stopped.wait(max(0.0, due - time.monotonic())):
                return
