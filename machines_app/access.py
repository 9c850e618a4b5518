"""Which machines a user may use: one queryset answers it for the picker, the model
list, the new-session form and every action that starts a server (docs/access.md).

A machine is open to a user when it is enabled and either has no allowed groups or the
user is in one of them. Staff may use every enabled machine: they manage machines in the
admin, so a group limit would not stop them anyway.
"""

from __future__ import annotations

from django.db.models import Exists, OuterRef, QuerySet

from .models import Machine


def machines_for(user) -> QuerySet[Machine]:
    """Every enabled machine ``user`` may see and start servers on, by name.

    Nothing for an anonymous or inactive user.
    """
    machines = Machine.objects.filter(enabled=True)
    if not (user.is_authenticated and user.is_active):
        return machines.none()
    if user.is_staff:
        return machines
    limits = Machine.allowed_groups.through.objects.filter(machine=OuterRef("pk"))
    return machines.filter(~Exists(limits) | Exists(limits.filter(group__user=user)))


def machine_refusal(user, machine: Machine) -> str:
    """Why ``user`` may not start a server on ``machine``, in their terms ('' when they may).

    The rule is :func:`machines_for`'s; this only words its answer.
    """
    if machines_for(user).filter(pk=machine.pk).exists():
        return ""
    if not machine.enabled:
        return f"Machine '{machine.name}' is disabled; an admin can enable it."
    return f"Machine '{machine.name}' is limited to some groups and you are not in them; an admin can add you."


def may_use(user, machine_id: int) -> bool:
    """Whether ``user`` may use the machine with this id now (:func:`machines_for`'s rule,
    for one machine). False for a missing user or machine."""
    return user is not None and machines_for(user).filter(pk=machine_id).exists()


def lost_refusal(user, machine: Machine, *, username: str = "") -> str:
    """Why work on ``machine`` may not go on for ``user`` (who may be None: an account
    deleted), in words for everyone watching the session ('' when it may).

    The rule is :func:`machines_for`'s; unlike :func:`machine_refusal` this names the
    user, since the sentence is recorded in a transcript others read.
    """
    if user is not None and may_use(user, machine.pk):
        return ""
    name = user.get_username() if user is not None else (username or "that account")
    if user is None:
        return f"{name}'s account no longer exists"
    if not user.is_active:
        return f"{name}'s account is turned off"
    if not machine.enabled:
        return f"machine '{machine.name}' is disabled"
    return f"{name} is no longer in the groups machine '{machine.name}' is limited to"
