"""Warm prompts: a session's llama-server slot saved before a stop and restored into the next
server of the same model and parameters (docs/behaviour.md §5, C43, C44), and saved
slots removed with their session or after ``CORRAL_SLOT_KEEP_HOURS`` asleep.
"""

from __future__ import annotations

import logging
import posixpath
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from machines_app import catalog
from machines_app.llama_server import (
    ServerProps,
    SlotError,
    restore_slot,
    save_slot,
    slot_dir,
    slot_file_name,
    slot_fingerprint,
)
from machines_app.models import ModelFile, reached_by
from machines_app.transports import Transport, TransportError, transport_at, transport_for

from ..events import append, locked
from ..models import AgentSession
from ..transcript import Kind
from .models import ServerRecord, SlotSave
from .records import endpoint_of

Status = AgentSession.Status
log = logging.getLogger(__name__)


RESTORE_FAILED = (
    "The saved prompt cache could not be restored ({reason}); it was deleted and llama-server was started "
    "again without it. The conversation is unchanged; its first prompt is read in full."
)


class RestoreRefused(Exception):
    """llama-server did not restore a saved slot: ``saved`` is the SlotSave, ``reason`` its words."""

    def __init__(self, saved: SlotSave, reason: str) -> None:
        super().__init__(reason)
        self.saved, self.reason = saved, reason


def slot_path(transport: Transport, session_id: int, save_id: int) -> str:
    return posixpath.join(slot_dir(transport.private_dir(), session_id), slot_file_name(session_id, save_id))


def forget_slot(saved: SlotSave, transport: Transport) -> None:
    """Delete a saved slot: its file (a link there is removed, not followed) and its row."""
    try:
        transport.remove(slot_path(transport, saved.session_id, saved.pk))
    except TransportError:
        pass
    SlotSave.objects.filter(pk=saved.pk).delete()


def _fingerprint(session: AgentSession, record: ServerRecord, props: ServerProps | None) -> str:
    """The ready server's slot key (llama_server.slot_fingerprint) from its ``GET /props``
    (``props``, None when it did not answer), '' when it cannot be made."""
    if props is None:
        return ""  # the transcript already says the server did not answer /props
    try:
        model = catalog.model_for_session(session.machine, record.model_key)
    except catalog.ModelUnavailable as exc:
        log.warning("session %s: no slot key for pid %s: %s", session.pk, record.pid, exc)
        return ""
    size = ModelFile.objects.filter(machine=session.machine, key=record.model_key).values_list("file_size", flat=True)
    # '' for a server that does not report n_ctx and its build (slot_fingerprint).
    return slot_fingerprint(
        binary=session.machine.llama_server_path,
        model_path=model.path, model_size=size.first() or 0, params=record.server_params, props=props,
        mmproj_path=model.mmproj_path,
    )


def restore_saved(
    session: AgentSession, transport: Transport, record: ServerRecord, props: ServerProps | None
) -> int | None:
    """Restore the session's saved slot of this model into the ready server (``props``:
    its ``GET /props``, None when it did not answer); the tokens restored, or None when
    there is nothing (fit) to restore. A saved slot whose
    fingerprint differs (another build, context size, parameters, a changed file) or whose
    path holds anything but a plain file is deleted unread. Raises RestoreRefused when
    llama-server does not restore the file (the caller decides what becomes of it)."""
    key = _fingerprint(session, record, props)
    ServerRecord.objects.filter(pk=record.pk).update(slot_key=key)
    record.slot_key = key
    saved = SlotSave.objects.filter(session=session, machine=session.machine, model_key=record.model_key).first()
    if saved is None or not key:
        return None
    path = slot_path(transport, session.pk, saved.pk)
    if saved.fingerprint != key or not transport.is_own_file(path):
        forget_slot(saved, transport)
        return None
    try:
        return restore_slot(endpoint_of(transport, record), slot_file_name(session.pk, saved.pk))
    except SlotError as exc:
        raise RestoreRefused(saved, str(exc)) from None


def save_before_stop(record: ServerRecord, transport: Transport) -> None:
    """Save the server's slot before it stops, keyed by its model and fingerprint (see
    SlotSave). Nothing when the server never became ready or has no slot key; a failed
    save deletes what it may have left. Never for the API's shared server (docs/api.md): it
    reads every request cold, so its slot would only keep members' prompts on disk."""
    if record.ready_at is None or not record.slot_key:
        return
    if AgentSession.objects.filter(pk=record.session_id, purpose=AgentSession.Purpose.API).exists():
        return
    try:
        saved, _ = SlotSave.objects.get_or_create(
            session_id=record.session_id, machine=record.machine, model_key=record.model_key,
            defaults={"fingerprint": record.slot_key},
        )
    except IntegrityError:
        # The session was deleted since this stop read its record (an idle stop racing a
        # delete): nothing of it is kept; its delete stops the process.
        return
    try:
        # Whatever is at the path goes first: llama-server opens the name for writing, and
        # a link planted there must not be written through (docs/behaviour.md C43).
        transport.remove(slot_path(transport, record.session_id, saved.pk))
        n_saved = save_slot(endpoint_of(transport, record), slot_file_name(record.session_id, saved.pk))
    except (SlotError, TransportError) as exc:
        log.warning("session %s: slot not saved: %s", record.session_id, exc)
        forget_slot(saved, transport)
        return
    if n_saved <= 0:
        forget_slot(saved, transport)
        return
    if not SlotSave.objects.filter(pk=saved.pk).update(fingerprint=record.slot_key, n_tokens=n_saved,
                                                        saved_at=timezone.now()):
        # The session was deleted while llama-server wrote the file, after its delete had
        # removed the files it knew of: this one goes too, or the conversation's prompt
        # cache would stay on the machine's disk with no row to find it by.
        try:
            transport.remove(slot_path(transport, record.session_id, saved.pk))
        except TransportError as exc:
            log.warning("session %s: slot file of a deleted session not removed: %s", record.session_id, exc)


def remove_slot_file(place: dict, session_id: int, save_id: int) -> None:
    """Delete one saved slot file of a session that is gone (its row went with it).
    ``place`` is a :func:`machines_app.transports.machine_place`; no row is read."""
    try:
        transport = transport_at(place)
        transport.remove(slot_path(transport, session_id, save_id))
    except TransportError as exc:
        log.warning("could not remove the saved slot %s of session %s on %s: %s", save_id, session_id,
                    place.get("name"), exc)


#: The notice when housekeeping deletes a saved slot (docs/operations.md "Disk").
SLOT_EXPIRED = (
    "The saved prompt cache of this conversation was deleted after {hours} without a running llama-server, to "
    "free the machine's disk. The next start is cold: the conversation is unchanged, and its prompt is read in "
    "full once."
)


def _hours(hours: float) -> str:
    return f"{hours:g} hour" + ("" if hours == 1 else "s")


def forget_old_slots(now: datetime | None = None, host: str | None = None) -> list[int]:
    """Housekeeping (every few minutes): delete each saved slot older than
    ``CORRAL_SLOT_KEEP_HOURS`` of a session whose server is not running or starting
    (asleep, stopped, exited), its file from its machine and its row, with a notice in the
    session's transcript (:data:`SLOT_EXPIRED`). A machine that cannot be reached keeps
    its file and row until a later round. The ids of the sessions concerned.

    ``host`` None: the slots on machines every host reaches (SSH machines, an unclaimed
    local one); a host id: those on that host's own local machine, which only it reaches
    (machines_app.models.reached_by; docs/operations.md, "More hosts")."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.CORRAL_SLOT_KEEP_HOURS)
    old = (SlotSave.objects.filter(reached_by(host, "machine__"), saved_at__lt=cutoff, session__server__isnull=True)
           .exclude(session__status=Status.LOADING).select_related("machine"))
    done = []
    for saved in old:
        try:
            transport = transport_for(saved.machine)
            transport.remove(slot_path(transport, saved.session_id, saved.pk))
            if transport.is_own_file(slot_path(transport, saved.session_id, saved.pk)):
                raise TransportError("the file is still there")
        except TransportError as exc:
            log.warning("session %s: old saved slot %s not deleted yet: %s", saved.session_id, saved.pk, exc)
            continue
        with transaction.atomic():
            session = locked(saved.session_id)
            if ServerRecord.objects.filter(session_id=session.pk).exists() or session.status == Status.LOADING:
                continue  # woken meanwhile: its start reads no file and starts cold by itself
            if SlotSave.objects.filter(pk=saved.pk, saved_at__lt=cutoff).delete()[0]:
                append(session, Kind.NOTICE, {"message": SLOT_EXPIRED.format(hours=_hours(settings.CORRAL_SLOT_KEEP_HOURS))})
                done.append(session.pk)
    return done
