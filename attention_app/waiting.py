"""Which questions wait for a person: the one rule the inbox, the pages' live count,
system notifications and Web Push share (docs/attention.md).

A question (a ``question`` event without an ``answered`` event for the same call id:
``sessions_app.transcript.open_questions``) waits for every person who may answer it: whoever
``AgentSession.access_for`` gives ACT or more — the owner, staff, and the team when the
session is shared to act — while they may use its machine (docs/sharing.md, docs/access.md).
The answer itself is checked again by the session's own view and action
(``sessions_app.actions.do_answer``); nothing here decides who may answer, it only reads that
rule. Synchronous ORM code: the consumer calls it through ``database_sync_to_async``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q
from django.template.loader import render_to_string

from sessions_app import callcard
from sessions_app.actions import may_grant_always
from sessions_app.live.items import TOOL_KINDS, tool_item
from sessions_app.models import Access, AgentSession, TranscriptEvent
from sessions_app.transcript import Kind

#: The most characters of a call's summary in a notification (the card shows all of it).
SUMMARY_CHARS = 100


@dataclass(frozen=True)
class Waiting:
    """One question waiting for a person: its session, its call, when it was asked (the
    ``question`` event's ``seq`` and ``created_at``) and what the call does in a few words
    (:func:`summary`)."""

    session_id: int
    session_title: str
    owner: str
    owner_id: int
    call_id: str
    seq: int
    asked_at: datetime
    summary: str

    @property
    def key(self) -> str:
        """Unique across sessions (call ids are unique within one session only)."""
        return f"{self.session_id}:{self.call_id}"

    @property
    def url(self) -> str:
        """The session page, at the call's card (its row's id, ``tool-<call id>``)."""
        return f"/sessions/{self.session_id}/#tool-{self.call_id}"

    def sentence(self, user_id: int) -> str:
        """"alice's session wants to run `make test`" ("Your session …" for its owner)."""
        whose = "Your session" if user_id == self.owner_id else f"{self.owner}'s session"
        return f"{whose} wants to {self.summary}"

    def as_message(self, user_id: int) -> dict:
        """What a page's script and a push message get: enough to name the session and the
        call in a notification and to open the card (``url``); ``tag`` lets a notification
        of the same question replace, never repeat, an earlier one."""
        return {"key": self.key, "session_id": self.session_id, "call_id": self.call_id, "url": self.url,
                "title": self.sentence(user_id), "body": self.session_title, "tag": f"corral-question-{self.key}"}


def summary(start: dict | None) -> str:
    """A call in a few words from its ``tool_start`` payload: "run `make test`", "write
    notes.txt", "edit src/app.py", "read README.md", else "call <tool>". Characters the card
    shows as escapes are escaped here too (``callcard.escape``: a notification never shows a
    command in another order than it runs), and a summary longer than
    :data:`SUMMARY_CHARS` ends with "…"."""
    start = start or {}
    tool = str(start.get("tool") or "a tool")
    given = start.get("input") if isinstance(start.get("input"), dict) else {}
    if tool == callcard.SHELL_TOOL and isinstance(given.get("command"), str):
        text = f"run `{given['command']}`"
    elif tool in ("write_file", "edit_file", "read_file") and isinstance(given.get("path"), str):
        text = f"{tool.split('_')[0]} {given['path']}"
    else:
        text = f"call {start.get('display_name') or tool}"
    text = callcard.escape(" ".join(text.split("\n")))
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def may_answer(user, session: AgentSession) -> bool:
    """Whether ``user`` is one of the people a question of ``session`` waits for."""
    return session.access_for(user) >= Access.ACT


def _candidates(user):
    """The sessions that may hold an open question for ``user``: those they may see whose
    turn is open or that wait for an answer (a question is only asked inside a turn, and a
    turn's end closes its questions as refusals)."""
    return (AgentSession.objects.visible_to(user).select_related("owner")
            .filter(Q(turn_active=True) | Q(status=AgentSession.Status.AWAITING_INPUT)))


def open_in(session: AgentSession) -> list[TranscriptEvent]:
    """The ``question`` events of ``session`` still open, the first asked for each call,
    in the order asked (``transcript.open_questions``' rule, keeping the events)."""
    events = TranscriptEvent.objects.filter(session=session, kind__in=[Kind.QUESTION, Kind.ANSWERED]).order_by("seq")
    asked: dict[str, TranscriptEvent] = {}
    answered: set[str] = set()
    for event in events:
        call_id = str(event.payload.get("id", ""))
        if event.kind == Kind.ANSWERED:
            answered.add(call_id)
        elif call_id not in asked:
            asked[call_id] = event
    return [event for call_id, event in asked.items() if call_id not in answered]


def waiting_in(session: AgentSession) -> list[Waiting]:
    """The questions open in ``session``, oldest first."""
    found = []
    for question in open_in(session):
        call_id = str(question.payload.get("id", ""))
        start = (TranscriptEvent.objects.filter(session=session, kind=Kind.TOOL_START, payload__id=call_id)
                 .values_list("payload", flat=True).first())
        found.append(Waiting(session.pk, session.display_title, session.owner.get_username(), session.owner_id,
                             call_id, question.seq, question.created_at, summary(start)))
    return found


def waiting_for(user) -> list[Waiting]:
    """Every question waiting for ``user``, newest first. ``[]`` for an anonymous or
    deactivated user."""
    found = []
    for session in _candidates(user):
        if may_answer(user, session):
            found.extend(waiting_in(session))
    return sorted(found, key=lambda w: (w.asked_at, w.session_id, w.seq), reverse=True)


def count_for(user) -> int:
    return len(waiting_for(user)) if user.is_authenticated else 0


def render_card(user, waiting: Waiting) -> str:
    """The call's row as its session page draws it (``sessions_app/_item.html`` from
    ``live.items.tool_item``: the same card, the same answer buttons posting to the same
    view), for ``user``; its ids made unique across sessions."""
    session = AgentSession.objects.select_related("owner").get(pk=waiting.session_id)
    events = (TranscriptEvent.objects.filter(session=session, kind__in=list(TOOL_KINDS), payload__id=waiting.call_id)
              .order_by("seq"))
    item = {**tool_item(events), "session_id": session.pk, "can_act": may_answer(user, session),
            "can_grant": may_answer(user, session) and may_grant_always(session, user),
            "dom_id": f"inbox-tool-{session.pk}-{waiting.call_id}", "feedback_id": f"{session.pk}-{waiting.call_id}"}
    return render_to_string("sessions_app/_item.html", {"item": item})
