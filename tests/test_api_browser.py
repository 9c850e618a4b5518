"""The API keys page in Debian's Chromium (docs/api.md "Keys"): a key is made, shown once,
revoked; the page is clean under axe-core at desktop and phone size, light and dark."""

from __future__ import annotations

import pytest

from api_app.models import ApiKey

from .helpers import check_views, console_errors, log_in

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_a_member_makes_sees_once_and_revokes_a_key(stack, browser_page, alice):
    page = browser_page
    log_in(page, stack, "alice", "alice-password-1")
    page.click("header nav >> text=API keys")
    page.wait_for_selector("#no-keys")
    page.fill("#key-name", "laptop editor")
    page.click("button:has-text('Make key')")
    token = page.input_value("#new-key-value")
    assert token.startswith("corral-")
    assert "shown only this once" in page.inner_text("#new-key")
    check_views(page, "api-key-made")

    page.goto(stack.base_url + "/settings/api-keys/")
    assert page.locator("#new-key").count() == 0 and token not in page.content()
    row = page.locator("#keys tbody tr", has_text="laptop editor")
    assert "never" in row.inner_text() and token[:12] in row.inner_text()
    row.locator("button:has-text('Revoke')").click()
    page.locator("#keys tbody tr", has_text="revoked").wait_for()
    assert ApiKey.objects.get(user=alice).revoked_at is not None
    check_views(page, "api-keys")
    assert console_errors(page) == []
