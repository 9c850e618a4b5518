"""Access changes apply at once (docs/access.md, "When access changes").

Two halves:

- **The pages.** Whatever changes an account (turned off, a new password, groups joined
  or left, staff status, deleted) or a machine (enabled or disabled, its allowed groups),
  from the admin, a shell or a view, Django's signals see it; once the change is
  committed, every socket of that account, or every socket following a session on that
  machine, is told to ask again (``broadcast.push_access_changed``). The consumer then
  closes (the login ended: 4401; nothing left to see: 4403) or tells the page to reload
  with the buttons its reader may still use.
- **The turn worker.** A tool call runs, and a turn goes on, only for people who may still
  use the session's machine: the turn's author (who sent the message) and, for a call a
  person allowed, whoever allowed it. Otherwise the call gets a tool result saying so and
  is not run, and the turn ends with an error in words (:func:`check_turn`,
  :func:`check_call`). The views refuse such people already (``AgentSession.access_for``);
  this covers what was under way, or queued, when the change came.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete, pre_save
from django.dispatch import receiver

from machines_app.access import lost_refusal
from machines_app.models import Machine

from . import broadcast, transcript
from .models import AgentSession, TranscriptEvent
from .transcript import Kind, TurnEnd

User = get_user_model()

#: The account fields whose change can end a login or change what its owner may do.
USER_FIELDS = ("is_active", "password", "is_staff", "is_superuser")

#: The tool result of a call not run because of an access change (docs/access.md).
NOT_RUN_RESULT = "Not run: {reason}, so nothing runs on that machine for them any more."
#: The error that ends such a turn.
TURN_STOPPED = "The turn stopped: {reason}, so nothing runs on that machine for them any more."


class TurnCutOff(Exception):
    """A step ended its turn because someone it ran for may no longer use the machine
    (already recorded and finished: the step's caller just stops)."""


# --- the pages -----------------------------------------------------------------------------


def _notify_users(user_ids) -> None:
    ids = sorted({pk for pk in user_ids if pk is not None})
    if ids:
        transaction.on_commit(lambda: [broadcast.push_access_changed(broadcast.user_group_name(pk)) for pk in ids])


def _notify_machines(machine_ids) -> None:
    ids = sorted({pk for pk in machine_ids if pk is not None})
    if ids:
        transaction.on_commit(
            lambda: [broadcast.push_access_changed(broadcast.machine_group_name(pk)) for pk in ids]
        )


@receiver(pre_save, sender=User, dispatch_uid="corral-access-user-before")
def _user_before(sender, instance, raw=False, update_fields=None, **kwargs) -> None:
    # The row as stored, to tell a real change from a save that changes none of these
    # (every login saves last_login).
    if raw or instance.pk is None:
        return
    if update_fields is not None and not set(update_fields) & set(USER_FIELDS):
        return
    instance._corral_access_before = User.objects.filter(pk=instance.pk).values(*USER_FIELDS).first()


@receiver(post_save, sender=User, dispatch_uid="corral-access-user-after")
def _user_after(sender, instance, created=False, raw=False, **kwargs) -> None:
    before = instance.__dict__.pop("_corral_access_before", None)
    if raw or created or before is None:
        return
    if any(before[field] != getattr(instance, field) for field in USER_FIELDS):
        _notify_users([instance.pk])


@receiver(post_delete, sender=User, dispatch_uid="corral-access-user-deleted")
def _user_deleted(sender, instance, **kwargs) -> None:
    _notify_users([instance.pk])


@receiver(m2m_changed, sender=User.groups.through, dispatch_uid="corral-access-user-groups")
def _groups_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    if action == "pre_clear":
        # After a clear pk_set is None: learn beforehand whom it concerns.
        instance._corral_cleared_users = (
            list(instance.user_set.values_list("pk", flat=True)) if reverse else [instance.pk]
        )
    elif action == "post_clear":
        _notify_users(instance.__dict__.pop("_corral_cleared_users", []))
    elif action in ("post_add", "post_remove"):
        _notify_users((pk_set or []) if reverse else [instance.pk])


@receiver(pre_delete, sender=Group, dispatch_uid="corral-access-group-deleted")
def _group_deleted(sender, instance, **kwargs) -> None:
    # Its memberships and machine limits go with it, without an m2m signal.
    _notify_users(instance.user_set.values_list("pk", flat=True))
    _notify_machines(instance.machines.values_list("pk", flat=True))


@receiver(pre_save, sender=Machine, dispatch_uid="corral-access-machine-before")
def _machine_before(sender, instance, raw=False, **kwargs) -> None:
    if not raw and instance.pk is not None:
        instance._corral_enabled_before = Machine.objects.filter(pk=instance.pk).values_list("enabled", flat=True).first()


@receiver(post_save, sender=Machine, dispatch_uid="corral-access-machine-after")
def _machine_after(sender, instance, created=False, raw=False, **kwargs) -> None:
    before = instance.__dict__.pop("_corral_enabled_before", None)
    if not (raw or created) and before is not None and before != instance.enabled:
        _notify_machines([instance.pk])


@receiver(m2m_changed, sender=Machine.allowed_groups.through, dispatch_uid="corral-access-machine-groups")
def _machine_groups_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    if action == "pre_clear":
        instance._corral_cleared_machines = (
            list(instance.machines.values_list("pk", flat=True)) if reverse else [instance.pk]
        )
    elif action == "post_clear":
        _notify_machines(instance.__dict__.pop("_corral_cleared_machines", []))
    elif action in ("post_add", "post_remove"):
        _notify_machines((pk_set or []) if reverse else [instance.pk])


# --- the turn worker -------------------------------------------------------------------------


def _refusal_for(actor: transcript.Actor | None, session: AgentSession) -> str:
    """Why the person ``actor`` names may no longer have work done on the session's machine
    ('' when they may). An actor recorded without an id (old transcripts) stands for the
    session's owner, as nothing proves who it was."""
    user_id = actor["id"] if actor and actor["id"] is not None else session.owner_id
    user = User.objects.filter(pk=user_id).first()
    return lost_refusal(user, session.machine, username=actor["username"] if actor else "")


def _turn_author(session_id: int) -> transcript.Actor | None:
    """Who sent the message the open turn answers (its last ``message_taken``)."""
    payload = (TranscriptEvent.objects.filter(session_id=session_id, kind=Kind.MESSAGE_TAKEN)
               .order_by("-seq").values_list("payload", flat=True).first())
    return transcript.actor(payload)


def check_turn(step, session: AgentSession) -> None:
    """Before a step asks the model anything: end the turn when its author may no longer
    use the session's machine (an error in words; raises :class:`TurnCutOff`)."""
    reason = _refusal_for(_turn_author(session.pk), session)
    if reason:
        step.error(TURN_STOPPED.format(reason=reason))
        step.finish(TurnEnd.ERROR)
        raise TurnCutOff(reason)


def check_call(step, session: AgentSession, call: dict) -> None:
    """Before a tool call runs: when the turn's author, or whoever allowed this call, may
    no longer use the session's machine, record the call's result as not run, end the turn
    with an error in words and raise :class:`TurnCutOff`."""
    actors = [_turn_author(session.pk)]
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

