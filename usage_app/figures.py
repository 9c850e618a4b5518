"""Usage summed from the rows when read: per UTC day, per member, machine and model, and
the day plot's bars. Queries in, plain dicts out; the views only choose the rows."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import TruncDate

from .models import UsageRecord
from .quota import day_start

#: The periods the page offers, in days (today included), and the one it opens with.
PERIODS = (7, 30, 90)
DEFAULT_PERIOD = 7

#: The day plots' size in SVG units.
PLOT_W, PLOT_H = 600, 120

_SUMS = {
    "replies": Count("id"),
    "prompt": Sum("prompt_tokens"),
    "cached": Sum("cached_tokens"),
    "completion": Sum("completion_tokens"),
    "seconds": Sum("seconds"),
}


def period_start(days: int, now: datetime | None = None) -> datetime:
    """00:00 UTC of the first day of a period of ``days`` days ending today."""
    return day_start(now) - timedelta(days=days - 1)


def records(start: datetime, *, member=None, machine_id: int | None = None) -> QuerySet[UsageRecord]:
    """The rows since ``start``, of one member and one machine when given."""
    rows = UsageRecord.objects.filter(at__gte=start)
    if member is not None:
        rows = rows.filter(member=member)
    if machine_id is not None:
        rows = rows.filter(machine_id=machine_id)
    return rows


def _filled(row: dict) -> dict:
    figures = {key: row.get(key) or 0 for key in _SUMS}
    figures["fresh"] = figures["prompt"] - figures["cached"]
    figures["tokens"] = figures["prompt"] + figures["completion"]
    return figures


def totals(rows: QuerySet[UsageRecord]) -> dict:
    """``{"replies", "prompt", "cached", "fresh", "completion", "tokens", "seconds"}`` over
    ``rows``: counts of tokens (``fresh`` = prompt − cached, ``tokens`` = prompt + completion),
    seconds on the machine."""
    return _filled(rows.aggregate(**_SUMS))


def by_day(rows: QuerySet[UsageRecord], first: date, days: int) -> list[dict]:
    """One entry per UTC day from ``first``, ``days`` of them, days without usage at 0:
    :func:`totals`' figures plus ``"day"`` (a date)."""
    # django-stubs types values().annotate(**_SUMS) rows without the sums: plain dicts here.
    summed: dict[date, dict[str, Any]] = {
        row["day"]: dict(row)
        for row in rows.annotate(day=TruncDate("at", tzinfo=UTC)).values("day").annotate(**_SUMS).order_by("day")
    }
    return [{"day": day, **_filled(summed.get(day, {}))}
            for day in (first + timedelta(days=n) for n in range(days))]


#: What each breakdown groups by: the link's id and the name it had then.
BREAKDOWNS = {
    "member": ("member_id", "member_name"),
    "machine": ("machine_id", "machine_name"),
    "model": ("model_key", "model_name"),
}


def by(rows: QuerySet[UsageRecord], what: str) -> list[dict]:
    """Totals per member, machine or model (``what``, a key of :data:`BREAKDOWNS`), most
    tokens first: :func:`totals`' figures plus ``"id"`` and ``"name"``. A model is told apart
    by its machine too (one file name on two machines is two models)."""
    key, name = BREAKDOWNS[what]
    fields = [key, name, "machine_name"] if what == "model" else [key, name]
    entries = []
    for row in rows.values(*fields).annotate(**_SUMS):
        entry = {"id": row[key], "name": row[name], **_filled(row)}
        if what == "model":
            entry["machine"] = row["machine_name"]
        entries.append(entry)
    entries.sort(key=lambda e: (-e["tokens"], str(e["name"])))
    return entries


def csv_rows(rows: QuerySet[UsageRecord]):
    """Per UTC day, member, machine, model and source, oldest day first: tuples of (day,
    member, machine, model, model file, source, replies, prompt tokens, cached tokens,
    completion tokens, seconds)."""
    grouped = (rows.annotate(day=TruncDate("at", tzinfo=UTC))
               .values("day", "member_name", "machine_name", "model_name", "model_key", "source")
               .annotate(**_SUMS)
               .order_by("day", "member_name", "machine_name", "model_name", "source"))
    for found in grouped:
        row: dict[str, Any] = dict(found)  # django-stubs does not see the annotated sums
        yield (row["day"].isoformat(), row["member_name"], row["machine_name"], row["model_name"], row["model_key"],
               row["source"], row["replies"], row["prompt"] or 0, row["cached"] or 0, row["completion"] or 0,
               round(row["seconds"] or 0.0, 3))


def stacked_bars(days: list[dict], keys: tuple[str, ...], *, width: int = PLOT_W, height: int = PLOT_H) -> dict:
    """The day plot: one bar per day, ``keys`` (figures of :func:`by_day`) stacked from the
    bottom, all scaled so the largest day fills ``height``. Returns ``{"top": the largest
    day's sum, "bars": [{"day", "x", "w", "total", "parts": [{"key", "y", "h", "value"}]}]}``
    in SVG units, y down from the top."""
    top = max((sum(day[key] for key in keys) for day in days), default=0)
    slot = width / max(len(days), 1)
    bars = []
    for index, day in enumerate(days):
        y = float(height)
        parts = []
        for key in keys:
            h = day[key] / top * height if top else 0.0
            y -= h
            if h > 0:
                parts.append({"key": key, "y": round(y, 2), "h": round(h, 2), "value": day[key]})
        bars.append({"day": day["day"], "x": round(index * slot + slot * 0.1, 2), "w": round(slot * 0.8, 2),
                     "total": sum(day[key] for key in keys), "parts": parts})
    return {"top": top, "bars": bars}


def duration(seconds: float) -> str:
    """Seconds in words for the page: ``"4.2 s"``, ``"3 min 12 s"``, ``"2 h 05 min"``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


__all__ = ["BREAKDOWNS", "DEFAULT_PERIOD", "PERIODS", "PLOT_H", "PLOT_W", "by", "by_day", "csv_rows",
           "duration", "period_start", "records", "stacked_bars", "totals"]
