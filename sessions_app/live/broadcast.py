"""The only module that talks to the channel layer (pushes leave from one place, after their transaction commits).

Every transcript message carries the session's sequence number, so a browser can tell a
gap or a duplicate and catch up from the database (docs/behaviour.md C17). Two more messages close
sockets: a session deleted, a browser login ended (docs/live-page.md); a third makes them ask
again what their reader may do (an account or a machine changed: docs/access.md).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
import time

import redis
from channels.layers import get_channel_layer
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry

from project.channel_layer import group_channel

log = logging.getLogger(__name__)

#: Seconds a push from synchronous code may take before it is given up as lost (Redis
#: gone silent); a page catches up from the database, as for any lost push. A PUBLISH
#: takes well under a millisecond; the push runs on the thread that stores a reply (under
#: its fragments' lock, which the interrupt poll also takes), so every second it waits is
#: a second the reply and an interrupt wait too.
PUSH_TIMEOUT = 0.5
#: Seconds after a failed push during which pushes are dropped at once, without trying
#: Redis: a Redis gone silent costs each process one PUSH_TIMEOUT per this many seconds,
#: not one per push (tests/test_silent_redis.py).
QUIET_AFTER_FAILURE = 2.0
#: Seconds to open a connection (once per process, and after Redis comes back): longer
#: than PUSH_TIMEOUT, so a TLS handshake with a distant Redis is not taken for a failure.
CONNECT_TIMEOUT = 2.0


class PushSkipped(Exception):
    """A push dropped without trying Redis, a moment after another failed."""


class _Publisher:
    """Pushes from synchronous code (a turn step in a Celery worker, a view): one ``PUBLISH``
    from the calling thread, on one Redis connection shared by the process (under a lock;
    a new one after a fork).

    What channels_redis's pub/sub layer's ``group_send`` does, without its event loop: the
    layer's serializer and its name for a group's channel
    (:func:`project.channel_layer.group_channel`). Going through ``group_send`` from
    synchronous code cost every push a hand-off to an event-loop thread and back, and
    redis-py's asyncio client: with 20 tails a second per streaming session, the largest
    part of a turns worker's CPU (docs/live-page.md, "What it costs"). Daphne's consumers
    receive these messages through the layer as any other.

    **A push does not wait for Redis's reply.** The command is written to the socket and
    the push returns; the replies (PUBLISH's count of receivers) are read at a later push,
    once they are there, without blocking. Waiting for each reply cost the pushing thread
    a sleep and a wake-up per push — the stream's thread, 20 times a second per streaming
    session — for a number nobody reads (docs/live-page.md, "What it costs"). Commands on
    one connection are carried out in order, so the pushes of the process arrive in the
    order they were made.

    A Redis that has stopped answering is seen at the next push: a reply still missing
    PUSH_TIMEOUT after its command was sent (or a write that waited PUSH_TIMEOUT) fails
    that push, and the process drops its pushes for :data:`QUIET_AFTER_FAILURE` seconds
    (:class:`PushSkipped`); the connection is dropped and opened again at the next push
    tried. A silent Redis would otherwise hold every push — the stream's thread between
    two bursts, the interrupt poll waiting for it, a view's answer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # The process's connection to Redis (a redis-py Connection; tests set it to None
        # to have it opened again, for another REDIS_URL).
        self.client: redis.connection.AbstractConnection | None = None
        self.pid = 0
        self.quiet_until = 0.0  # time.monotonic() before which pushes are dropped
        self.unread: collections.deque[float] = collections.deque()  # when each command not answered was sent

    def publish(self, layer, group: str, message: dict) -> None:
        """PUBLISH ``message`` to ``group``'s channel. Raises what redis-py or the
        serializer raise (redis.TimeoutError when an earlier push has waited PUSH_TIMEOUT
        for its reply), or :class:`PushSkipped` within QUIET_AFTER_FAILURE of a failure."""
        if time.monotonic() < self.quiet_until:
            raise PushSkipped(f"a push failed less than {QUIET_AFTER_FAILURE:g} s ago")
        prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"]
        body = layer.serialize(message)
        with self.lock:
            try:
                connection = self._connection()
                self._read_replies(connection)
                connection.send_packed_command(connection.pack_command("PUBLISH", group_channel(prefix, group), body),
                                               check_health=False)
                self.unread.append(time.monotonic())
            except (redis.RedisError, OSError):
                self.quiet_until = time.monotonic() + QUIET_AFTER_FAILURE
                self._drop()
                raise

    def pending(self) -> int:
        """How many pushes' replies have not been read yet (tests)."""
        with self.lock:
            return len(self.unread)

    def _read_replies(self, connection) -> None:
        """Read the replies that have come, without waiting; raise redis.TimeoutError when
        one has been awaited PUSH_TIMEOUT."""
        unread = self.unread
        while unread and connection.can_read(timeout=0):
            unread.popleft()
            try:
                connection.read_response()
            except redis.ResponseError as exc:  # Redis refused one push: that one is lost
                log.warning("a push was refused by Redis (%s)", exc)
        if unread and time.monotonic() - unread[0] >= PUSH_TIMEOUT:
            raise redis.TimeoutError(f"Redis has not answered a push for {PUSH_TIMEOUT:g} s")

    def _drop(self) -> None:
        if self.client is not None:
            self.client.disconnect()
        self.client = None
        self.unread.clear()

    def _connection(self):
        if self.client is None or self.pid != os.getpid():
            # After a fork the parent's socket is left to the parent (never closed here).
            self.client, self.unread = None, collections.deque()
            self.client = redis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=PUSH_TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
                retry=Retry(NoBackoff(), 0),  # a lost push is caught up from the database: never wait twice
            ).connection_pool.make_connection()
            self.pid = os.getpid()
        return self.client


_publisher = _Publisher()


def group_name(session_id: int) -> str:
    """The Channels group of a session's watchers (no colons: Channels rejects them)."""
    return f"session-{session_id}"


def login_group_name(session_key: str) -> str:
    """The Channels group of the sockets opened under one browser login (Django session
    key); named by a hash, so the key itself, a secret, is never written to Redis."""
    return "login-" + hashlib.sha256(session_key.encode()).hexdigest()[:32]


def user_group_name(user_id: int) -> str:
    """The Channels group of every socket one account has open (docs/access.md: access
    changes apply at once)."""
    return f"user-{user_id}"


def machine_group_name(machine_id: int) -> str:
    """The Channels group of every socket following a session on one machine."""
    return f"machine-{machine_id}"


def _send(group: str, message: dict) -> None:
    """Send ``message`` to ``group``. Every caller has already stored what the message
    says, so a send that fails (Redis restarting, the channel layer full) is logged and
    dropped, never raised: a page catches up from the database."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        _publisher.publish(layer, group, message)
    except PushSkipped:
        pass  # the failure that started the quiet was logged
    except Exception as exc:  # redis-py and the serializer raise many kinds
        log.warning("push of %s to %s lost (%s)", message.get("type"), group, exc)


#: The Channels group of every page's attention socket (attention_app.consumers): each reads
#: again, for its own reader, which questions wait for them (docs/attention.md).
ATTENTION_GROUP = "attention"
#: The events after which the questions waiting for someone may have changed.
_ATTENTION_KINDS = frozenset({"question", "answered", "turn_end"})


def push_attention(session_id: int) -> None:
    """Tell every attention socket that the questions of a session changed (asked,
    answered, its sharing changed, the session deleted). No list: each socket reads what
    waits for its own reader, so a page never learns of a question it may not answer."""
    _send(ATTENTION_GROUP, {"type": "attention.changed", "session_id": session_id})


def push_session_gone(session_id: int) -> None:
    """Close every watcher's socket of a deleted session (the page says so: docs/live-page.md)."""
    _send(group_name(session_id), {"type": "session.gone"})
    push_attention(session_id)


def push_login_ended(session_key: str) -> None:
    """Close every socket opened under a browser login that has just ended (logout)."""
    _send(login_group_name(session_key), {"type": "login.ended"})


def push_access_changed(group: str) -> None:
    """Tell every socket in ``group`` (:func:`user_group_name`, :func:`machine_group_name`)
    that what its reader may do may have changed: each asks again, and closes or reloads
    its page (sessions_app.live.consumers). Lost ones are caught by the presence heartbeat."""
    _send(group, {"type": "access.changed"})


def push_event(session_id: int, seq: int, kind: str, payload: dict) -> None:
    """Tell every watcher of the session about one stored event.

    Called from ``transaction.on_commit`` only, so a watcher never sees an event the
    database does not have yet. Losing one is harmless: the consumer sees the gap at the
    next event and reads the missing ones from the database. So a push that fails (Redis
    restarting, the channel layer full) is logged and dropped, never raised: the event is
    already stored, and the step, view or task that stored it must go on as if it had
    been delivered.
    """
    _send(group_name(session_id), {"type": "transcript.event", "seq": seq, "kind": kind, "payload": payload})
    if kind in _ATTENTION_KINDS or (kind == "settings" and "visibility" in payload):
        push_attention(session_id)


def push_tail(session_id: int, after: int, kind: str, text: str) -> None:
    """Tell every watcher the text a reply has streamed since its last stored event (seq
    ``after``, of ``kind``) but not stored yet — all of it, each time, so a watcher shows
    the latest and never adds one to another (docs/live-page.md, "What it costs"). Not a
    transcript event: no seq, nothing stored; lost ones cost nothing (the stored event
    brings the same text)."""
    _send(group_name(session_id), {"type": "transcript.tail", "after": after, "kind": kind, "text": text})


def push_progress(session_id: int, state: dict) -> None:
    """Tell every watcher how far a completion has come: ``{"phase": "prompt",
    "processed": n, "total": N}`` (prompt tokens read, llama-server's ``prompt_progress``)
    or ``{"phase": "reply", "tokens": n}`` (tokens streamed so far). Not a transcript
    event: nothing stored; a lost one is replaced by the next, and the page drops the line
    when the turn ends."""
    _send(group_name(session_id), {"type": "transcript.progress", "state": state})


async def push_presence(session_id: int) -> None:
    """Tell every watcher of the session that who is watching changed. The message
    carries no list: each daphne's board reads the list once when the message arrives
    (sessions_app.live.presence_board), so the last list sent after several changes always
    shows the last state (two lists computed by two processes could arrive in either
    order)."""
    layer = get_channel_layer()
    if layer is None:
        return
    await layer.group_send(group_name(session_id), {"type": "presence.changed"})
