"""The only module that talks to the channel layer (STYLE: push from one place, after commit).

Every message carries the session's sequence number, so a browser can tell a gap or a
duplicate and catch up from the database (case C17).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def group_name(session_id: int) -> str:
    """The Channels group of a session's watchers (no colons: Channels rejects them)."""
    return f"session-{session_id}"


def push_event(session_id: int, seq: int, kind: str, payload: dict) -> None:
    """Tell every watcher of the session about one stored event.

    Called from ``transaction.on_commit`` only, so a watcher never sees an event the
    database does not have yet. Losing one is harmless: the consumer sees the gap at the
    next event and reads the missing ones from the database. So a push that fails (Redis
    restarting, the channel layer full) is logged and dropped, never raised: the event is
    already stored, and the step, view or task that stored it must go on as if it had
    been delivered.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            group_name(session_id),
            {"type": "transcript.event", "seq": seq, "kind": kind, "payload": payload},
        )
    except Exception as exc:  # redis-py, channels_redis and asyncio raise many kinds
        log.warning("push of event %s of session %s lost (%s); watchers catch up", seq, session_id, exc)


async def push_presence(session_id: int) -> None:
    """Tell every watcher of the session that who is watching changed. The message
    carries no list: each consumer reads the list when the message arrives, so the last
    message after several changes always shows the last state (two lists computed by
    two processes could arrive in either order)."""
    layer = get_channel_layer()
    if layer is None:
        return
    await layer.group_send(group_name(session_id), {"type": "presence.changed"})
