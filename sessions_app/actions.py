"""Writes to sessions, each followed by its push (Zulip's ``access_*`` / ``do_*`` shape).

- ``access_*`` fetches with a permission check (404 for someone else's session).
- ``record_event`` is the one way an event enters a transcript: it takes the next sequence
  number under a row lock and pushes the event after commit.
- ``do_*`` are the user's actions; they raise :class:`SessionError` with a sentence for the
  user when the action cannot be done.
"""

from __future__ import annotations

import unicodedata
import uuid

from django.db import transaction
from django.http import Http404
from django.utils import timezone

from . import broadcast, transcript
from .models import AgentSession, TranscriptEvent

Status = AgentSession.Status


class SessionError(Exception):
    """An action refused, with the reason in the user's terms."""


def access_session(user, session_id: int) -> AgentSession:
    """The session if ``user`` may see and use it (its owner, or staff); 404 otherwise, so
    another member cannot even learn that it exists."""
    qs = AgentSession.objects.select_related("machine", "owner")
    if not user.is_staff:
        qs = qs.filter(owner=user)
    try:
        return qs.get(pk=session_id)
    except AgentSession.DoesNotExist:
        raise Http404("No such session") from None


def can_access(user, session: AgentSession) -> bool:
    return bool(user.is_authenticated and user.is_active and (user.is_staff or session.owner_id == user.pk))


def _locked(session_id: int) -> AgentSession:
    return AgentSession.objects.select_for_update().get(pk=session_id)


def storable(value):
    """``value`` with every string made storable as JSON text in any database: NUL
    becomes U+FFFD and lone surrogates are replaced (PostgreSQL's jsonb refuses both, and
    a shell command's output or a model's reply can contain them)."""
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = value.encode("utf-8", "replace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def _append(session: AgentSession, kind: str, payload: dict) -> TranscriptEvent:
    """Append to a session already locked by the caller's transaction."""
    payload = storable(payload)
    session.last_seq += 1
    event = TranscriptEvent.objects.create(session_id=session.pk, seq=session.last_seq, kind=kind, payload=payload)
    AgentSession.objects.filter(pk=session.pk).update(last_seq=session.last_seq, last_activity_at=timezone.now())
    transaction.on_commit(lambda: broadcast.push_event(session.pk, event.seq, kind, payload))
    return event


def record_event(session_id: int, kind: str, payload: dict | None = None) -> TranscriptEvent:
    """Append one event to a transcript and push it to watchers after commit (SPEC §7, §12)."""
    with transaction.atomic():
        return _append(_locked(session_id), kind, payload or {})


def set_status(session_id: int, status: str, *, only_from: tuple[str, ...] | None = None) -> bool:
    """Change a session's status and record a ``status`` event; False when unchanged or
    when the current status is not in ``only_from``."""
    with transaction.atomic():
        session = _locked(session_id)
        if session.status == status or (only_from is not None and session.status not in only_from):
            return False
        AgentSession.objects.filter(pk=session_id).update(status=status)
        _append(session, "status", {"status": status})
        return True


def record_error(session_id: int, message: str) -> None:
    record_event(session_id, "error", {"message": message})


def load_events(session_id: int, *, after: int = 0) -> list[TranscriptEvent]:
    return list(TranscriptEvent.objects.filter(session_id=session_id, seq__gt=after).order_by("seq"))


def do_create_session(
    owner, *, machine, model_key: str, working_dir: str, server_params: dict, sampling: dict,
    permission_mode: str, title: str = "",
) -> AgentSession:
    """Create a session and start its llama-server in the background (SPEC §5)."""
    from .tasks import start_server

    with transaction.atomic():
        session = AgentSession.objects.create(
            owner=owner,
            machine=machine,
            model_key=model_key,
            working_dir=working_dir,
            server_params=server_params,
            sampling=sampling,
            permission_mode=permission_mode,
            title=title,
            status=Status.LOADING,
        )
        record_event(
            session.pk,
            "settings",
            {"model_key": model_key, "permission_mode": permission_mode, "sampling": sampling,
             "server_params": server_params},
        )
        transaction.on_commit(lambda: start_server.delay(session.pk))
    return session


def do_restart(session: AgentSession, user) -> None:
    """Start the session's server again: after it exited (SPEC §4: exited but
    restartable), or to apply changed server parameters. Refused mid-turn."""
    from .tasks import restart_server

    with transaction.atomic():
        locked = _locked(session.pk)
        if locked.turn_active:
            raise SessionError("Stop the turn first, then restart.")
        if locked.status == Status.LOADING:
            raise SessionError("The server is already starting.")
        AgentSession.objects.filter(pk=locked.pk).update(status=Status.LOADING)
        _append(locked, "status", {"status": Status.LOADING})
        transaction.on_commit(lambda: restart_server.delay(session.pk))


def do_change_model(session: AgentSession, user, model_key: str) -> None:
    """Move the session to another model on its machine (SPEC §10): refused mid-turn;
    otherwise stop the server and start one with the new model. The conversation goes on
    (it lives in the transcript); the prompt cache is lost."""
    from machines_app import catalog

    from .tasks import restart_server

    try:
        model = catalog.model_for_session(session.machine, model_key)
    except catalog.ModelUnavailable as exc:
        raise SessionError(str(exc)) from None
    with transaction.atomic():
        locked = _locked(session.pk)
        if locked.turn_active:
            raise SessionError("Stop the turn first, then change the model.")
        if locked.model_key == model_key and locked.status not in (Status.EXITED, Status.UNKNOWN):
            raise SessionError(f"The session already uses {model.display_name}.")
        AgentSession.objects.filter(pk=locked.pk).update(model_key=model_key, status=Status.LOADING)
        _append(locked, "status", {"status": Status.LOADING})
        _append(locked, "settings", {"model_key": model_key, "model": model.display_name, "by": user.get_username()})
        transaction.on_commit(lambda: restart_server.delay(session.pk))


def do_update_settings(session: AgentSession, user, *, title: str, sampling: dict, server_params: dict) -> bool:
    """Rename the session and change its parameters. Sampling takes effect on the next
    request; server parameters need a restart (returns True when they changed)."""
    with transaction.atomic():
        locked = _locked(session.pk)
        changes: dict = {}
        if title != locked.title:
            changes["title"] = title
        if sampling != locked.sampling:
            changes["sampling"] = sampling
        if server_params != locked.server_params:
            changes["server_params"] = server_params
        if not changes:
            return False
        AgentSession.objects.filter(pk=locked.pk).update(**changes)
        _append(locked, "settings", {**changes, "by": user.get_username()})
        return "server_params" in changes


def do_delete(session: AgentSession, user) -> None:
    """Delete a session and its transcript, stopping its server first (no process is
    left behind)."""
    from . import lifecycle

    with transaction.atomic():
        locked = _locked(session.pk)
        AgentSession.objects.filter(pk=locked.pk).update(interrupt_requested=True)
    lifecycle._stop_process(session.pk)
    AgentSession.objects.filter(pk=session.pk).delete()


def do_stop(session: AgentSession, user) -> None:
    """Stop the session's server; an open turn ends (the queue waits for a restart)."""
    from .tasks import stop_server

    if session.turn_active:
        with transaction.atomic():
            locked = _locked(session.pk)
            AgentSession.objects.filter(pk=locked.pk).update(interrupt_requested=True)
    stop_server.delay(session.pk)


# --- the turn flag and the queue change together (SPEC §10) ---------------------------


def _enqueue_turn(session_id: int) -> None:
    from .tasks import run_turn

    transaction.on_commit(lambda: run_turn.delay(session_id))


#: The longest message a person may send, in characters (after surrounding spaces are cut).
MAX_MESSAGE_CHARS = 200_000

# Tab, newline and carriage return are text; every other control character (C0, DEL,
# C1) is not something a person types, and PostgreSQL's jsonb cannot store NUL at all.
_TEXT_CONTROLS = {"\t", "\n", "\r"}


def check_message(text: str) -> str:
    """The message as it will be sent: ``text`` without surrounding white space.

    Raises SessionError with one sentence per reason: nothing typed, longer than
    MAX_MESSAGE_CHARS characters, a control character (NUL and the like; tab and new
    lines are fine), or a slash command (not supported for llama.cpp sessions).
    """
    text = text.strip()
    if not text:
        raise SessionError("Type a message first.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise SessionError(
            f"This message is {len(text):,} characters long; a message can be at most {MAX_MESSAGE_CHARS:,}."
        )
    for index, char in enumerate(text):
        if unicodedata.category(char) == "Cc" and char not in _TEXT_CONTROLS:
            raise SessionError(
                f"This message contains a control character (U+{ord(char):04X} at character {index + 1:,}), "
                "which cannot be sent; remove it and send again."
            )
    if text.startswith("/"):
        command = text.split()[0]
        raise SessionError(f"{command}: compact and slash commands are not supported for llama.cpp sessions.")
    return text


def do_send_message(session: AgentSession, user, text: str) -> None:
    """Take a user's message: start a turn with it, or queue it behind the running one.

    Raises SessionError for a message check_message refuses or a session whose server is
    gone (SPEC §4 ``exited``). A message sent while the model is ``loading`` is accepted
    and waits (SPEC §4).
    """
    text = check_message(text)
    with transaction.atomic():
        locked = _locked(session.pk)
        if locked.status == Status.EXITED:
            raise SessionError("This session's llama-server is not running. Restart the session to send messages.")
        if locked.turn_active:
            _append(locked, "message_queued", {"id": uuid.uuid4().hex, "text": text, "author": user.get_username()})
            return
        _append(locked, "message_taken", {"text": text, "queued_id": None, "author": user.get_username()})
        AgentSession.objects.filter(pk=locked.pk).update(turn_active=True, interrupt_requested=False)
        _enqueue_turn(locked.pk)


def do_drop_queued(session: AgentSession, user, queued_id: str) -> None:
    """Withdraw a queued message before a turn takes it (SPEC §10)."""
    with transaction.atomic():
        locked = _locked(session.pk)
        pending = transcript.pending_queue(load_events(locked.pk))
        if not any(item["id"] == queued_id for item in pending):
            raise SessionError("That message has already been taken or withdrawn.")
        _append(locked, "message_dropped", {"id": queued_id, "by": user.get_username()})


def _close_questions(locked: AgentSession, events, reason: str) -> None:
    """Close every open question as a refusal (SPEC §8: no card stays open anywhere)."""
    for question in transcript.open_questions(events):
        _append(
            locked,
            "answered",
            {"id": question["id"], "tool": question.get("tool"), "answer": transcript.ANSWER_REFUSE,
             "by": "", "reason": reason},
        )


def _take_next(locked: AgentSession, events) -> bool:
    """Start a turn with the oldest queued message, in the caller's transaction; False
    when the queue is empty. The lease is handed back here too, so the step enqueued for
    the message can claim it even before the finishing step has let go."""
    pending = transcript.pending_queue(events)
    if not pending:
        return False
    item = pending[0]
    _append(locked, "message_taken", {"text": item["text"], "queued_id": item["id"], "author": item["author"]})
    AgentSession.objects.filter(pk=locked.pk).update(
        turn_active=True, interrupt_requested=False, lease_owner="", lease_expires=None
    )
    _enqueue_turn(locked.pk)
    return True


def finish_turn(session_id: int, reason: str) -> None:
    """End the running turn and, in the same transaction, take the next queued message
    (SPEC §6.8, §10): a message is never stranded with nothing running. Open questions
    are closed as refusals."""
    with transaction.atomic():
        locked = _locked(session_id)
        events = load_events(session_id)
        _close_questions(locked, events, reason)
        if transcript.open_turn(events):
            _append(locked, "turn_end", {"reason": reason})
        if locked.status == Status.EXITED or not _take_next(locked, events):
            AgentSession.objects.filter(pk=session_id).update(turn_active=False, interrupt_requested=False)
            if locked.status in (Status.RUNNING, Status.AWAITING_INPUT):
                AgentSession.objects.filter(pk=session_id).update(status=Status.IDLE)
                _append(locked, "status", {"status": Status.IDLE})


def resume_queue(session_id: int) -> None:
    """Take the next queued message when no turn runs (after a restart: messages queued
    while the server was stopped wait for it, SPEC §10)."""
    with transaction.atomic():
        locked = _locked(session_id)
        if locked.turn_active or locked.status in (Status.EXITED, Status.LOADING):
            return
        _take_next(locked, load_events(session_id))


def do_interrupt(session: AgentSession, user) -> None:
    """Stop the running turn (SPEC §6): a streaming step sees the flag within a fraction
    of a second; a turn that no step holds (waiting for a person or for the model to
    load) ends here, its open questions closed as refusals."""
    with transaction.atomic():
        locked = _locked(session.pk)
        if not locked.turn_active:
            raise SessionError("Nothing is running.")
        AgentSession.objects.filter(pk=locked.pk).update(interrupt_requested=True)
        _append(locked, "interrupted", {"by": user.get_username()})
        held = bool(locked.lease_owner) and locked.lease_expires is not None and locked.lease_expires > timezone.now()
    if not held:
        finish_turn(session.pk, "interrupted")


# --- the permission gate (SPEC §8) ---------------------------------------------------------


def ask_question(session_id: int, call_id: str, tool: str) -> None:
    """Record a question about one call and show the session as awaiting input."""
    with transaction.atomic():
        locked = _locked(session_id)
        _append(locked, "question", {"id": call_id, "tool": tool})
        if locked.status != Status.AWAITING_INPUT:
            AgentSession.objects.filter(pk=session_id).update(status=Status.AWAITING_INPUT)
            _append(locked, "status", {"status": Status.AWAITING_INPUT})


ANSWERS = (transcript.ANSWER_ALLOW_ONCE, transcript.ANSWER_ALLOW_ALWAYS, transcript.ANSWER_REFUSE)


def do_answer(session: AgentSession, user, call_id: str, answer: str) -> None:
    """Answer an open question; the first valid answer wins and the turn goes on in a
    new step (no worker waited for it, SPEC §8)."""
    if answer not in ANSWERS:
        raise SessionError("Choose Allow once, Always allow or Refuse.")
    with transaction.atomic():
        locked = _locked(session.pk)
        question = next((q for q in transcript.open_questions(load_events(locked.pk)) if q["id"] == call_id), None)
        if question is None:
            raise SessionError("That question has already been answered.")
        _append(locked, "answered", {"id": call_id, "tool": question.get("tool"), "answer": answer,
                                     "by": user.get_username()})
        if locked.status == Status.AWAITING_INPUT:
            AgentSession.objects.filter(pk=locked.pk).update(status=Status.RUNNING)
            _append(locked, "status", {"status": Status.RUNNING})
        _enqueue_turn(locked.pk)


def do_set_permission_mode(session: AgentSession, user, mode: str) -> None:
    """Switch between asking and not asking; takes effect for the next call (SPEC §8)."""
    if mode not in AgentSession.PermissionMode.values:
        raise SessionError("Unknown permission mode.")
    with transaction.atomic():
        locked = _locked(session.pk)
        if locked.permission_mode == mode:
            return
        AgentSession.objects.filter(pk=locked.pk).update(permission_mode=mode)
        _append(locked, "settings", {"permission_mode": mode, "by": user.get_username()})


def do_clear(session: AgentSession, user) -> None:
    """Record a ``cleared`` marker; the conversation folds from after it (SPEC §10)."""
    with transaction.atomic():
        locked = _locked(session.pk)
        if locked.turn_active:
            raise SessionError("Stop the turn first, then clear.")
        _append(locked, "cleared", {"by": user.get_username()})
