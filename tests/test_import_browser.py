"""Importing an export through the page — the session list's "Import an export",
the file chosen in a real browser, the new session opened, its server started, and the
imported conversation going on (the llama-server stand-in answers; the model is sent the
imported messages)."""

from __future__ import annotations

import json

import httpx
import pytest
from playwright.sync_api import expect

from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord

from .conftest import wait_for
from .helpers import log_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def test_an_export_is_imported_from_the_session_list_and_goes_on(stack, page, fake_machine, alice, tmp_path):
    exported = [
        {"seq": 1, "kind": "message_taken", "payload": {"text": "How many sheep?", "queued_id": None,
                                                         "by": {"id": 999, "username": "shepherd"}}},
        {"seq": 2, "kind": "reasoning", "payload": {"text": "Count them."}},
        {"seq": 3, "kind": "assistant_text", "payload": {"text": "Twelve sheep."}},
        {"seq": 4, "kind": "turn_end", "payload": {"reason": "done"}},
    ]
    machine = fake_machine([{"text": "And one goat."}])
    log_in(page, stack, "alice", "alice-password-1")
    page.click("#import-session")
    expect(page.locator("h1")).to_have_text("Import a session")
    page.select_option("#id_machine", str(machine.pk))
    page.fill("#id_working_dir", str(tmp_path))
    page.set_input_files("#id_transcript", files=[{
        "name": "flock.jsonl", "mimeType": "application/x-ndjson",
        "buffer": "".join(json.dumps(line) + "\n" for line in exported).encode()}])
    page.click("#new-session button[type=submit]")
    page.wait_for_url(f"{stack.base_url}/sessions/*/")
    session = AgentSession.objects.get(owner=alice)
    expect(page.locator("#transcript")).to_contain_text("Twelve sheep.")
    expect(page.locator("#transcript")).to_contain_text("Imported by alice from an export")
    expect(page.locator("#transcript")).to_contain_text("shepherd")  # who did what, as a name
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 60, what="the server")

    page.fill("#id_text", "And goats?")
    page.click("#composer button[type=submit]")
    expect(page.locator("#transcript")).to_contain_text("And one goat.", timeout=60_000)
    record = ServerRecord.objects.get(session=session)
    sent = httpx.get(f"http://127.0.0.1:{record.port}/requests",
                     headers={"Authorization": f"Bearer {record.api_key}"}, timeout=5).json()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent if m["role"] != "system"] == [
        ("user", "How many sheep?"), ("assistant", "Twelve sheep."), ("user", "And goats?")]
