"""The login form, which says so when password login is switched off."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError


def password_off_sentence() -> str:
    return (f"Password login is switched off on this Corral, except for administrators: "
            f"use “Sign in with {settings.CORRAL_OIDC_PROVIDER_NAME}”.")


class LoginForm(AuthenticationForm):
    """Django's form; with ``CORRAL_PASSWORD_LOGIN=off`` a refused login says that password
    login is off (for a member's right password and for any wrong one alike, so the
    sentence tells nobody which accounts are superusers)."""

    def clean(self):
        try:
            return super().clean()
        except ValidationError as exc:
            if not settings.CORRAL_PASSWORD_LOGIN and getattr(exc, "code", None) == "invalid_login":
                raise ValidationError(password_off_sentence(), code="password_login_off") from None
            raise
