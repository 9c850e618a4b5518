"""Live updates over the real websocket: order, catch-up, gaps, duplicates (C17, C19)."""

from __future__ import annotations

import pytest
from django.test import Client

from machines_app.models import Machine
from sessions_app.events import record_event
from sessions_app.live import broadcast
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import WSRecorder, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def session(alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    return AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path))


@pytest.fixture
def connect(stack, alice):
    client = Client()
    client.force_login(alice)
    opened = []

    def open_socket(session, after=0):
        ws = WSRecorder(
            stack.ws_url(session.pk, after), cookie=f"sessionid={client.cookies['sessionid'].value}",
            origin=stack.base_url,
        )
        opened.append(ws)
        return ws

    yield open_socket
    for ws in opened:
        ws.close()


def test_case_c17_reconnect_catches_up_from_the_last_seq_without_duplicates(session, connect):
    for text in ["a", "b", "c"]:
        record_event(session.pk, "assistant_text", {"text": text})
    first = connect(session)
    wait_for(lambda: first.seqs == [1, 2, 3], 10, what="catch-up")
    first.close()
    record_event(session.pk, "assistant_text", {"text": "d"})
    record_event(session.pk, "error", {"message": "x"})
    again = connect(session, after=3)
    record_event(session.pk, "assistant_text", {"text": "e"})
    wait_for(lambda: again.seqs and again.seqs[-1] == 6, 10, what="catch-up after reconnect")
    assert again.seqs == [4, 5, 6]
    # The block opened before the reconnect is continued, then closed into Markdown.
    assert again.messages[0]["ops"] == [{"op": "text", "id": "a-1", "text": "d"}]
    replace = again.messages[1]["ops"][0]
    assert replace["op"] == "replace" and replace["id"] == "a-1" and "abcd" in replace["html"]


def test_case_c17_a_gap_is_filled_from_the_database_and_a_repeat_is_dropped(session, connect):
    ws = connect(session)
    record_event(session.pk, "assistant_text", {"text": "one"})
    wait_for(lambda: ws.seqs == [1], 10, what="the first event")
    # An event stored but never pushed (a message the channel layer dropped) …
    AgentSession.objects.filter(pk=session.pk).update(last_seq=2)
    TranscriptEvent.objects.create(session=session, seq=2, kind="assistant_text", payload={"text": " two"})
    # … and a push repeated by a fast sender.
    broadcast.push_event(session.pk, 1, "assistant_text", {"text": "one"})
    record_event(session.pk, "assistant_text", {"text": " three"})
    wait_for(lambda: ws.seqs and ws.seqs[-1] == 3, 10, what="the gap to be filled")
    assert ws.seqs == [1, 2, 3]
    texts = [op["text"] for m in ws.messages for op in m["ops"] if op["op"] == "text"]
    assert texts == [" two", " three"]


def test_case_c19_fragments_carry_non_empty_ids_and_the_socket_is_not_on_a_swapped_element(session, connect, alice):
    record_event(session.pk, "message_queued", {"id": "q1", "text": "later", "author": "alice"})
    record_event(session.pk, "assistant_text", {"text": "<b>bold</b> **md**"})
    record_event(session.pk, "usage", {"prompt_tokens": 3})
    ws = connect(session)
    wait_for(lambda: len(ws.seqs) == 3, 10, what="events")
    for message in ws.messages:
        for op in message["ops"]:
            assert op.get("id", "x") and op.get("target", "x")
            if op["op"] == "append":
                assert 'id=""' not in op["html"] and ' id="' in op["html"]
    html = "".join(op.get("html", "") for m in ws.messages for op in m["ops"])
    assert "<b>bold</b>" not in html and "&lt;b&gt;bold&lt;/b&gt;" in html
    client = Client()
    client.force_login(alice)
    page = client.get(f"/sessions/{session.pk}/").content.decode()
    # The page script owns the socket; no element carries a ws-connect htmx attribute.
    assert "ws-connect" not in page and 'id="session"' in page and 'data-last-seq="3"' in page


def tail_ops(ws) -> list[dict]:
    return [op for message in ws.tails for op in message["ops"]]


def test_a_tail_reaches_a_page_that_holds_exactly_the_workers_last_stored_event(session, connect):
    """docs/live-page.md: text streamed but not stored yet is shown in the open block's
    tail — only to a page at the worker's last stored event, only in a block of its kind."""
    record_event(session.pk, "message_taken", {"text": "hi", "queued_id": None})
    record_event(session.pk, "assistant_text", {"text": "Hel"})
    ws = connect(session)
    wait_for(lambda: ws.seqs == [1, 2], 10, what="catch-up")
    broadcast.push_tail(session.pk, 1, "assistant_text", "stale")  # the page is past it
    broadcast.push_tail(session.pk, 2, "reasoning", "other kind")  # no such block open
    broadcast.push_tail(session.pk, 2, "assistant_text", "lo wor")
    wait_for(lambda: tail_ops(ws), 10, what="the tail")
    broadcast.push_tail(session.pk, 2, "assistant_text", "lo world")
    wait_for(lambda: len(tail_ops(ws)) == 2, 10, what="the next tail")
    assert tail_ops(ws) == [{"op": "tail", "id": "a-2", "text": "lo wor"}, {"op": "tail", "id": "a-2", "text": "lo world"}]
    assert all("seq" not in message for message in ws.tails)  # never counted by the page
    record_event(session.pk, "assistant_text", {"text": "lo world!"})
    wait_for(lambda: ws.seqs == [1, 2, 3], 10, what="the stored text")
    assert ws.messages[-1]["ops"] == [{"op": "text", "id": "a-2", "text": "lo world!"}]


def test_case_c17_a_page_reconnecting_mid_reply_gets_the_text_once_whatever_tails_it_saw(session, connect):
    record_event(session.pk, "message_taken", {"text": "hi", "queued_id": None})
    record_event(session.pk, "assistant_text", {"text": "one "})
    first = connect(session)
    wait_for(lambda: first.seqs == [1, 2], 10, what="catch-up")
    broadcast.push_tail(session.pk, 2, "assistant_text", "two ")
    wait_for(lambda: tail_ops(first), 10, what="the tail")
    first.close()
    record_event(session.pk, "assistant_text", {"text": "two three "})
    again = connect(session, after=2)  # the page's last seq: a tail is never counted
    broadcast.push_tail(session.pk, 2, "assistant_text", "two three ")  # late, from before the store
    record_event(session.pk, "assistant_text", {"text": "four"})
    wait_for(lambda: again.seqs and again.seqs[-1] == 4, 10, what="catch-up after reconnect")
    texts = [op["text"] for m in again.messages for op in m["ops"] if op["op"] == "text"]
    assert "one " + "".join(texts) == "one two three four"
    assert again.seqs == [3, 4] and tail_ops(again) == []
