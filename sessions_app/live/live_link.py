"""Pages' sockets and Redis: a page must not say "live" while nothing can reach it.

Every push to a page goes through Redis (the Channels layer, sessions_app/live/broadcast.py).
When Redis stops — killed, restarting — channels_redis keeps each daphne's subscription
and retries in the background; the sockets stay open and the pages went on showing *live*
while every push was lost. Here one task per daphne process keeps a question waiting in
Redis while any page is open: a ``BLPOP`` of a list nobody writes, which Redis itself
answers (empty) after :data:`PING_EVERY` seconds, when the task asks again at once. An
answer that does not come within :data:`PING_EVERY` more seconds is a failure; after
:data:`FAILURES_BEFORE_LOST` in a row every open socket of this process is closed with
:data:`LINK_LOST`, and a socket opened while Redis is down is closed the same way at once.
The page then shows that its live link is lost and tries again (0.5 s, doubling up to 5 s:
static/corral/session.js); once Redis answers, it connects and catches up from the
database by ``seq`` (docs/live-page.md, "Staying connected"). What is sent meanwhile is
stored and waits (docs/operations.md).

Why a wait in Redis and not a ``PING`` every :data:`PING_EVERY` seconds: a PING cost the
daphne two wake-ups, its own clock's and the answer's; the wait costs one, the answer,
timed by Redis's clock (docs/live-page.md, "What it costs"). Redis may end a wait up to one
of its background rounds late (``hz``: a second for the embedded Redis), well within the
time allowed for the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis
import redis.asyncio
from django.conf import settings

from project.channel_layer import channel_prefix

log = logging.getLogger(__name__)

#: Seconds Redis holds each question before it answers (a whole number: BLPOP's timeout);
#: also the time allowed for the answer after that, and the least time between two
#: questions after a failure.
PING_EVERY = 2
#: Questions unanswered in a row before the pages are told their live link is lost.
FAILURES_BEFORE_LOST = 2
#: The close code of a socket whose live link went with Redis ("service unavailable", in
#: the application's range: daphne's websocket library refuses to send 1013 and the like).
#: Not one of the page's final codes (consumers.CloseCode): the page reconnects.
LINK_LOST = 4503
#: What a Redis that cannot be reached raises: redis-py's errors, a socket's, a timeout.
UNREACHABLE = (redis.RedisError, OSError, asyncio.TimeoutError)

_open: set = set()
_task: asyncio.Task | None = None


def watch(consumer) -> None:
    """Count ``consumer`` (an accepted websocket consumer with ``close(code=…)``) among the
    open sockets; starts this process's PING task if none runs."""
    global _task
    _open.add(consumer)
    if _task is None or _task.done():
        _task = asyncio.get_running_loop().create_task(_ping_while_open())


def pages_open() -> bool:
    """Whether any socket of this process is open (counted by :func:`watch`); the live
    pages' database connection is kept only while one is (sessions_app/live/db_thread.py)."""
    return bool(_open)


def forget(consumer) -> None:
    """The socket of ``consumer`` closed."""
    _open.discard(consumer)


async def lost(consumer) -> None:
    """Close ``consumer``'s socket as one whose live link is lost (Redis cannot be reached)."""
    forget(consumer)
    with contextlib.suppress(Exception):  # the socket may be closing already
        await consumer.close(code=LINK_LOST)


async def _ping_while_open() -> None:
    client: redis.asyncio.Redis | None = None
    failures = 0
    loop = asyncio.get_running_loop()
    nobody_writes = channel_prefix(settings.REDIS_URL) + "live-link"  # a list that stays empty
    try:
        while _open:
            asked = loop.time()
            if client is None:
                client = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=PING_EVERY)
                # Set after the URL's options, which redis-py lets win: a shorter socket
                # timeout of the URL's (``?socket_timeout=1``) would cut every answer.
                client.connection_pool.connection_kwargs["socket_timeout"] = 2 * PING_EVERY
            try:
                await asyncio.wait_for(client.blpop([nobody_writes], timeout=PING_EVERY), 2 * PING_EVERY)
                failures = 0
            except UNREACHABLE as exc:
                # A question cut by its timeout leaves its answer unread on the connection:
                # every later command would read the wrong answer. The next one uses a new client.
                with contextlib.suppress(Exception):
                    await client.aclose()
                client = None
                failures += 1
                # One late answer is a busy process (a large upload read in this loop), not
                # a lost Redis: only FAILURES_BEFORE_LOST in a row close the pages.
                if failures < FAILURES_BEFORE_LOST:
                    # A question refused at once (Redis killed) is followed when its answer
                    # would have timed out, as one that went unanswered: the pages learn of a
                    # killed Redis in 2–4 s and of a silent one within 8 s, as with PING.
                    await asyncio.sleep(max(0.0, asked + 2 * PING_EVERY - loop.time()))
                    continue
                if _open:
                    log.warning("Redis does not answer (%s): closing %d live page(s); they reconnect",
                                exc or type(exc).__name__, len(_open))
                for consumer in list(_open):
                    await lost(consumer)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
