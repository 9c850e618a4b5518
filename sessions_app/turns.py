"""The turn's state machine: the one place that starts, steps, ends and recovers turns.

A session has at most one open turn. Its state lives in three columns of the session row
(``turn_active``, the step lease ``lease_owner``/``lease_expires``, ``interrupt_requested``)
and in the transcript (``message_taken`` … ``turn_end``); every change below is made under
the session's row lock and recorded as events in the same transaction::

                 take_message                       claim_step
      no turn ───────────────▶ step queued ─────────────────────▶ step running
     (idle)   ◀─ finish_turn ─┐    ▲  ▲                             │  lease held,
        ▲      (takes the next │    │  │ answer                      │  renewed by LeaseKeeper
        │       queued message │    │  └───────── awaiting input ◀──┤ ask_question
        │       in the same    │    │             (no step runs)    │ (step ends)
        │       transaction)   │    │ recover: open turn, lease     │
        │                      │    └─ free or lapsed (worker died)  │
        │                      └──────── done / error / interrupted ◀┘ finish_turn
        │                                  / stopped / limit
        └──── take_message while a turn is open only queues (message_queued)

- A *step* is one Celery task run (:func:`sessions_app.agent.run_turn_step`). It must
  :func:`claim_step` first; a second copy of the same step (a redelivered task, a
  recovery) finds the lease held and leaves. The lease is renewed every third of its
  lifetime while the step lives (:class:`LeaseKeeper`) and lapses when its worker dies.
- No worker waits for a person: a question ends the step; the answer queues a new one.
- :func:`interrupt` sets the flag a streaming step watches; a turn that no step holds
  (waiting for a person, for the model to load) is finished at once.
- :func:`recoverable` lists open turns whose step is not running, for the recovery round to re-queue.
- A step's lease id names its worker (:func:`step_owner`), so a step whose worker is known
  dead — gone from Celery's view, or restarted under the same name — is taken over at
  once (:func:`take_over_dead_steps`) instead of after the lease lapses.

Lower layers enqueue steps by task name (:mod:`sessions_app.dispatch`).
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Collection
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from usage_app import quota

from . import db_link, dispatch, transcript
from .events import append, append_held, change_status, load_events, locked, session_column
from .models import AgentSession
from .servers.models import ServerRecord
from .transcript import Kind, TurnEnd

Status = AgentSession.Status


def lease_ttl() -> timedelta:
    return timedelta(seconds=settings.CORRAL_LEASE_SECONDS)


def lease_held(session: AgentSession) -> bool:
    """Whether a live step holds the session's lease (as read from ``session``)."""
    return bool(session.lease_owner) and session.lease_expires is not None and session.lease_expires > timezone.now()


def enqueue_step(session_id: int) -> None:
    """Queue a step of the session's turn once the current transaction commits."""
    dispatch.enqueue_on_commit(dispatch.RUN_TURN, session_id)


# --- taking messages ------------------------------------------------------------------------


def take_message(
    session: AgentSession, text: str, by: transcript.Actor, images: list[transcript.ImageRef] | None = None
) -> bool:
    """Start a turn with ``text`` (and the stored ``images`` it carries) on a session locked
    by the caller, or queue it behind the open turn (``message_queued``). ``by`` is its
    author. True when a turn started."""
    if session.turn_active:
        payload = {"id": uuid.uuid4().hex, "text": text, "by": by}
        append(session, Kind.MESSAGE_QUEUED, {**payload, "images": images} if images else payload)
        return False
    _open(session, text, by, queued_id=None, images=images)
    return True


def take_again(
    session: AgentSession, text: str, by: transcript.Actor, *, replaces: int, edited: bool,
    images: list[transcript.ImageRef] | None = None,
) -> None:
    """Start a turn that sends a message again in the place of the one at seq ``replaces``
    (regenerate: the same text and images; edit: ``edited``, a new text), on a session
    locked by the caller with no turn open. The transcript keeps the first reply; the
    request does not (:func:`transcript.build_messages`)."""
    _open(session, text, by, queued_id=None, images=images, again={"replaces": replaces, "edited": edited})


def _open(
    session: AgentSession, text: str, by: transcript.Actor | None, queued_id: str | None,
    images: list[transcript.ImageRef] | None = None, again: dict | None = None,
) -> None:
    payload = {"text": text, "queued_id": queued_id, "by": by, **(again or {})}
    append(session, Kind.MESSAGE_TAKEN, {**payload, "images": images} if images else payload)
    # The lease is handed back too, so the step queued for this message can claim it even
    # before a finishing step has let go of it.
    AgentSession.objects.filter(pk=session.pk).update(
        turn_active=True, interrupt_requested=False, lease_owner="", lease_expires=None
    )
    session.turn_active = True
    enqueue_step(session.pk)


def _take_next(session: AgentSession, events) -> bool:
    """Start a turn with the oldest queued message; False when the queue is empty.

    A message whose author's daily token quota is spent by now is not taken: it leaves the
    queue with a notice that quotes its start and gives the quota's sentence (docs/usage.md,
    "Quotas"), and the next one is tried. A quota is checked when a message is sent; without
    this, messages queued before it ran out would all be taken after."""
    for item in transcript.pending_queue(events):
        author = transcript.actor(item)
        author_id = author.get("id") if author else None
        refusal = quota.refusal_for_id(author_id) if author_id else None
        if refusal is not None:
            append(session, Kind.MESSAGE_DROPPED, {"id": item["id"], "by": author})
            start = " ".join(str(item.get("text", "")).split())
            quoted = start if len(start) <= 80 else start[:79] + "…"
            name = (author.get("username") if author else None) or "A"
            append(session, Kind.NOTICE, {"message": f"{name}'s queued message "
                                                     f"“{quoted}” was not sent: {refusal}"})
            continue
        # The message stays its author's, whoever's turn end took it off the queue.
        _open(session, item.get("text", ""), author, queued_id=item["id"], images=transcript.image_refs(item))
        return True
    return False


def resume_queue(session_id: int) -> None:
    """Take the next queued message when no turn runs (after a restart: messages queued
    while the server was stopped wait for it)."""
    with transaction.atomic():
        session = locked(session_id)
        if session.turn_active or session.status in (*Status.server_down(), Status.LOADING, Status.SLEEPING):
            return
        _take_next(session, load_events(session_id))


# --- ending ---------------------------------------------------------------------------------


def _close_questions(session: AgentSession, events, reason: str) -> None:
    """Close every open question as a refusal: no question card stays open anywhere."""
    for question in transcript.open_questions(events):
        append(
            session,
            Kind.ANSWERED,
            {"id": question["id"], "tool": question.get("tool"), "answer": transcript.ANSWER_REFUSE,
             "reason": reason},
        )


class LeaseLost(Exception):
    """The step no longer holds its session's lease: another step took the turn over (its
    worker was thought dead, or the lease lapsed while the database or the machine was
    slow). It must stop at once and write nothing more: the new holder owns the turn."""


def _check_holder(session: AgentSession, owner: str | None) -> None:
    if owner is not None and session.lease_owner != owner:
        raise LeaseLost(f"session {session.pk}: the lease is no longer held by {owner}")


def record_for_step(session_id: int, owner: str, kind: str, payload: dict) -> int:
    """Record an event for the step holding lease ``owner``; its seq. Raises
    :class:`LeaseLost` (writing nothing) when another step holds it now."""
    with transaction.atomic():
        event = append_held(session_id, owner, kind, payload)
        if event is None:
            # Gone (AgentSession.DoesNotExist, as locked() raises) or held by another.
            _check_holder(locked(session_id), owner)
            raise LeaseLost(f"session {session_id}: the lease is no longer held by {owner}")
        return event.seq


def step_status(session_id: int, owner: str, status: str) -> None:
    """Change the status for the step holding lease ``owner`` (:class:`LeaseLost` if not)."""
    with transaction.atomic():
        session = locked(session_id)
        _check_holder(session, owner)
        change_status(session, status)


def finish_turn(session_id: int, reason: TurnEnd, *, owner: str | None = None) -> None:
    """End the open turn (``turn_end`` with ``reason``: done, error, interrupted, stopped,
    limit) and, in the same transaction, take the next queued message — a message is never
    stranded with nothing running. Open questions are closed as refusals. A step passes its
    lease ``owner``: a step that lost the lease ends nothing (:class:`LeaseLost`). A turn
    ended ``stopped`` (its server stopped on purpose) hands nothing on: the queue waits for
    a restart, even while the stop is still under way."""
    with transaction.atomic():
        session = locked(session_id)
        _check_holder(session, owner)
        events = load_events(session_id)
        _close_questions(session, events, reason)
        if transcript.open_turn(events):
            append(session, Kind.TURN_END, {"reason": reason})
        if (session.status in Status.server_down() or reason == TurnEnd.STOPPED or _stopping(session_id)
                or not _take_next(session, events)):
            AgentSession.objects.filter(pk=session_id).update(turn_active=False, interrupt_requested=False)
            if session.status in (Status.RUNNING, Status.AWAITING_INPUT):
                change_status(session, Status.IDLE)


def _stopping(session_id: int) -> bool:
    """Whether the session's server is being stopped (its record claimed ``stopping``): the
    status changes only once it is gone, and a turn ending meanwhile hands nothing on."""
    return ServerRecord.objects.filter(session_id=session_id, stopping=True).exists()


def finish_if_unheld(session_id: int, reason: TurnEnd) -> bool:
    """Finish the open turn unless a live step holds it (that step will see the flag or
    the status and finish it itself). True when finished here."""
    session = AgentSession.objects.get(pk=session_id)
    if not session.turn_active or lease_held(session):
        return False
    finish_turn(session_id, reason)
    return True


def interrupt(session: AgentSession, by: transcript.Actor) -> bool:
    """Ask the open turn of a session locked by the caller to stop; False when no turn is
    open. The caller finishes the turn with :func:`finish_if_unheld` after commit."""
    if not session.turn_active:
        return False
    AgentSession.objects.filter(pk=session.pk).update(interrupt_requested=True)
    append(session, Kind.INTERRUPTED, {"by": by})
    return True


# --- the gate ---------------------------------------------------------------------------------


def ask_question(session_id: int, call_id: str, tool: str, *, owner: str | None = None, **details) -> None:
    """Record a question about one call; the session awaits input and the step ends.
    ``details``: the question payload's optional keys (``offers``, ``changed``, ``claims``:
    docs/transcript.md)."""
    with transaction.atomic():
        session = locked(session_id)
        _check_holder(session, owner)
        append(session, Kind.QUESTION, {"id": call_id, "tool": tool, **details})
        change_status(session, Status.AWAITING_INPUT)


def go_on_after_answer(session: AgentSession) -> None:
    """After an answer (recorded by the caller): the turn goes on in a new step."""
    if session.status == Status.AWAITING_INPUT:
        change_status(session, Status.RUNNING)
    enqueue_step(session.pk)


# --- the lease --------------------------------------------------------------------------------


def claim_step(session_id: int, owner: str) -> str | None:
    """Take the session's turn lease if nobody holds a live one.

    Returns None when not taken; otherwise the previous holder's id ('' when the lease
    was free, another id when its holder died without handing it back).
    """
    now = timezone.now()
    free = Q(lease_expires__isnull=True) | Q(lease_expires__lt=now)
    row = AgentSession.objects.filter(free, pk=session_id, turn_active=True).values_list("lease_owner", flat=True)
    previous = row.first()
    if previous is None:
        return None
    taken = (
        AgentSession.objects.filter(free, pk=session_id, turn_active=True, lease_owner=previous)
        .update(lease_owner=owner, lease_expires=now + lease_ttl())
    )
    return previous if taken == 1 else None


def may_go_on(session_id: int, owner: str) -> bool:
    """Whether the step holding lease ``owner`` may go on: the session is there, asks for
    no interrupt, and ``owner`` still holds its lease. One read by primary key, written
    in SQL: a streaming reply's interrupt watcher asks it every half second, and the
    ORM's building of the query cost several times its running (docs/live-page.md,
    "What it costs")."""
    with connection.cursor() as cursor:
        cursor.execute(_may_go_on_sql(), [session_id, False, owner])
        return cursor.fetchone() is not None


@functools.cache
def _may_go_on_sql() -> str:
    pk, flag, holder = map(session_column, ("pk", "interrupt_requested", "lease_owner"))
    table = connection.ops.quote_name(AgentSession._meta.db_table)
    return f"SELECT 1 FROM {table} WHERE {pk} = %s AND {flag} = %s AND {holder} = %s"


def renew_lease(session_id: int, owner: str) -> bool:
    return AgentSession.objects.filter(pk=session_id, lease_owner=owner).update(
        lease_expires=timezone.now() + lease_ttl()
    ) == 1


def release_lease(session_id: int, owner: str) -> None:
    AgentSession.objects.filter(pk=session_id, lease_owner=owner).update(lease_owner="", lease_expires=None)


class LeaseKeeper:
    """Renews a step's lease every third of its lifetime from a thread of its own, so a
    long prompt or a long tool run never lets it lapse while the step lives; when the
    worker dies, the renewals stop and the lease lapses."""

    def __init__(self, session_id: int, owner: str) -> None:
        self.session_id, self.owner = session_id, owner
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"lease-{session_id}", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stopped.wait(settings.CORRAL_LEASE_SECONDS / 3):
                try:
                    renew_lease(self.session_id, self.owner)
                except db_link.LOST:
                    # Its connection was cut (sessions_app/db_link.py): a new one at the
                    # next renewal, instead of a dead thread and a lease that lapses.
                    db_link.reconnect()
        finally:
            connection.close()

    def __enter__(self) -> LeaseKeeper:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(5)


# --- waiting for a worker ---------------------------------------------------------------------


def waiting_for_worker() -> dict[int, int]:
    """Sessions whose turn waits for a free turn worker: open turn, no step holding the
    lease, neither loading nor awaiting a person. Session id → how many wait ahead of it
    (0 = next), oldest first by last activity (a waiting turn records nothing, so that is
    when its step was queued). One query; for the pages."""
    waiting = (
        AgentSession.objects.filter(turn_active=True, lease_owner="", status__in=[Status.IDLE, Status.RUNNING])
        .order_by("last_activity_at", "pk")
        .values_list("pk", flat=True)
    )
    return {session_id: ahead for ahead, session_id in enumerate(waiting)}


# --- fast takeover ----------------------------------------------------------------------------

# Said before the next step knows whether the turn goes on (a tool call) or ends (a reply cut
# mid-stream is partial): "Resuming" here was followed, on the page, by "Send another message".
RESUMING_NOTICE = "Taken over after a worker restart: the worker running this turn stopped."


def step_owner(worker: str | None) -> str:
    """A new lease id for a step run by the Celery worker named ``worker`` (its nodename,
    e.g. ``turns@host``) in this process: ``"<16 hex> <pid> <worker>"``, cut to the
    column's 64 characters; just the hex when not run by a worker (tests, a shell)."""
    token = uuid.uuid4().hex[:16]
    return f"{token} {os.getpid()} {worker}"[:64] if worker else token


def _holder(owner: str) -> tuple[int, str, bool] | None:
    """``(pid, worker nodename, cut)`` from a lease id made by :func:`step_owner`; None
    for one that names no worker. ``cut``: the name may have lost its end to the column."""
    parts = owner.split(" ", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2], len(owner) >= 64


def holder_is_dead(owner: str, *, live: Collection[str] | None = None,
                   restarted: tuple[str, int] | None = None) -> bool:
    """Whether the worker holding lease ``owner`` is known to be gone: its name is not
    among ``live`` (the nodenames that answered a ping), or ``restarted`` = (nodename,
    pid) is that worker started again in another process. Unknown holders are alive."""
    holder = _holder(owner)
    if holder is None:
        return False
    pid, name, cut = holder
    if restarted is not None and restarted[0].startswith(name) and (cut or restarted[0] == name):
        return restarted[1] != pid
    if live is not None:
        return not any(node == name or (cut and node.startswith(name)) for node in live)
    return False


def any_open_turn() -> bool:
    """Whether any session has an open turn (one indexed-column query): without one, turn
    recovery has nothing to take over or re-queue (:func:`held_leases`, :func:`recoverable`
    read only open turns), and its round, every 5 s, stops here (docs/live-page.md, "What
    it costs")."""
    return AgentSession.objects.filter(turn_active=True).exists()


def held_leases() -> bool:
    """Whether any open turn's step holds an unexpired lease: the only steps
    :func:`take_over_dead_steps` can take over (one indexed-column query)."""
    return _held().exists()


def _held():
    return AgentSession.objects.filter(turn_active=True, lease_expires__gt=timezone.now()).exclude(lease_owner="")


def take_over_dead_steps(*, live: Collection[str] | None = None,
                         restarted: tuple[str, int] | None = None) -> list[int]:
    """Let go of the lease of every open turn whose step's worker is dead (see
    :func:`holder_is_dead`), saying so on the page (a ``notice``); the ids, for the
    caller to queue a step each. The next step claims the lease as one that lost its
    holder and goes on, or ends the turn truthfully, from the transcript."""
    now = timezone.now()
    held = _held()
    taken = []
    for session_id, owner in held.values_list("pk", "lease_owner"):
        if not holder_is_dead(owner, live=live, restarted=restarted):
            continue
        with transaction.atomic():
            session = locked(session_id)
            if session.lease_owner != owner or not session.turn_active:
                continue  # the step ended, or was taken over, meanwhile
            AgentSession.objects.filter(pk=session_id, lease_owner=owner).update(lease_expires=now)
            append(session, Kind.NOTICE, {"message": RESUMING_NOTICE})
        taken.append(session_id)
    return taken


# --- recovery ---------------------------------------------------------------------------------


def recoverable() -> list[int]:
    """Sessions whose open turn has no step running: the lease is free and nothing happened
    for 10 s (a step message lost with the broker), or the lease lapsed (its worker died).
    Re-queuing one that is in fact fine is harmless: the lease lets one copy run."""
    now = timezone.now()
    free = AgentSession.objects.filter(
        turn_active=True, last_activity_at__lt=now - timedelta(seconds=10), status__in=[Status.IDLE, Status.RUNNING],
        lease_expires__isnull=True,
    )
    lapsed = AgentSession.objects.filter(turn_active=True, lease_expires__lt=now)
    return sorted(set(free.values_list("pk", flat=True)) | set(lapsed.values_list("pk", flat=True)))
