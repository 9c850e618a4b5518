"""Nothing runs on a machine for someone who may no longer use it (docs/access.md, "When
access changes").

A turn goes on, and a tool call runs, only while the people it runs for may still use the
session's machine (``machines_app.access.machines_for``): the turn's author (who sent the
message, also one that waited in the queue) and, for a call a person allowed, whoever
allowed it. Otherwise the call gets a tool result saying so and is not run, and the turn
ends with an error in words. The views refuse such people already
(``AgentSession.access_for``); this covers what was under way, or queued, when an account,
a group or the machine changed. The turn loop (``agent.Step``) calls :func:`check_turn` as
a step starts and :func:`check_call` before each call runs, and counts only the
allowances whose granter still stands behind them (:func:`standing`).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

from machines_app.access import lost_refusal

from . import actions, transcript
from .models import AgentSession, TranscriptEvent
from .transcript import Kind, TurnEnd

#: The tool result of a call not run because of an access change.
NOT_RUN_RESULT = "Not run: {reason}, so nothing runs on that machine for them any more."
#: The error that ends such a turn.
TURN_STOPPED = "The turn stopped: {reason}, so nothing runs on that machine for them any more."


class TurnCutOff(Exception):
    """A step ended its turn because someone it ran for may no longer use the machine
    (already recorded and finished: the step's caller just stops)."""


def _refusal_for(actor: transcript.Actor | None, session: AgentSession) -> str:
    """Why the person ``actor`` names may no longer have work done on the session's machine
    ('' when they may). An actor recorded without an id (old transcripts) stands for the
    session's owner, as nothing proves who it was."""
    user_id = actor["id"] if actor and actor["id"] is not None else session.owner_id
    user = get_user_model().objects.filter(pk=user_id).first()
    return lost_refusal(user, session.machine, username=actor["username"] if actor else "")


def turn_author(session_id: int) -> transcript.Actor | None:
    """Who sent the message the open turn answers (its last ``message_taken``)."""
    payload = (TranscriptEvent.objects.filter(session_id=session_id, kind=Kind.MESSAGE_TAKEN)
               .order_by("-seq").values_list("payload", flat=True).first())
    return transcript.actor(payload)


def check_turn(step, session: AgentSession) -> None:
    """Before a step asks the model anything: end the turn when its author may no longer
    use the session's machine (an error in words; raises :class:`TurnCutOff`)."""
    reason = _refusal_for(turn_author(session.pk), session)
    if reason:
        step.error(TURN_STOPPED.format(reason=reason))
        step.finish(TurnEnd.ERROR)
        raise TurnCutOff(reason)


def check_call(step, session: AgentSession, call: dict) -> None:
    """Before a tool call runs: when the turn's author, or whoever allowed this call, may
    no longer use the session's machine, record the call's result as not run, end the turn
    with an error in words and raise :class:`TurnCutOff`."""
    actors = [turn_author(session.pk)]
    answer = (TranscriptEvent.objects.filter(session_id=session.pk, kind=Kind.ANSWERED, payload__id=call["id"])
              .order_by("-seq").values_list("payload", flat=True).first())
    if answer is not None:
        actors.append(transcript.actor(answer))
    for actor in actors:
        if reason := _refusal_for(actor, session):
            step.record(Kind.TOOL_END, {"id": call["id"], "output": NOT_RUN_RESULT.format(reason=reason), "ok": False})
            step.error(TURN_STOPPED.format(reason=reason))
            step.finish(TurnEnd.ERROR)
            raise TurnCutOff(reason)



def standing(session: AgentSession, in_force: list[transcript.Allowance]) -> list[transcript.Allowance]:
    """The allowances of ``in_force`` (transcript.allowances) whose granter may still grant
    them: an account still active, still allowed on the session's machine, and still one
    who may answer "always" there (actions.may_grant_always: the owner, staff, a holder of
    the bypass permission). An allowance is a person's standing answer; once that person
    could no longer give it, the calls it covered are asked about again (docs/access.md,
    "When access changes"). A grant recorded without an id stands for the owner, as in
    :func:`_refusal_for`."""
    verdicts: dict[int, bool] = {}
    users = get_user_model().objects
    kept = []
    for allowance in in_force:
        actor = allowance.get("by")
        user_id = actor["id"] if actor and actor.get("id") is not None else session.owner_id
        if user_id not in verdicts:
            user = users.filter(pk=user_id).first()
            verdicts[user_id] = bool(user is not None and not lost_refusal(user, session.machine)
                                     and actions.may_grant_always(session, user))
        if verdicts[user_id]:
            kept.append(allowance)
    return kept
