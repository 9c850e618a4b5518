"""Thin views: parse, check access, call an action, answer with a page or a fragment."""

from __future__ import annotations

from django.contrib import messages as flash
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.template.response import TemplateResponse
from django.views.decorators.http import require_GET, require_POST

from machines_app import catalog
from machines_app.models import Machine

from . import actions, transcript
from .forms import MessageForm, NewSessionForm
from .models import AgentSession
from .presenters import build_items


@require_GET
def session_list(request: HttpRequest) -> HttpResponse:
    sessions = AgentSession.objects.select_related("machine", "owner")
    if not request.user.is_staff:
        sessions = sessions.filter(owner=request.user)
    return render(request, "sessions_app/session_list.html", {"sessions": sessions.order_by("-last_activity_at")})


def session_new(request: HttpRequest) -> HttpResponse:
    form = NewSessionForm(request.POST or None, initial={"machine": request.GET.get("machine")})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        session = actions.do_create_session(
            request.user,
            machine=data["machine"],
            model_key=data["model_key"],
            working_dir=data["working_dir"],
            server_params=form.server_params(),
            sampling=form.sampling(),
            permission_mode=data["permission_mode"],
            title=data["title"],
        )
        return redirect(session)
    return render(request, "sessions_app/session_new.html", {"form": form})


@require_GET
def model_options(request: HttpRequest) -> HttpResponse:
    """The model picker for one machine (htmx fragment); the list is catalog.models_for's."""
    machine = Machine.objects.filter(pk=request.GET.get("machine"), enabled=True).first()
    models = list(catalog.models_for(machine)) if machine else []
    return render(request, "sessions_app/_model_options.html", {"models": models, "machine": machine})


@require_POST
def refresh_models(request: HttpRequest, machine_id: int) -> HttpResponse:
    """Re-read a machine's model files (a Celery task); the picker reloads when it is done."""
    from machines_app.tasks import refresh_models as refresh_task

    machine = Machine.objects.filter(pk=machine_id, enabled=True).first()
    if machine is None:
        return HttpResponse(status=404)
    refresh_task.delay(machine.pk)
    return render(request, "sessions_app/_refreshing.html", {"machine": machine, "since": machine.models_refreshed_at.isoformat() if machine.models_refreshed_at else ""})


@require_GET
def refresh_status(request: HttpRequest, machine_id: int) -> HttpResponse:
    machine = Machine.objects.filter(pk=machine_id, enabled=True).first()
    if machine is None:
        return HttpResponse(status=404)
    since = request.GET.get("since", "")
    done = machine.models_refreshed_at is not None and machine.models_refreshed_at.isoformat() != since
    if not done:
        return render(request, "sessions_app/_refreshing.html", {"machine": machine, "since": since})
    models = list(catalog.models_for(machine))
    return render(request, "sessions_app/_model_options.html", {"models": models, "machine": machine})


@require_GET
def session_detail(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    events = actions.load_events(session.pk)
    context = {
        "session": session,
        "session_id": session.pk,
        "items": build_items(events, session.pk),
        "queued": transcript.pending_queue(events),
        "last_seq": events[-1].seq if events else 0,
        "form": MessageForm(),
    }
    return TemplateResponse(request, "sessions_app/session_detail.html", context)


def _composer(request: HttpRequest, session: AgentSession, form: MessageForm, error: str = "") -> HttpResponse:
    return render(request, "sessions_app/_composer.html", {"session": session, "form": form, "error": error})


@require_POST
def session_send(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    form = MessageForm(request.POST)
    if not form.is_valid():
        return _composer(request, session, form, "Type a message first.")
    try:
        actions.do_send_message(session, request.user, form.cleaned_data["text"])
    except actions.SessionError as exc:
        return _composer(request, session, form, str(exc))
    return _composer(request, session, MessageForm())


def _act(request: HttpRequest, session_id: int, action, *args) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    try:
        action(session, request.user, *args)
    except actions.SessionError as exc:
        if request.htmx:
            return render(request, "sessions_app/_flash.html", {"error": str(exc)})
        flash.error(request, str(exc))
    if request.htmx:
        return render(request, "sessions_app/_flash.html", {"error": ""})
    return redirect(session)


@require_POST
def session_interrupt(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_interrupt)


@require_POST
def session_clear(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_clear)


@require_POST
def session_drop(request: HttpRequest, session_id: int, queued_id: str) -> HttpResponse:
    return _act(request, session_id, actions.do_drop_queued, queued_id)


@require_POST
def session_stop(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_stop)


@require_POST
def session_answer(request: HttpRequest, session_id: int, call_id: str) -> HttpResponse:
    return _act(request, session_id, actions.do_answer, call_id, request.POST.get("answer", ""))


@require_POST
def session_mode(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_set_permission_mode, request.POST.get("permission_mode", ""))


@require_POST
def session_restart(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_restart)
