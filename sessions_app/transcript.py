"""Folds over a session transcript (SPEC §7, §8, §10).

The transcript is an append-only list of events; everything the agent loop and the page
need to know about a session's conversation is *folded* from it by the pure functions in
this module:

- :func:`build_messages` — the chat messages sent to ``/v1/chat/completions`` (SPEC §7);
- :func:`allowed_tools` and :func:`permission_mode` — the permission gate (SPEC §8);
- :func:`pending_queue`, :func:`open_turn`, :func:`pending_calls`,
  :func:`open_questions` and :func:`last_model_key` — queue / turn state
  (SPEC §6, §8, §10);
- :func:`actor` — who did a user action (docs/sharing.md).

An *event* is any object with the attributes ``seq: int``, ``kind: str`` and
``payload: dict`` — the :class:`Event` dataclass defined here or a Django model
instance; the folds only duck-type. Every fold is a pure function of its input: it
reads the events in ``seq`` order (ties keep their input order), never mutates them,
never touches the database and keeps no state between calls. This module must not
import Django.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, runtime_checkable

__all__ = [
    "ANSWER_ALLOW_ALWAYS",
    "ANSWER_ALLOW_ONCE",
    "ANSWER_REFUSE",
    "DEFAULT_PERMISSION_MODE",
    "EMPTY_ARGUMENTS",
    "UNFINISHED_TOOL_RESULT",
    "Actor",
    "Event",
    "EventLike",
    "actor",
    "allowed_tools",
    "build_messages",
    "last_catalogue",
    "last_model_key",
    "open_questions",
    "open_turn",
    "pending_calls",
    "pending_queue",
    "permission_mode",
]

#: The ``tool`` message content for a call that never got a ``tool_end`` (SPEC §7: a
#: call with no result gets a fixed sentence saying it did not finish, never an
#: invented outcome).
UNFINISHED_TOOL_RESULT = (
    "This tool call did not finish (it was interrupted before it returned a result)."
)

#: Arguments sent back for a call whose stored arguments are empty or missing (SPEC §7).
EMPTY_ARGUMENTS = "{}"

#: Permission mode of a session with no ``settings`` event naming one (SPEC §8).
DEFAULT_PERMISSION_MODE = "manual"

#: Values of ``answered.payload["answer"]`` (SPEC §8).
ANSWER_ALLOW_ONCE = "allow_once"
ANSWER_ALLOW_ALWAYS = "allow_always"
ANSWER_REFUSE = "refuse"

# Event kinds that take part in the conversation fold (SPEC §7). Every other kind
# (status, usage, error, reasoning, settings, question, answered, message_queued,
# message_dropped, interrupted, ...) is invisible to build_messages, except
# ``turn_end``, which seals the tool batch in progress (see build_messages).
_MESSAGE_TAKEN = "message_taken"
_MESSAGE_QUEUED = "message_queued"
_MESSAGE_DROPPED = "message_dropped"
_ASSISTANT_TEXT = "assistant_text"
_TOOL_START = "tool_start"
_TOOL_END = "tool_end"
_QUESTION = "question"
_ANSWERED = "answered"
_SETTINGS = "settings"
_CLEARED = "cleared"
_TURN_END = "turn_end"


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

    ``payload`` is the kind-specific dict described in SPEC §6 to §10.
    """

    seq: int
    kind: str
    payload: dict[str, Any] = field(default_factory=dict)


class Actor(TypedDict):
    """Who did a user action: the user's id (None for events recorded before ids were
    kept) and their username at the time."""

    id: int | None
    username: str


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


# --- helpers


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
    as compact, key-sorted JSON so that the result is deterministic (SPEC §7: content is
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


def _arguments(value: Any) -> str:
    """Tool-call arguments as sent back to the model (SPEC §7).

    The stored JSON text is sent exactly as stored; empty (or whitespace-only) or
    missing arguments are sent as ``"{}"``. A non-string value (defensive: should not
    be stored) is serialised as compact, key-sorted JSON.
    """
    text = _text(value)
    return text if text.strip() else EMPTY_ARGUMENTS


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


class _Fold:
    """Accumulator for :func:`build_messages`; one instance per call.

    ``text`` holds the assistant text seen since the last message was closed.
    ``calls`` is the tool batch being collected or awaiting its results; ``run_open``
    is True while ``tool_start`` events may still join that batch. ``results`` maps
    the batch's call ids to the first output seen for them.
    """

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.batch_content = ""
        self.calls: list[Mapping[str, Any]] = []
        self.results: dict[str, str] = {}
        self.run_open = False

    def close_text(self) -> None:
        """Emit the accumulated assistant text as one message (omitted when empty)."""
        content = "".join(self.text)
        self.text = []
        if content:
            self.messages.append({"role": "assistant", "content": content})

    def close_batch(self) -> None:
        """Emit the tool batch: an assistant message with ``tool_calls``, then results.

        Results are paired by call id, in call order; a call without a result gets
        :data:`UNFINISHED_TOOL_RESULT`.
        """
        self.run_open = False
        if not self.calls:
            return
        tool_calls = []
        for call in self.calls:
            tool_calls.append(
                {
                    "id": _text(call.get("id")),
                    "type": "function",
                    "function": {
                        "name": _text(call.get("tool")),
                        "arguments": _arguments(call.get("arguments")),
                    },
                }
            )
        self.messages.append(
            {
                "role": "assistant",
                "content": self.batch_content,
                "tool_calls": tool_calls,
            }
        )
        for call in self.calls:
            call_id = _text(call.get("id"))
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": self.results.get(call_id, UNFINISHED_TOOL_RESULT),
                }
            )
        self.calls = []
        self.results = {}
        self.batch_content = ""

    def close_all(self) -> None:
        """Close whatever is open: the tool batch, then any trailing text."""
        self.close_batch()
        self.close_text()

    def user(self, payload: Mapping[str, Any]) -> None:
        """A ``message_taken``: close the assistant side, then add the user message."""
        self.close_all()
        self.messages.append({"role": "user", "content": _text(payload.get("text"))})

    def assistant_text(self, payload: Mapping[str, Any]) -> None:
        """A text delta: after a tool batch it opens a new assistant message."""
        self.close_batch()
        fragment = _text(payload.get("text"))
        if fragment:
            self.text.append(fragment)

    def tool_start(self, payload: Mapping[str, Any]) -> None:
        """A call: join the open run of calls, or start a new batch taking the text."""
        if not self.run_open:
            self.close_batch()
            self.batch_content = "".join(self.text)
            self.text = []
            self.run_open = True
        self.calls.append(payload)

    def tool_end(self, payload: Mapping[str, Any]) -> None:
        """A result: end the run of calls; record the output for a call of the batch.

        Results for ids outside the current batch (a late or stray ``tool_end``) and
        repeated results for the same id are ignored, so a message once emitted never
        changes.
        """
        self.run_open = False
        call_id = _text(payload.get("id"))
        if call_id in self.results:
            return
        if any(_text(call.get("id")) == call_id for call in self.calls):
            self.results[call_id] = _text(payload.get("output"))


# --- folds


def build_messages(
    events: Iterable[EventLike], system_prompt: str | None = None
) -> list[dict[str, Any]]:
    """The chat messages for the next completion request, folded from the transcript.

    Contract (SPEC §7, "the transcript is the memory"):

    - Pure function of ``events`` (read in ``seq`` order); nothing else is consulted.
    - Only events after the **last** ``cleared`` event count (SPEC §10).
    - If ``system_prompt`` is not None it is the first message, ``{"role": "system"}``.
    - ``message_taken`` → ``{"role": "user", "content": text}``.
    - Consecutive ``assistant_text`` deltas form one
      ``{"role": "assistant", "content"}`` message, closed by the next user message or
      by a tool call. Text that arrives after a tool batch (i.e. after its results)
      opens a new assistant message. An interrupted reply is kept as the partial text
      that was seen.
    - A run of consecutive ``tool_start`` events (non-conversation events in between do
      not break it; ``tool_end``, text and user messages do) is ONE assistant message:
      ``{"role": "assistant", "content": <text just before, or "">,
      "tool_calls": [...]}`` with
      ``{"id", "type": "function", "function": {"name", "arguments"}}`` per call in
      start order; ``arguments`` is the stored JSON text, ``"{}"`` when empty or
      missing.
      It is followed by one ``{"role": "tool", "tool_call_id", "content"}`` per call, in
      call order, paired with the ``tool_end`` outputs **by call id**, not by position.
      A call without a ``tool_end`` is kept and gets :data:`UNFINISHED_TOOL_RESULT`.
      Only ``tool_end`` events seen before the batch is closed (by text, a user message,
      a new run of calls or ``turn_end``) count; later ones are ignored.
    - ``content`` is always a ``str`` (``""`` when empty), never ``None`` or missing
      (case C05). An assistant message with empty content and no tool calls is omitted.
    - Other kinds (status, error, usage, reasoning, settings, question, answered,
      message_queued, message_dropped, interrupted, turn_end, ...) add no messages.

    Stability (SPEC §7, §13): a message, once the fold has moved past it, is never
    changed by later events, and every dict is built with a fixed key order, so for
    a prefix ``events[:k]`` ending at a turn boundary, ``build_messages(events[:k])``
    equals the first messages of ``build_messages(events)`` and serialises
    byte-identically.
    This is what lets ``llama-server`` reuse its cached prompt prefix.
    """
    fold = _Fold()
    for event in _after_last_clear(_ordered(events)):
        kind = event.kind
        if kind == _MESSAGE_TAKEN:
            fold.user(_payload(event))
        elif kind == _ASSISTANT_TEXT:
            fold.assistant_text(_payload(event))
        elif kind == _TOOL_START:
            fold.tool_start(_payload(event))
        elif kind == _TOOL_END:
            fold.tool_end(_payload(event))
        elif kind == _TURN_END:
            # A turn that ended seals its tool batch: a late result cannot change it.
            fold.close_batch()
    fold.close_all()
    if system_prompt is not None:
        return [{"role": "system", "content": system_prompt}, *fold.messages]
    return fold.messages


def allowed_tools(events: Iterable[EventLike]) -> frozenset[str]:
    """Tool names the user chose to "Always allow" in this session (SPEC §8).

    The set is folded from every ``answered`` event whose ``answer`` is
    ``"allow_always"`` (its ``tool`` names the tool). Allowances are per session:
    ``cleared`` does NOT reset them, and neither does a model change or a restart.
    """
    names: set[str] = set()
    for event in events:
        if event.kind != _ANSWERED:
            continue
        payload = _payload(event)
        tool = payload.get("tool")
        if (
            payload.get("answer") == ANSWER_ALLOW_ALWAYS
            and isinstance(tool, str)
            and tool
        ):
            names.add(tool)
    return frozenset(names)


def permission_mode(
    events: Iterable[EventLike], default: str = DEFAULT_PERMISSION_MODE
) -> str:
    """The session's permission mode: the latest settings "permission_mode" (SPEC §8).

    ``"manual"`` or ``"bypassPermissions"`` as recorded; ``default`` when no
    ``settings`` event names a mode. Not reset by ``cleared``.
    """
    mode = default
    for event in _ordered(events):
        if event.kind == _SETTINGS:
            value = _payload(event).get("permission_mode")
            if isinstance(value, str) and value:
                mode = value
    return mode


def last_model_key(events: Iterable[EventLike]) -> str | None:
    """The model named by the latest ``settings`` event carrying "model_key" (SPEC §10).

    None when no ``settings`` event names a model. Not reset by ``cleared``.
    """
    key: str | None = None
    for event in _ordered(events):
        if event.kind == _SETTINGS:
            value = _payload(event).get("model_key")
            if isinstance(value, str) and value:
                key = value
    return key


def pending_queue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Queued messages still waiting, oldest first (SPEC §10).

    A ``message_queued`` payload is pending until a ``message_taken`` names its id as
    ``queued_id`` or a ``message_dropped`` names its id. Returns copies of the queued
    payloads in queue order. ``cleared`` does not empty the queue.
    """
    queued: dict[str, dict[str, Any]] = {}
    resolved: set[str] = set()
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == _MESSAGE_QUEUED:
            queue_id = _text(payload.get("id"))
            if queue_id not in queued:
                queued[queue_id] = dict(payload)
        elif event.kind == _MESSAGE_TAKEN:
            taken = payload.get("queued_id")
            if taken is not None:
                resolved.add(_text(taken))
        elif event.kind == _MESSAGE_DROPPED:
            resolved.add(_text(payload.get("id")))
    return [item for queue_id, item in queued.items() if queue_id not in resolved]


def open_turn(events: Iterable[EventLike]) -> bool:
    """True when a turn was started and has not ended (SPEC §6, §10).

    That is: some ``message_taken`` comes after the last ``turn_end`` (or there is a
    ``message_taken`` and no ``turn_end`` at all).
    """
    return _current_turn(_ordered(events)) is not None


def pending_calls(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Tool calls of the open turn that have not returned yet (SPEC §6, §7, §9).

    Copies of the ``tool_start`` payloads of the current open turn, in start order,
    whose id has no ``tool_end`` in that turn. Empty when no turn is open. The agent
    loop folds the conversation with :func:`build_messages` only once this is empty.
    """
    turn = _current_turn(_ordered(events))
    if turn is None:
        return []
    ended = {_text(_payload(ev).get("id")) for ev in turn if ev.kind == _TOOL_END}
    return [
        dict(_payload(ev))
        for ev in turn
        if ev.kind == _TOOL_START and _text(_payload(ev).get("id")) not in ended
    ]


def open_questions(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Permission questions still waiting for an answer (SPEC §8).

    Copies of the ``question`` payloads, in the order asked (one per call id, the first
    asked), whose id has no ``answered`` event. Not reset by ``cleared``.
    """
    asked: dict[str, dict[str, Any]] = {}
    answered: set[str] = set()
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == _QUESTION:
            call_id = _text(payload.get("id"))
            if call_id not in asked:
                asked[call_id] = dict(payload)
        elif event.kind == _ANSWERED:
            answered.add(_text(payload.get("id")))
    return [item for call_id, item in asked.items() if call_id not in answered]


def last_catalogue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """The tool entries of the latest ``catalogue`` event (recorded when a server became
    ready, SPEC §9); ``[]`` when none was recorded."""
    latest: list[dict[str, Any]] = []
    for event in _ordered(events):
        if event.kind == "catalogue":
            latest = list(_payload(event).get("tools", []))
    return latest
