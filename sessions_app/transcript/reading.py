"""How the folds read events (private to :mod:`sessions_app.transcript`; not re-exported).

Every fold reads the events in ``seq`` order (ties keep their input order), reads a
payload that is not a mapping as an empty one and a payload value as text the same way;
these helpers are that shared reading. This module must not import Django.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .vocabulary import EventLike, Kind

# Short names for the kinds the folds look for. The conversation fold reads the message,
# text, tool and version kinds (docs/behaviour.md §7); every other kind is invisible to
# build_messages, except ``turn_end``, which seals the tool batch in progress.
_MESSAGE_TAKEN = Kind.MESSAGE_TAKEN
_MESSAGE_QUEUED = Kind.MESSAGE_QUEUED
_MESSAGE_DROPPED = Kind.MESSAGE_DROPPED
_ASSISTANT_TEXT = Kind.ASSISTANT_TEXT
_TOOL_START = Kind.TOOL_START
_TOOL_END = Kind.TOOL_END
_QUESTION = Kind.QUESTION
_ANSWERED = Kind.ANSWERED
_CLEARED = Kind.CLEARED
_TURN_END = Kind.TURN_END
_VERSION_CHOSEN = Kind.VERSION_CHOSEN


def _ordered(events: Iterable[EventLike]) -> list[EventLike]:
    """The events sorted by ``seq`` (stable: equal seqs keep their input order)."""
    return sorted(events, key=lambda ev: ev.seq)


def _payload(event: EventLike) -> Mapping[str, Any]:
    """The event's payload, or an empty mapping when it is missing or not a mapping."""
    payload = getattr(event, "payload", None)
    return payload if isinstance(payload, Mapping) else {}


def _text(value: Any) -> str:
    """A payload value as message text: strings as they are, ``None`` as ``""``.

    Anything else (a dict or list someone stored as a tool output, a number) is rendered
    as compact, key-sorted JSON so that the result is deterministic (docs/behaviour.md §7: content is
    always a string).
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(
            value, ensure_ascii=False, sort_keys=True, separators=(",", ":")
        )
    except (TypeError, ValueError):
        return str(value)


def _after_last_clear(events: list[EventLike]) -> list[EventLike]:
    """The events after the last ``cleared`` event (all of them when there is none)."""
    for index in range(len(events) - 1, -1, -1):
        if events[index].kind == _CLEARED:
            return events[index + 1 :]
    return events


def _current_turn(events: list[EventLike]) -> list[EventLike] | None:
    """The events of the open turn (from its ``message_taken``), or None if none."""
    start: int | None = None
    for index, event in enumerate(events):
        if event.kind == _TURN_END:
            start = None
        elif event.kind == _MESSAGE_TAKEN and start is None:
            start = index
    return None if start is None else events[start:]
