"""Writes to sessions, each followed by its push (Zulip's ``access_*`` / ``do_*`` shape).

- ``access_*`` fetches with a permission check (404 for a session the user may not see,
  403 for one they may see but not act on: docs/sharing.md).
- events enter a transcript only through :mod:`sessions_app.events` (``record_event``,
  ``append``), and the turn's rules live in :mod:`sessions_app.turns`.
- ``do_*`` are the user's actions; they raise :class:`SessionError` with a sentence for the
  user when the action cannot be done, and record who did them (``"by"``, see :func:`by`).
"""

from __future__ import annotations

import re

from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, transaction
from django.http import Http404

from machines_app import catalog
from machines_app.access import machine_refusal
from machines_app.transports import reader_for
from usage_app import quota

from . import dispatch, images, room, transcript, turns
from .events import append, change_status, load_events, load_kinds, load_queue_events, locked, record_event
from .models import Access, AgentSession, TranscriptEvent
from .rules import SessionError, check_message, check_title
from .server_state import start_live
from .servers.models import ServerRecord
from .transcript import Kind, TurnEnd

Status = AgentSession.Status


#: What a message to a session without a server is told (docs/behaviour.md §4).
SERVER_DOWN_SENTENCE = "llama-server is not running in this session: restart it to send messages."


class NotAllowed(PermissionDenied):
    """The user may see the session but not do this; the message says why, in their terms."""


#: The largest id a database stores (a signed 64-bit integer); a bigger one in a URL
#: would make SQLite raise instead of finding nothing.
MAX_ID = 2**63 - 1


def find_session(session_id: int) -> AgentSession | None:
    """The chat session with this id (machine and owner loaded), or None, whatever the
    number. The API's hidden sessions (purpose ``api``, docs/api.md) are never one: no page,
    socket or action opens them, for staff neither (the machines page stops their servers)."""
    if not 0 < session_id <= MAX_ID:
        return None
    return (AgentSession.objects.select_related("machine", "owner")
            .filter(pk=session_id, purpose=AgentSession.Purpose.CHAT).first())


def access_session(user, session_id: int, need: Access = Access.WATCH) -> AgentSession:
    """The session if ``user`` may do what ``need`` names (``AgentSession.access_for``
    decides). 404 when they may not see it at all, so a member cannot even learn that a
    private session exists; :class:`NotAllowed` (a 403) when they may see it but not do
    this — also when the sharing would allow it but ``user`` may no longer use the
    session's machine (its groups, or disabled)."""
    session = find_session(session_id)
    have = session.access_for(user) if session is not None else Access.NONE
    if have == Access.NONE:
        raise Http404("No such session")
    if have < need:
        if session.shared_access(user) >= need:
            # Held to watching by the machine (docs/access.md): say which rule, and who can help.
            raise NotAllowed(f"You can watch this session but no longer act in it: "
                             f"{machine_refusal(user, session.machine)}")
        owner = session.owner.get_username()
        if need == Access.ACT:
            raise NotAllowed(f"{owner} shares this session to watch only: you cannot send, answer or interrupt here.")
        raise NotAllowed(f"Only {owner}, who owns this session, or staff can do that.")
    return session


def by(user) -> transcript.Actor:
    """Who did a user action, as recorded in its event's ``"by"`` (read back with
    :func:`transcript.actor`)."""
    return {"id": user.pk, "username": user.get_username()}


def do_create_session(
    owner, *, machine, model_key: str, working_dir: str, server_params: dict, sampling: dict,
    permission_mode: str, title: str = "", system_prompt: str = "",
) -> AgentSession:
    """Create a session and start its llama-server in the background (docs/behaviour.md §5).

    ``working_dir`` is the real path :func:`machines_app.workspaces.check_working_dir`
    answered for ``owner`` (the new-session form calls it). Raises SessionError when the
    machine is not open to ``owner`` or the mode needs a permission they lack.
    """
    refusal = machine_refusal(owner, machine)
    if refusal:
        raise SessionError(refusal)
    check_permission_mode(session_owner=owner, user=owner, mode=permission_mode)
    title = check_title(title)
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
            system_prompt=system_prompt,
            status=Status.LOADING,
        )
        model = machine.model_files.filter(key=model_key).values_list("display_name", flat=True).first()
        record_event(
            session.pk,
            Kind.SETTINGS,
            {"model_key": model_key, **({"model": model} if model else {}), "permission_mode": permission_mode,
             "server_params": server_params, "sampling": sampling,
             **({"system_prompt": system_prompt} if system_prompt else {}),
             "by": by(owner)},
        )
        dispatch.enqueue_on_commit(dispatch.START_SERVER, session.pk)
    return session


def do_restart(session: AgentSession, user) -> None:
    """Start the session's server again: after it exited (docs/behaviour.md §4: exited but
    restartable), or to apply changed server parameters. Refused mid-turn, and while a
    start is under way — but a ``loading`` session whose start was lost (no live start
    claim: ``server_state.start_live``) may be restarted."""
    refusal = machine_refusal(user, session.machine)
    if refusal:
        raise SessionError(refusal)
    with transaction.atomic():
        current = locked(session.pk)
        if current.turn_active:
            raise SessionError("Stop the turn first, then restart.")
        if current.status == Status.LOADING and start_live(current):
            raise SessionError("The server is already starting.")
        if current.status not in (Status.LOADING, Status.SLEEPING) and stop_under_way(current):
            # Its status and note change when the stop has finished: a restart now would be
            # said before the stop it follows.
            raise SessionError("The server is still stopping; restart it once it shows stopped.")
        change_status(current, Status.LOADING, by=by(user))
        dispatch.enqueue_on_commit(dispatch.RESTART_SERVER, session.pk)


def stop_under_way(session: AgentSession) -> bool:
    """Whether a stop of the session's server is under way (its record claimed ``stopping``)."""
    return ServerRecord.objects.filter(session_id=session.pk, stopping=True).exists()


def do_change_model(session: AgentSession, user, model_key: str) -> None:
    """Move the session to another model on its machine (docs/behaviour.md §10): refused mid-turn;
    otherwise stop the server and start one with the new model. The conversation goes on
    (it lives in the transcript); the old model's prompt cache is saved with its slot and
    restored if the session switches back (docs/behaviour.md §5 warm prompts)."""
    refusal = machine_refusal(user, session.machine)
    if refusal:
        raise SessionError(refusal)
    try:
        model = catalog.model_for_session(session.machine, model_key, reader_for)
    except catalog.ModelUnavailable as exc:
        raise SessionError(str(exc)) from None
    if refusal := catalog.context_refusal(model, session.server_params.get("contextSize")):
        raise SessionError(f"{refusal[:-1]} in Settings before switching to it.")
    if refusal := room.never_fits(session.machine, model_key, session.server_params):
        raise SessionError(refusal)  # docs/behaviour.md §5 "Room on a machine"
    with transaction.atomic():
        current = locked(session.pk)
        if current.turn_active:
            raise SessionError("Stop the turn first, then change the model.")
        if current.model_key == model_key and current.status not in (*Status.server_down(), Status.UNKNOWN, Status.SLEEPING):
            raise SessionError(f"The session already uses {model.display_name}.")
        AgentSession.objects.filter(pk=current.pk).update(model_key=model_key)
        change_status(current, Status.LOADING)
        # takes_images: whether the composer offers attachments now (docs/behaviour.md §16).
        append(current, Kind.SETTINGS, {"model_key": model_key, "model": model.display_name,
                                        "takes_images": bool(model.mmproj_path), "by": by(user)})
        dispatch.enqueue_on_commit(dispatch.RESTART_SERVER, session.pk)


def do_update_settings(
    session: AgentSession, user, *, title: str, sampling: dict, server_params: dict, system_prompt: str | None = None
) -> bool:
    """Rename the session and change its parameters. Sampling and the system prompt take
    effect on the next request (docs/behaviour.md §17; None leaves the prompt as it is);
    server parameters need a restart (returns True when they changed). Raises SessionError
    for a title :func:`check_title` refuses."""
    title = check_title(title)
    with transaction.atomic():
        current = locked(session.pk)
        changes: dict = {}
        if title != current.title:
            changes["title"] = title
        if system_prompt is not None and system_prompt != current.system_prompt:
            changes["system_prompt"] = system_prompt
        if sampling != current.sampling:
            changes["sampling"] = sampling
        if server_params != current.server_params:
            changes["server_params"] = server_params
        if not changes:
            return False
        AgentSession.objects.filter(pk=current.pk).update(**changes)
        append(current, Kind.SETTINGS, {**changes, "by": by(user)})
        return "server_params" in changes


def do_delete(session: AgentSession, user) -> None:
    """Delete a session and its transcript; its server is stopped by a task (SIGTERM,
    grace, SIGKILL take seconds a web request should not wait), handed over by the
    ``pre_delete`` receiver that every delete of a session goes through
    (:func:`sessions_app.servers.stop.stop_when_deleted`)."""
    with transaction.atomic():
        current = locked(session.pk)
        AgentSession.objects.filter(pk=current.pk).delete()


def do_stop(session: AgentSession, user) -> None:
    """Stop the session's server; an open turn ends (the queue waits for a restart)."""
    if session.turn_active:
        with transaction.atomic():
            current = locked(session.pk)
            AgentSession.objects.filter(pk=current.pk).update(interrupt_requested=True)
    dispatch.enqueue(dispatch.STOP_SERVER, session.pk, by(user))


# --- messages, interrupt and questions: the turn's rules live in sessions_app/turns.py ---------



def check_images(session: AgentSession, uploads: list[images.Upload]) -> list[transcript.ImageRef]:
    """The references of the images a message carries, checked (docs/behaviour.md §16).

    Raises SessionError when the session's model has no vision projector ("<model name>
    cannot take images"), when there are more than ``CORRAL_IMAGE_MAX_COUNT``, or with
    :func:`images.check_image`'s sentence for a file that is not an image Corral takes.
    """
    if not uploads:
        return []
    name, takes_images = catalog.vision(session.machine, session.model_key)
    if not takes_images:
        raise SessionError(f"{name} cannot take images.")
    if len(uploads) > images.max_count():
        raise SessionError(f"A message can carry at most {images.max_count()} images; this one has {len(uploads)}.")
    try:
        return [images.check_image(upload) for upload in uploads]
    except images.ImageRefused as exc:
        raise SessionError(str(exc)) from None


def do_send_message(session: AgentSession, user, text: str, uploads: list[images.Upload] | None = None) -> None:
    """Take a user's message, with the images attached to it: start a turn with it, or
    queue it behind the running one.

    Raises SessionError for a member whose daily token quota is spent (before anything is
    stored: docs/usage.md), a message check_message refuses, images check_images refuses,
    or a session whose server is gone (docs/behaviour.md §4 ``exited``, ``stopped``). A
    message sent while the model is ``loading`` is accepted and waits (docs/behaviour.md §4);
    one sent to a ``sleeping`` session starts its server again and waits for it
    (docs/behaviour.md §5 "sleep"), in the same transaction that takes it, so an idle stop
    under way is waited for by the start, never raced. Images are stored before the message
    is recorded, in its transaction, so a recorded message never names a missing image.
    """
    refuse_spent_quota(user)
    uploads = uploads or []
    text = check_message(text, with_images=bool(uploads))
    refs = check_images(session, uploads)
    with transaction.atomic():
        session = locked(session.pk)
        _wake(session, user)
        try:
            # In the transaction that records the message: its images cannot be deleted as
            # unreferenced in between (images.forget_unreferenced).
            with transaction.atomic():
                for upload, ref in zip(uploads, refs, strict=True):
                    images.store(upload, ref)
        except DatabaseError as exc:
            raise SessionError(f"The image could not be stored in the database ({exc}).") from None
        turns.take_message(session, text, by(user), refs)


def refuse_spent_quota(user) -> None:
    """Raise SessionError with usage_app's sentence when ``user`` has spent today's token
    quota (docs/usage.md, "Quotas"). Every way a person sends a message checks it first: a
    new one, Regenerate, an edit."""
    if refusal := quota.refusal(user):
        raise SessionError(refusal)


def _wake(session: AgentSession, user) -> None:
    """Before a message is taken on ``session`` (locked by the caller): refuse when its
    server is gone (``exited``, ``stopped``); start a ``sleeping`` one again, so the turn
    waits for it as for ``loading`` (docs/behaviour.md §5 "sleep", C45). Every way a
    message is sent — a new one, Regenerate, an edit — comes through here."""
    if session.status in Status.server_down():
        raise SessionError(SERVER_DOWN_SENTENCE)
    if session.status == Status.SLEEPING:
        # Waking starts a server on the machine: only for someone who may still use it.
        if refusal := machine_refusal(user, session.machine):
            raise SessionError(refusal)
        change_status(session, Status.LOADING, by=by(user), reason="wake")
        dispatch.enqueue_on_commit(dispatch.START_SERVER, session.pk)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def access_image(user, session_id: int, sha256: str) -> transcript.ImageRef:
    """An image a message of the session carries, if ``user`` may watch the session
    (docs/security.md): a hash alone opens nothing, so a member who knows the hash of an
    image seen elsewhere cannot read it through a session that never carried it. 404
    otherwise, as for the session itself."""
    session = access_session(user, session_id)
    if not _SHA256.fullmatch(sha256):
        raise Http404("No such image")
    # Sent messages, and queued ones still waiting (their bubble shows the image); a
    # withdrawn message's image is no longer the session's to show.
    taken = TranscriptEvent.objects.filter(
        session=session, kind=Kind.MESSAGE_TAKEN, payload__icontains=sha256
    ).values_list("payload", flat=True)
    pending = transcript.pending_queue(load_queue_events(session.pk, upto=session.last_seq))
    for payload in [*taken, *pending]:
        for ref in transcript.image_refs(payload):
            if ref["sha256"] == sha256:
                return ref
    raise Http404("No such image")


def do_send_again(session: AgentSession, user, text: str | None = None) -> None:
    """Send the last user message again in its own place: regenerate the reply (``text``
    None: the same words) or edit it (``text``: the new words, checked as any message).
    Both are new transcript events (docs/transcript.md): the first reply stays in the
    history; the model no longer sees it.

    Raises SessionError for a spent daily token quota, while a turn runs, when the server is
    not running, or when there is no message yet or since the conversation was cleared. A ``sleeping`` server is started again
    first, as for a new message (docs/behaviour.md §5 "sleep").
    """
    refuse_spent_quota(user)
    if text is not None:
        text = check_message(text, with_images=True)  # empty only for a message with images (below)
    with transaction.atomic():
        session = locked(session.pk)
        if session.server_down:
            raise SessionError(SERVER_DOWN_SENTENCE)
        if session.turn_active:
            raise SessionError("Wait for the reply to finish (or stop it), then send again.")
        events = load_events(session.pk)
        last = transcript.last_message(events)
        if last is None:
            if any(event.kind == Kind.CLEARED for event in events):
                raise SessionError("There is no message to send again since the conversation was cleared.")
            raise SessionError("There is no message to send again yet.")  # a new session: no Clear to blame
        if text == "" and not last.get("images"):
            raise SessionError("Type a message first.")
        _wake(session, user)  # a sleeping server wakes for it as for a new message (C45)
        turns.take_again(session, last["text"] if text is None else text, by(user), replaces=last["seq"],
                         images=last.get("images"),
                         edited=text is not None)


def do_choose_version(session: AgentSession, user, seq: str) -> None:
    """Make an earlier (or later) version of a message sent again the one in force: a
    ``version_chosen`` event (docs/transcript.md, "Versions"); the page shows that version
    and its reply, and the model's next request continues from them.

    Raises SessionError while a turn runs, or when ``seq`` is not a version of a message
    since the conversation was last cleared. Choosing the version in force changes nothing.
    """
    if not str(seq).isdigit() or int(seq) >= 2**63:
        raise SessionError("That version is not in this conversation.")
    seq = int(seq)
    with transaction.atomic():
        session = locked(session.pk)
        if session.turn_active:
            raise SessionError("Wait for the reply to finish (or stop it), then choose a version.")
        versions = transcript.Versions()
        for event in load_kinds(session.pk, [Kind.MESSAGE_TAKEN, Kind.VERSION_CHOSEN, Kind.CLEARED],
                                upto=session.last_seq):
            versions.feed(event)
        if seq not in versions.live or len(versions.group(seq)) < 2:
            raise SessionError("That version is not in this conversation any more (it was cleared).")
        if versions.chosen[versions.root_of[seq]] == seq:
            return
        append(session, Kind.VERSION_CHOSEN, {"seq": seq, "by": by(user)})


def do_drop_queued(session: AgentSession, user, queued_id: str) -> None:
    """Withdraw a queued message before a turn takes it (docs/behaviour.md §10). A member the team
    may act for withdraws only their own messages; the owner and staff any."""
    with transaction.atomic():
        session = locked(session.pk)
        pending = transcript.pending_queue(load_events(session.pk))
        item = next((item for item in pending if item.get("id") == queued_id), None)
        if item is None:
            raise SessionError("That message has already been taken or withdrawn.")
        author = transcript.actor(item)
        if not session.access_for(user).may_withdraw(user.pk, author["id"] if author else None):
            raise SessionError("Only its author or the session's owner can withdraw that message.")
        append(session, Kind.MESSAGE_DROPPED, {"id": queued_id, "by": by(user)})


def do_interrupt(session: AgentSession, user) -> None:
    """Stop the running turn (docs/behaviour.md §6): a streaming step sees the flag within a fraction
    of a second; a turn that no step holds (waiting for a person or for the model to
    load) ends here, its open questions closed as refusals."""
    with transaction.atomic():
        if not turns.interrupt(locked(session.pk), by(user)):
            raise SessionError("Nothing is running.")
    turns.finish_if_unheld(session.pk, TurnEnd.INTERRUPTED)


ANSWERS = (transcript.ANSWER_ALLOW_ONCE, transcript.ANSWER_ALLOW_ALWAYS, transcript.ANSWER_REFUSE)


def may_grant_always(session: AgentSession, user) -> bool:
    """Whether ``user`` may answer "always" in ``session`` (docs/behaviour.md §8): its
    owner, staff, or anyone who may turn the gate off (:func:`may_bypass`). An allowance
    is the gate opened for part of what a tool can do, so a member the session is shared
    with to act may otherwise only allow once or refuse."""
    return bool(user.is_authenticated and user.is_active
                and (user.pk == session.owner_id or user.is_staff or may_bypass(user)))


def do_answer(session: AgentSession, user, call_id: str, answer: str, offer: str = "") -> None:
    """Answer an open question; the first valid answer wins and the turn goes on in a
    new step (no worker waited for it, docs/behaviour.md §8).

    ``allow_always`` needs ``offer``: the index (``"0"``, ``"1"``, …) of one of the scopes
    the question offers (its payload's ``offers``); that scope is recorded with the answer.
    Raises SessionError for an unknown answer, a question already answered, an "always"
    the user may not grant (:func:`may_grant_always`) or that the question did not offer."""
    if answer not in ANSWERS:
        raise SessionError("Choose Allow once, Always allow or Refuse.")
    if answer == transcript.ANSWER_ALLOW_ALWAYS and not may_grant_always(session, user):
        raise SessionError(
            f"Only {session.owner.get_username()}, who owns this session, staff, or someone who may run tools "
            "without asking can allow a tool always; you can allow this call once or refuse it."
        )
    with transaction.atomic():
        session = locked(session.pk)
        question = next((q for q in transcript.open_questions(load_events(session.pk)) if q["id"] == call_id), None)
        if question is None:
            raise SessionError("That question has already been answered.")
        extra: dict = {}
        if answer == transcript.ANSWER_ALLOW_ALWAYS:
            offers = question.get("offers") if isinstance(question.get("offers"), list) else []
            index = int(offer) if offer.isascii() and offer.isdigit() and len(offer) < 4 else -1
            if not 0 <= index < len(offers) or not isinstance(offers[index], dict):
                raise SessionError("This call can be allowed once or refused, not always in that way.")
            extra["scope"] = offers[index].get("scope")
        append(session, Kind.ANSWERED, {"id": call_id, "tool": question.get("tool"), "answer": answer,
                                     **extra, "by": by(user)})
        turns.go_on_after_answer(session)


def do_revoke_allowance(session: AgentSession, user, seq: str) -> None:
    """Take back the allowance granted by the ``answered`` event ``seq`` (docs/behaviour.md
    §8): recorded as ``allowance_revoked``; the next call it would have covered is asked
    about. Anyone who may act may revoke (asking again never needs a permission). Raises
    SessionError when no allowance in force was granted by that event."""
    number = int(seq) if seq.isascii() and seq.isdigit() and len(seq) < 19 else -1
    with transaction.atomic():
        current = locked(session.pk)
        in_force = transcript.allowances(
            load_kinds(current.pk, [Kind.ANSWERED, Kind.ALLOWANCE_REVOKED, Kind.IMPORTED], upto=current.last_seq))
        allowance = next((allowance for allowance in in_force if allowance["seq"] == number), None)
        if allowance is None:
            raise SessionError("That allowance is no longer in force.")
        append(current, Kind.ALLOWANCE_REVOKED, {"seq": number, "tool": allowance["tool"], "scope": allowance["scope"],
                                                 "by": by(user)})


def may_bypass(user) -> bool:
    """Whether ``user`` may turn the permission gate off: staff, or anyone an admin granted
    ``sessions_app.bypass_permissions`` (directly or through a group). docs/access.md."""
    return bool(
        user.is_authenticated and user.is_active and (user.is_staff or user.has_perm("sessions_app.bypass_permissions"))
    )


def check_permission_mode(*, session_owner, user, mode: str) -> None:
    """Whether ``user`` may put a session of ``session_owner`` in ``mode``.

    Turning the gate on (``manual``) is always allowed. ``bypassPermissions`` needs the
    permission twice: from the person asking, and from the owner, whose session it is
    (the gate stays off only while the owner holds it: :func:`gate_mode`). Raises
    SessionError saying which is missing.
    """
    if mode not in AgentSession.PermissionMode.values:
        raise SessionError("Unknown permission mode.")
    if mode != AgentSession.PermissionMode.BYPASS:
        return
    if not may_bypass(user):
        raise SessionError(
            "You may not turn the permission gate off (run tools without asking); an admin can grant you that "
            "permission."
        )
    if not may_bypass(session_owner):
        raise SessionError(
            f"{session_owner.get_username()}, who owns this session, may not run tools without asking, so it keeps "
            "asking; an admin can grant them that permission."
        )


def do_set_permission_mode(session: AgentSession, user, mode: str) -> None:
    """Switch between asking and not asking; takes effect for the next call (docs/behaviour.md §8).

    Raises SessionError for an unknown mode or a bypass the user or owner may not have.
    """
    check_permission_mode(session_owner=session.owner, user=user, mode=mode)
    _change_setting(session, user, "permission_mode", mode)


def _change_setting(session: AgentSession, user, field: str, value: str) -> None:
    """Set one column of the session and record it as a ``settings`` event naming ``user``;
    nothing when it already has that value."""
    with transaction.atomic():
        current = locked(session.pk)
        if getattr(current, field) == value:
            return
        AgentSession.objects.filter(pk=current.pk).update(**{field: value})
        append(current, Kind.SETTINGS, {field: value, "by": by(user)})


GATE_BACK_ON_REASON = "{owner} may no longer run tools without asking, so the permission gate is back on."


def gate_mode(session_id: int) -> str:
    """The permission mode the gate applies to the session's next call.

    A session in ``bypassPermissions`` whose owner no longer may bypass (the permission
    was taken away, or they left staff) goes back to ``manual`` here, recorded as a
    ``settings`` event so every page shows it; the gate then asks as usual.
    """
    session = AgentSession.objects.select_related("owner").get(pk=session_id)
    if session.permission_mode != AgentSession.PermissionMode.BYPASS or may_bypass(session.owner):
        return session.permission_mode
    manual = AgentSession.PermissionMode.MANUAL
    with transaction.atomic():
        current = locked(session_id)
        if current.permission_mode == AgentSession.PermissionMode.BYPASS:
            AgentSession.objects.filter(pk=current.pk).update(permission_mode=manual)
            reason = GATE_BACK_ON_REASON.format(owner=session.owner.get_username())
            append(current, Kind.SETTINGS, {"permission_mode": manual, "reason": reason})
    return manual


def do_clear(session: AgentSession, user) -> None:
    """Record a ``cleared`` marker; the conversation folds from after it (docs/behaviour.md §10)."""
    with transaction.atomic():
        current = locked(session.pk)
        if current.turn_active:
            raise SessionError("Stop the turn first, then clear.")
        append(current, Kind.CLEARED, {"by": by(user)})


def do_rename(session: AgentSession, user, title: str) -> None:
    """Give the session a new title (empty: back to "Session <id>"), recorded as a
    ``settings`` event so every open page updates its heading and tab title at once.
    Raises SessionError for a title :func:`check_title` refuses."""
    _change_setting(session, user, "title", check_title(title))


def do_set_visibility(session: AgentSession, user, visibility: str) -> None:
    """Share the session with the team (to watch or to act) or make it private again
    (docs/sharing.md). Recorded as a ``settings`` event; every open page re-checks what
    its user may do when it sees one (a watcher of a now private session is cut off)."""
    if visibility not in AgentSession.Visibility.values:
        raise SessionError("Choose private, the team may watch, or the team may act.")
    _change_setting(session, user, "visibility", visibility)
