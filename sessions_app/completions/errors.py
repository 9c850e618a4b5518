"""How a refused or broken-off completion is said: :class:`CompletionError`, in the
server's own words (docs/behaviour.md §6.6, C07). Plain data; no Django import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .deltas import as_int

__all__ = ["MAX_BODY_QUOTE", "CompletionError", "quote"]

#: Longest piece of a non-JSON error body quoted to the user, in characters.
MAX_BODY_QUOTE = 1000


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
            return cls(quote(text), status=status)
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
            message = quote(text) if (text := body_text.strip()) else f"HTTP {status}"
        code = as_int(details.get("code"))
        return cls(
            message,
            status=status if status is not None else code,
            n_prompt_tokens=as_int(details.get("n_prompt_tokens", body.get("n_prompt_tokens"))),
            n_ctx=as_int(details.get("n_ctx", body.get("n_ctx"))),
            error_type=_nonempty_str(details.get("type")),
        )


def quote(text: str) -> str:
    """``text`` trimmed, cut to :data:`MAX_BODY_QUOTE` characters (with "…" when cut)."""
    text = text.strip()
    return text if len(text) <= MAX_BODY_QUOTE else text[:MAX_BODY_QUOTE] + "…"


def _nonempty_str(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None

