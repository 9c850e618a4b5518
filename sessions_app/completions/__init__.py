"""Streaming client for llama-server's ``POST /v1/chat/completions`` (docs/behaviour.md §6, §9).

One module per job, all over plain data but for the HTTP seam; no Django import:

- :mod:`.deltas`: the typed deltas a chunk turns into — :class:`TextDelta`,
  :class:`ReasoningDelta`, :class:`ToolCallFragment`, :class:`Finish`, :class:`Usage`,
  :class:`Progress`.
- :mod:`.errors`: :class:`CompletionError`, a refusal or a break-off in the server's own
  words (docs/behaviour.md C07).
- :mod:`.sse`: :func:`iter_sse_data` turns Server-Sent-Events lines into the data payload
  of each event.
- :mod:`.chunks`: :func:`parse_chunk` turns one decoded ``chat.completion.chunk`` into
  deltas; :class:`InlineReasoning` splits a reply's opening ``<think>…</think>`` out.
- :mod:`.client`: :class:`CompletionClient`, the only place that talks HTTP to
  ``llama-server`` for completions; it streams one completion and raises
  :class:`CompletionError` when the server refuses or breaks off (C07, C11).
- :mod:`.tool_calls`: :class:`ToolCallAssembler` joins streamed ``tool_calls`` fragments
  into :class:`ToolCall` values (docs/behaviour.md §9, C01, C02, C04).
- :mod:`.pacing`: :class:`AbortableHTTP`, reads another thread can break off, paced into
  bursts.

The names below are re-exported so ``completions.X`` keeps working; new code imports from
the module that defines the name.
"""

from __future__ import annotations

from .chunks import InlineReasoning, parse_chunk
from .client import INCOMPLETE_REPLY, CompletionClient
from .deltas import Delta, Finish, Progress, ReasoningDelta, TextDelta, ToolCallFragment, Usage
from .errors import CompletionError
from .pacing import AbortableHTTP
from .sse import iter_sse_data
from .tool_calls import ToolCall, ToolCallAssembler, arguments_problem, parse_arguments

__all__ = [
    "INCOMPLETE_REPLY",
    "AbortableHTTP",
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
