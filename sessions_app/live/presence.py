"""Who is watching a session now, from its open websockets (docs/sharing.md).

One :class:`~sessions_app.models.Watcher` row per open connection, in the database so
every daphne process sees every other's. A connection refreshes its row every
``CORRAL_PRESENCE_SECONDS`` (the heartbeat); a row not refreshed for three heartbeats
belongs to a process that died without closing its sockets and no longer counts. The
next heartbeat of any live watcher of that session deletes it and says the list changed.

Synchronous ORM code: the consumer calls it through ``database_sync_to_async``.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from ..models import Watcher

#: A row expires this many heartbeats after its last refresh.
MISSED_BEATS = 3


def heartbeat_seconds() -> float:
    """Seconds between two refreshes of a connection's row (setting
    ``CORRAL_PRESENCE_SECONDS``, default 20)."""
    return float(getattr(settings, "CORRAL_PRESENCE_SECONDS", 20.0))


def until_next_beat(now: float) -> float:
    """Seconds from ``now`` (the event loop's clock, ``loop.time()``) to this process's
    next heartbeat, in (0, :func:`heartbeat_seconds`]: after its first beat, a whole beat
    after it opened, every connection beats on the same multiples of the heartbeat, so a
    daphne with many pages open wakes once a beat for all of them, not once for each at
    its own moment (docs/live-page.md, "What it costs"). No connection waits longer
    between two beats than it did."""
    period = heartbeat_seconds()
    return period - now % period


def _expiry():
    return timezone.now() + timedelta(seconds=heartbeat_seconds() * MISSED_BEATS)


def join(session_id: int, user_id: int, channel_name: str) -> None:
    """Count one open connection of ``user_id`` on the session: one ``INSERT … ON
    CONFLICT`` statement (a row already there for ``channel_name`` is updated), not a
    locking read and an insert in a transaction of their own."""
    Watcher.objects.bulk_create(
        [Watcher(channel_name=channel_name, session_id=session_id, user_id=user_id, expires_at=_expiry())],
        update_conflicts=True, unique_fields=["channel_name"], update_fields=["session", "user", "expires_at"],
    )


def leave(channel_name: str) -> bool:
    """Stop counting a connection; True when it was counted."""
    deleted, _ = Watcher.objects.filter(channel_name=channel_name).delete()
    return bool(deleted)


def beat(session_id: int, user_id: int, channel_name: str) -> bool:
    """Refresh this connection's row and drop the session's expired ones.

    True when the list of watchers may have changed: an expired row was dropped, or this
    connection's own row was gone (dropped while its process stalled) and is back.
    Deleting is one statement, so of several live watchers only the one whose delete
    removed the rows reports the change.
    """
    now = timezone.now()
    expired, _ = Watcher.objects.filter(session_id=session_id, expires_at__lte=now).delete()
    refreshed = Watcher.objects.filter(channel_name=channel_name).update(expires_at=_expiry())
    if not refreshed:
        join(session_id, user_id, channel_name)
    return bool(expired) or not refreshed


def watching(session_id: int) -> list[str]:
    """Usernames with at least one live connection on the session, sorted; one name
    however many tabs its user has open."""
    names = (
        Watcher.objects.filter(session_id=session_id, expires_at__gt=timezone.now())
        .values_list("user__username", flat=True)
        .distinct()
    )
    return sorted(set(names))
