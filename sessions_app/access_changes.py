"""Access changes reach the open pages at once (docs/access.md, "When access changes").

Whatever changes an account (turned off, a new password, groups joined or left, staff
status, deleted) or a machine (enabled or disabled, its allowed groups), from the admin, a
shell or a view, Django's signals see it; once the change is committed, every socket of
that account, or every socket following a session on that machine, is told to ask again
(``broadcast.push_access_changed``). The consumer then closes (the login ended: 4401;
nothing left to see: 4403) or tells the page to reload with the buttons its reader may
still use. The turn worker's side is :mod:`sessions_app.machine_use`.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete, pre_save
from django.dispatch import receiver

from machines_app.models import Machine

from .live import broadcast

User = get_user_model()

#: The account fields whose change can end a login or change what its owner may do.
USER_FIELDS = ("is_active", "password", "is_staff", "is_superuser")

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
