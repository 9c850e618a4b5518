"""The Channels layer: channels_redis's pub/sub layer, its channel names kept apart per
Redis database.

Why pub/sub (docs/live-page.md, "What it costs"): a message to a session's watchers is one
``PUBLISH``, and Redis pushes it to every daphne subscribed to the session's group, which
hands it to its consumers in memory. channels_redis's default layer keeps a sorted set per
group and a queue per consumer: a group read and a script to send, and for every consumer a
cleanup script, a blocking ``BZPOPMIN`` and a ``ZREM`` to receive — three round trips per
message per watcher, most of daphne's CPU while a reply streams. What the default layer
kept and pub/sub does not — messages waiting for a consumer that is not reading — Corral
never needs: every message says something already stored, and a page that misses one
catches up from the database by ``seq`` (docs/behaviour.md C17).

Subscriptions belong to a daphne's Redis connection, so a daphne that dies (no consumer's
disconnect ever runs) leaves every group at once, as its connection closes; there is no
group expiry to wait for.

Redis keeps one pub/sub namespace for the whole server, whatever database a client
selects: two Corral deployments on one Redis, each in its own database, would otherwise
receive each other's transcript messages. :func:`channel_prefix` puts the database number
into every channel name.
"""

from __future__ import annotations

from redis.connection import parse_url


def channel_prefix(redis_url: str) -> str:
    """The prefix of every channel and group name for the Redis at ``redis_url``:
    ``"corral-db<n>."`` where ``n`` is the database the URL selects (``/n`` or ``?db=n``,
    0 when it names none). Raises ``ValueError`` for a URL redis-py cannot read."""
    return f"corral-db{int(parse_url(redis_url).get('db') or 0)}."


def group_channel(prefix: str, group: str) -> str:
    """The Redis pub/sub channel of a Channels group in channels_redis's pub/sub layer
    configured with ``prefix`` (``RedisPubSubLoopLayer._get_group_channel_name``), for
    publishing to it without the layer (sessions_app/live/broadcast.py).
    tests/test_live_connection.py checks it against the layer's own."""
    return f"{prefix}__group__{group}"
