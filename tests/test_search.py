"""Full-text search over what was said, across the sessions a person
may see, each result linking to its message. Runs on the database the suite runs on:
SQLite's FTS5 by default, PostgreSQL's full-text search with DATABASE_URL set."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup
from django.db import connection
from django.test import Client

from machines_app.models import Machine
from search_app.models import Passage
from search_app.search import find, snippet
from sessions_app.events import record_event
from sessions_app.models import AgentSession

pytestmark = pytest.mark.django_db


@pytest.fixture
def machine(tmp_path):
    return Machine.objects.create(name="m", models_dir=str(tmp_path), llama_server_path="/bin/true")


def session_of(owner, machine, title="", **fields):
    return AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir="/tmp",
                                       title=title, status=AgentSession.Status.IDLE, **fields)


def say(session, who, text, *fragments):
    record_event(session.pk, "message_taken", {"text": text, "queued_id": None,
                                               "by": {"id": who.pk, "username": who.username}})
    record_event(session.pk, "status", {"status": "running"})
    for fragment in fragments:
        record_event(session.pk, "assistant_text", {"text": fragment})
    record_event(session.pk, "usage", {"seed": 1})
    record_event(session.pk, "turn_end", {"reason": "done"})


def visible(user):
    return AgentSession.objects.visible_to(user)


def test_a_word_said_in_a_message_or_split_across_a_replys_fragments_is_found_with_its_anchor(alice, machine):
    session = session_of(alice, machine, "Deploy notes")
    say(session, alice, "How do I restart the kubelet?", "First drain the no", "de, then restart it.")
    assert connection.vendor in ("sqlite", "postgresql")
    [mine] = find(visible(alice), "KUBELET")
    assert (mine.who, mine.passage.role, mine.url) == ("alice", "user", f"/sessions/{session.pk}/?at=1#ev-1")
    [reply] = find(visible(alice), "drain node")
    assert reply.who == "the model" and reply.url == f"/sessions/{session.pk}/?at=3#a-3"
    assert reply.passage.text == "First drain the node, then restart it."
    assert ("node", True) in reply.snippet and ("drain", True) in reply.snippet
    assert find(visible(alice), "drain kubelet") == []  # every word, in one message
    assert find(visible(alice), "nod") == []  # whole words


def test_what_is_said_later_is_found_and_nothing_is_indexed_twice(alice, machine):
    session = session_of(alice, machine)
    say(session, alice, "first words", "a reply")
    assert len(find(visible(alice), "words")) == 1
    say(session, alice, "second words", "another reply")
    assert [f.passage.text for f in find(visible(alice), "words")] == ["second words", "first words"]
    assert Passage.objects.filter(session=session).count() == 4
    # A reply still streaming goes on in the same passage.
    record_event(session.pk, "message_taken", {"text": "go", "queued_id": None})
    record_event(session.pk, "assistant_text", {"text": "strea"})
    assert find(visible(alice), "streaming") == []
    record_event(session.pk, "assistant_text", {"text": "ming now"})
    [found] = find(visible(alice), "streaming")
    assert found.passage.text == "streaming now" and Passage.objects.filter(session=session).count() == 6


def test_only_the_sessions_a_person_may_see_are_searched(alice, bob, charlie_staff, machine):
    private = session_of(alice, machine, "private")
    shared = session_of(alice, machine, "shared", visibility=AgentSession.Visibility.TEAM_WATCH)
    say(private, alice, "the secret password is hunter2")
    say(shared, alice, "the shared plan mentions hunter2")
    assert [f.session.pk for f in find(visible(bob), "hunter2")] == [shared.pk]
    assert {f.session.pk for f in find(visible(alice), "hunter2")} == {private.pk, shared.pk}
    assert {f.session.pk for f in find(visible(charlie_staff), "hunter2")} == {private.pk, shared.pk}
    private.delete()
    assert [f.session.pk for f in find(visible(alice), "hunter2")] == [shared.pk]


@pytest.mark.parametrize("query", ['"', 'hunter2"', "NEAR(a b)", "a AND OR", "*", "col:x", "'; drop table", "-", "ü ñ"])
def test_a_query_is_never_read_as_search_syntax(alice, machine, query):
    session = session_of(alice, machine)
    say(session, alice, "hunter2 and col x")
    find(visible(alice), query)  # answers, whatever it finds


def test_the_list_shows_what_was_said_and_the_link_opens_the_page_at_that_turn(alice, machine):
    session = session_of(alice, machine, "Long one")
    say(session, alice, "the zebra question", "zebras have stripes")
    for index in range(12):  # more turns than a page shows at first
        say(session, alice, f"filler {index}", "ok")
    client = Client()
    client.force_login(alice)
    page = BeautifulSoup(client.get("/", {"q": "zebra"}).content, "html.parser")
    links = page.select("#said a")
    assert [a["href"] for a in links] == [f"/sessions/{session.pk}/?at=1#ev-1"]
    assert page.select_one("#said mark").get_text() == "zebra"
    assert page.select_one("#no-match") is None
    said_only = BeautifulSoup(client.get("/", {"q": "stripes"}).content, "html.parser")  # in no title: said only
    assert said_only.select_one("#said a") is not None
    assert "No sessions yet" not in said_only.get_text() and said_only.select_one("#no-match") is None
    opened = BeautifulSoup(client.get(links[0]["href"].split("#")[0]).content, "html.parser")
    assert opened.find(id="ev-1") is not None
    assert BeautifulSoup(client.get(f"/sessions/{session.pk}/").content, "html.parser").find(id="ev-1") is None
    none = BeautifulSoup(client.get("/", {"q": "Long"}).content, "html.parser")  # a title, said nowhere
    assert none.select_one("#said-none") is not None and none.select_one("#sessions-mine") is not None


def test_a_snippet_marks_whole_words_around_the_first_found():
    text = "x " * 100 + "the Needle is here, needles are not, needle again" + " y" * 100
    pieces = snippet(text, "needle")
    assert pieces[0] == ("…", False) and pieces[-1] == ("…", False)
    assert [part for part, hit in pieces if hit] == ["Needle", "needle"]
