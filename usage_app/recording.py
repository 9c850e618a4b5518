"""Recording what a finished completion used: the one way rows enter :class:`UsageRecord`.

Callers: a session's turn (``sessions_app.metering``, in the transaction that stores the
completion's ``usage`` event) and an API request, each once its completion has ended and
the server has sent its final report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.utils import timezone

from machines_app.models import Machine, ModelFile

from .models import UsageRecord

__all__ = ["record_usage"]


def _count(value: Any) -> int | None:
    """A token count as the server sent it: a whole number ≥ 0, else None (missing or not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _millis(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:  # NaN fails too
        return 0.0
    return float(value) if value != float("inf") else 0.0


def record_usage(
    *,
    member,
    machine: Machine | None,
    model_file: ModelFile | None,
    usage: Mapping[str, Any] | None,
    timings: Mapping[str, Any] | None,
    source: str,
    member_name: str = "",
    machine_name: str = "",
    model_key: str = "",
    model_name: str = "",
) -> None:
    """Record one finished completion's usage, as llama-server reported it.

    - ``member``: the user it counts for (the author of the message that started the turn;
      for an API request, the key's owner), or None for a deleted account — then
      ``member_name`` names them.
    - ``machine``: where it ran; None when its row is gone, then ``machine_name`` names it. ``model_file``: the ModelFile served; None when its row is
      gone, then ``model_key`` / ``model_name`` name it.
    - ``usage``: the OpenAI ``usage`` object of the final chunk or response:
      ``{"prompt_tokens": int, "completion_tokens": int, "prompt_tokens_details":
      {"cached_tokens": int}}`` (token counts; ``prompt_tokens`` includes the cached ones).
    - ``timings``: llama-server's ``timings`` object of the same chunk, or None:
      ``{"prompt_n": int, "cache_n": int, "predicted_n": int, "prompt_ms": float,
      "predicted_ms": float, …}`` (counts, milliseconds).
    - ``source``: ``"session"`` or ``"api"`` (UsageRecord.Source).

    A field missing from ``usage`` is taken from ``timings`` (prompt tokens ``prompt_n +
    cache_n``, cached ``cache_n``, completion ``predicted_n``); anything missing from both,
    or not a count, is 0. Seconds on the machine: ``(prompt_ms + predicted_ms) / 1000``.
    Raises ValueError for an unknown ``source``. Writes one row in the caller's transaction.
    """
    if source not in UsageRecord.Source.values:
        raise ValueError(f"unknown usage source {source!r}: one of {', '.join(UsageRecord.Source.values)}")
    usage = usage if isinstance(usage, Mapping) else {}
    timings = timings if isinstance(timings, Mapping) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}
    cached = _count(details.get("cached_tokens"))
    if cached is None:
        cached = _count(timings.get("cache_n")) or 0
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = (_count(timings.get("prompt_n")) or 0) + (_count(timings.get("cache_n")) or 0)
    completion = _count(usage.get("completion_tokens"))
    if completion is None:
        completion = _count(timings.get("predicted_n")) or 0
    UsageRecord.objects.create(
        member=member,
        member_name=member.get_username() if member is not None else member_name,
        machine=machine,
        machine_name=machine.name if machine is not None else machine_name,
        model_key=model_file.key if model_file is not None else model_key,
        model_name=model_file.display_name if model_file is not None else (model_name or model_key),
        source=source,
        prompt_tokens=prompt,
        # Never more than the prompt: a quota counts prompt − cached and must not go negative.
        cached_tokens=min(cached, prompt),
        completion_tokens=completion,
        seconds=(_millis(timings.get("prompt_ms")) + _millis(timings.get("predicted_ms"))) / 1000,
        at=timezone.now(),
    )
