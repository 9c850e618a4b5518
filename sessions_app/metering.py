"""A session's completions counted as usage (usage_app, docs/usage.md): each finished
completion's ``usage`` event and its usage row are written in one transaction, so the
figures hold exactly the completions the transcripts hold.

Only a completion a turn streamed here is counted: an imported session's ``usage``
events are the other deployment's (they enter through ``importing``, never through here).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from machines_app.models import ModelFile
from usage_app.models import UsageRecord
from usage_app.recording import record_usage

from . import machine_use, turns
from .completions.deltas import Usage
from .models import AgentSession
from .transcript import Kind


def server_report(usage: Usage) -> tuple[dict, dict]:
    """The server's ``usage`` and ``timings`` objects again, from the fields the stream kept
    (``Usage``): what :func:`usage_app.recording.record_usage` reads."""
    reported: dict = {}
    if usage.prompt_tokens is not None:
        reported["prompt_tokens"] = usage.prompt_tokens
    if usage.completion_tokens is not None:
        reported["completion_tokens"] = usage.completion_tokens
    if usage.cached_tokens is not None:
        reported["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    timings = {key: value for key, value in (
        ("prompt_n", usage.prompt_n), ("cache_n", usage.cache_n), ("predicted_n", usage.predicted_n),
        ("prompt_ms", usage.prompt_ms), ("predicted_ms", usage.predicted_ms),
    ) if value is not None}
    return reported, timings


def turn_member(session: AgentSession) -> tuple[object | None, str]:
    """Who the open turn works for (machine_use.turn_author: the author of its last
    ``message_taken``) as (user, or None when the account is gone; name). An actor recorded
    without an id stands for the session's owner."""
    actor = machine_use.turn_author(session.pk)
    user_id = actor["id"] if actor and actor["id"] is not None else session.owner_id
    user = get_user_model().objects.filter(pk=user_id).first()
    return user, (user.get_username() if user else actor["username"] if actor else "")


def record_completion(session_id: int, owner: str, payload: dict, usage: Usage | None,
                      model: ModelFile | None, model_key: str, model_name: str) -> int:
    """Store a completion's ``usage`` event for the step holding lease ``owner`` and, when
    the server reported usage, its usage row (who the turn works for, the machine, the
    model: ``model``, or when its row is gone ``model_key`` and ``model_name``, the name the
    server's start recorded) in the same transaction. Returns the event's seq; raises turns.LeaseLost,
    writing neither, when the step no longer holds the lease."""
    with transaction.atomic():
        seq = turns.record_for_step(session_id, owner, Kind.USAGE, payload)
        if usage is not None:
            session = AgentSession.objects.select_related("machine").get(pk=session_id)
            member, name = turn_member(session)
            reported, timings = server_report(usage)
            record_usage(member=member, member_name=name, machine=session.machine, model_file=model,
                         model_key=model_key, model_name=model_name,
                         usage=reported, timings=timings, source=UsageRecord.Source.SESSION)
    return seq
