"""The transcript's vocabulary (docs/transcript.md): the kinds of event, why a turn ends,
who did an action, the images a message carries, and what an event is to a fold.

An *event* is any object with the attributes ``seq: int``, ``kind: str`` and
``payload: dict`` (:class:`EventLike`) — the :class:`Event` dataclass defined here or a
Django model instance. What each kind's payload holds is :mod:`.payloads`. This module
must not import Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypedDict, runtime_checkable

#: Values of ``answered.payload["answer"]`` (docs/behaviour.md §8).
ANSWER_ALLOW_ONCE = "allow_once"
ANSWER_ALLOW_ALWAYS = "allow_always"
ANSWER_REFUSE = "refuse"


class Actor(TypedDict):
    """Who did a user action: the user's id (None for events recorded before ids were
    kept) and their username at the time."""

    id: int | None
    username: str


class ImageRef(TypedDict):
    """An image a user message carries (docs/transcript.md): the SHA-256 of its bytes (64
    lower-case hex digits, also its file name in the data directory), its media type
    (``image/png``, ``image/jpeg``, ``image/webp`` or ``image/gif``) and its size in bytes."""

    sha256: str
    media_type: str
    size: int


class Kind(StrEnum):
    """Every kind of transcript event (docs/transcript.md). A ``StrEnum``: members are the
    strings stored in ``TranscriptEvent.kind``, so comparisons with stored kinds hold."""

    SETTINGS = "settings"
    STATUS = "status"
    SERVER_READY = "server_ready"
    CATALOGUE = "catalogue"
    SERVER_STOPPED = "server_stopped"
    MESSAGE_QUEUED = "message_queued"
    MESSAGE_DROPPED = "message_dropped"
    MESSAGE_TAKEN = "message_taken"
    ASSISTANT_TEXT = "assistant_text"
    REASONING = "reasoning"
    TOOL_START = "tool_start"
    QUESTION = "question"
    ANSWERED = "answered"
    TOOL_RUNNING = "tool_running"
    TOOL_END = "tool_end"
    USAGE = "usage"
    ERROR = "error"
    NOTICE = "notice"
    INTERRUPTED = "interrupted"
    CLEARED = "cleared"
    TURN_END = "turn_end"
    ALLOWANCE_REVOKED = "allowance_revoked"
    VERSION_CHOSEN = "version_chosen"
    IMPORTED = "imported"


class TurnEnd(StrEnum):
    """Why a turn ended: the ``reason`` of its ``turn_end`` event."""

    DONE = "done"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"
    LIMIT = "limit"


@runtime_checkable
class EventLike(Protocol):
    """What a fold reads from an event: ``seq``, ``kind`` and ``payload``."""

    @property
    def seq(self) -> int:
        """Position in the session's transcript; folds read events in this order."""
        ...

    @property
    def kind(self) -> str:
        """Event kind, e.g. ``"message_taken"`` or ``"tool_start"``."""
        ...

    @property
    def payload(self) -> Any:
        """Kind-specific dict (anything else is read as an empty payload)."""
        ...


@dataclass(frozen=True, slots=True)
class Event:
    """A transcript event outside the ORM (tests, the agent loop's in-memory additions).

    ``payload`` is the kind-specific dict described in docs/behaviour.md §6 to §10.
    """

    seq: int
    kind: str
    payload: dict[str, Any] = field(default_factory=dict)


def actor(payload: Any) -> Actor | None:
    """Who did the user action an event records, or None for what nobody did (a turn's
    own end, a question closed by an interrupt, an event from a worker).

    Read from ``payload["by"]`` as ``{"id": int, "username": str}``; events recorded
    before that shape carry a plain username in ``"by"`` (answers, interrupts, clears,
    settings) or in ``"author"`` (messages), read with ``id`` None. An empty name is
    nobody.
    """
    if not isinstance(payload, Mapping):
        return None
    by = payload.get("by")
    if isinstance(by, Mapping):
        username = by.get("username")
        user_id = by.get("id")
        if isinstance(username, str) and username:
            return {"id": user_id if isinstance(user_id, int) and not isinstance(user_id, bool) else None,
                    "username": username}
        return None
    for legacy in (by, payload.get("author")):
        if isinstance(legacy, str) and legacy:
            return {"id": None, "username": legacy}
    return None


_HEX = frozenset("0123456789abcdef")


def image_refs(payload: Any) -> list[ImageRef]:
    """The well-formed image references of a ``message_taken`` / ``message_queued`` payload,
    in order (docs/transcript.md); anything else in ``images`` is skipped, so an odd entry
    never reaches a request or a page."""
    if not isinstance(payload, Mapping):
        return []
    refs: list[ImageRef] = []
    for item in payload.get("images") or ():
        if not isinstance(item, Mapping):
            continue
        digest, media_type, size = item.get("sha256"), item.get("media_type"), item.get("size")
        if (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX
                and isinstance(media_type, str) and media_type.startswith("image/")
                and isinstance(size, int) and not isinstance(size, bool)):
            refs.append({"sha256": digest, "media_type": media_type, "size": size})
    return refs
