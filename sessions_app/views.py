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
from .consumers import CloseCode
from .forms import MachineChoiceForm, MessageForm, NewSessionForm, SessionSettingsForm
from .models import AgentSession
from .presenters import build_items


@require_GET
def session_list(request: HttpRequest) -> HttpResponse:
    from django.db.models import OuterRef, Subquery

    from machines_app.models import ModelFile

    model_name = ModelFile.objects.filter(machine=OuterRef("machine"), key=OuterRef("model_key")).values("display_name")
    sessions = AgentSession.objects.select_related("machine", "owner").annotate(model_name=Subquery(model_name[:1]))
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
    """The model picker for one machine (htmx fragment); the list is catalog.models_for's.
    A missing, malformed or unknown ``machine`` gets an empty picker saying so (400)."""
    form = MachineChoiceForm(request.GET)
    if not form.is_valid():
        context = {"models": [], "machine": None, "error": form.errors["machine"][0]}
        return render(request, "sessions_app/_model_options.html", context, status=400)
    machine = form.cleaned_data["machine"]
    return render(request, "sessions_app/_model_options.html",
                  {"models": list(catalog.models_for(machine)), "machine": machine})


@require_POST
def refresh_models(request: HttpRequest, machine_id: int) -> HttpResponse:
    """Re-read a machine's model files (a Celery task); the picker reloads when it is done."""
    from machines_app.tasks import refresh_models as refresh_task

    machine = Machine.objects.filter(pk=machine_id, enabled=True).first()
    if machine is None:
        return HttpResponse(status=404)
    refresh_task.delay(machine.pk)
    since = machine.models_refreshed_at.isoformat() if machine.models_refreshed_at else ""
    context = {"machine": machine, "since": since, "selected": request.POST.get("model_key", "")}
    return render(request, "sessions_app/_refreshing.html", context)


@require_GET
def refresh_status(request: HttpRequest, machine_id: int) -> HttpResponse:
    machine = Machine.objects.filter(pk=machine_id, enabled=True).first()
    if machine is None:
        return HttpResponse(status=404)
    since = request.GET.get("since", "")
    done = machine.models_refreshed_at is not None and machine.models_refreshed_at.isoformat() != since
    selected = request.GET.get("selected", "")
    if not done:
        return render(request, "sessions_app/_refreshing.html", {"machine": machine, "since": since, "selected": selected})
    models = list(catalog.models_for(machine))
    return render(request, "sessions_app/_model_options.html", {"models": models, "machine": machine, "selected": selected})


def _session_context(session: AgentSession) -> dict:
    """What the session page shows besides the transcript: the model by name, the other
    models of the machine (same list as everywhere), whether a restart is pending."""
    from machines_app.models import ServerRecord

    models = list(catalog.models_for(session.machine))
    current = next((m for m in models if m.key == session.model_key), None)
    record = ServerRecord.objects.filter(session=session).first()
    return {
        "model_name": current.display_name if current else session.model_key,
        "machine_models": models,
        "restart_needed": record is not None and record.server_params != session.server_params,
    }


@require_GET
def session_detail(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    events = actions.load_events(session.pk)
    context = {
        **_session_context(session),
        "settings_form": SessionSettingsForm.for_session(session),
        "tools": transcript.last_catalogue(events),
        "machine_name": session.machine.name,
        "session": session,
        "session_id": session.pk,
        "items": build_items(events, session.pk),
        "queued": transcript.pending_queue(events),
        "last_seq": events[-1].seq if events else 0,
        "form": MessageForm(),
        "close_codes": {code.name: code.value for code in CloseCode},
    }
    return TemplateResponse(request, "sessions_app/session_detail.html", context)


def _composer(request: HttpRequest, session: AgentSession, form: MessageForm, error: str = "") -> HttpResponse:
    return render(request, "sessions_app/_composer.html", {"session": session, "form": form, "error": error})


@require_POST
def session_send(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    form = MessageForm(request.POST)
    if not form.is_valid():
        return _composer(request, session, form, form.errors["text"][0])
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
def session_model(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_change_model, request.POST.get("model_key", ""))


@require_POST
def session_settings(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    form = SessionSettingsForm(request.POST)
    if not form.is_valid():
        return render(request, "sessions_app/_settings.html", {"session": session, "settings_form": form,
                                                               **_session_context(session)})
    restart = actions.do_update_settings(
        session, request.user, title=form.cleaned_data["title"], sampling=form.sampling(),
        server_params=form.server_params(),
    )
    session.refresh_from_db()
    context = {"session": session, "settings_form": form, "saved": True, "restart_asked": restart,
               **_session_context(session)}
    return render(request, "sessions_app/_settings.html", context)


@require_POST
def session_delete(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    actions.do_delete(session, request.user)
    flash.success(request, f"Deleted {session.display_title}.")
    if request.htmx:
        response = HttpResponse(status=204)
        response["HX-Redirect"] = "/"
        return response
    return redirect("session_list")


@require_POST
def session_restart(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, actions.do_restart)
