"""Every page and websocket checks who is asking."""

from __future__ import annotations

import pytest
from django.test import Client

from machines_app.models import Machine
from sessions_app.events import record_event
from sessions_app.live.consumers import CloseCode
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import WSRecorder, wait_for


@pytest.fixture
def alices_session(alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    return AgentSession.objects.create(
        owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle", title="Alice's"
    )


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/sessions/{pk}/"),
        ("post", "/sessions/{pk}/send/"),
        ("post", "/sessions/{pk}/interrupt/"),
        ("post", "/sessions/{pk}/clear/"),
        ("post", "/sessions/{pk}/stop/"),
        ("post", "/sessions/{pk}/restart/"),
        ("post", "/sessions/{pk}/queue/abc/drop/"),
        ("get", "/sessions/{pk}/export.jsonl"),
        ("get", "/sessions/{pk}/export.md"),
    ],
)
def test_it_hides_alices_session_from_bob(alices_session, bob, method, path):
    response = getattr(logged_in(bob), method)(path.format(pk=alices_session.pk), {"text": "let me in"})
    assert response.status_code == 404
    assert not TranscriptEvent.objects.filter(session=alices_session).exists()
    assert AgentSession.objects.get(pk=alices_session.pk).turn_active is False


@pytest.mark.django_db
def test_it_lists_only_your_own_sessions_but_all_for_staff(alices_session, bob, charlie_staff):
    assert "Alice&#x27;s" not in logged_in(bob).get("/").content.decode()
    assert "Alice&#x27;s" in logged_in(charlie_staff).get("/").content.decode()
    assert logged_in(charlie_staff).get(f"/sessions/{alices_session.pk}/").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path", ["/", "/sessions/new/", "/sessions/1/", "/sessions/models/?machine=1", "/sessions/1/export.jsonl",
             "/sessions/models/defaults/?machine=1"],
)
def test_it_sends_strangers_to_the_login_page(path):
    response = Client().get(path)
    assert response.status_code == 302 and response.url.startswith("/login/")


@pytest.mark.django_db(transaction=True)
def test_it_refuses_bobs_websocket_and_a_strangers(stack, alices_session, alice, bob):
    bob_client = logged_in(bob)
    ws = WSRecorder(
        stack.ws_url(alices_session.pk), cookie=f"sessionid={bob_client.cookies['sessionid'].value}",
        origin=stack.base_url,
    )
    # Accepted, then closed before anything is sent (the page stops retrying): bob hears
    # what a missing session gets (4404), a stranger is asked to log in (4401).
    wait_for(lambda: ws.close_code is not None, 10, what="the socket to be closed")
    assert ws.close_code == CloseCode.GONE and ws.messages == []
    anonymous = WSRecorder(stack.ws_url(alices_session.pk), cookie="", origin=stack.base_url)
    wait_for(lambda: anonymous.close_code is not None, 10, what="the socket to be closed")
    assert anonymous.close_code == CloseCode.LOGGED_OUT and anonymous.messages == []
    other_port = WSRecorder(
        stack.ws_url(alices_session.pk), cookie=f"sessionid={logged_in(alice).cookies['sessionid'].value}",
        origin="http://127.0.0.1:1",
    )
    assert other_port.refused_status == 403, "a page on another port of this host must not ride alice's cookie"
    foreign = WSRecorder(
        stack.ws_url(alices_session.pk), cookie=f"sessionid={logged_in(alice).cookies['sessionid'].value}",
        origin="http://evil.example",
    )
    assert foreign.refused_status == 403, "a page on another origin must not ride alice's cookie"

    alice_client = logged_in(alice)
    ok = WSRecorder(
        stack.ws_url(alices_session.pk), cookie=f"sessionid={alice_client.cookies['sessionid'].value}",
        origin=stack.base_url,
    )
    try:
        record_event(alices_session.pk, "error", {"message": "visible to alice"})
        wait_for(lambda: ok.messages, 10, what="alice's socket to get the event")
        assert ok.close_code is None
    finally:
        ok.close()
