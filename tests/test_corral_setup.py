"""``manage.py corral_setup`` (run by ``./corral run`` and ``./corral setup``): the admin
account. The password is printed once, when the account is created; a later run, when
that output is long gone, says an admin exists and how to set a new password, instead of
saying nothing (CORRAL_ADMIN_PASSWORD then changes nothing)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import get_user_model

from machines_app.management.commands.corral_setup import Command

pytestmark = pytest.mark.django_db


def ensure_admin() -> str:
    out = StringIO()
    Command(stdout=out)._ensure_admin()
    return out.getvalue()


def test_it_prints_the_password_once_then_how_to_set_a_new_one(monkeypatch):
    monkeypatch.delenv("CORRAL_ADMIN_USER", raising=False)
    monkeypatch.delenv("CORRAL_ADMIN_PASSWORD", raising=False)
    first = ensure_admin()
    assert "admin account created: user 'admin' password '" in first

    monkeypatch.setenv("CORRAL_ADMIN_PASSWORD", "a-new-password-1")
    later = ensure_admin()
    assert "password '" not in later
    assert "an admin account exists (admin)" in later
    assert "manage.py changepassword admin" in later
    assert get_user_model().objects.filter(is_superuser=True).count() == 1
    assert not get_user_model().objects.get(username="admin").check_password("a-new-password-1")
