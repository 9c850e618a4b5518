"""The conversation fold (docs/behaviour.md §7): :func:`build_messages`, the chat messages
sent to ``/v1/chat/completions``, folded from the transcript; and :func:`last_message`,
the user message a person may send again.

Pure: no database, no state between calls. This module must not import Django.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .reading import (
    _ASSISTANT_TEXT,
    _MESSAGE_TAKEN,
    _TOOL_END,
    _TOOL_START,
    _TURN_END,
    _VERSION_CHOSEN,
    _after_last_clear,
    _ordered,
    _payload,
    _text,
)
from .vocabulary import EventLike, ImageRef, image_refs

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
