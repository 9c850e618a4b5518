"""One decoded ``chat.completion.chunk`` → typed deltas (:func:`parse_chunk`), and the
``<think>…</think>`` a reply's text may open with split out as reasoning
(:class:`InlineReasoning`). Plain data; no Django import.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from .deltas import (
    Delta,
    Finish,
    Progress,
    ReasoningDelta,
    TextDelta,
    ToolCallFragment,
    Usage,
    as_float,
    as_int,
)
from .errors import CompletionError, quote

__all__ = ["THINK_CLOSE", "THINK_OPEN", "InlineReasoning", "decode_chunk", "parse_chunk", "split_inline"]

#: Inline reasoning tags some models write into ``content`` when the server does not split
#: them out itself (``--reasoning-format none``, or a template the server does not know).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: What may stand before ``<think>``: white space and a byte-order mark (U+FEFF), which
#: some templates emit first and ``str.lstrip()`` keeps.
_LEADING = " \t\r\n\ufeff"


def _is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    # A decoded chunk's objects are dicts: the check against the Mapping ABC (slow, a
    # dozen times per token) is left for anything else.
    return type(value) is dict or isinstance(value, Mapping)


def parse_chunk(data: Mapping[str, Any]) -> list[Delta]:
    """One decoded ``chat.completion.chunk`` → its deltas, in this order:
    prompt progress, reasoning, text, tool-call fragments, finish, usage.

    Only ``choices[0]`` is read (one completion per request). Empty or null ``content``
    / ``reasoning_content`` yield nothing. A :class:`Usage` is produced when the chunk has
    ``usage``, or has llama-server's ``timings`` on a final chunk (empty ``choices`` — C11,
    the ``include_usage`` chunk — or one with a ``finish_reason``); per-token timings on
    ordinary chunks (``timings_per_token``) are ignored. A non-streamed body
    (``choices[0].message``) is read the same way.

    Raises :class:`CompletionError` for a chunk with a top-level ``error`` (C07c: HTTP 200,
    the stream started, then ``data: {"error": {...}}``).
    """
    if data.get("error") is not None:
        raise CompletionError._from_json(data, status=None, body_text=_dump(data))
    deltas: list[Delta] = []
    progress = data.get("prompt_progress")
    if _is_mapping(progress):
        total, processed = as_int(progress.get("total")), as_int(progress.get("processed"))
        if total is not None and processed is not None:
            deltas.append(Progress(total=total, processed=processed, cache=as_int(progress.get("cache")) or 0))
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    finished = False
    if _is_mapping(choice):
        delta = choice.get("delta")
        if not _is_mapping(delta):
            delta = choice.get("message")
        if _is_mapping(delta):
            deltas.extend(_message_deltas(delta))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            deltas.append(Finish(reason))
            finished = True
    usage = data.get("usage")
    timings = data.get("timings")
    if _is_mapping(usage) or (_is_mapping(timings) and (finished or not choices)):
        deltas.append(_usage(usage, timings))
    return deltas


def _message_deltas(delta: Mapping[str, Any]) -> list[Delta]:
    deltas: list[Delta] = []
    reasoning = delta.get("reasoning_content")
    if not isinstance(reasoning, str) or not reasoning:
        reasoning = delta.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        deltas.append(ReasoningDelta(reasoning))
    content = delta.get("content")
    if isinstance(content, str) and content:
        deltas.append(TextDelta(content))
    tool_calls = delta.get("tool_calls")
    if isinstance(tool_calls, list):
        fragments = [dict(entry) for entry in tool_calls if _is_mapping(entry)]
        if fragments:
            deltas.append(ToolCallFragment(fragments))
    return deltas


def _usage(usage: Any, timings: Any) -> Usage:
    usage = usage if isinstance(usage, Mapping) else {}
    timings = timings if isinstance(timings, Mapping) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}
    return Usage(
        prompt_tokens=as_int(usage.get("prompt_tokens")),
        completion_tokens=as_int(usage.get("completion_tokens")),
        cached_tokens=as_int(details.get("cached_tokens")),
        prompt_n=as_int(timings.get("prompt_n")),
        cache_n=as_int(timings.get("cache_n")),
        predicted_n=as_int(timings.get("predicted_n")),
        predicted_per_second=as_float(timings.get("predicted_per_second")),
        prompt_per_second=as_float(timings.get("prompt_per_second")),
        draft_n=as_int(timings.get("draft_n")),
        draft_n_accepted=as_int(timings.get("draft_n_accepted")),
        prompt_ms=as_float(timings.get("prompt_ms")),
        predicted_ms=as_float(timings.get("predicted_ms")),
    )


def _dump(data: Mapping[str, Any]) -> str:
    try:
        return json.dumps(data, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(data)


def decode_chunk(data: str) -> Mapping[str, Any]:
    """One event's data payload as a JSON object; raises :class:`CompletionError` (quoting
    it) when it is not one."""
    try:
        decoded: Any = json.loads(data)
    except ValueError:
        decoded = None
    if not _is_mapping(decoded):
        raise CompletionError(f"llama-server sent something that is not a completion chunk: {quote(data)}")
    return decoded


class InlineReasoning:
    """Splits ``<think>…</think>`` at the start of a reply's text out as reasoning.

    Feed it every :class:`TextDelta` of one reply, in order, then call :meth:`flush` at the
    end. Reasoning is recognised only when the reply *begins* with ``<think>`` (leading
    whitespace aside): the same tags later in an answer are text the model meant to show.
    Tags split across chunks (``"<thi"`` + ``"nk>"``) are held back until they can be told
    apart from text, so nothing is shown twice or lost; whitespace right after
    ``</think>`` is dropped. A reply that ends inside ``<think>`` is all reasoning.

    ``opened``: the generation prompt already opened the thinking block (the chat
    templates of R1-style distills end it with ``<think>``), so the reply starts inside
    it and carries only the closing ``</think>``: everything before that is reasoning.
    A server that splits the reasoning out itself (``reasoning_content``) says so with
    its first reasoning delta: :meth:`server_splits` then reads the rest as answer.
    """

    def __init__(self, *, opened: bool = False) -> None:
        # "start" → "thinking" → "after" → "answer", or "start" → "answer"
        self.state = "thinking" if opened else "start"
        self.opened = opened
        self.fed = False
        self.held = ""

    def server_splits(self) -> None:
        """The server sent reasoning in a field of its own: it closed the opened block
        itself, so no ``</think>`` will come in ``content``."""
        if self.opened and self.state == "thinking" and not self.fed:
            self.state = "start"

    def feed(self, text: str) -> list[Delta]:
        self.held += text
        self.fed = self.fed or bool(text)
        out: list[Delta] = []
        while True:
            if self.state == "start":
                stripped = self.held.lstrip(_LEADING)
                if stripped.startswith(THINK_OPEN):
                    self.held = stripped[len(THINK_OPEN) :]
                    self.state = "thinking"
                    continue
                if THINK_OPEN.startswith(stripped):
                    return out  # nothing yet, or maybe the first part of the tag
                self.state = "answer"
                continue
            if self.state == "thinking":
                end = self.held.find(THINK_CLOSE)
                if end < 0:
                    keep = _partial_suffix(self.held, THINK_CLOSE)
                    thought, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                    if thought:
                        out.append(ReasoningDelta(thought))
                    return out
                if end:
                    out.append(ReasoningDelta(self.held[:end]))
                self.held = self.held[end + len(THINK_CLOSE) :]
                self.state = "after"
                continue
            if self.state == "after":
                self.held = self.held.lstrip(_LEADING)
                if not self.held:
                    return out
                self.state = "answer"
                continue
            if self.held:
                out.append(TextDelta(self.held))
            self.held = ""
            return out

    def flush(self) -> list[Delta]:
        held, self.held = self.held, ""
        if not held or (self.state in ("start", "after") and not held.strip()):
            return []
        return [ReasoningDelta(held) if self.state == "thinking" else TextDelta(held)]


def split_inline(deltas: list[Delta], inline: InlineReasoning) -> Iterator[Delta]:
    """One chunk's deltas with its text passed through ``inline`` (reasoning in
    ``<think>`` split out); text ``inline`` holds back comes before whatever else follows."""
    for delta in deltas:
        if isinstance(delta, TextDelta):
            yield from inline.feed(delta.text)
            continue
        if isinstance(delta, ReasoningDelta):
            inline.server_splits()
        yield from inline.flush()
        yield delta


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
