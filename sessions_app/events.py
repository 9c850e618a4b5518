"""The one way an event enters a transcript, and the one way a status changes.

- :func:`record_event` appends one event: it takes the session's row lock, hands out the
  next sequence number (gap-free per session) and pushes the event to watchers after
  commit (:mod:`sessions_app.live.broadcast`).
- :func:`append` does the same inside a transaction that already holds the lock (see
  :func:`locked`), so an action can change columns and record events atomically;
  :func:`append_held` locks and appends at once for the step holding the turn lease.
- :func:`change_status` is "set the status, then record a ``status`` event" — written once.

The event kinds and their payloads are listed in docs/transcript.md.
"""

from __future__ import annotations

import functools

from django.db import connection, models, transaction
from django.utils import timezone

from . import dispatch
from .live import broadcast
from .models import AgentSession, TranscriptEvent
from .transcript import Kind, check_payload

Status = AgentSession.Status


def locked(session_id: int) -> AgentSession:
    """The session row, locked until the caller's transaction ends.

    PostgreSQL's ``FOR NO KEY UPDATE``, as every row lock in Corral: it serialises the
    writers of the row, yet lets other transactions check a foreign key to it (``FOR KEY
    SHARE``). A plain ``FOR UPDATE`` blocks those checks too, and two transactions each
    holding one row (a session, a machine) while checking a key to the other's deadlocked
    (a setting changed while a start was admitted on the session's machine)."""
    return AgentSession.objects.select_for_update(no_key=True).get(pk=session_id)


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


def append(session: AgentSession, kind: str, payload: dict) -> TranscriptEvent:
    """Append to a session already locked by the caller's transaction.

    Raises :class:`sessions_app.transcript.InvalidEvent` for a kind or payload outside
    the vocabulary (docs/transcript.md), before anything is written.
    """
    kind = check_payload(kind, payload)
    payload = storable(payload)
    session.last_seq += 1
    event = _insert(session.pk, session.last_seq, kind, payload)
    AgentSession.objects.filter(pk=session.pk).update(last_seq=session.last_seq, last_activity_at=timezone.now())
    return event


def append_held(session_id: int, lease_owner: str, kind: str, payload: dict) -> TranscriptEvent | None:
    """Append one event for the step holding the session's turn lease ``lease_owner``, in
    the caller's transaction (which must be atomic); None, writing nothing, when the
    session is gone or its lease is held by another (the caller says which).

    What :func:`locked` and :func:`append` do, in one statement less: the row is locked,
    its ``last_seq`` taken and its activity time set by one ``UPDATE … RETURNING``
    (the same ``FOR NO KEY UPDATE`` lock as :func:`locked`, one write of the row), then
    the event is inserted. A streaming reply stores an event every half second
    (docs/live-page.md, "What it costs"), and each read the whole row (and built the
    model instance) only to take one number from it. Raises
    :class:`sessions_app.transcript.InvalidEvent` as :func:`append` does, before anything
    is written."""
    kind = check_payload(kind, payload)
    payload = storable(payload)
    with connection.cursor() as cursor:
        cursor.execute(_take_seq_sql(), [connection.ops.adapt_datetimefield_value(timezone.now()), session_id,
                                         lease_owner])
        row = cursor.fetchone()
    if row is None:
        return None
    return _insert(session_id, row[0], kind, payload)


def session_column(name: str) -> str:
    """The quoted column of the session model's field ``name`` (``"pk"`` for its primary
    key), for the few statements written in SQL."""
    meta = AgentSession._meta
    field = meta.pk if name == "pk" else meta.get_field(name)
    assert isinstance(field, models.Field) and field.column, name
    return connection.ops.quote_name(field.column)


@functools.cache
def _take_seq_sql() -> str:
    """:func:`append_held`'s statement (built once the models are loaded)."""
    seq, at, pk, owner = map(session_column, ("last_seq", "last_activity_at", "pk", "lease_owner"))
    table = connection.ops.quote_name(AgentSession._meta.db_table)
    return f"UPDATE {table} SET {seq} = {seq} + 1, {at} = %s WHERE {pk} = %s AND {owner} = %s RETURNING {seq}"


def _insert(session_id: int, seq: int, kind: str, payload: dict) -> TranscriptEvent:
    """Insert event ``seq`` (the session's row locked and ``last_seq`` taken by the
    caller) and push it to the watchers after commit."""
    event = TranscriptEvent.objects.create(session_id=session_id, seq=seq, kind=kind, payload=payload)
    transaction.on_commit(lambda: broadcast.push_event(session_id, seq, kind, payload))
    if kind == Kind.QUESTION:
        # Whoever may answer is told on their devices when no page of theirs shows it (docs/attention.md).
        dispatch.enqueue_on_commit(dispatch.PUSH_QUESTION, session_id, payload.get("id", ""))
    return event


def record_event(session_id: int, kind: str, payload: dict | None = None) -> TranscriptEvent:
    """Append one event to a transcript and push it to watchers after commit."""
    with transaction.atomic():
        return append(locked(session_id), kind, payload or {})


def change_status(session: AgentSession, status: str, *, by: dict | None = None, reason: str = "") -> bool:
    """Set the status of a session locked by the caller and record a ``status`` event
    (naming ``by`` when a person caused it, and ``reason`` when a word says how: ``"wake"``
    for a message that woke a sleeping server); False (and nothing recorded) when it
    already had that status."""
    if session.status == status:
        return False
    AgentSession.objects.filter(pk=session.pk).update(status=status)
    session.status = status
    append(session, Kind.STATUS, {"status": str(status), **({"by": by} if by else {}),
                                  **({"reason": reason} if reason else {})})
    return True


def set_status(session_id: int, status: str, *, only_from: tuple[str, ...] | None = None) -> bool:
    """:func:`change_status` in a transaction of its own; False when unchanged or when the
    current status is not in ``only_from``."""
    with transaction.atomic():
        session = locked(session_id)
        if only_from is not None and session.status not in only_from:
            return False
        return change_status(session, status)


def record_error(session_id: int, message: str, *, log: str = "") -> None:
    """An ``error`` event: ``message`` in the user's terms, ``log`` (optional) the raw
    lines behind it (a server's last words), which the page folds below the sentence."""
    record_event(session_id, Kind.ERROR, {"message": message, **({"log": log} if log else {})})


def load_events(session_id: int, *, after: int = 0) -> list[TranscriptEvent]:
    return list(TranscriptEvent.objects.filter(session_id=session_id, seq__gt=after).order_by("seq"))


def load_kinds(session_id: int, kinds, *, upto: int, after: int = 0) -> list[TranscriptEvent]:
    """The events of ``kinds`` only, after seq ``after`` up to seq ``upto``, in seq order
    (what a fold over one concern needs: the queue, the catalogue), without reading the
    whole transcript."""
    events = TranscriptEvent.objects.filter(session_id=session_id, kind__in=list(kinds), seq__gt=after, seq__lte=upto)
    return list(events.order_by("seq"))


def load_queue_events(session_id: int, *, upto: int) -> list[TranscriptEvent]:
    """What :func:`sessions_app.transcript.pending_queue` needs, up to seq ``upto``: the
    queued messages and, from the first of them on, the takes and drops that may settle
    them (none at all in a session that never queued one)."""
    first = (TranscriptEvent.objects.filter(session_id=session_id, kind=Kind.MESSAGE_QUEUED, seq__lte=upto)
             .order_by("seq").values_list("seq", flat=True).first())
    if first is None:
        return []
    kinds = [Kind.MESSAGE_QUEUED, Kind.MESSAGE_TAKEN, Kind.MESSAGE_DROPPED, Kind.IMPORTED]
    return load_kinds(session_id, kinds, upto=upto, after=first - 1)


def load_turns(session_id: int, turns: int, *, before: int | None = None) -> tuple[list[TranscriptEvent], int]:
    """The last ``turns`` turns of a transcript (before seq ``before`` when given): the
    events from the ``turns``-th last ``message_taken`` before ``before`` up to it, and the
    seq they start at (1 when they reach the start of the transcript). A page shows these
    and offers the earlier ones (docs/live-page.md)."""
    starts = TranscriptEvent.objects.filter(session_id=session_id, kind=Kind.MESSAGE_TAKEN)
    if before is not None:
        starts = starts.filter(seq__lt=before)
    found = list(starts.order_by("-seq").values_list("seq", flat=True)[:turns])
    start = found[-1] if len(found) == turns else 1
    events = TranscriptEvent.objects.filter(session_id=session_id, seq__gte=start)
    if before is not None:
        events = events.filter(seq__lt=before)
    return list(events.order_by("seq")), start


def turns_since(session_id: int, seq: int) -> int:
    """How many turns a page must show to reach back to the event ``seq``: the turns that
    start after it, and the one it is in (a search result links to an earlier message)."""
    if seq >= 2**63:
        return 1
    return TranscriptEvent.objects.filter(session_id=session_id, kind=Kind.MESSAGE_TAKEN, seq__gt=seq).count() + 1
