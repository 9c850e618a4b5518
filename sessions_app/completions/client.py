"""The one place that talks HTTP to ``llama-server`` for completions (docs/behaviour.md §6.4):
:class:`CompletionClient` streams one completion as deltas and raises
:class:`~sessions_app.completions.errors.CompletionError` in the server's own words when the
server refuses or breaks off (docs/behaviour.md C07, C11).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import httpx

from machines_app.llama_server import auth_headers, tls_context

from .chunks import InlineReasoning, decode_chunk, parse_chunk, split_inline
from .deltas import Delta, Finish
from .errors import CompletionError
from .sse import iter_lines, iter_sse_data

__all__ = ["CHAT_COMPLETIONS_PATH", "DEFAULT_IDLE_TIMEOUT", "DEFAULT_TIMEOUT", "INCOMPLETE_REPLY",
           "CompletionClient"]

#: Wall-clock cap on one completion, in seconds (docs/behaviour.md §6: "longer than 30 minutes").
DEFAULT_TIMEOUT = 1800.0

#: Seconds a stream may send nothing before the reply is abandoned (docs/behaviour.md §6):
#: a frozen llama-server (SIGSTOP, a wedged GPU driver) used to hold the turn for the whole
#: 30 minutes. Requests ask ``return_progress``, so even a long prompt sends a chunk per
#: batch it reads; the bound is long enough for one batch of a large model on a CPU.
DEFAULT_IDLE_TIMEOUT = 600.0

#: Seconds allowed to open the TCP connection, capped by the overall timeout.
CONNECT_TIMEOUT = 30.0

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

_DONE = "[DONE]"

#: The sentence for a stream that ended (EOF, or a last empty chunk) without a
#: ``finish_reason`` and without ``data: [DONE]``: the server stopped mid-reply (it crashed,
#: was killed, or a proxy cut the response), so the text so far is only part of a reply.
INCOMPLETE_REPLY = (
    "llama-server stopped mid-reply: the stream ended without saying the reply was finished, "
    "so the reply above is cut off. Send another message to carry on."
)


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
                for data in iter_sse_data(iter_lines(chunks)):
                    if data.strip() == _DONE:
                        finished = True
                        break
                    deltas = parse_chunk(decode_chunk(data))
                    yield from split_inline(deltas, inline)
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
        deltas = parse_chunk(decode_chunk(text))
        inline = InlineReasoning(opened=opens_thinking)
        yield from split_inline(deltas, inline)
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


def _duration(seconds: float) -> str:
    """``1800`` → ``"30 minutes"``, ``0.5`` → ``"0.5 seconds"``."""
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds:g} second{'s' if seconds != 1 else ''}"
