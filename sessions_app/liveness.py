"""Which Celery workers are alive, told by keys they keep in Redis (docs/operations.md,
"When a worker dies mid-turn").

Every worker process keeps a key ``<prefix>worker:<nodename>`` (the prefix is the channel
layer's, so deployments sharing a Redis in different databases stay apart) holding its
pid: written every :data:`BEAT_SECONDS` from a thread of its own, lapsing after
:data:`LAPSE_SECONDS` when no write renews it. The turn recovery reads them
(:func:`live_workers`) to find steps whose worker is gone.

Why keys and not Celery's ``control.ping``: a ping is a broadcast that every worker answers
through its own Redis round trips, and recovery pings while any step holds a lease — that
is, all the time a reply streams. That cost more CPU in the turns worker than storing the
reply (docs/live-page.md, "What it costs"); a key costs each worker one ``SET`` every two
seconds, and recovery one ``SCAN``.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis
from django.conf import settings

from project.channel_layer import channel_prefix

log = logging.getLogger(__name__)

#: Seconds between a worker's writes of its key.
BEAT_SECONDS = 2.0
#: Seconds a key lives without a write: three missed writes in a row.
LAPSE_SECONDS = 3 * BEAT_SECONDS


def _key_prefix() -> str:
    return channel_prefix(settings.REDIS_URL) + "worker:"


def _host_prefix() -> str:
    return channel_prefix(settings.REDIS_URL) + "host:"


def worker_pid(nodename: str) -> int | None:
    """The pid the worker ``nodename`` wrote in its key, None when the key has lapsed or
    Redis cannot be read: a worker restarted under the same name is told from the one
    before it by this pid (its key is written once the worker consumes: ``worker_ready``)."""
    value = _read(lambda client: client.get(_key_prefix() + nodename))
    return int(value) if value is not None else None


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=BEAT_SECONDS, socket_timeout=BEAT_SECONDS)


class Heartbeat:
    """The thread that keeps this worker's key (started once per worker process), and
    with ``host`` (a host id: this worker consumes that host's own housekeeping queue)
    the host's key too, which tells that the host is up: a start lost on a host that is
    down waits for it rather than being queued again (:func:`live_hosts`)."""

    def __init__(self, nodename: str, host: str = "") -> None:
        self.key = _key_prefix() + nodename
        self.host_key = _host_prefix() + host if host else ""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="corral-liveness", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(BEAT_SECONDS * 2)

    def _run(self) -> None:
        connection = None
        unread = 0  # writes sent whose reply has not been read
        failing = False

        def failed(exc: Exception) -> None:
            nonlocal failing
            if not failing:  # once per outage, not every beat
                log.warning("could not write liveness key %s: %s", self.key, exc)
            failing = True

        while True:
            try:
                if connection is None:
                    connection = _client().connection_pool.make_connection()
                    unread = 0
                try:
                    _read_replies(connection, unread)
                    if unread and failing:
                        log.warning("liveness key %s written again", self.key)
                        failing = False
                except redis.RedisError as exc:
                    # The last beat's writes went wrong: Redis closed the connection (a
                    # restart: not worth a word, redis-py's own retry of a command said
                    # nothing either), refused them, or has not answered them. This beat's
                    # go on a new connection, at once.
                    if not isinstance(exc, redis.ConnectionError):
                        failed(exc)
                    connection.disconnect()
                    connection = _client().connection_pool.make_connection()
                unread = self._send(connection)
            except (redis.RedisError, OSError) as exc:
                failed(exc)
                if connection is not None:
                    connection.disconnect()
                connection = None
            if self.stopped.wait(BEAT_SECONDS):
                if connection is not None:
                    connection.disconnect()
                return

    def _send(self, connection) -> int:
        """Send this beat's writes on ``connection``, both keys in one, without waiting for
        their replies (:func:`_read_replies` reads them at the next beat); how many were
        sent. Waiting cost the thread a second wake-up a beat (two with the host key), for
        an answer that changes nothing until then (docs/live-page.md, "What it costs")."""
        writes = [("SET", key, os.getpid(), "PX", int(LAPSE_SECONDS * 1000)) for key in (self.key, self.host_key) if key]
        connection.send_packed_command(connection.pack_commands(writes), check_health=False)
        return len(writes)


def _read_replies(connection, unread: int) -> None:
    """Read the replies of the ``unread`` writes sent a beat ago on ``connection``, without
    waiting. Raises ``redis.TimeoutError`` when one has not come within that beat (a Redis
    gone silent), ``redis.ConnectionError`` for a connection Redis closed, or Redis's error
    for a write it refused."""
    for _reply in range(unread):
        if not connection.can_read(timeout=0):
            raise redis.TimeoutError(f"Redis has not answered a liveness write for {BEAT_SECONDS:g} s")
        connection.read_response()


def live_workers() -> set[str] | None:
    """Nodenames of the workers whose key is alive (written within the last
    :data:`LAPSE_SECONDS`); None when Redis cannot be read."""
    prefix = _key_prefix()
    return _read(lambda client: {key.decode()[len(prefix):]
                                 for key in client.scan_iter(match=prefix + "*", count=1000)})


def live_hosts() -> set[str] | None:
    """Ids of the Corral hosts whose housekeeping worker is alive (its host key written
    within :data:`LAPSE_SECONDS`); None when Redis cannot be read."""
    prefix = _host_prefix()
    return _read(lambda client: {key.decode()[len(prefix):]
                                 for key in client.scan_iter(match=prefix + "*", count=1000)})


def name_in_use(nodename: str, watch: float | None = None) -> int | None:
    """The pid kept in the key of a *live* worker named ``nodename``, None when there is
    none. A key left by a worker that died (a restart under the same name) is not renewed:
    its time to live only falls until it lapses. A live worker renews it every
    :data:`BEAT_SECONDS`, so the key is watched for a beat and a quarter (``watch``
    seconds) and counts as live once its time to live goes up. None too when Redis cannot
    be read (logged): nothing can be told, and refusing would keep every worker down."""
    watch = BEAT_SECONDS * 1.25 if watch is None else watch
    key = _key_prefix() + nodename

    def renewed(client) -> int | None:
        last = client.pttl(key)
        deadline = time.monotonic() + watch
        while last >= 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            now = client.pttl(key)
            if now > last:
                return int(client.get(key) or 0)
            last = now
        return None

    return _read(renewed)


_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def _shared_client() -> redis.Redis:
    """This process's client for the reads below, one per Redis URL, kept: the health
    watch read the host keys every 2 s, and a client of its own each time cost a connect,
    an ``AUTH`` and a ``HELLO`` per read — most of an idle housekeeping worker's Redis work
    (docs/live-page.md, "What it costs"). Its pool is thread-safe; a connection broken
    under it (Redis restarted) is dropped and made again at the next command."""
    url = settings.REDIS_URL
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = _client()
        return client


def _read(query):
    """``query(client)`` on this process's kept client (:func:`_shared_client`); None
    (logged) when Redis cannot be read."""
    try:
        return query(_shared_client())
    except redis.RedisError as exc:
        log.warning("could not read the workers' liveness keys: %s", exc)
        return None
