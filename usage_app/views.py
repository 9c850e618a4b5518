"""The usage page and its CSV (docs/usage.md): staff see everyone's figures, by member,
machine, model and UTC day; a member sees their own and only theirs."""

from __future__ import annotations

import csv

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from machines_app.models import Machine

from . import figures, quota

#: What a member who asks for someone else's figures is told (403).
OTHERS_REFUSED = "Only staff can see other members' usage; this page shows your own."
#: … and one who asks for the CSV.
CSV_REFUSED = "Only staff can download the usage of everyone as CSV."

#: The plots: which figures each stacks, bottom first, and what the legend calls them.
TOKEN_PARTS = (("cached", "prompt from cache"), ("fresh", "prompt read"), ("completion", "reply"))
TIME_PARTS = (("seconds", "seconds on the machine"),)

#: Characters a spreadsheet reads as the start of a formula in a cell (a model's name
#: comes from its GGUF file: anyone's words).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _period(request: HttpRequest) -> int:
    raw = request.GET.get("days", "")
    # ASCII digits only: str.isdigit() is also true of '²', which int() refuses.
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) in figures.PERIODS else figures.DEFAULT_PERIOD


def _id(request: HttpRequest, name: str) -> int | None:
    raw = request.GET.get(name, "")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise Http404(f"No such {name}")
    return int(raw)


def _member(request: HttpRequest):
    """Whose figures: staff choose anyone (``?member=id``) or everyone (None); a member sees
    only their own (PermissionDenied for another id)."""
    wanted = _id(request, "member")
    if not request.user.is_staff:
        if wanted is not None and wanted != request.user.pk:
            raise PermissionDenied(OTHERS_REFUSED)
        return request.user
    if wanted is None:
        return None
    member = get_user_model().objects.filter(pk=wanted).first()
    if member is None:
        raise Http404("No such member")
    return member


@require_GET
def usage(request: HttpRequest) -> HttpResponse:
    """Figures for a period (``?days=`` 7, 30 or 90, UTC days, today included) and
    optionally one machine (``?machine=id``): totals, a plot of tokens and one of time on the
    machine per day, a table per day, and per member (staff viewing everyone), machine and
    model; a member's quota for today when one applies."""
    now = timezone.now()
    days = _period(request)
    member = _member(request)
    machine_id = _id(request, "machine")
    start = figures.period_start(days, now)
    rows = figures.records(start, member=member, machine_id=machine_id)
    daily = figures.by_day(rows, start.date(), days)
    context = {
        "days": days, "periods": figures.PERIODS, "member": member, "machine_id": machine_id,
        "start": start.date(), "today": now.date(),
        "totals": figures.totals(rows), "daily": daily,
        "token_plot": figures.stacked_bars(daily, tuple(key for key, _ in TOKEN_PARTS)),
        "time_plot": figures.stacked_bars(daily, tuple(key for key, _ in TIME_PARTS)),
        "token_parts": TOKEN_PARTS, "plot_w": figures.PLOT_W, "plot_h": figures.PLOT_H,
        "by_member": figures.by(rows, "member") if request.user.is_staff and member is None else None,
        "by_machine": figures.by(rows, "machine"), "by_model": figures.by(rows, "model"),
        "quota": quota.standing(member, now) if member is not None else None,
        "counted": quota.COUNTED,
    }
    for entry in [*daily, context["totals"], *context["by_machine"], *context["by_model"],
                  *(context["by_member"] or [])]:
        entry["time"] = figures.duration(entry["seconds"])
    if request.user.is_staff:
        context["members"] = get_user_model().objects.filter(is_active=True).order_by("username")
        context["machines"] = Machine.objects.order_by("name")
    return render(request, "usage_app/usage.html", context)


def _cell(value):
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


@require_GET
def usage_csv(request: HttpRequest) -> HttpResponse:
    """Staff only: the period's usage (the page's filters) as CSV, a row per UTC day,
    member, machine, model and source (figures.csv_rows); 403 for members."""
    if not request.user.is_staff:
        raise PermissionDenied(CSV_REFUSED)
    now = timezone.now()
    days = _period(request)
    member = _member(request)
    rows = figures.records(figures.period_start(days, now), member=member, machine_id=_id(request, "machine"))
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="corral-usage-{now.date().isoformat()}-{days}d.csv"'
    writer = csv.writer(response)
    writer.writerow(["day (UTC)", "member", "machine", "model", "model file", "source", "replies", "prompt tokens",
                     "cached tokens", "completion tokens", "seconds"])
    for row in figures.csv_rows(rows):
        writer.writerow([_cell(value) for value in row])
    return response
