"""Login throttling (docs/deployment.md, "Login throttling"): django-axes locks a username out, from one
address, after repeated wrong passwords, with a page that says so in plain words."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.test import Client
from django.utils import timezone

pytestmark = pytest.mark.django_db

LIMIT = settings.AXES_FAILURE_LIMIT


def _log_in(client: Client, username: str, password: str, *, path: str = "/login/", **extra):
    return client.post(path, {"username": username, "password": password}, **extra)


def _fail(client: Client, username: str, times: int, **extra) -> None:
    """``times`` wrong passwords, all below the limit: each gets the form's own error."""
    assert times < LIMIT
    for _ in range(times):
        response = _log_in(client, username, "not-the-password", **extra)
        assert response.status_code == 200 and "Please enter a correct username and password" in response.text


def _lock_out(client: Client, username: str, **extra):
    """Wrong passwords up to the limit; the last one is answered with the lockout page."""
    _fail(client, username, LIMIT - 1, **extra)
    response = _log_in(client, username, "not-the-password", **extra)
    assert response.status_code == 429
    return response


def test_it_locks_a_username_out_after_repeated_wrong_passwords_with_a_clear_message(alice):
    client = Client()
    response = _lock_out(client, "alice")
    assert "Login locked for a while" in response.text
    assert "too many wrong passwords for <strong>alice</strong> from your address" in response.text
    assert f"paused for {settings.AXES_COOLOFF_TIME.seconds // 60} minutes" in response.text
    assert "Content-Security-Policy" in response.headers  # the lockout page is a page like the others

    # Even the right password is refused while the lock lasts, and no session is made.
    response = _log_in(client, "alice", "alice-password-1")
    assert response.status_code == 429 and "_auth_user_id" not in client.session
    # The admin's login is the same door.
    response = _log_in(Client(), "alice", "alice-password-1", path="/admin/login/?next=/admin/")
    assert response.status_code == 429


def test_the_lock_lifts_after_the_cool_off(alice):
    client = Client()
    _lock_out(client, "alice")
    assert _log_in(client, "alice", "alice-password-1").status_code == 429
    AccessAttempt.objects.update(attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1))
    response = _log_in(client, "alice", "alice-password-1")
    assert response.status_code == 302 and response.url == "/"


def test_it_locks_only_that_username_from_that_address(alice, bob):
    _lock_out(Client(), "alice", REMOTE_ADDR="203.0.113.7")
    assert _log_in(Client(), "alice", "alice-password-1", REMOTE_ADDR="203.0.113.7").status_code == 429
    # A colleague behind the same address, and alice from elsewhere, still get in.
    assert _log_in(Client(), "bob", "bob-password-1", REMOTE_ADDR="203.0.113.7").status_code == 302
    assert _log_in(Client(), "alice", "alice-password-1", REMOTE_ADDR="198.51.100.2").status_code == 302


def test_a_client_cannot_dodge_the_count_with_its_own_forwarded_for_header(alice):
    statuses = [
        _log_in(Client(), "alice", "not-the-password", HTTP_X_FORWARDED_FOR=f"192.0.2.{n}",
                REMOTE_ADDR="203.0.113.7").status_code
        for n in range(LIMIT)
    ]
    assert statuses == [200] * (LIMIT - 1) + [429]
    response = _log_in(Client(), "alice", "alice-password-1", HTTP_X_FORWARDED_FOR="192.0.2.99",
                       REMOTE_ADDR="203.0.113.7")
    assert response.status_code == 429


def test_a_right_password_resets_the_count_and_unknown_names_are_counted_alike(alice):
    client = Client()
    _fail(client, "alice", LIMIT - 1)
    assert _log_in(client, "alice", "alice-password-1").status_code == 302
    _fail(Client(), "alice", LIMIT - 1)  # a fresh count: not locked yet
    assert _log_in(Client(), "alice", "alice-password-1").status_code == 302
    # A name nobody has is locked the same way: the page does not tell who exists.
    response = _lock_out(Client(), "mallory")
    assert "too many wrong passwords for <strong>mallory</strong>" in response.text


def test_the_record_keeps_no_password_and_the_page_escapes_the_typed_name(alice):
    hostile = '<img src=x onerror="alert(1)">'
    response = _lock_out(Client(), hostile)
    assert hostile not in response.text and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in response.text
    assert all("not-the-password" not in a.post_data for a in AccessAttempt.objects.all())


def test_a_huge_username_is_counted_and_locked_like_any_other(alice):
    huge = "a" * 10_000  # the login form sends it to authentication as it is
    response = _lock_out(Client(), huge)
    assert "Login locked for a while" in response.text
    # Stored cut to the column's 255 characters: PostgreSQL would refuse the whole name.
    assert {len(a.username) for a in AccessAttempt.objects.all()} == {255}


@pytest.mark.parametrize("username", ["ali\x00ce", "   "])
def test_usernames_the_form_refuses_get_its_own_answer_and_are_not_counted(alice, username):
    for _ in range(LIMIT + 1):
        response = _log_in(Client(), username, "not-the-password")
        assert response.status_code == 200 and "<form" in response.text
    assert not AccessAttempt.objects.exists()
