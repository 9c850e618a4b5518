"""The only module that talks to the channel layer (STYLE: push from one place, after commit).

Every transcript message carries the session's sequence number, so a browser can tell a
gap or a duplicate and catch up from the database (case C17). Two more messages close
sockets: a session deleted, a browser login ended (docs/live-page.md).
"""

from __future__ import annotations

import hashlib

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def group_name(session_id: int) -> str:
    """The Channels group of a session's watchers (no colons: Channels rejects them)."""
    return f"session-{session_id}"


def login_group_name(session_key: str) -> str:
    """The Channels group of the sockets opened under one browser login (Django session
    key); named by a hash, so the key itself, a secret, is never written to Redis."""
    return "login-" + hashlib.sha256(session_key.encode()).hexdigest()[:32]


def _send(group: str, message: dict) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def push_session_gone(session_id: int) -> None:
    """Close every watcher's socket of a deleted session (the page says so: docs/live-page.md)."""
    _send(group_name(session_id), {"type": "session.gone"})


def push_login_ended(session_key: str) -> None:
    """Close every socket opened under a browser login that has just ended (logout)."""
    _send(login_group_name(session_key), {"type": "login.ended"})


def push_event(session_id: int, seq: int, kind: str, payload: dict) -> None:
    """Tell every watcher of the session about one stored event.

    Called from ``transaction.on_commit`` only, so a watcher never sees an event the
    database does not have yet. Losing one is harmless: the consumer sees the gap at the
    next event and reads the missing ones from the database.
    """
    _send(group_name(session_id), {"type": "transcript.event", "seq": seq, "kind": kind, "payload": payload})
