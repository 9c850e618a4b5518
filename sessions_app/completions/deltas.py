"""What one streamed completion is made of: the typed deltas a chunk turns into
(docs/behaviour.md §6), and the readers of the JSON numbers they carry. Plain data; no
Django import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Delta", "Finish", "Progress", "ReasoningDelta", "TextDelta", "ToolCallFragment", "Usage",
           "as_float", "as_int"]


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


def as_int(value: Any) -> int | None:
    """A JSON number that is a whole number, as an int; None for anything else (booleans,
    fractions, text, null)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_float(value: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (booleans, NaN, text, null)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None
