"""Attacks on Regenerate and Edit (docs/behaviour.md §10, docs/sharing.md): forged by
someone who may only watch or not even see, clicked twice at once, after Clear."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from sessions_app import actions
from sessions_app.events import record_event
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import model_key


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def taken(session) -> list[dict]:
    return [e.payload for e in TranscriptEvent.objects.filter(session=session, kind="message_taken").order_by("seq")]


@pytest.fixture
def answered(local_machine, alice, tmp_path):
    """An idle session whose one turn ("count the sheep") has ended."""
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"),
                                          working_dir=str(tmp_path), status="idle")
    record_event(session.pk, "message_taken", {"text": "count the sheep", "queued_id": None,
                                               "by": {"id": alice.pk, "username": "alice"}})
    record_event(session.pk, "assistant_text", {"text": "Twelve."})
    record_event(session.pk, "turn_end", {"reason": "done"})
    return session


def forge(client, session) -> list[int]:
    headers = {"HX-Request": "true"}
    return [
        client.post(f"/sessions/{session.pk}/regenerate/", headers=headers).status_code,
        client.post(f"/sessions/{session.pk}/send/", {"text": "count the goats", "edit": "last"},
                    headers=headers).status_code,
    ]


@pytest.mark.django_db
def test_a_watcher_or_a_stranger_cannot_regenerate_or_edit_by_a_forged_post(answered, bob):
    assert forge(client_for(bob), answered) == [404, 404]  # private: as if it did not exist
    AgentSession.objects.filter(pk=answered.pk).update(visibility="team_watch")
    assert forge(client_for(bob), answered) == [403, 403]
    assert forge(Client(), answered)[0] in (302, 403, 404)
    assert [m["text"] for m in taken(answered)] == ["count the sheep"]
    assert not AgentSession.objects.get(pk=answered.pk).turn_active


@pytest.mark.django_db
def test_after_clear_there_is_nothing_to_send_again_and_the_page_says_so(answered, alice):
    actions.do_clear(answered, alice)
    client = client_for(alice)
    answer = client.post(f"/sessions/{answered.pk}/regenerate/", headers={"HX-Request": "true"})
    assert "There is no message to send again since the conversation was cleared." in answer.content.decode()
    answer = client.post(f"/sessions/{answered.pk}/send/", {"text": "count the goats", "edit": "last"},
                         headers={"HX-Request": "true"})
    assert "There is no message to send again since the conversation was cleared." in answer.content.decode()
    assert [m["text"] for m in taken(answered)] == ["count the sheep"]


@pytest.mark.django_db(transaction=True)
def test_regenerate_clicked_twice_at_once_sends_the_message_again_once(answered, alice):
    session_id = answered.pk
    barrier = threading.Barrier(4)
    answers: list[str] = []

    def click(text: str | None) -> None:
        try:
            barrier.wait()
            session = AgentSession.objects.get(pk=session_id)
            try:
                actions.do_send_again(session, alice, text)
                answers.append("sent")
            except actions.SessionError as exc:
                answers.append(str(exc))
        finally:
            connection.close()

    clicks = [threading.Thread(target=click, args=(text,)) for text in (None, None, "count the goats", None)]
    for thread in clicks:
        thread.start()
    for thread in clicks:
        thread.join(30)
    assert sorted(answers) == ["Wait for the reply to finish (or stop it), then send again."] * 3 + ["sent"]
    again = taken(answered)
    assert len(again) == 2 and again[1]["replaces"] == TranscriptEvent.objects.get(
        session_id=session_id, kind="message_taken", payload__replaces__isnull=True).seq


@pytest.mark.django_db
def test_before_any_message_there_is_nothing_to_send_again_and_no_clear_is_blamed(local_machine, alice, tmp_path):
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"),
                                          working_dir=str(tmp_path), status="idle")
    client = client_for(alice)
    for answer in (client.post(f"/sessions/{session.pk}/regenerate/", headers={"HX-Request": "true"}),
                   client.post(f"/sessions/{session.pk}/send/", {"text": "count the goats", "edit": "last"},
                               headers={"HX-Request": "true"})):
        page = answer.content.decode()
        assert "There is no message to send again yet." in page
        assert "cleared" not in page
    assert taken(session) == []
