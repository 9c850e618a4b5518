"""Password login, which can be kept for superusers only (``CORRAL_PASSWORD_LOGIN=off``)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.backends import ModelBackend


def password_login_allowed(user) -> bool:
    """Whether ``user`` may log in with a password here: always with password login on;
    with it off, superusers only (the admin who must still get in when the identity
    provider is down)."""
    return settings.CORRAL_PASSWORD_LOGIN or bool(user.is_superuser)


class PasswordBackend(ModelBackend):
    """Django's ``ModelBackend`` that refuses the password of a user
    :func:`password_login_allowed` refuses, wherever it is typed (Corral's login page, the
    admin's). Django asks the same question when it restores a login from its cookie,
    so a member's login made with a password before password login was switched off ends
    at their next request; logins made by single sign-on belong to the other backend
    and stand."""

    def user_can_authenticate(self, user) -> bool:
        return password_login_allowed(user) and super().user_can_authenticate(user)
