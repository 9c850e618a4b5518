"""Two people on one session in real browsers against the real stack (docs/sharing.md).

Alice shares her session for the team to watch; Bob watches it live and cannot act;
both pages name both watchers, live. Alice lets the team act: Bob's page redraws with
the buttons, he answers her tool question and sends a message; her page names him.
The model side is the stand-in (a 135M model will not call a tool on demand).
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from playwright.sync_api import expect

from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import wait_for
from .helpers import log_in, open_menu

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def test_a_teammate_watches_live_then_acts_when_allowed(stack, page, fake_machine, alice, bob, tmp_path):
    from sessions_app import actions

    (tmp_path / "flock.txt").write_text("twelve sheep, one goat")
    machine = fake_machine([{"tool_calls": [{"name": "read_file", "arguments": '{"path": "flock.txt"}'}]},
                            {"text": "Twelve sheep and a goat.", "delay": 0.05},
                            {"text": "No cows here."}])
    created = []

    def create() -> None:  # off the thread where Playwright runs its event loop
        created.append(actions.do_create_session(
            alice, machine=machine, model_key=machine.model_files.first().key, working_dir=str(tmp_path),
            server_params={}, sampling={}, permission_mode="manual", title="Flock count",
        ))
        connection.close()

    worker = threading.Thread(target=create)
    worker.start()
    worker.join()
    session = created[0]

    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")
    expect(page.locator("#presence")).to_have_text("Watching now: alice")
    open_menu(page)
    page.select_option("#visibility", "team_watch")
    page.locator("#sharing-feedback", has_text="Saved: the team can watch this session.").wait_for()
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).visibility == "team_watch", 10, what="sharing saved")

    bobs = page.context.browser.new_context().new_page()
    log_in(bobs, stack, "bob", "bob-password-1")
    bobs.locator("#sessions-shared a", has_text="Flock count").click()
    bobs.wait_for_url(f"**/sessions/{session.pk}/")
    bobs.wait_for_selector("#conn-state[data-state=live]")
    # Both names on both pages, live.
    expect(page.locator("#presence")).to_have_text("Watching now: alice, bob")
    expect(bobs.locator("#presence")).to_have_text("Watching now: alice, bob")
    assert bobs.locator("#composer").count() == 0 and bobs.locator("#visibility").count() == 0
    assert "shared with the team to watch" in bobs.inner_text("#sharing-note")

    # Bob follows Alice's turn live but cannot answer the question.
    page.fill("#id_text", "Count the flock.")
    page.press("#id_text", "Enter")
    bobs.locator(".msg.user", has_text="Count the flock.").wait_for()
    bob_row = bobs.locator(".msg.tool[data-tool=read_file]")
    bob_row.locator(".question", has_text="Waiting for someone who may act").wait_for()
    assert bob_row.locator("button").count() == 0
    # Nor by posting past the page: the server asks the same rule.
    csrf = next(c["value"] for c in bobs.context.cookies() if c["name"] == "csrftoken")
    call_id = TranscriptEvent.objects.get(session=session, kind="question").payload["id"]
    refused = bobs.request.post(f"{stack.base_url}/sessions/{session.pk}/calls/{call_id}/answer/",
                                headers={"X-CSRFToken": csrf, "Referer": stack.base_url + "/"},
                                form={"answer": "allow_once"})
    assert refused.status == 403 and "watch only" in refused.text()
    assert not TranscriptEvent.objects.filter(session=session, kind="answered").exists()

    # Alice lets the team act: Bob's page redraws itself with the buttons.
    open_menu(page)
    page.select_option("#visibility", "team_act")
    bob_row.locator("button", has_text="Allow once").wait_for()
    bobs.wait_for_selector("#conn-state[data-state=live]")
    assert bobs.locator("#composer").count() == 1 and bobs.locator("#visibility").count() == 0
    bob_row.locator("button", has_text="Allow once").click()
    alice_row = page.locator(".msg.tool[data-tool=read_file]")
    alice_row.locator(".answer", has_text="Allowed once by bob").wait_for()
    bob_row.locator(".answer", has_text="Allowed once by bob").wait_for()
    page.wait_for_selector("#status-badge[data-status=idle]")

    bobs.fill("#id_text", "Any cows?")
    bobs.press("#id_text", "Enter")
    page.locator(".msg.user", has_text="Any cows?").locator(".who", has_text="bob").wait_for()
    page.locator(".msg.assistant .md", has_text="No cows here.").wait_for()
    taken = TranscriptEvent.objects.filter(session=session, kind="message_taken").order_by("seq")
    assert [e.payload["by"]["username"] for e in taken] == ["alice", "bob"]
    page.screenshot(path=str(stack.data_dir / "browser-shared-alice.png"))
    bobs.screenshot(path=str(stack.data_dir / "browser-shared-bob.png"))

    # Bob leaves: Alice's page drops his name.
    bobs.close()
    expect(page.locator("#presence")).to_have_text("Watching now: alice")
