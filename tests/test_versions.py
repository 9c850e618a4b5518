"""Versions of a message sent again (Regenerate, Edit) — the fold the
model's request follows, which version is in force, the action that chooses one, and the
page's one bubble with "‹ 2/3 ›". The browser side is tests/test_search_versions_browser.py."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup
from django.test import Client

from sessions_app import actions, transcript
from sessions_app.events import load_events, record_event
from sessions_app.live.items import render_item
from sessions_app.live.transcript_view import build_items
from sessions_app.models import AgentSession
from sessions_app.transcript import Event, Versions, build_messages


def taken(seq, text, **extra):
    return Event(seq, "message_taken", {"text": text, "queued_id": None, **extra})


def reply(seq, text):
    return Event(seq, "assistant_text", {"text": text})


def end(seq):
    return Event(seq, "turn_end", {"reason": "done"})


def chosen(seq, version):
    return Event(seq, "version_chosen", {"seq": version, "by": {"id": 1, "username": "alice"}})


BASE = [taken(1, "first"), reply(2, "One."), end(3),
        taken(4, "a poem"), reply(5, "Roses."), end(6),
        taken(7, "a poem", replaces=4), reply(8, "Violets."), end(9),
        taken(10, "a haiku", replaces=7, edited=True), reply(11, "Old pond."), end(12)]


def test_choosing_an_earlier_version_puts_that_exchange_back_as_it_was():
    events = [*BASE, chosen(13, 4)]
    assert build_messages(events) == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "One."},
        {"role": "user", "content": "a poem"}, {"role": "assistant", "content": "Roses."},
    ]
    # Byte for byte what the request was when that version was the last one (the prompt cache holds).
    assert build_messages(events) == build_messages(BASE[:6])
    # The next message goes on from the chosen version; Regenerate and Edit send it again.
    assert transcript.last_message(events) == {"seq": 4, "text": "a poem"}
    going_on = [*events, taken(14, "shorter"), reply(15, "Ro."), end(16)]
    assert build_messages(going_on)[-2:] == [{"role": "user", "content": "shorter"}, {"role": "assistant", "content": "Ro."}]
    assert build_messages(going_on)[3] == {"role": "assistant", "content": "Roses."}
    assert transcript.last_message(going_on)["seq"] == 14


def test_regenerating_a_chosen_version_replaces_it_and_choosing_the_latest_again_restores_it():
    events = [*BASE, chosen(13, 7), taken(14, "a poem", replaces=7), reply(15, "Lilies."), end(16)]
    assert build_messages(events)[-2:] == [{"role": "user", "content": "a poem"}, {"role": "assistant", "content": "Lilies."}]
    back = [*events, chosen(17, 10)]
    assert build_messages(back)[-2:] == [{"role": "user", "content": "a haiku"}, {"role": "assistant", "content": "Old pond."}]
    versions = Versions()
    for event in back:
        versions.feed(event)
    assert versions.group(4) == [4, 7, 10, 14]
    assert versions.pager(10) == {"index": 3, "total": 4, "previous": 7, "next": 14}
    assert [versions.hidden(x) for x in (1, 4, 7, 10, 14)] == [False, True, True, False, True]


def test_a_choice_before_a_clear_or_of_no_message_changes_nothing():
    cleared = [*BASE, Event(13, "cleared", {"by": "alice"}), taken(14, "fresh"), reply(15, "Hi."), end(16)]
    for odd in (4, 99, "4", None):
        events = [*cleared, Event(17, "version_chosen", {"seq": odd, "by": {"id": 1, "username": "a"}})]
        assert build_messages(events) == [{"role": "user", "content": "fresh"}, {"role": "assistant", "content": "Hi."}]
        assert transcript.last_message(events)["seq"] == 14


def test_a_version_that_joined_an_unanswered_message_comes_back_joined():
    events = [taken(1, "hi"), Event(2, "error", {"message": "x"}), Event(3, "turn_end", {"reason": "error"}),
              taken(4, "second"), reply(5, "Ok."), end(6),
              taken(7, "second again", replaces=4, edited=True), reply(8, "Fine."), end(9),
              chosen(10, 4)]
    assert build_messages(events) == [{"role": "user", "content": "hi\n\nsecond"}, {"role": "assistant", "content": "Ok."}]


def test_the_page_shows_one_bubble_per_message_with_its_versions():
    items = build_items([*BASE, chosen(13, 7)], session_id=3)
    html = BeautifulSoup("".join(render_item(item) for item in items), "html.parser")
    shown = [el for el in html.select(".msg") if not el.has_attr("hidden")]
    assert [el.select_one(".body").get_text().strip() for el in shown] == ["first", "One.", "a poem", "Violets."]
    assert html.select_one("#versions-7 .version-count").get_text() == "2/3"
    assert html.select_one("#versions-1").get_text() == ""  # one version: no pager
    steps = html.select("#versions-7 button.version-step")
    assert [b["aria-label"] for b in steps] == ["Show the previous version", "Show the next version"]
    assert '"4"' in steps[0]["hx-vals"] and '"10"' in steps[1]["hx-vals"]
    # Every item of a hidden version is hidden, the reply and the usage line too.
    assert all(el.has_attr("hidden") for el in html.select('[data-exchange="4"], [data-exchange="10"]'))


@pytest.mark.django_db
def test_choosing_a_version_is_an_event_refused_while_a_turn_runs_and_for_a_stranger(alice, bob, tmp_path):
    from machines_app.models import Machine

    machine = Machine.objects.create(name="m", models_dir=str(tmp_path), llama_server_path="/bin/true")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status=AgentSession.Status.IDLE)
    for event in BASE:
        record_event(session.pk, event.kind, event.payload)
    client = Client()
    client.force_login(alice)
    answer = client.post(f"/sessions/{session.pk}/version/", {"seq": "4"}, HTTP_HX_REQUEST="true")
    assert answer.status_code == 200
    last = load_events(session.pk)[-1]
    assert (last.kind, last.payload) == ("version_chosen", {"seq": 4, "by": {"id": alice.pk, "username": "alice"}})
    client.post(f"/sessions/{session.pk}/version/", {"seq": "4"}, HTTP_HX_REQUEST="true")  # in force already
    assert load_events(session.pk)[-1].seq == last.seq
    for odd in ("1", "99", "x", "-4", str(2**70)):  # no versions, no message, not a number
        answer = client.post(f"/sessions/{session.pk}/version/", {"seq": odd}, HTTP_HX_REQUEST="true")
        assert "not in this conversation" in answer.content.decode(), odd
    AgentSession.objects.filter(pk=session.pk).update(turn_active=True)
    with pytest.raises(actions.SessionError, match="Wait for the reply to finish"):
        actions.do_choose_version(session, alice, "7")
    client.force_login(bob)  # a private session of someone else: as if missing
    assert client.post(f"/sessions/{session.pk}/version/", {"seq": "7"}).status_code == 404
