"""The machines page: every machine a member may use, its memory, the sessions' servers on
it and the starts waiting there for memory (docs/behaviour.md §5 "Room on a machine"; who
may use which machine: docs/access.md). Kept with the servers it shows, so machines_app
knows nothing of sessions (tests/test_layers.py)."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages as flash
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from machines_app.access import machines_for
from machines_app.memory import size
from machines_app.models import Machine, MemoryClaim, ModelFile

from .. import actions, room
from ..models import AgentSession
from .models import ServerRecord

#: The plot's width and height in SVG units, and how far back it looks.
PLOT_W, PLOT_H = 240, 48
PLOT_SPAN = timedelta(hours=1)


def _ago(delta: timedelta) -> str:
    seconds = max(int(delta.total_seconds()), 0)
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 90 * 60:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _state(machine: Machine) -> str:
    if machine.transport != Machine.Transport.SSH:
        return "reachable"
    return machine.get_link_state_display()


def _figures(machine: Machine, sample) -> dict:
    """Used and free for the page, in the room a start there is measured against."""
    if sample is None:
        return {"read": False}
    if sample.error:
        return {"read": False, "error": sample.error}
    reading = room.reading_of(sample)
    if machine.memory_budget_mib:
        total = machine.memory_budget_mib * 1024 * 1024
        used = sample.corral_used
        where = "memory budget"
    elif reading.gpus:
        total = sum(g.total for g in reading.gpus)
        used = sum(g.used for g in reading.gpus)
        where = "GPU memory"
    else:
        total = reading.ram_total or 0
        used = total - (reading.ram_available or 0)
        where = "memory"
    return {
        "read": True, "where": where, "used": size(used), "free": size(max(total - used, 0)), "total": size(total),
        "gpus": [{"index": g.index, "used": size(g.used), "free": size(g.free), "total": size(g.total)}
                 for g in reading.gpus],
        "ram": {"used": size((reading.ram_total or 0) - (reading.ram_available or 0)),
                "free": size(reading.ram_available), "total": size(reading.ram_total)} if reading.ram_total else None,
        "taken_at": sample.taken_at,
    }


def _used_fraction(machine: Machine, sample) -> float | None:
    if sample.error:
        return None
    if machine.memory_budget_mib:
        return sample.corral_used / (machine.memory_budget_mib * 1024 * 1024)
    if sample.gpus:
        total = sum(g["total"] for g in sample.gpus)
        return sum(g["used"] for g in sample.gpus) / total if total else None
    if sample.ram_total:
        return (sample.ram_total - (sample.ram_available or 0)) / sample.ram_total
    return None


def plot_points(machine: Machine, now=None) -> str:
    """The last hour's samples as SVG polyline points ("x,y x,y …"), used memory from the
    bottom (0) to the top (all of it); '' with fewer than two samples."""
    now = now or timezone.now()
    start = now - PLOT_SPAN
    points = []
    for sample in machine.samples.filter(taken_at__gte=start).order_by("taken_at"):
        fraction = _used_fraction(machine, sample)
        if fraction is None:
            continue
        x = (sample.taken_at - start) / PLOT_SPAN * PLOT_W
        y = PLOT_H - min(max(fraction, 0.0), 1.0) * PLOT_H
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points) if len(points) >= 2 else ""


@require_GET
def machine_list(request: HttpRequest) -> HttpResponse:
    """Each machine the user may use (:func:`machines_app.access.machines_for`): state,
    memory used and free with the last hour's plot, running servers (model, owner, idle
    for) and who waits for memory there. Staff get Stop on each server. The htmx poll
    asks for the same page and swaps the list."""
    now = timezone.now()
    visible = set(AgentSession.objects.visible_to(request.user).values_list("pk", flat=True))
    machines = []
    for machine in machines_for(request.user):
        sample = room.latest_sample(machine)
        names = dict(ModelFile.objects.filter(machine=machine).values_list("key", "display_name"))
        servers = [
            {
                "session_id": r.session_id, "visible": r.session_id in visible, "model": names.get(r.model_key, r.model_key),
                "owner": r.session.owner.get_username(), "status": r.session.get_status_display(),
                "idle_for": _ago(now - r.session.last_activity_at) if r.session.status == AgentSession.Status.IDLE else "",
                "use": size(sum(sample.server_use.get(str(r.session_id), [0, 0]))) if sample and not sample.error
                and str(r.session_id) in sample.server_use else "",
            }
            for r in ServerRecord.objects.filter(machine=machine).select_related("session__owner").order_by("started_at")
        ]
        line = (MemoryClaim.objects.filter(machine=machine, granted=False, session__status=AgentSession.Status.LOADING)
                .select_related("session__owner").order_by("queued_at", "pk"))
        waiting = [
            {"session_id": c.session_id, "visible": c.session_id in visible, "owner": c.session.owner.get_username(),
             "model": names.get(c.session.model_key, c.session.model_key), "need": size(c.need),
             "since": _ago(now - c.queued_at)}
            for c in line
        ]
        machines.append({
            "machine": machine, "state": _state(machine), "figures": _figures(machine, sample),
            "plot": plot_points(machine, now), "servers": servers, "waiting": waiting,
            "budget": size(machine.memory_budget_mib * 1024 * 1024) if machine.memory_budget_mib else "",
        })
    context = {"machines": machines, "plot_w": PLOT_W, "plot_h": PLOT_H}
    if request.htmx:
        return render(request, "machines_app/_machines.html", context)
    return render(request, "machines_app/machine_list.html", context)


@require_POST
def machine_server_stop(request: HttpRequest, session_id: int) -> HttpResponse:
    """Staff's Stop on a server from the machines page: the session's Stop server."""
    if not request.user.is_staff:
        return HttpResponse(status=403)
    session = get_object_or_404(AgentSession, pk=session_id)
    actions.do_stop(session, request.user)
    flash.success(request, f"Stopping the server of {session.display_title} on {session.machine.name}.")
    return redirect("machine_list")
