"""Thin views: parse, check access, call an action, answer with a page or a fragment."""

from __future__ import annotations

import re

from django.contrib import messages as flash
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotModified
from django.shortcuts import redirect, render
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from machines_app import catalog
from machines_app.access import machine_refusal, machines_for

from . import actions, dispatch, export, first_run, images, importing, room, rules, tex, text_files, transcript, turns
from .events import load_events, load_kinds, load_queue_events, load_turns, turns_since
from .forms import MachineChoiceForm, MessageForm, NewSessionForm, SessionSettingsForm
from .live import markdown, presence
from .live.consumers import CloseCode
from .live.header import context_size, model_details, model_facts, template_info
from .live.items import ALLOWANCE_KINDS, TOOL_KINDS, VERSION_KINDS, Viewer, allowance_items, attach_context, queued_item
from .live.transcript_view import TURNS_PER_PAGE, gauge_of, turn_items
from .models import Access, AgentSession, TranscriptEvent
from .transcript import Versions

ACT, MANAGE = Access.ACT, Access.MANAGE


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """The 403 page (``handler403``): the refusal's own sentence (``actions.NotAllowed``).
    An htmx click gets it in the page's flash line, whatever the button targeted (the
    page's htmx config swaps 403 answers: templates/base.html)."""
    message = str(exception) if exception and str(exception) else "You may not do that."
    if getattr(request, "htmx", False):
        response = render(request, "sessions_app/_flash.html", {"error": message}, status=403)
        # Beside the control that was clicked when it has a feedback slot (docs/live-page.md).
        target = request.htmx.target or ""
        response["HX-Retarget"] = f"#{target}" if target.endswith("feedback") else "#flash"
        response["HX-Reswap"] = "innerHTML"
        return response
    return render(request, "403.html", {"message": message}, status=403)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """``CSRF_FAILURE_VIEW``: a page left open across a logout or a new login sends a stale
    token; say so in the same place as any other refusal."""
    return permission_denied(
        request, PermissionDenied("This page is out of date (you logged in or out since it was loaded): reload it.")
    )


#: The session list's "Show" filter: its value → the statuses it shows (None: all).
LIST_FILTERS = {
    "": None,
    "active": (AgentSession.Status.RUNNING, AgentSession.Status.AWAITING_INPUT, AgentSession.Status.LOADING),
    "answer": (AgentSession.Status.AWAITING_INPUT,),
    "down": AgentSession.Status.server_down(),
}


@require_GET
def session_list(request: HttpRequest) -> HttpResponse:
    """The sessions this user may see, as "mine", "shared with me" and, for staff, the
    others' private ones; ``q`` keeps those whose title, model, machine or owner contains
    it (any case), ``show`` those in the statuses :data:`LIST_FILTERS` names."""
    # No control characters: PostgreSQL text cannot hold NUL (a search for one was a 500).
    query = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", request.GET.get("q", "")).split())[:200]
    show = request.GET.get("show", "")
    statuses = LIST_FILTERS.get(show)
    sessions = (
        AgentSession.objects.visible_to(request.user)
        .select_related("machine", "owner")
        .with_model_name()
        .matching(query)
        .order_by("-last_activity_at")
    )
    if statuses is not None:
        sessions = sessions.filter(status__in=statuses)
    waiting = turns.waiting_for_worker()
    mine, shared, others = [], [], []
    for session in sessions:
        session.waiting_ahead = waiting.get(session.pk)
        if session.owner_id == request.user.pk:
            mine.append(session)
        elif session.visibility != AgentSession.Visibility.PRIVATE:
            shared.append(session)
        else:
            others.append(session)
    # What was said in those sessions (search_app.search): the same sessions, before the
    # title filter, so a word said in a chat is found whatever the session is called.
    said = []
    if query:
        from search_app.search import find

        seen = AgentSession.objects.visible_to(request.user)
        said = find(seen.filter(status__in=statuses) if statuses is not None else seen, query)
    context = {"mine": mine, "shared": shared, "others": others, "any": bool(mine or shared or others),
               "q": query, "show": show if show in LIST_FILTERS else "", "filtering": bool(query or statuses),
               "said": said, "first_run": first_run.checklist_for(request.user)}
    return render(request, "sessions_app/session_list.html", context)


def session_new(request: HttpRequest) -> HttpResponse:
    """The new-session form; with a file in ``transcript``, the session starts from that
    JSON Lines export (docs/transcript.md, "Import"), as the person asking: the file is
    refused, naming the line and why, when it is not a sound export."""
    form = NewSessionForm(request.POST or None, request.FILES or None, user=request.user,
                          initial={"machine": request.GET.get("machine")})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        create = dict(
            machine=data["machine"],
            model_key=data["model_key"],
            working_dir=data["working_dir"],
            server_params=form.server_params(),
            sampling=form.sampling(),
            permission_mode=data["permission_mode"],
            title=data["title"],
            system_prompt=data["system_prompt"],
        )
        upload = data.get("transcript")
        try:
            if upload:
                if upload.size > importing.MAX_IMPORT_BYTES:
                    raise importing.ImportRefused(f"The file is {upload.size:,} bytes; an export to import can be at "
                                                  f"most {importing.MAX_IMPORT_BYTES:,}.")
                session = importing.do_import(request.user, upload.read(), **create)
            else:
                session = actions.do_create_session(request.user, **create)
        except importing.ImportRefused as exc:
            form.add_error("transcript", str(exc))
        except actions.SessionError as exc:  # the access changed between the form's check and now
            form.add_error(None, str(exc))
        else:
            return redirect(session)
    importing_file = bool(request.GET.get("import") or (form.is_bound and request.FILES.get("transcript")))
    return render(request, "sessions_app/session_new.html", {"form": form, "importing": importing_file})


@require_GET
def model_options(request: HttpRequest) -> HttpResponse:
    """The model picker for one machine (htmx fragment); the list is catalog.models_for's.
    A missing, malformed or unknown ``machine``, or one not open to this user, gets an
    empty picker saying so (400)."""
    form = MachineChoiceForm(request.GET, user=request.user)
    if not form.is_valid():
        context = {"models": [], "machine": None, "error": form.errors["machine"][0]}
        return render(request, "sessions_app/_model_options.html", context, status=400)
    machine = form.cleaned_data["machine"]
    models = list(catalog.models_for(machine))
    room.mark_fits(machine, models)  # fits now / after sleeping idle servers / waits / too big
    return render(request, "sessions_app/_model_options.html", {"models": models, "machine": machine})


@require_GET
def model_defaults(request: HttpRequest) -> HttpResponse:
    """The new-session form's system prompt and sampling fields, redrawn for the model now
    chosen (htmx): what the person typed is kept, the placeholders are that model's
    defaults (docs/behaviour.md §17). Only machines open to the user are read."""
    names = ("machine", "model_key", "system_prompt", *NewSessionForm.SAMPLING_FIELDS)
    initial = {name: request.GET[name] for name in names if request.GET.get(name)}
    return render(request, "sessions_app/_model_defaults.html", {"form": NewSessionForm(user=request.user, initial=initial)})


@require_POST
def refresh_models(request: HttpRequest, machine_id: int) -> HttpResponse:
    """Re-read a machine's model files (a Celery task, on the machine's own host for a
    local one); the picker reloads when it is done."""
    machine = machines_for(request.user).filter(pk=machine_id).first()
    if machine is None:
        return HttpResponse(status=404)
    dispatch.enqueue(dispatch.REFRESH_MODELS, machine.pk)
    since = machine.models_refreshed_at.isoformat() if machine.models_refreshed_at else ""
    context = {"machine": machine, "since": since, "selected": request.POST.get("model_key", "")}
    return render(request, "sessions_app/_refreshing.html", context)


@require_GET
def refresh_status(request: HttpRequest, machine_id: int) -> HttpResponse:
    machine = machines_for(request.user).filter(pk=machine_id).first()
    if machine is None:
        return HttpResponse(status=404)
    since = request.GET.get("since", "")
    done = machine.models_refreshed_at is not None and machine.models_refreshed_at.isoformat() != since
    selected = request.GET.get("selected", "")
    if not done:
        return render(request, "sessions_app/_refreshing.html", {"machine": machine, "since": since, "selected": selected})
    models = list(catalog.models_for(machine))
    room.mark_fits(machine, models)
    return render(request, "sessions_app/_model_options.html", {"models": models, "machine": machine, "selected": selected})


def _session_context(session: AgentSession) -> dict:
    """What the session page shows besides the transcript: the model by name, the other
    models of the machine (same list as everywhere), whether a restart is pending."""
    from .servers.models import ServerRecord

    models = list(catalog.models_for(session.machine))
    current = next((m for m in models if m.key == session.model_key), None)
    record = ServerRecord.objects.filter(session=session).first()
    return {
        "model_file": current,
        "model_name": current.display_name if current else session.model_key,
        "machine_models": models,
        "restart_needed": record is not None and record.server_params != session.server_params,
    }


@require_GET
def session_detail(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id)
    viewer = Viewer(request.user.pk, session.access_for(request.user), actions.may_grant_always(session, request.user))
    # The last turns only (docs/live-page.md): the earlier ones come with "Show earlier turns".
    # A search result (?at=<seq>) asks for an earlier message: the page reaches back to its turn.
    at = request.GET.get("at", "")
    events, start = load_turns(session.pk, max(TURNS_PER_PAGE, turns_since(session.pk, int(at)) if at.isascii() and at.isdigit() and len(at) < 19 else 0))
    last_seq = events[-1].seq if events else 0
    # The queue and the catalogue span the whole transcript: read their own kinds only,
    # up to the page's last event (the socket brings what comes after it).
    session_context = _session_context(session)
    model_file = session_context["model_file"]
    # So do the template the server runs and the context gauge.
    ready = transcript.last_server_ready(
        load_kinds(session.pk, [transcript.Kind.SERVER_READY, transcript.Kind.IMPORTED], upto=last_seq))
    gauge = gauge_of(
        load_kinds(session.pk, [transcript.Kind.USAGE, transcript.Kind.CLEARED], upto=last_seq),
        n_ctx=context_size(ready, session.server_params.get("contextSize")),
    )
    template = template_info(ready, remembered=model_file.chat_template_caps if model_file else None)
    context = {
        **session_context,
        "settings_form": SessionSettingsForm.for_session(session),
        "tools": transcript.last_catalogue(
            load_kinds(session.pk, [transcript.Kind.CATALOGUE, transcript.Kind.IMPORTED], upto=last_seq)),
        "allowances": allowance_items(
            transcript.allowances(load_kinds(session.pk, [*ALLOWANCE_KINDS, transcript.Kind.IMPORTED], upto=last_seq)),
            session.pk, viewer),
        "template": template,
        # The header's model details: the file's facts (as the last server said them when
        # the file is gone from the machine's list).
        "model_details": model_details(model_facts(model_file) if model_file else (ready or {}).get("model_facts") or {},
                                       template, context_size(ready, None)),
        "machine_name": session.machine.name,
        "session": session,
        "session_id": session.pk,
        # Shown to whom may choose it; kept (hidden, disabled) for the rest so the select can
        # still show that the gate is off when someone else turns it off.
        "offer_bypass": actions.may_bypass(request.user) and actions.may_bypass(session.owner),
        "can_act": viewer.access >= ACT,
        "can_manage": viewer.access >= MANAGE,
        # Why a reader the sharing lets act may only watch: the machine (docs/access.md).
        "held_back": (machine_refusal(request.user, session.machine)
                      if session.shared_access(request.user) > viewer.access else ""),
        "items": turn_items(events, session.pk, viewer, call_events=_call_events(session.pk),
                            versions=_versions(session.pk, last_seq)),
        "earlier": start if start > 1 else None,
        "gauge": gauge,
        "queued": [queued_item(payload, viewer, session.pk)
                   for payload in transcript.pending_queue(load_queue_events(session.pk, upto=last_seq))],
        # This page's own socket is about to join the list.
        "watching": sorted({*presence.watching(session.pk), request.user.get_username()}),
        "last_seq": last_seq,
        "form": MessageForm(),
        **attach_context(catalog.vision(session.machine, session.model_key)[1]),
        **_waiting_context(session),
        "close_codes": {code.name: code.value for code in CloseCode},
        "down_statuses": " ".join(AgentSession.Status.server_down()),
        "reply_statuses": " ".join(AgentSession.Status.reply_possible()),
        "has_message": _has_message(session),
        "md_tags": " ".join(sorted(markdown.ALLOWED_TAGS)),
        "md_attrs": " ".join(sorted({"href", "class", *tex.MATHML_ATTRIBUTES})),
    }
    return TemplateResponse(request, "sessions_app/session_detail.html", context)


@require_GET
def session_export(request: HttpRequest, session_id: int, fmt: str) -> HttpResponse:
    """The transcript as a download (docs/behaviour.md §18): ``jsonl`` (one stored event a
    line) or ``md`` (what a person reads). Whoever may watch the session may export it."""
    if fmt not in ("jsonl", "md"):
        raise Http404("There is no such export format.")
    session = actions.access_session(request.user, session_id)
    events = load_events(session.pk)
    if fmt == "jsonl":
        # The images the messages carry go with it, so an import attaches them again.
        response = HttpResponse("".join(export.to_jsonl(events, image_data=images.read)),
                                content_type="application/x-ndjson; charset=utf-8")
    else:
        def image_url(ref: dict) -> str:
            path = reverse("session_image", args=[session.pk, ref["sha256"], images.EXTENSIONS.get(ref["media_type"], "bin")])
            return request.build_absolute_uri(path)

        text = export.to_markdown(events, title=session.display_title, image_url=image_url)
        response = HttpResponse(text, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="session-{session.pk}.{fmt}"'
    return response
def session_earlier(request: HttpRequest, session_id: int) -> HttpResponse:
    """The turns before seq ``before`` (``TURNS_PER_PAGE`` of them) for "Show earlier
    turns", with the control for the ones before those (docs/live-page.md)."""
    session = actions.access_session(request.user, session_id)
    raw = request.GET.get("before", "")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= session.last_seq + 1:
        return HttpResponse("Which turns? 'before' must be a sequence number of this session's transcript.",
                            status=400, content_type="text/plain; charset=utf-8")
    viewer = Viewer(request.user.pk, session.access_for(request.user), actions.may_grant_always(session, request.user))
    events, start = load_turns(session.pk, TURNS_PER_PAGE, before=int(raw))
    items = turn_items(events, session.pk, viewer, followed=True, call_events=_call_events(session.pk),
                       versions=_versions(session.pk, session.last_seq))
    context = {"items": items, "earlier": start if start > 1 else None, "session_id": session.pk}
    return render(request, "sessions_app/_earlier.html", context)


def _versions(session_id: int, upto: int) -> Versions:
    """Which messages up to seq ``upto`` are versions of one another (a page that draws only
    some turns still shows "‹ 2/3 ›" for a message whose first version lies before them)."""
    versions = Versions()
    for event in load_kinds(session_id, VERSION_KINDS, upto=upto):
        versions.feed(event)
    return versions


def _call_events(session_id: int):
    """``call_events`` for a fold that starts mid-transcript: the earlier events of a tool
    call whose start lies before the first event read (a turn boundary, so in practice none)."""

    def call_events(call_id: str, before_seq: int) -> list[TranscriptEvent]:
        return list(TranscriptEvent.objects.filter(
            session_id=session_id, kind__in=TOOL_KINDS, payload__id=call_id, seq__lt=before_seq).order_by("seq"))

    return call_events


@require_GET
def session_waiting(request: HttpRequest, session_id: int) -> HttpResponse:
    """The "waiting for a worker (n ahead)" note of a session page (polled by htmx)."""
    session = actions.access_session(request.user, session_id)
    return render(request, "sessions_app/_waiting.html", _waiting_context(session))


def _waiting_context(session: AgentSession) -> dict:
    """The waiting note's context: how many turns wait ahead of this one (None when it
    does not wait), and whether its turn may be waiting for a worker — open, and not
    waiting for a person's answer — the only time the note polls: a page left open on an
    idle session, or on a question nobody has answered, would otherwise ask every 3 s for
    nothing. (An answer sets the status to running: the page asks again then.)"""
    may_wait = session.turn_active and session.status != AgentSession.Status.AWAITING_INPUT
    # Only such a turn can be in the queue: the others need not read it.
    ahead = turns.waiting_for_worker().get(session.pk) if may_wait else None
    return {"session_id": session.pk, "ahead": ahead, "may_wait": may_wait}


def _has_message(session: AgentSession) -> bool:
    """Whether the session has a message to edit or send again (else those buttons are inactive)."""
    return TranscriptEvent.objects.filter(session=session, kind=transcript.Kind.MESSAGE_TAKEN).exists()


def _composer(request: HttpRequest, session: AgentSession, form: MessageForm, error: str = "") -> HttpResponse:
    # A refused edit stays an edit (its text and its flag come back with the error).
    editing = bool(error) and request.POST.get("edit") == "last"
    context = {"session": session, "form": form, "error": error, "editing": editing,
               "can_manage": session.access_for(request.user) >= MANAGE, "has_message": _has_message(session),
               **attach_context(catalog.vision(session.machine, session.model_key)[1])}
    return render(request, "sessions_app/_composer.html", context)


def _uploads(request: HttpRequest) -> list[images.Upload]:
    """The files attached as ``images``; one over the size limit is not read (its size is
    enough to refuse it)."""
    return [
        images.Upload(upload.name or "", upload.read() if upload.size <= images.max_bytes() else b"", upload.size)
        for upload in request.FILES.getlist("images")
    ]


def _text_files(request: HttpRequest) -> list[images.Upload]:
    """The files attached as ``files`` (text: sessions_app/text_files.py); one over the
    size limit is not read."""
    return [
        images.Upload(upload.name or "", upload.read() if upload.size <= text_files.max_bytes() else b"", upload.size)
        for upload in request.FILES.getlist("files")
    ]


@require_POST
def session_send(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id, ACT)
    uploads = _uploads(request)
    files = _text_files(request)
    form = MessageForm(request.POST, with_images=bool(uploads or files))
    if not form.is_valid():
        return _composer(request, session, form, form.errors["text"][0])
    try:
        text = form.cleaned_data["text"]
        if files:  # each file after the text, as a fenced block; then the message's own checks
            text = rules.check_message(text_files.attach(text, files), with_images=bool(uploads))
        if request.POST.get("edit") == "last":  # the composer's "Edit last message"
            actions.do_send_again(session, request.user, text)
        else:
            actions.do_send_message(session, request.user, text, uploads)
    except (actions.SessionError, text_files.TextFileRefused) as exc:
        return _composer(request, session, form, str(exc))
    return _composer(request, session, MessageForm())


#: The image view's answer for an image its message carries whose bytes are gone.
IMAGE_GONE = ("This image is no longer stored in Corral (it was deleted, or its bytes were damaged), so it cannot be "
              "shown, and the model does not see it either.")


@require_GET
def session_image(request: HttpRequest, session_id: int, sha256: str, ext: str) -> HttpResponse:
    """An image a message of the session carries, to whom may watch the session
    (docs/security.md); 404 for anyone else and for an image the session never carried.
    Served as the stored kind (never sniffed: ``nosniff``), revalidated on each view so
    access taken away is access gone."""
    ref = actions.access_image(request.user, session_id, sha256)
    if images.EXTENSIONS.get(ref["media_type"]) != ext:
        return HttpResponse("No such image", status=404, content_type="text/plain; charset=utf-8")
    etag = f'"{ref["sha256"]}"'
    if request.headers.get("If-None-Match") == etag and images.stored({ref["sha256"]}):
        response = HttpResponseNotModified()
    else:
        data = images.read(ref)
        if data is None:
            return HttpResponse(IMAGE_GONE, status=404, content_type="text/plain; charset=utf-8")
        response = HttpResponse(data, content_type=ref["media_type"])
        response["Content-Disposition"] = f'inline; filename="{ref["sha256"][:12]}.{ext}"'
    response["ETag"] = etag
    response["Cache-Control"] = "private, no-cache"
    response["X-Content-Type-Options"] = "nosniff"
    return response


def _act(request: HttpRequest, session_id: int, need: Access, action, *args, done: str = "") -> HttpResponse:
    """Run ``action`` for the control that asked; its answer (an htmx one) goes beside that
    control: the refusal, or ``done`` (what a change did, when the page shows it nowhere else)."""
    session = actions.access_session(request.user, session_id, need)
    try:
        action(session, request.user, *args)
    except actions.SessionError as exc:
        if request.htmx:
            return render(request, "sessions_app/_flash.html", {"error": str(exc)})
        flash.error(request, str(exc))
        return redirect(session)
    if request.htmx:
        return render(request, "sessions_app/_flash.html", {"error": "", "done": done})
    return redirect(session)


@require_POST
def session_choose_version(request: HttpRequest, session_id: int) -> HttpResponse:
    """Show another version of a message sent again (the "‹ 2/3 ›" of its bubble)."""
    return _act(request, session_id, ACT, actions.do_choose_version, request.POST.get("seq", ""))


@require_POST
def session_interrupt(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, ACT, actions.do_interrupt)


@require_POST
def session_regenerate(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, ACT, actions.do_send_again)


@require_POST
def session_clear(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, MANAGE, actions.do_clear)


@require_POST
def session_drop(request: HttpRequest, session_id: int, queued_id: str) -> HttpResponse:
    return _act(request, session_id, ACT, actions.do_drop_queued, queued_id)


@require_POST
def session_stop(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, MANAGE, actions.do_stop)


@require_POST
def session_answer(request: HttpRequest, session_id: int, call_id: str) -> HttpResponse:
    return _act(request, session_id, ACT, actions.do_answer, call_id, request.POST.get("answer", ""),
                request.POST.get("offer", ""))


@require_POST
def session_revoke_allowance(request: HttpRequest, session_id: int, seq: int) -> HttpResponse:
    """Revoke one allowance (docs/behaviour.md §8); every open page's list follows the event."""
    return _act(request, session_id, ACT, actions.do_revoke_allowance, str(seq))


@require_POST
def session_mode(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, MANAGE, actions.do_set_permission_mode, request.POST.get("permission_mode", ""))


@require_POST
def session_model(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, MANAGE, actions.do_change_model, request.POST.get("model_key", ""))


#: What the sharing control says by itself once a change is saved (docs/sharing.md).
SHARING_SAVED = {
    AgentSession.Visibility.PRIVATE: "Saved: only you (and staff) can see this session.",
    AgentSession.Visibility.TEAM_WATCH: "Saved: the team can watch this session.",
    AgentSession.Visibility.TEAM_ACT: "Saved: the team can watch and act in this session.",
}


@require_POST
def session_sharing(request: HttpRequest, session_id: int) -> HttpResponse:
    visibility = request.POST.get("visibility", "")
    return _act(request, session_id, MANAGE, actions.do_set_visibility, visibility,
                done=SHARING_SAVED.get(visibility, ""))


@require_POST
def session_settings(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id, MANAGE)
    form = SessionSettingsForm(request.POST, session=session)
    if not form.is_valid():
        return render(request, "sessions_app/_settings.html", {"session": session, "settings_form": form,
                                                               **_session_context(session)})
    restart = actions.do_update_settings(
        session, request.user, title=form.cleaned_data["title"], sampling=form.sampling(),
        server_params=form.server_params(), system_prompt=form.cleaned_data["system_prompt"],
    )
    session.refresh_from_db()
    context = {"session": session, "settings_form": form, "saved": True, "restart_asked": restart,
               **_session_context(session)}
    return render(request, "sessions_app/_settings.html", context)


@require_POST
def session_delete(request: HttpRequest, session_id: int) -> HttpResponse:
    session = actions.access_session(request.user, session_id, MANAGE)
    actions.do_delete(session, request.user)
    flash.success(request, f"Deleted the session “{session.display_title}”.")
    if request.htmx:
        response = HttpResponse(status=204)
        response["HX-Redirect"] = "/"
        return response
    return redirect("session_list")


@require_POST
def session_rename(request: HttpRequest, session_id: int) -> HttpResponse:
    """Rename in place (the heading's Rename); every page follows through the ``settings`` event."""
    return _act(request, session_id, MANAGE, actions.do_rename, request.POST.get("title", ""))


@require_POST
def session_restart(request: HttpRequest, session_id: int) -> HttpResponse:
    return _act(request, session_id, MANAGE, actions.do_restart)
