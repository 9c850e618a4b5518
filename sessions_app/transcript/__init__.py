"""The transcript: its vocabulary and the folds over it (docs/behaviour.md §7, §8, §10;
docs/transcript.md).

The transcript is an append-only list of events; everything the agent loop and the page
need to know about a session's conversation is *folded* from it by pure functions:

- :func:`build_messages` — the chat messages sent to ``/v1/chat/completions`` (docs/behaviour.md §7);
- :func:`allowances` — the "always" answers in force, for the permission gate
  (docs/behaviour.md §8; whether one covers a call is :func:`sessions_app.allowances.matches`;
  the mode itself is the session's ``permission_mode`` column, each change recorded as a
  ``settings`` event);
- :func:`pending_queue`, :func:`open_turn`, :func:`pending_calls`,
  :func:`open_questions` and :func:`reply_cut_off` — queue / turn state
  (docs/behaviour.md §6, §8, §10);
- :func:`actor` — who did a user action (docs/sharing.md).

An *event* is any object with the attributes ``seq: int``, ``kind: str`` and
``payload: dict`` — the :class:`Event` dataclass or a Django model instance; the folds
only duck-type. Every fold is a pure function of its input: it reads the events in
``seq`` order (ties keep their input order), never mutates them, never touches the
database and keeps no state between calls. No module of this package imports Django.

Where each part lives (every name is re-exported here, so ``transcript.X`` reads the same
from anywhere):

- :mod:`.vocabulary` — :class:`Kind`, :class:`TurnEnd`, :class:`Actor`, :class:`ImageRef`,
  the answers, :class:`EventLike` / :class:`Event`, :func:`actor`, :func:`image_refs`;
- :mod:`.payloads` — one payload type per kind, :data:`PAYLOADS` and :func:`check_payload`;
- :mod:`.messages` — the conversation fold: :func:`build_messages`, :func:`last_message`;
- :mod:`.folds` — the state folds: :func:`allowances`, the queue, the turn, the calls and
  questions waiting, the latest catalogue and ``server_ready``;
- :mod:`.versions` — :class:`Versions`, which version of a message sent again is shown;
- :mod:`.reading` — how every fold reads events (private to the package).
"""

from __future__ import annotations

from .folds import (
    Allowance,
    allowances,
    last_catalogue,
    last_server_ready,
    open_questions,
    open_turn,
    pending_calls,
    pending_queue,
    reply_cut_off,
)
from .messages import (
    EMPTY_ARGUMENTS,
    IMAGE_MISSING,
    IMAGE_NOT_SHOWN,
    UNFINISHED_TOOL_RESULT,
    USER_JOIN,
    ImageURL,
    build_messages,
    last_message,
)
from .payloads import (
    PAYLOADS,
    AllowanceRevokedPayload,
    AnsweredPayload,
    ByPayload,
    CallPayload,
    CataloguePayload,
    ErrorPayload,
    ImportedPayload,
    InvalidEvent,
    MessageDroppedPayload,
    MessagePayload,
    MessageQueuedPayload,
    MessageTakenPayload,
    QuestionPayload,
    ServerReadyPayload,
    ServerStoppedPayload,
    SettingsPayload,
    StatusPayload,
    TextPayload,
    ToolEndPayload,
    ToolStartPayload,
    TurnEndPayload,
    UsagePayload,
    VersionChosenPayload,
    check_payload,
)
from .versions import Versions
from .vocabulary import (
    ANSWER_ALLOW_ALWAYS,
    ANSWER_ALLOW_ONCE,
    ANSWER_REFUSE,
    Actor,
    Event,
    EventLike,
    ImageRef,
    Kind,
    TurnEnd,
    actor,
    image_refs,
)

__all__ = [
    # vocabulary
    "ANSWER_ALLOW_ALWAYS",
    "ANSWER_ALLOW_ONCE",
    "ANSWER_REFUSE",
    "Actor",
    "Event",
    "EventLike",
    "ImageRef",
    "Kind",
    "TurnEnd",
    "actor",
    "image_refs",
    # payloads
    "PAYLOADS",
    "AllowanceRevokedPayload",
    "AnsweredPayload",
    "ByPayload",
    "CallPayload",
    "CataloguePayload",
    "ErrorPayload",
    "ImportedPayload",
    "InvalidEvent",
    "MessageDroppedPayload",
    "MessagePayload",
    "MessageQueuedPayload",
    "MessageTakenPayload",
    "QuestionPayload",
    "ServerReadyPayload",
    "ServerStoppedPayload",
    "SettingsPayload",
    "StatusPayload",
    "TextPayload",
    "ToolEndPayload",
    "ToolStartPayload",
    "TurnEndPayload",
    "UsagePayload",
    "VersionChosenPayload",
    "check_payload",
    # the conversation fold
    "EMPTY_ARGUMENTS",
    "IMAGE_MISSING",
    "IMAGE_NOT_SHOWN",
    "UNFINISHED_TOOL_RESULT",
    "USER_JOIN",
    "ImageURL",
    "build_messages",
    "last_message",
    # the state folds
    "Allowance",
    "allowances",
    "last_catalogue",
    "last_server_ready",
    "open_questions",
    "open_turn",
    "pending_calls",
    "pending_queue",
    "reply_cut_off",
    # versions
    "Versions",
]
