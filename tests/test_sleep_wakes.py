"""Attacks on a sleeping session (docs/behaviour.md §5 "sleep", C45): every way of sending a
message — Regenerate and an edit too, not only a new message — wakes the server and is
answered, with the slot's prompt cache restored. Real llama-server, real worker."""

from __future__ import annotations

import pytest
from django.test import Client

from sessions_app.models import TranscriptEvent
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.stop import sleep_server

from .conftest import wait_for
from .helpers import converse_once, fresh, idle_seeded_session, payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("how", ["regenerate", "edit"])
def test_regenerate_and_edit_wake_a_sleeping_server_and_are_answered(stack, local_machine, alice, tmp_path, how):
    session = idle_seeded_session(local_machine, alice, tmp_path)
    converse_once(session, alice, "My sheep is called Dolly.")
    assert sleep_server(session.pk)
    wait_for(lambda: not ServerRecord.objects.filter(session=session).exists(), 60, what="the server to stop")
    assert fresh(session).status == "sleeping"
    ended = len(payloads(session, "turn_end"))

    client = client_for(alice)
    if how == "regenerate":
        answer = client.post(f"/sessions/{session.pk}/regenerate/", headers={"HX-Request": "true"})
    else:
        answer = client.post(f"/sessions/{session.pk}/send/", {"text": "My goat is called Billy.", "edit": "last"},
                             headers={"HX-Request": "true"})
    assert answer.status_code == 200

    wait_for(lambda: len(payloads(session, "turn_end")) > ended and not fresh(session).turn_active, 180,
             what="the turn sent again to end")
    assert payloads(session, "turn_end")[-1]["reason"] == "done", payloads(session, "error")
    assert not [p for p in payloads(session, "error") if "not running" in p["message"]]
    assert fresh(session).status == "idle"
    assert payloads(session, "server_ready")[-1].get("warm_tokens", 0) > 0  # the slot came back with it
    again = payloads(session, "message_taken")[-1]
    first = TranscriptEvent.objects.filter(session=session, kind="message_taken").order_by("seq").first()
    assert again["replaces"] == first.seq
    assert again.get("edited", False) == (how == "edit")
