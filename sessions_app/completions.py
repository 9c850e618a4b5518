"""Streaming client for llama-server's ``POST /v1/chat/completions`` (docs/behaviour.md §6, §9).

Pure Python over plain data plus one seam (:class:`CompletionClient`, the only place that
talks HTTP to ``llama-server`` for completions); no Django import.

- :func:`iter_sse_data` turns Server-Sent-Events lines into the data payload of each event.
- :func:`parse_chunk` turns one decoded ``chat.completion.chunk`` into typed deltas:
  :class:`TextDelta`, :class:`ReasoningDelta`, :class:`ToolCallFragment`, :class:`Finish`,
  :class:`Usage`.
- :class:`CompletionClient` streams one completion and raises :class:`CompletionError`
  in the server's own words when the server refuses or breaks off (docs/behaviour.md C07, C11).
- :class:`ToolCallAssembler` joins streamed ``tool_calls`` fragments into
  :class:`ToolCall` values (docs/behaviour.md §9, docs/behaviour.md C01, C02, C04).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import socket
import string
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpcore
import httpx

from machines_app.llama_server import auth_headers, tls_context

from . import callcard

__all__ = [
    "CompletionClient",
    "CompletionError",
    "Delta",
    "Finish",
    "InlineReasoning",
    "Progress",
    "ReasoningDelta",
    "TextDelta",
    "ToolCall",
    "ToolCallAssembler",
    "ToolCallFragment",
    "Usage",
    "arguments_problem",
    "iter_sse_data",
    "parse_arguments",
    "parse_chunk",
]

#: Wall-clock cap on one completion, in seconds (docs/behaviour.md §6: "longer than 30 minutes").
DEFAULT_TIMEOUT = 1800.0

#: Seconds a stream may send nothing before the reply is abandoned (docs/behaviour.md §6):
#: a frozen llama-server (SIGSTOP, a wedged GPU driver) used to hold the turn for the whole
#: 30 minutes. Requests ask ``return_progress``, so even a long prompt sends a chunk per
#: batch it reads; the bound is long enough for one batch of a large model on a CPU.
DEFAULT_IDLE_TIMEOUT = 600.0

#: Seconds allowed to open the TCP connection, capped by the overall timeout.
CONNECT_TIMEOUT = 30.0

#: Longest piece of a non-JSON error body quoted to the user, in characters.
MAX_BODY_QUOTE = 1000

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

_DONE = "[DONE]"

#: The sentence for a stream that ended (EOF, or a last empty chunk) without a
#: ``finish_reason`` and without ``data: [DONE]``: the server stopped mid-reply (it crashed,
#: was killed, or a proxy cut the response), so the text so far is only part of a reply.
INCOMPLETE_REPLY = (
    "llama-server stopped mid-reply: the stream ended without saying the reply was finished, "
    "so the reply above is cut off. Send another message to carry on."
)

#: Inline reasoning tags some models write into ``content`` when the server does not split
#: them out itself (``--reasoning-format none``, or a template the server does not know).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: What may stand before ``<think>``: white space and a byte-order mark (U+FEFF), which
#: some templates emit first and ``str.lstrip()`` keeps.
_LEADING = " \t\r\n\ufeff"
_EOL = re.compile(rb"\r\n|\r|\n")
_ID_ALPHABET = string.ascii_letters + string.digits


# --------------------------------------------------------------------------- deltas


@dataclass(frozen=True)
class TextDelta:
    """A piece of the reply text (``choices[0].delta.content``); never empty."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning; never empty.

    Read from every form servers send it in: ``delta.reasoning_content`` (llama-server's
    ``--reasoning-format deepseek``, the default), ``delta.reasoning`` (other
    OpenAI-compatible servers), and ``<think>…</think>`` at the start of ``content``
    (:class:`InlineReasoning`). Kept as ``reasoning`` events, shown collapsed, never sent
    back to the model as reply text (docs/transcript.md).
    """

    text: str


@dataclass(frozen=True)
class ToolCallFragment:
    """The raw ``choices[0].delta.tool_calls`` entries of one chunk, in order.

    Each entry is shaped ``{"index"?: int, "id"?: str, "type"?: "function",
    "function": {"name"?: str, "arguments"?: str}}``; feed them to :class:`ToolCallAssembler`.
    """

    fragments: list[dict[str, Any]]


@dataclass(frozen=True)
class Finish:
    """``choices[0].finish_reason``: ``"stop"``, ``"length"``, ``"tool_calls"``, …"""

    reason: str | None


@dataclass(frozen=True)
class Usage:
    """Token counts and speeds of one completion (docs/behaviour.md §6.7, docs/behaviour.md C11).

    From the OpenAI ``usage`` object: ``prompt_tokens`` (the context held),
    ``completion_tokens``, ``cached_tokens`` (``usage.prompt_tokens_details.cached_tokens``).
    From llama-server's own ``timings`` object: ``prompt_n`` (prompt tokens processed this
    time), ``cache_n`` (prompt tokens reused from the prompt cache), ``predicted_n`` (tokens
    generated), ``predicted_per_second`` and ``prompt_per_second`` (tokens per second),
    and with speculative decoding on (a draft model or MTP) ``draft_n`` (tokens drafted)
    and ``draft_n_accepted`` (drafted tokens the model kept); ``prompt_ms`` and
    ``predicted_ms`` (milliseconds spent reading the prompt and generating: the time the
    completion held the machine, counted by usage_app). Any field the server did not send is ``None``.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    predicted_n: int | None = None
    predicted_per_second: float | None = None
    prompt_per_second: float | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    prompt_ms: float | None = None
    predicted_ms: float | None = None

    def as_payload(self) -> dict[str, Any]:
        """The fields that were sent, as a JSON-able dict (e.g. for a ``usage`` event)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Progress:
    """How far llama-server has read the prompt (``prompt_progress``, sent while it reads
    when the request asks ``return_progress``): ``processed`` of ``total`` prompt tokens,
    ``cache`` of them reused from the prompt cache (``processed`` counts those too)."""

    total: int
    processed: int
    cache: int = 0


Delta = TextDelta | ReasoningDelta | ToolCallFragment | Finish | Usage | Progress


# --------------------------------------------------------------------------- errors


class CompletionError(Exception):
    """The server refused or broke off the completion. `message` is in the server's own words.

    ``status`` is the HTTP status (or the ``error.code`` of an error sent inside the stream);
    ``n_prompt_tokens`` and ``n_ctx`` are the counts llama-server adds to an
    ``exceed_context_size_error`` (docs/behaviour.md C07a); ``error_type`` is ``error.type``.
    ``str(exc)`` is the sentence to show the user: the message, plus the counts when they
    were given and the message does not already state them, e.g.
    ``"... (request 9960 tokens, context 8192 tokens)"``.

    Transport failures (nothing reached, connection cut, too slow) are raised as this class
    too, with a plain sentence as ``message`` and no status.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        n_prompt_tokens: int | None = None,
        n_ctx: int | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.error_type = error_type

    def __str__(self) -> str:
        counts = []
        if self.n_prompt_tokens is not None:
            counts.append(("request", self.n_prompt_tokens))
        if self.n_ctx is not None:
            counts.append(("context", self.n_ctx))
        if not counts or all(str(number) in self.message for _, number in counts):
            return self.message
        said = ", ".join(f"{label} {number} tokens" for label, number in counts)
        return f"{self.message} ({said})"

    @property
    def context_exceeded(self) -> bool:
        """Whether the request did not fit the server's context, in any of llama-server's
        three shapes (docs/behaviour.md C07): ``exceed_context_size_error`` (with or without
        counts, as an HTTP 400 or an error frame in the stream) or the bare "Context size
        has been exceeded." of an HTTP 500."""
        if self.error_type == "exceed_context_size_error":
            return True
        message = self.message.lower()
        return "exceeds the available context size" in message or "context size has been exceeded" in message

    @classmethod
    def from_body(cls, status: int | None, body: str) -> CompletionError:
        """The error for a refused request, read from its response body (docs/behaviour.md §6.6).

        The message is ``error.message``, else ``message``, else the body text (trimmed,
        at most :data:`MAX_BODY_QUOTE` characters), else ``"HTTP <status>"``. llama-server
        answers ``{"error": {"code", "message", "type", "n_prompt_tokens"?, "n_ctx"?}}``
        (C07a, C07b) but a plain-text body (C07b, a proxy) is taken as it is.
        """
        text = body.strip()
        try:
            decoded: Any = json.loads(text) if text else None
        except ValueError:
            decoded = None
        if isinstance(decoded, Mapping):
            return cls._from_json(decoded, status=status, body_text=text)
        if text:
            return cls(_quote(text), status=status)
        return cls(f"HTTP {status}" if status is not None else "llama-server gave no reason", status=status)

    @classmethod
    def _from_json(cls, body: Mapping[str, Any], *, status: int | None, body_text: str) -> CompletionError:
        error = body.get("error")
        details: Mapping[str, Any] = error if isinstance(error, Mapping) else {}
        message = _nonempty_str(details.get("message"))
        if message is None and isinstance(error, str):
            message = _nonempty_str(error)
        if message is None:
            message = _nonempty_str(body.get("message"))
        if message is None:
            message = _quote(text) if (text := body_text.strip()) else f"HTTP {status}"
        code = _as_int(details.get("code"))
        return cls(
            message,
            status=status if status is not None else code,
            n_prompt_tokens=_as_int(details.get("n_prompt_tokens", body.get("n_prompt_tokens"))),
            n_ctx=_as_int(details.get("n_ctx", body.get("n_ctx"))),
            error_type=_nonempty_str(details.get("type")),
        )


def _quote(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_BODY_QUOTE else text[:MAX_BODY_QUOTE] + "…"


def _nonempty_str(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


# --------------------------------------------------------------------------- SSE


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data payload of each Server-Sent Event, in order.

    ``lines`` are the lines of a ``text/event-stream`` body, with or without their line
    terminator. ``data:`` lines accumulate (one leading space stripped; several joined with
    ``"\\n"``); a blank line ends the event; lines starting with ``:`` are comments
    (llama-server's keep-alive pings); ``id``/``retry``/other fields are ignored. The last
    event is flushed at end of input even without a trailing blank line (C11: ``[DONE]``
    may arrive that way). Events without data yield nothing.

    Errors are turned into ``{"error": ...}`` payloads so :func:`parse_chunk` raises on
    them whatever their framing: older llama-server builds send a mid-stream error as an
    ``error: {...}`` line (not ``data:``), and ``event: error`` events carry the error in
    their data.
    """
    data: list[str] = []
    error: list[str] = []
    event = ""
    first = True
    for raw in lines:
        line = raw.rstrip("\r\n")
        if first:
            line = line.removeprefix("\ufeff")
            first = False
        if not line:
            payload = _dispatch(event, data, error)
            if payload is not None:
                yield payload
            data, error, event = [], [], ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "error":
            error.append(value)
        elif name == "event":
            event = value
    payload = _dispatch(event, data, error)
    if payload is not None:
        yield payload


def _dispatch(event: str, data: list[str], error: list[str]) -> str | None:
    if error:
        return _as_error_payload("\n".join(error))
    if not data:
        return None
    payload = "\n".join(data)
    return _as_error_payload(payload) if event == "error" else payload


def _as_error_payload(text: str) -> str:
    """``text`` as a chunk with a top-level ``error``, unless it already is one."""
    try:
        decoded: Any = json.loads(text)
    except ValueError:
        return json.dumps({"error": {"message": text}})
    if isinstance(decoded, Mapping) and "error" in decoded:
        return text
    return json.dumps({"error": decoded})


def _iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Split a byte stream into lines at CR, LF or CRLF only (the SSE line terminators).

    Splitting bytes before decoding is safe for UTF-8 and avoids ``str.splitlines()``
    (used by ``httpx.Response.iter_lines``), which also breaks at U+2028, U+0085 and
    form feeds — characters llama-server writes unescaped inside JSON strings.
    """
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        start = 0
        while (match := _EOL.search(buffer, start)) is not None:
            if match.group() == b"\r" and match.end() == len(buffer):
                break  # maybe the first half of a CRLF split across chunks
            yield buffer[start : match.start()].decode("utf-8", "replace")
            start = match.end()
        buffer = buffer[start:]
    if buffer:
        yield buffer.removesuffix(b"\r").decode("utf-8", "replace")


# --------------------------------------------------------------------------- chunks


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
    if isinstance(progress, Mapping):
        total, processed = _as_int(progress.get("total")), _as_int(progress.get("processed"))
        if total is not None and processed is not None:
            deltas.append(Progress(total=total, processed=processed, cache=_as_int(progress.get("cache")) or 0))
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    finished = False
    if isinstance(choice, Mapping):
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            delta = choice.get("message")
        if isinstance(delta, Mapping):
            deltas.extend(_message_deltas(delta))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            deltas.append(Finish(reason))
            finished = True
    usage = data.get("usage")
    timings = data.get("timings")
    if isinstance(usage, Mapping) or (isinstance(timings, Mapping) and (finished or not choices)):
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
        fragments = [dict(entry) for entry in tool_calls if isinstance(entry, Mapping)]
        if fragments:
            deltas.append(ToolCallFragment(fragments))
    return deltas


def _usage(usage: Any, timings: Any) -> Usage:
    usage = usage if isinstance(usage, Mapping) else {}
    timings = timings if isinstance(timings, Mapping) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}
    return Usage(
        prompt_tokens=_as_int(usage.get("prompt_tokens")),
        completion_tokens=_as_int(usage.get("completion_tokens")),
        cached_tokens=_as_int(details.get("cached_tokens")),
        prompt_n=_as_int(timings.get("prompt_n")),
        cache_n=_as_int(timings.get("cache_n")),
        predicted_n=_as_int(timings.get("predicted_n")),
        predicted_per_second=_as_float(timings.get("predicted_per_second")),
        prompt_per_second=_as_float(timings.get("prompt_per_second")),
        draft_n=_as_int(timings.get("draft_n")),
        draft_n_accepted=_as_int(timings.get("draft_n_accepted")),
        prompt_ms=_as_float(timings.get("prompt_ms")),
        predicted_ms=_as_float(timings.get("predicted_ms")),
    )


def _dump(data: Mapping[str, Any]) -> str:
    try:
        return json.dumps(data, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(data)


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


def _split_inline(deltas: list[Delta], inline: InlineReasoning) -> Iterator[Delta]:
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


# --------------------------------------------------------------------------- client


class CompletionClient:
    """Streams completions from one llama-server (docs/behaviour.md §6.4); the seam tests replace.

    ``base_url`` is the server root (``http://host:port``, no ``/v1``). ``http`` is an
    ``httpx.Client`` to use (tests may pass one with a mock transport); without it each
    :meth:`stream` opens its own client and closes it when the stream ends, so nothing
    needs closing. ``timeout`` is the wall-clock cap on one completion, in seconds
    (docs/behaviour.md §6: 30 minutes). ``idle_timeout`` is the read timeout: seconds the
    server may send nothing at all (not even a progress chunk) before the reply is
    abandoned as "sent nothing for N"; capped by ``timeout``. ``api_key`` is the server's
    own key, sent as ``Authorization: Bearer …`` (docs/security.md).
    """

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.Client | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        api_key: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.idle_timeout = min(idle_timeout, timeout)
        self._http = http
        self._headers = auth_headers(api_key)

    def request_body(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The JSON body :meth:`stream` sends.

        ``{**sampling, "messages", "stream": true, "stream_options": {"include_usage":
        true}, "return_progress": true}`` plus ``"tools"`` only when ``tools`` is non-empty. Sampling keys
        (``temperature``, ``top_k``, ``seed``, …) pass through as given but cannot
        override ``messages``, ``stream``, ``stream_options``, ``return_progress`` or ``tools``.
        """
        body: dict[str, Any] = dict(sampling or {})
        body.pop("tools", None)
        body["messages"] = messages
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        # llama-server says how far it has read a long prompt (Progress): the page shows it,
        # and the bytes keep an SSH forward from looking idle before the first token.
        body["return_progress"] = True
        if tools:
            body["tools"] = tools
        return body

    def stream(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: Mapping[str, Any] | None = None,
        opens_thinking: bool = False,
    ) -> Generator[Delta, None, None]:
        """POST ``/v1/chat/completions`` and yield the deltas as they arrive.

        ``opens_thinking``: the server's generation prompt ends inside an opened
        ``<think>`` block (:func:`machines_app.llama_server.prompt_opens_thinking`), so the
        reply's text up to ``</think>`` is reasoning (:class:`InlineReasoning`).

        ``messages`` are OpenAI chat messages; ``tools`` OpenAI function definitions;
        ``sampling`` extra body keys (see :meth:`request_body`). Nothing is sent until
        the first ``next()``. Ends at ``data: [DONE]`` or at the end of the stream (C11).
        Closing the generator (``gen.close()``, the interrupt) closes the HTTP response at
        once; llama-server notices the closed socket and stops generating.

        Raises :class:`CompletionError`:

        - non-2xx: in the server's words, read from the body (C07a, C07b);
        - an ``error`` frame inside the stream (C07c);
        - connection refused or unreachable: "could not reach llama-server at …";
        - the connection cut mid-stream: "llama-server closed the connection mid-reply";
        - longer than ``timeout`` seconds in all: "completion took longer than 30 minutes;
          abandoned".
        """
        body = self.request_body(messages, tools=tools, sampling=sampling)
        if self._http is not None:
            yield from self._stream(self._http, body, opens_thinking)
            return
        with httpx.Client(verify=tls_context()) as http:
            yield from self._stream(http, body, opens_thinking)

    def _stream(self, http: httpx.Client, body: dict[str, Any], opens_thinking: bool = False
                ) -> Generator[Delta, None, None]:
        url = self.base_url + CHAT_COMPLETIONS_PATH
        deadline = time.monotonic() + self.timeout
        timeout = httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT, self.timeout), read=self.idle_timeout)
        started = False
        try:
            with http.stream("POST", url, json=body, headers=self._headers, timeout=timeout) as response:
                started = True
                if not response.is_success:
                    raise CompletionError.from_body(response.status_code, _read_text(response))
                content_type = response.headers.get("content-type", "")
                if "text/event-stream" not in content_type:
                    yield from self._whole_body(response, content_type, opens_thinking)
                    return
                chunks = self._until(deadline, response.iter_bytes())
                inline = InlineReasoning(opened=opens_thinking)
                finished = False
                for data in iter_sse_data(_iter_lines(chunks)):
                    if data.strip() == _DONE:
                        finished = True
                        break
                    deltas = parse_chunk(_decode_chunk(data))
                    yield from _split_inline(deltas, inline)
                    finished = finished or any(isinstance(delta, Finish) for delta in deltas)
                yield from inline.flush()
                if not finished:
                    # A clean end of stream is not a finished reply: only a finish_reason or
                    # [DONE] says the server meant to stop here.
                    raise CompletionError(INCOMPLETE_REPLY)
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise self._unreachable(exc) from exc
            if isinstance(exc, httpx.ReadTimeout) and time.monotonic() < deadline:
                raise CompletionError(
                    f"llama-server sent nothing for {_duration(self.idle_timeout)}; the reply is abandoned "
                    "(the server may be frozen or overloaded)"
                ) from exc
            raise self._too_slow() from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            raise self._unreachable(exc) from exc
        except httpx.TransportError as exc:
            if started:
                raise CompletionError("llama-server closed the connection mid-reply") from exc
            raise CompletionError(
                f"llama-server at {self.base_url} closed the connection before replying ({exc})"
            ) from exc

    def _whole_body(self, response: httpx.Response, content_type: str, opens_thinking: bool) -> Iterator[Delta]:
        """A 2xx that is not an event stream: a whole JSON completion or error, else an error.
        Read as a stream of one chunk: its ``<think>`` split out the same way, and a body
        whose ``finish_reason`` is null (or missing) a cut-off reply, as a stream that
        ended without one is (docs/transcript.md, "How a reply ends")."""
        text = _read_text(response)
        if "json" not in content_type:
            raise CompletionError.from_body(response.status_code, text)
        deltas = parse_chunk(_decode_chunk(text))
        inline = InlineReasoning(opened=opens_thinking)
        yield from _split_inline(deltas, inline)
        yield from inline.flush()
        if not any(isinstance(delta, Finish) for delta in deltas):
            raise CompletionError(INCOMPLETE_REPLY)

    def _until(self, deadline: float, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            if time.monotonic() > deadline:
                raise self._too_slow()
            yield chunk

    def _too_slow(self) -> CompletionError:
        return CompletionError(f"completion took longer than {_duration(self.timeout)}; abandoned")

    def _unreachable(self, exc: Exception) -> CompletionError:
        reason = str(exc) or type(exc).__name__
        return CompletionError(f"could not reach llama-server at {self.base_url} ({reason})")


def _read_text(response: httpx.Response) -> str:
    """The body of a response being streamed, or "" if it cannot be read."""
    try:
        response.read()
    except httpx.HTTPError:
        return ""
    return response.content.decode("utf-8", "replace")


def _decode_chunk(data: str) -> Mapping[str, Any]:
    try:
        decoded: Any = json.loads(data)
    except ValueError:
        decoded = None
    if not isinstance(decoded, Mapping):
        raise CompletionError(f"llama-server sent something that is not a completion chunk: {_quote(data)}")
    return decoded


def _duration(seconds: float) -> str:
    """``1800`` → ``"30 minutes"``, ``0.5`` → ``"0.5 seconds"``."""
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds:g} second{'s' if seconds != 1 else ''}"


# --------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    """One assembled tool call (docs/behaviour.md §9).

    ``arguments`` is the JSON text sent back to the model in the assistant message's
    ``tool_calls``: the received text byte for byte when it is a JSON object, ``"{}"``
    otherwise (empty — C04 — or malformed, e.g. truncated ``{"q"``). Malformed text is
    not sent back because llama-server parses the arguments of earlier calls for chat
    templates that take them as objects and refuses the whole request when they are not
    JSON ("Failed to parse tool call arguments as JSON"), which would break every later
    turn of the session. ``raw_arguments`` keeps the text as received when it differs from
    ``arguments`` (``None`` otherwise), for the transcript and the user.

    ``arguments_error`` is why non-empty arguments are not one JSON object (the parser's
    words, e.g. ``"Expecting ':' delimiter: line 1 column 5 (char 4)"`` or ``"duplicate key
    'command'"``), ``None`` when they are one or are empty. Such a call is never run
    (docs/behaviour.md §9, C04): the model is told the error instead.
    """

    id: str
    name: str
    arguments: str
    raw_arguments: str | None = None
    arguments_error: str | None = None

    def parsed_arguments(self) -> dict[str, Any]:
        """``arguments`` as a dict: the one parsed object the card, the exports and the tool
        all read; ``{}`` when they are empty or malformed (a malformed call is not run)."""
        decoded, _ = parse_arguments(self.arguments)
        return decoded if decoded is not None else {}


def parse_arguments(text: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """A call's arguments text → ``(object, None)``, or ``(None, why)`` when it is not one
    JSON object llama-server's parser accepts, or names a key twice (the rules are
    :func:`sessions_app.callcard.parse_arguments`'s, the one parser of arguments);
    ``({}, None)`` for empty or white-space text (C04: a call with no arguments runs with
    ``{}``)."""
    parsed = callcard.parse_arguments(text or "")
    return (None, parsed.error) if parsed.error is not None else (parsed.input, None)


def arguments_problem(raw_arguments: str | None) -> str | None:
    """Why a stored call's received arguments (``tool_start``'s ``raw_arguments``) may not
    run, or None. Transcripts recorded before calls were refused for this carry no
    ``arguments_error``; this reads theirs from the text (docs/behaviour.md §9)."""
    return parse_arguments(raw_arguments)[1]


def _new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class _PartialCall:
    index: int | None
    id: str | None = None
    name: str | None = None
    pieces: list[str] = field(default_factory=list)


class ToolCallAssembler:
    """Joins streamed ``tool_calls`` fragments into calls (docs/behaviour.md §9; docs/behaviour.md C01, C02, C04).

    Rules, per fragment ``{"index"?, "id"?, "function": {"name"?, "arguments"?}}``:

    - a non-empty ``id`` already seen names that call, whatever its ``index`` (C02: a
      repeated id is the same call, not a new one);
    - otherwise ``index`` names the call; a fragment at a known index that brings a new,
      different id starts a new call there (servers that number every call 0);
    - without ``index`` a fragment extends the newest call, unless it carries a new
      non-empty id, which starts a new call (C01); an id-less fragment with an index no
      call has yet continues the newest call when that one began without an index;
    - a fragment with no known id that names a function other than the one of the call it
      would extend starts a new call instead (C01 amended: two unnumbered, id-less calls
      each with its own name are two calls, never one whose arguments run together);
    - ``id`` and ``function.name`` are taken from the first fragment that has them;
      ``function.arguments`` pieces are concatenated in arrival order (a non-string value
      is serialised as JSON).

    :meth:`calls` lists calls in the order their first fragment arrived; a call whose name
    never arrived is dropped; a call with a name but no id gets ``"call_"`` + 24 random
    letters and digits, fixed for the assembler's lifetime.
    """

    def __init__(self) -> None:
        self._calls: list[_PartialCall] = []
        self._by_index: dict[int, _PartialCall] = {}
        self._by_id: dict[str, _PartialCall] = {}

    def feed(self, fragments: Iterable[Mapping[str, Any]]) -> None:
        """Take the ``tool_calls`` entries of one chunk (a :class:`ToolCallFragment`)."""
        for fragment in fragments:
            if isinstance(fragment, Mapping):
                self._feed_one(fragment)

    def _feed_one(self, fragment: Mapping[str, Any]) -> None:
        index = _as_int(fragment.get("index"))
        call_id = fragment.get("id") if isinstance(fragment.get("id"), str) and fragment.get("id") else None
        function = fragment.get("function")
        function = function if isinstance(function, Mapping) else {}

        name = function.get("name")
        name = name if isinstance(name, str) and name else None
        call = self._find(index, call_id)
        if call_id is None and name is not None and call.name is not None and name != call.name:
            # Another function named where this call would go on: a call of its own.
            call = self._start(index)
        if call_id is not None and call.id is None:
            call.id = call_id
            self._by_id[call_id] = call
        if call.name is None and name is not None:
            call.name = name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            call.pieces.append(arguments)
        elif arguments is not None:
            call.pieces.append(json.dumps(arguments, ensure_ascii=False))

    def _find(self, index: int | None, call_id: str | None) -> _PartialCall:
        if call_id is not None and call_id in self._by_id:
            return self._by_id[call_id]
        if index is not None:
            known = self._by_index.get(index)
            if known is not None and (call_id is None or known.id in (None, call_id)):
                return known
            newest = self._calls[-1] if self._calls else None
            if known is None and call_id is None and newest is not None and newest.index is None:
                # C01 mixed: the call began without an index and its pieces now carry one.
                newest.index = index
                self._by_index[index] = newest
                return newest
            return self._start(index)
        # C01: no index; a new id starts a new call (an id already seen was handled above).
        if self._calls and call_id is None:
            return self._calls[-1]
        return self._start(None)

    def _start(self, index: int | None) -> _PartialCall:
        call = _PartialCall(index=index)
        self._calls.append(call)
        if index is not None:
            self._by_index[index] = call
        return call

    def calls(self) -> list[ToolCall]:
        """The assembled calls, in the order their first fragment arrived."""
        result = []
        for call in self._calls:
            if call.name is None:
                continue
            if call.id is None:
                call.id = _new_call_id()
                self._by_id[call.id] = call
            received = "".join(call.pieces)
            decoded, error = parse_arguments(received)
            arguments = received if decoded is not None and received.strip() else "{}"
            raw = received if received != arguments else None
            result.append(ToolCall(id=call.id, name=call.name, arguments=arguments, raw_arguments=raw,
                                   arguments_error=error))
        return result


class _PacedStream(httpcore.NetworkStream):
    """A network stream whose reads start at least ``read_every`` seconds apart, calling
    ``before_read()`` first. The pauses start once ``before_read`` has returned anything
    but ``False`` (None included): a hook that returns False while it has shown nothing
    has the reply's first token read, and shown, the moment it comes — paced from the
    start, it waited up to ``read_every`` after the response's headers, a delay every
    reply's first token paid (docs/live-page.md, "What it costs").

    httpcore reads only when everything read so far has been handed on (h11 needs more
    data), so ``before_read`` runs at the end of each burst of tokens: the step shows
    them then (docs/live-page.md, "What it costs"). The pause lets llama-server's tokens
    gather in the socket: one wake-up, one read and one burst for several tokens, where
    reading each token as it comes cost a wake-up and a trip through httpx per token —
    more CPU than everything else a reply costs Corral."""

    def __init__(self, stream: httpcore.NetworkStream, read_every: float,
                 before_read: Callable[[], bool | None] | None):
        self.stream, self.read_every, self.before_read = stream, read_every, before_read
        self.next_read = 0.0
        self.pacing = before_read is None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self.before_read is not None and self.before_read() is not False:
            self.pacing = True
        wait = self.next_read - time.monotonic()
        if self.pacing and wait > 0:
            time.sleep(wait)  # an abort shuts the socket: the read below then fails at once
        try:
            return self.stream.read(max_bytes, timeout)
        finally:
            self.next_read = time.monotonic() + self.read_every

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, timeout)

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _PacedStream(self.stream.start_tls(*args, **kwargs), self.read_every, self.before_read)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class _RecordingBackend(httpcore.SyncBackend):
    """httpcore's own socket backend, keeping the sockets it opens so they can be shut
    down, its streams paced (:class:`_PacedStream`) when ``read_every`` > 0."""

    def __init__(self, read_every: float = 0.0, before_read: Callable[[], bool | None] | None = None) -> None:
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.read_every, self.before_read = read_every, before_read

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        stream = super().connect_tcp(*args, **kwargs)
        with self._lock:
            self.sockets.append(stream.get_extra_info("socket"))
        if self.read_every > 0 or self.before_read is not None:
            return _PacedStream(stream, self.read_every, self.before_read)
        return stream


class AbortableHTTP:
    """An ``httpx.Client`` whose connections another thread can break off at once, and
    whose reads may be paced.

    Closing a socket does not wake a thread blocked reading it; shutting it down does.
    llama-server sends no byte while it processes a long prompt, so an interrupt must be
    able to end a read that may otherwise last minutes; the shutdown also tells
    llama-server that the client is gone, so it stops working on the request.

    ``read_every`` (seconds, 0 for none) and ``before_read`` pace the reads of every
    connection (:class:`_PacedStream`: the pauses start once ``before_read`` returns
    anything but False).
    """

    def __init__(self, *, read_every: float = 0.0, before_read: Callable[[], bool | None] | None = None) -> None:
        self._backend = _RecordingBackend(read_every, before_read)
        transport = httpx.HTTPTransport(verify=tls_context())  # shared: a new one costs ~26 ms CPU
        # httpx offers no public way to pass httpcore a network backend.
        transport._pool._network_backend = self._backend
        self.client = httpx.Client(transport=transport, verify=tls_context())

    def abort(self) -> None:
        with self._backend._lock:
            sockets = list(self._backend.sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def close(self) -> None:
        self.client.close()
