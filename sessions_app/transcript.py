"""Folds over a session transcript (docs/behaviour.md §7, §8, §10).

The transcript is an append-only list of events; everything the agent loop and the page
need to know about a session's conversation is *folded* from it by the pure functions in
this module:

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
``payload: dict`` — the :class:`Event` dataclass defined here or a Django model
instance; the folds only duck-type. Every fold is a pure function of its input: it
reads the events in ``seq`` order (ties keep their input order), never mutates them,
never touches the database and keeps no state between calls. This module must not
import Django.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypedDict, runtime_checkable

__all__ = [
    "ANSWER_ALLOW_ALWAYS",
    "ANSWER_ALLOW_ONCE",
    "ANSWER_REFUSE",
    "EMPTY_ARGUMENTS",
    "IMAGE_MISSING",
    "IMAGE_NOT_SHOWN",
    "UNFINISHED_TOOL_RESULT",
    "Actor",
    "Event",
    "EventLike",
    "ImageRef",
    "InvalidEvent",
    "Kind",
    "TurnEnd",
    "Versions",
    "check_payload",
    "actor",
    "image_refs",
    "Allowance",
    "allowances",
    "build_messages",
    "last_catalogue",
    "last_server_ready",
    "open_questions",
    "open_turn",
    "pending_calls",
    "pending_queue",
    "reply_cut_off",
    "last_message",
]

#: What joins a user message that got no reply to the next one (see ``_Fold.user``).
USER_JOIN = "\n\n"

#: The ``tool`` message content for a call that never got a ``tool_end`` (docs/behaviour.md §7: a
#: call with no result gets a fixed sentence saying it did not finish, never an
#: invented outcome).
UNFINISHED_TOOL_RESULT = (
    "This tool call did not finish (it was interrupted before it returned a result)."
)

#: Arguments sent back for a call whose stored arguments are empty or missing (docs/behaviour.md §7).
EMPTY_ARGUMENTS = "{}"

#: What a user message says in place of an image when the session's model has no vision
#: projector (docs/behaviour.md §16: a conversation goes on after a change to such a model).
IMAGE_NOT_SHOWN = "[An image was attached here; the current model cannot take images.]"

#: What it says in place of an image that is no longer stored (docs/behaviour.md §16; the
#: session says which one in a notice).
IMAGE_MISSING = "[An image was attached here; it is no longer stored, so it cannot be shown.]"

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


# One payload type per kind: what :func:`check_payload` (called by every write of an
# event) holds a payload to. Keys not listed are refused, so a typo never reaches a
# transcript that the folds would then silently misread.


class SettingsPayload(TypedDict, total=False):
    model_key: str
    model: str
    permission_mode: str
    sampling: dict
    server_params: dict
    system_prompt: str
    title: str
    visibility: str
    takes_images: bool
    by: Actor
    reason: str


class _StatusPayloadRequired(TypedDict):
    status: str


class StatusPayload(_StatusPayloadRequired, total=False):
    by: Actor
    reason: str  # "wake": a person's message woke a sleeping server (with ``by``)


class _ServerReadyPayloadRequired(TypedDict):
    model_key: str
    model: str


class ServerReadyPayload(_ServerReadyPayloadRequired, total=False):
    # What llama-server said about itself in GET /props once ready (docs/behaviour.md §17).
    chat_template: str  # "" the file's own; a built-in name; or the template file's path
    chat_template_caps: dict  # chat_template_caps as reported: supports_tools, supports_system_role, …
    jinja: bool  # False when started with a built-in template (legacy engine: no tools in a request)
    sampling_defaults: dict  # default_generation_settings.params: temperature, top_k, top_p, min_p, …
    n_ctx: int  # the slot's context size in tokens, from GET /props (when the server says)
    warm_tokens: int  # prompt tokens restored from a saved slot (docs/behaviour.md §5 warm prompts)
    opens_thinking: bool  # the generation prompt ends inside "<think>": replies start as reasoning
    # What the header's model details say of the file (live.header.model_facts): size_label,
    # quantization, context_length, takes_images, own_template, template_label.
    model_facts: dict


class CataloguePayload(TypedDict):
    tools: list


class _ServerStoppedPayloadRequired(TypedDict):
    reason: str  # "stopped" (a person), "restart", "idle" (put to sleep: docs/behaviour.md §5)


class ServerStoppedPayload(_ServerStoppedPayloadRequired, total=False):
    by: Actor


class _MessageQueuedPayloadRequired(TypedDict):
    id: str
    text: str


class MessageQueuedPayload(_MessageQueuedPayloadRequired, total=False):
    by: Actor
    images: list[ImageRef]
    author: str  # transcripts written before "by": the author's username


class MessageDroppedPayload(TypedDict):
    id: str
    by: Actor


class _MessageTakenPayloadRequired(TypedDict):
    text: str
    queued_id: str | None


class MessageTakenPayload(_MessageTakenPayloadRequired, total=False):
    by: Actor | None
    images: list[ImageRef]
    author: str  # transcripts written before "by"
    # Sent again (regenerate, or edit and send): the seq of the message_taken this one
    # takes the place of in the conversation (build_messages drops the replaced reply).
    replaces: int
    edited: bool  # the text was changed (edit), not the same (regenerate)


class TextPayload(TypedDict):
    text: str


class _ToolStartPayloadRequired(TypedDict):
    id: str
    tool: str
    arguments: str  # JSON text, as the model wrote it (or "{}")


class ToolStartPayload(_ToolStartPayloadRequired, total=False):
    raw_arguments: str | None
    # Why the received arguments are not one JSON object, in words: the call is not run.
    arguments_error: str
    input: dict
    # Parsed once when the call is recorded (sessions_app/callcard.py, docs/behaviour.md §8):
    duplicate_keys: list  # keys named more than once in the arguments (the last value counts)
    file_before: dict  # a file write or edit: the file as it was then ({"path", "state", ...})
    origin: str | None
    server: str | None
    writes: bool | None
    display_name: str


class _QuestionPayloadRequired(TypedDict):
    id: str
    tool: str


class QuestionPayload(_QuestionPayloadRequired, total=False):
    # What "always" may cover for this call (sessions_app.allowances.offers); only these
    # may be granted. Absent (questions asked before scopes): no "always" is offered.
    offers: list[dict]
    # An MCP tool allowed before whose definition changed since: what changed, in words.
    changed: list[str]
    # What an MCP server claims about the tool (readOnlyHint), shown, never trusted.
    claims: str


class _AnsweredPayloadRequired(TypedDict):
    id: str
    tool: str | None
    answer: str


class AnsweredPayload(_AnsweredPayloadRequired, total=False):
    by: Actor
    reason: str
    scope: dict  # with allow_always: what it covers (sessions_app/allowances.py)


class AllowanceRevokedPayload(TypedDict):
    seq: int  # the seq of the ``answered`` event that granted the allowance
    tool: str  # the grant's tool and scope, copied, so the event reads on its own
    scope: dict
    by: Actor


class CallPayload(TypedDict):
    id: str


class _ToolEndRequired(TypedDict):
    id: str
    output: str  # cut to CORRAL_TOOL_RESULT_MAX_CHARS, as the model and the page see it
    ok: bool


class ToolEndPayload(_ToolEndRequired, total=False):
    full_chars: int  # the result's length before it was cut; absent when whole


class UsagePayload(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_n: int
    cache_n: int
    predicted_n: int
    predicted_per_second: float
    prompt_per_second: float
    draft_n: int  # speculative decoding: tokens drafted (llama-server's timings)
    draft_n_accepted: int  # … and kept
    prompt_ms: float  # milliseconds reading the prompt (llama-server's timings)
    predicted_ms: float  # … and generating the reply
    seed: int
    finish_reason: str | None
    sampling: dict  # the values in force (docs/behaviour.md §17)
    sampling_from: dict  # name → "session" | "model" | "server"


class MessagePayload(TypedDict):
    message: str


class _ErrorPayloadRequired(TypedDict):
    message: str  # one plain sentence: what failed, what to try


class ErrorPayload(_ErrorPayloadRequired, total=False):
    log: str  # the raw lines behind it (a server's last log lines), shown folded
    context_exceeded: bool  # the request did not fit the context (docs/behaviour.md C07): offer Clear


class VersionChosenPayload(TypedDict):
    seq: int  # the message_taken whose version (that message and its reply) is in force again
    by: Actor


class ByPayload(TypedDict):
    by: Actor


class TurnEndPayload(TypedDict):
    reason: str


class ImportedPayload(TypedDict):
    by: Actor  # who imported the file (the new session's owner)
    events: int  # how many events came from the file: the ones just before this one
    first_seq: int  # the seq the first of them had in the file's session


PAYLOADS: dict[Kind, Any] = {  # Kind → its payload TypedDict
    Kind.SETTINGS: SettingsPayload,
    Kind.STATUS: StatusPayload,
    Kind.SERVER_READY: ServerReadyPayload,
    Kind.CATALOGUE: CataloguePayload,
    Kind.SERVER_STOPPED: ServerStoppedPayload,
    Kind.MESSAGE_QUEUED: MessageQueuedPayload,
    Kind.MESSAGE_DROPPED: MessageDroppedPayload,
    Kind.MESSAGE_TAKEN: MessageTakenPayload,
    Kind.ASSISTANT_TEXT: TextPayload,
    Kind.REASONING: TextPayload,
    Kind.TOOL_START: ToolStartPayload,
    Kind.QUESTION: QuestionPayload,
    Kind.ANSWERED: AnsweredPayload,
    Kind.TOOL_RUNNING: CallPayload,
    Kind.TOOL_END: ToolEndPayload,
    Kind.USAGE: UsagePayload,
    Kind.ERROR: ErrorPayload,
    Kind.NOTICE: MessagePayload,
    Kind.INTERRUPTED: ByPayload,
    Kind.CLEARED: ByPayload,
    Kind.TURN_END: TurnEndPayload,
    Kind.ALLOWANCE_REVOKED: AllowanceRevokedPayload,
    Kind.VERSION_CHOSEN: VersionChosenPayload,
    Kind.IMPORTED: ImportedPayload,
}


class InvalidEvent(ValueError):
    """An event that is not in the vocabulary: an unknown kind, a missing or unknown key."""


def check_payload(kind: str, payload: Mapping[str, Any]) -> Kind:
    """The :class:`Kind` of ``kind`` after checking ``payload`` against its payload type:
    every required key present, no key the type does not list. Raises :class:`InvalidEvent`."""
    try:
        known = Kind(kind)
    except ValueError:
        raise InvalidEvent(f"unknown event kind {kind!r}") from None
    shape = PAYLOADS[known]
    missing = shape.__required_keys__ - payload.keys()
    unknown = payload.keys() - shape.__required_keys__ - shape.__optional_keys__
    if missing or unknown:
        raise InvalidEvent(f"{kind} payload: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return known


# The kinds the conversation fold reads (docs/behaviour.md §7); every other kind is invisible to
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


#: How the fold turns a stored image into the URL of an ``image_url`` content part: a
#: ``data:`` URI of the stored bytes, or None when they cannot be read.
ImageURL = Callable[[ImageRef], "str | None"]


def _user_message(text: str, images: list[ImageRef], image_url: ImageURL | None) -> dict[str, Any]:
    """One ``user`` message (docs/behaviour.md §7, §16).

    Without images, ``content`` is the text. With images and a model that takes them
    (``image_url`` given), ``content`` is OpenAI content parts: the text part (left out
    when the text is empty), then one ``{"type": "image_url", "image_url": {"url"}}`` per
    image in the order attached — llama-server places each image where its part stands.
    Without ``image_url`` each image is the sentence :data:`IMAGE_NOT_SHOWN` after the
    text, so a session whose model changed keeps its conversation.
    """
    if not images:
        return {"role": "user", "content": text}
    if image_url is None:
        notes = [IMAGE_NOT_SHOWN] * len(images)
        return {"role": "user", "content": USER_JOIN.join([text, *notes] if text else notes)}
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for ref in images:
        url = image_url(ref)
        if url is None:
            parts.append({"type": "text", "text": IMAGE_MISSING})
        else:
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "user", "content": parts}


def _arguments(value: Any) -> str:
    """Tool-call arguments as sent back to the model (docs/behaviour.md §7).

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

    def __init__(self, image_url: ImageURL | None = None) -> None:
        self.image_url = image_url
        # The text and images of the last user message, kept so a message that joins it
        # (see ``user``) rebuilds it whole.
        self.last_user: tuple[str, list[ImageRef]] = ("", [])
        self.messages: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.batch_content = ""
        self.calls: list[Mapping[str, Any]] = []
        self.results: dict[str, str] = {}
        self.run_open = False
        # seq of each message_taken → how the messages stood just before it: their number
        # and, when it joined an unanswered user message, that message's content then.
        self.marks: dict[int, tuple[int, tuple[str, list[ImageRef]] | None]] = {}
        # The exchange in force (the seq of its message_taken), and what each exchange the
        # fold has left produced: where its messages start, the messages, its last user
        # message — so a version chosen again (``version_chosen``) is put back as it was.
        self.current: int | None = None
        self.produced: dict[int, tuple[int, list[dict[str, Any]], tuple[str, list[ImageRef]]]] = {}

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

    def leave_exchange(self) -> None:
        """Keep what the exchange in force produced (see ``produced``), closing it first."""
        self.close_all()
        if self.current is not None and self.current in self.marks:
            length, joined_onto = self.marks[self.current]
            start = length - 1 if joined_onto is not None else length
            self.produced[self.current] = (start, list(self.messages[start:]), self.last_user)

    def choose(self, seq: Any) -> None:
        """A ``version_chosen``: the conversation goes back to where the chosen exchange
        began and takes its messages again, as they were; later ones leave the request
        (the transcript keeps them). An exchange the fold has not seen (before the last
        ``cleared``, or unknown) changes nothing."""
        self.leave_exchange()
        if not isinstance(seq, int) or seq not in self.produced:
            return
        start, messages, last_user = self.produced[seq]
        del self.messages[start:]
        self.messages.extend(messages)
        self.last_user = last_user
        self.current = seq

    def user(self, payload: Mapping[str, Any], seq: int | None = None) -> None:
        """A ``message_taken``: close the assistant side, then add the user message.

        When the turn before left no assistant message (it failed, was interrupted before
        the first token, or the reply was empty or reasoning only), the new text joins the
        unanswered user message, separated by a blank line: many chat templates refuse two
        user messages in a row ("Conversation roles must alternate"), and a session would
        otherwise fail on every turn until cleared.
        """
        self.leave_exchange()
        replaces = payload.get("replaces")
        if isinstance(replaces, int) and replaces in self.marks:
            # Sent again: the conversation goes back to just before the message it replaces
            # (its reply leaves the request; the transcript keeps both).
            length, joined_onto = self.marks[replaces]
            del self.messages[length:]
            if joined_onto is not None:
                self.last_user = joined_onto
                self.messages[-1] = _user_message(*joined_onto, self.image_url)
        last = self.messages[-1] if self.messages else None
        if seq is not None:
            self.marks[seq] = (len(self.messages), self.last_user if last is not None and last["role"] == "user" else None)
        text = _text(payload.get("text"))
        images = image_refs(payload)
        if last is not None and last["role"] == "user":
            # Joined: one text, then the images of both messages in the order sent.
            before, before_images = self.last_user
            text = f"{before}{USER_JOIN}{text}" if before else text
            images = before_images + images
            self.messages.pop()
        self.last_user = (text, images)
        self.messages.append(_user_message(text, images, self.image_url))
        self.current = seq

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
    events: Iterable[EventLike], system_prompt: str | None = None, *, image_url: ImageURL | None = None
) -> list[dict[str, Any]]:
    """The chat messages for the next completion request, folded from the transcript.

    Contract (docs/behaviour.md §7, "the transcript is the memory"):

    - Pure function of ``events`` (read in ``seq`` order); nothing else is consulted.
    - Only events after the **last** ``cleared`` event count (docs/behaviour.md §10).
    - If ``system_prompt`` is not None it is the first message, ``{"role": "system"}``.
    - ``message_taken`` → ``{"role": "user", "content": text}``; but never two user
      messages in a row: a message that follows a turn which left no assistant message
      is joined to the unanswered one with :data:`USER_JOIN` (a blank line).
    - A user message with ``images`` (docs/behaviour.md §16) has content parts: its text,
      then one ``image_url`` part per image whose URL ``image_url(ref)`` gives (a
      ``data:`` URI; :data:`IMAGE_MISSING` as a text part when it gives None). Without
      ``image_url`` (a model with no vision projector) the content stays a string, each
      image said as :data:`IMAGE_NOT_SHOWN`. Joined messages keep every image.
    - A ``message_taken`` with ``replaces`` (a message sent again: regenerate, or edit and
      send) first takes the conversation back to how it stood just before the message
      whose seq it names (that message and everything after it leave the request; the
      earlier messages stay byte-identical), then adds its own text. One that names a
      message before the last ``cleared``, or none at all, is an ordinary message.
    - A ``version_chosen`` naming the seq of an earlier ``message_taken`` (a version of a
      message sent again, chosen on the page) takes the conversation back to where that
      message began and puts back that message and what followed it up to the next
      message or choice, exactly as they were; what came after leaves the request. One
      that names a message before the last ``cleared`` (or no message) changes nothing.
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
    - ``content`` is always a ``str`` (``""`` when empty) or, for a user message with
      images, a list of parts; never ``None`` or missing (docs/behaviour.md C05). An assistant message with empty content and no tool calls is omitted.
    - Other kinds (status, error, usage, reasoning, settings, question, answered,
      message_queued, message_dropped, interrupted, turn_end, ...) add no messages.

    Stability (docs/behaviour.md §7, §13): a message, once the fold has moved past it, is never
    changed by later events, and every dict is built with a fixed key order, so for
    a prefix ``events[:k]`` ending at a turn boundary, ``build_messages(events[:k])``
    equals the first messages of ``build_messages(events)`` and serialises
    byte-identically — except a trailing user message that no reply followed, which the
    next message joins (the server has nothing cached after it worth keeping).
    This is what lets ``llama-server`` reuse its cached prompt prefix.
    """
    fold = _Fold(image_url)
    for event in _after_last_clear(_ordered(events)):
        kind = event.kind
        if kind == _MESSAGE_TAKEN:
            fold.user(_payload(event), event.seq)
        elif kind == _ASSISTANT_TEXT:
            fold.assistant_text(_payload(event))
        elif kind == _TOOL_START:
            fold.tool_start(_payload(event))
        elif kind == _TOOL_END:
            fold.tool_end(_payload(event))
        elif kind == _TURN_END:
            # A turn that ended seals its tool batch: a late result cannot change it.
            fold.close_batch()
        elif kind == _VERSION_CHOSEN:
            fold.choose(_payload(event).get("seq"))
    fold.close_all()
    if system_prompt is not None:
        return [{"role": "system", "content": system_prompt}, *fold.messages]
    return fold.messages


def last_message(events: Iterable[EventLike]) -> dict[str, Any] | None:
    """The user message a person may send again (regenerate, or edit and send):
    ``{"seq", "text"}`` (and ``"images"`` when it carried any) of the last ``message_taken``
    after the last ``cleared`` — or of the version chosen after it (``version_chosen``);
    None when there is none."""
    current = _after_last_clear(_ordered(events))
    taken = {event.seq: event for event in current if event.kind == _MESSAGE_TAKEN}
    for event in reversed(current):
        if event.kind == _VERSION_CHOSEN and _payload(event).get("seq") in taken:
            event = taken[_payload(event)["seq"]]  # the version in force is the last message
        if event.kind == _MESSAGE_TAKEN:
            payload = _payload(event)
            refs = image_refs(payload)
            return {"seq": event.seq, "text": _text(payload.get("text")), **({"images": refs} if refs else {})}
    return None


class Allowance(TypedDict):
    """An "always" answer in force: the ``seq`` of its ``answered`` event, the ``tool`` it
    was given for, its ``scope`` (sessions_app/allowances.py), who granted it (``by``, or
    None) and when (``at``: the event's ``created_at`` when it has one, else None)."""

    seq: int
    tool: str
    scope: dict
    by: Actor | None
    at: Any


def allowances(events: Iterable[EventLike]) -> list[Allowance]:
    """The allowances in force, in the order granted (docs/behaviour.md §8).

    Folded from every ``answered`` event with ``answer: allow_always`` and a ``scope``
    (a dict with a ``kind``), less those an ``allowance_revoked`` names by seq. An
    ``allow_always`` with no scope (written before scopes existed: it meant "the whole
    tool") grants nothing: such a tool is asked about again. A grant equal to one in
    force (same tool and scope) is not listed twice; a grant for an MCP tool replaces an
    earlier one for the same server and remote name (its definition changed since).
    Allowances are the session's: ``cleared``, a model change and a restart keep them;
    ``imported`` ends those granted before it (granted in another session, by people who
    granted nothing here).
    """
    in_force: list[Allowance] = []
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == Kind.IMPORTED:
            in_force = []
            continue
        if event.kind == Kind.ALLOWANCE_REVOKED:
            in_force = [a for a in in_force if a["seq"] != payload.get("seq")]
            continue
        if event.kind != _ANSWERED or payload.get("answer") != ANSWER_ALLOW_ALWAYS:
            continue
        scope, tool = payload.get("scope"), payload.get("tool")
        if not isinstance(scope, Mapping) or not isinstance(scope.get("kind"), str) or not isinstance(tool, str):
            continue
        scope = dict(scope)
        if scope["kind"] == "mcp":
            in_force = [a for a in in_force if not (a["scope"]["kind"] == "mcp"
                        and a["scope"].get("server") == scope.get("server")
                        and a["scope"].get("remote_name") == scope.get("remote_name"))]
        elif any(a["tool"] == tool and a["scope"] == scope for a in in_force):
            continue  # granted again while in force (two pages answering): one is enough
        in_force.append({"seq": event.seq, "tool": tool, "scope": scope, "by": actor(payload),
                         "at": getattr(event, "created_at", None)})
    return in_force


def _still_open(events: Iterable[EventLike], opens: str, closed_by: Mapping[str, str]) -> list[dict[str, Any]]:
    """Copies of the ``opens`` payloads (the first per ``id``), in order, whose id no
    later event of a ``closed_by`` kind names (in that kind's given payload key)."""
    opened: dict[str, dict[str, Any]] = {}
    closed: set[str] = set()
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == opens:
            opened.setdefault(_text(payload.get("id")), dict(payload))
        elif event.kind in closed_by and payload.get(closed_by[event.kind]) is not None:
            closed.add(_text(payload.get(closed_by[event.kind])))
    return [item for key, item in opened.items() if key not in closed]


def pending_queue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Queued messages still waiting, oldest first (docs/behaviour.md §10).

    A ``message_queued`` payload is pending until a ``message_taken`` names its id as
    ``queued_id`` or a ``message_dropped`` names its id. Returns copies of the queued
    payloads in queue order. ``cleared`` does not empty the queue; ``imported`` does (what
    was queued in another session is not sent from this one).
    """
    return _still_open(_since_import(events), _MESSAGE_QUEUED, {_MESSAGE_TAKEN: "queued_id", _MESSAGE_DROPPED: "id"})


def _since_import(events: Iterable[EventLike]) -> list[EventLike]:
    """The events after the last ``imported`` (all of them when there is none)."""
    ordered = list(_ordered(events))
    for index in range(len(ordered) - 1, -1, -1):
        if ordered[index].kind == Kind.IMPORTED:
            return ordered[index + 1:]
    return ordered


def open_turn(events: Iterable[EventLike]) -> bool:
    """True when a turn was started and has not ended (docs/behaviour.md §6, §10).

    That is: some ``message_taken`` comes after the last ``turn_end`` (or there is a
    ``message_taken`` and no ``turn_end`` at all).
    """
    return _current_turn(_ordered(events)) is not None


_MODEL_OUTPUT = frozenset({Kind.ASSISTANT_TEXT, Kind.REASONING})
_TURN_STEPS = _MODEL_OUTPUT | {Kind.MESSAGE_TAKEN, Kind.TOOL_START, Kind.TOOL_END, Kind.ANSWERED, Kind.ERROR, Kind.USAGE}


def reply_cut_off(events: Iterable[EventLike]) -> bool:
    """True when the open turn's last step is streamed output that no completion closed.

    A completion that ends normally is followed by its ``usage``, its calls or the end of
    the turn; one that fails by an ``error``. Streamed ``assistant_text`` / ``reasoning``
    as the last step of an open turn therefore means the step streaming it died (a worker
    killed, a database or Redis outage): running the completion again would answer the
    same message twice, so the turn ends with "partial, send again" instead.
    """
    turn = _current_turn(_ordered(events))
    if turn is None:
        return False
    steps = [event.kind for event in turn if event.kind in _TURN_STEPS]
    return bool(steps) and steps[-1] in _MODEL_OUTPUT


def pending_calls(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Tool calls of the open turn that have not returned yet (docs/behaviour.md §6, §7, §9).

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
    """Permission questions still waiting for an answer (docs/behaviour.md §8).

    Copies of the ``question`` payloads, in the order asked (one per call id, the first
    asked), whose id has no ``answered`` event. Not reset by ``cleared``.
    """
    return _still_open(events, _QUESTION, {_ANSWERED: "id"})


def last_catalogue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """The tool entries of the latest ``catalogue`` event (recorded when a server became
    ready, docs/behaviour.md §9); ``[]`` when none was recorded since the last ``imported``."""
    latest: list[dict[str, Any]] = []
    for event in _ordered(events):
        if event.kind == Kind.CATALOGUE:
            latest = list(_payload(event).get("tools", []))
        elif event.kind == Kind.IMPORTED:
            latest = []  # another deployment's tools: this session's server has not said its own yet
    return latest


def last_server_ready(events: Iterable[EventLike]) -> dict[str, Any]:
    """A copy of the latest ``server_ready`` payload (what the running server reported about
    its chat template and sampling defaults, docs/behaviour.md §17); ``{}`` when none since
    the last ``imported``."""
    latest: dict[str, Any] = {}
    for event in _ordered(events):
        if event.kind == Kind.SERVER_READY:
            latest = dict(_payload(event))
        elif event.kind == Kind.IMPORTED:
            latest = {}  # another deployment's server: this session's has not said anything yet
    return latest


class Versions:
    """Which user messages are versions of one another, and which version is shown
    (docs/transcript.md, "Versions"): a fold over ``message_taken``, ``version_chosen`` and
    ``cleared`` events (others are ignored), fed in seq order, each event once (one at or
    below the last seq fed is skipped, so a fold fed ahead can be fed a window again).

    A message sent again (``replaces``) joins the group of the message it replaces — the
    group's first message is its root — and becomes the version in force; a
    ``version_chosen`` makes an earlier one the version in force. As in
    :func:`build_messages`, a message before the last ``cleared`` starts no group.
    Everything a group's messages started (the exchange: the message and what followed it
    up to the next message) shows only for the version in force.
    """

    def __init__(self) -> None:
        self.root_of: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        self.chosen: dict[int, int] = {}
        self.live: set[int] = set()  # messages after the last cleared
        self.upto = 0

    def feed(self, event: EventLike) -> tuple[int, int] | None:
        """Fold one event; ``(hidden, shown)`` — the exchanges whose showing changed —
        when it changed which version of a group is in force, else None."""
        if event.seq <= self.upto:
            return None
        self.upto = event.seq
        payload = _payload(event)
        if event.kind == _CLEARED:
            self.live = set()
        elif event.kind == _MESSAGE_TAKEN:
            replaces = payload.get("replaces")
            root = self.root_of[replaces] if isinstance(replaces, int) and replaces in self.live else event.seq
            self.root_of[event.seq] = root
            self.members.setdefault(root, []).append(event.seq)
            self.live.add(event.seq)
            before = self.chosen.get(root)
            self.chosen[root] = event.seq
            if before is not None and before != event.seq:
                return before, event.seq
        elif event.kind == _VERSION_CHOSEN:
            seq = payload.get("seq")
            if isinstance(seq, int) and seq in self.live:
                root = self.root_of[seq]
                before = self.chosen[root]
                self.chosen[root] = seq
                if before != seq:
                    return before, seq
        return None

    def hidden(self, exchange: int | None) -> bool:
        """Whether what the exchange started by message ``exchange`` shows: not when
        another version of its group is in force."""
        root = self.root_of.get(exchange) if exchange is not None else None
        return root is not None and self.chosen[root] != exchange

    def group(self, seq: int) -> list[int]:
        """The versions of the message ``seq`` (itself included), oldest first."""
        root = self.root_of.get(seq)
        return list(self.members[root]) if root is not None else []

    def pager(self, seq: int) -> dict[str, Any] | None:
        """``{"index", "total", "previous", "next"}`` (1-based index; neighbours' seqs or
        None) for a message with more than one version, else None."""
        members = self.group(seq)
        if len(members) < 2:
            return None
        index = members.index(seq)
        return {"index": index + 1, "total": len(members),
                "previous": members[index - 1] if index else None,
                "next": members[index + 1] if index + 1 < len(members) else None}
