"""First paint and live updates are two uses of one fold.

Zulip's ``verify_action`` idea: for every cut ``k`` of a recorded transcript, a page
first painted from ``events[:k]`` and then brought up to date by the live operations for
``events[k:]`` (applied the way ``static/corral/session.js`` applies them) shows the same
DOM as a page first painted from all the events.
"""

from __future__ import annotations

import re

import pytest
from bs4 import BeautifulSoup

from machines_app.models import Machine
from sessions_app import actions, agent, images, transcript
from sessions_app.events import load_events
from sessions_app.live.items import TOOL_KINDS, VERSION_KINDS, prime_window, render_item, render_queued
from sessions_app.live.transcript_view import TranscriptView, build_items
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord
from sessions_app.transcript import Event

from .scripted_server import ScriptedServer, chunk, sse


@pytest.fixture(autouse=True)
def every_image_stored(monkeypatch):
    """These tests fold transcripts without a database: every image a message carries
    counts as stored (what a missing one shows is tests/test_images.py's, on the real table)."""
    monkeypatch.setattr(images, "stored", lambda hashes: set(hashes))

SESSION = 7


def script(*specs) -> list[Event]:
    return [Event(seq=i + 1, kind=kind, payload=payload) for i, (kind, payload) in enumerate(specs)]


IMAGE_A = {"sha256": "a" * 64, "media_type": "image/png", "size": 2048}
IMAGE_B = {"sha256": "b" * 64, "media_type": "image/gif", "size": 300}

CALL = {"id": "c1", "tool": "exec_shell_command", "arguments": '{"command": "ls"}', "input": {"command": "ls"},
        "origin": "machine", "writes": True, "display_name": "Shell"}

TRANSCRIPTS = {
    "a plain exchange": script(
        ("settings", {"model_key": "m.gguf", "permission_mode": "manual", "sampling": {}, "server_params": {}}),
        ("status", {"status": "idle"}),
        ("server_ready", {"model_key": "m.gguf", "model": "SmolLM2"}),
        ("catalogue", {"tools": []}),
        ("message_taken", {"text": "hi", "queued_id": None, "author": "alice"}),
        ("status", {"status": "running"}),
        ("reasoning", {"text": "Let me"}), ("reasoning", {"text": " think."}),
        ("assistant_text", {"text": "Hello"}), ("assistant_text", {"text": " **there**"}),
        ("usage", {"prompt_tokens": 9, "completion_tokens": 2, "seed": 4, "finish_reason": "stop"}),
        ("turn_end", {"reason": "done"}), ("status", {"status": "idle"}),
    ),
    "interrupt while streaming, queue, withdraw": script(
        ("message_taken", {"text": "count", "queued_id": None, "author": "alice"}),
        ("assistant_text", {"text": "one "}),
        ("message_queued", {"id": "q1", "text": "later", "author": "bob"}),
        ("message_queued", {"id": "q2", "text": "never", "author": "bob"}),
        ("interrupted", {"by": "bob"}),
        ("assistant_text", {"text": "two"}),
        ("message_dropped", {"id": "q2", "by": "bob"}),
        ("turn_end", {"reason": "interrupted"}),
        ("message_taken", {"text": "later", "queued_id": "q1", "author": "bob"}),
        ("error", {"message": "context overflow"}),
        ("turn_end", {"reason": "error"}),
        ("cleared", {"by": "alice"}),
        ("message_taken", {"text": "again", "queued_id": None, "author": "alice"}),
        ("notice", {"message": "The model returned an empty reply."}),
        ("usage", {"seed": 3}),
        ("turn_end", {"reason": "done"}),
    ),
    "a gated tool call": script(
        ("message_taken", {"text": "list files", "queued_id": None, "author": "alice"}),
        ("assistant_text", {"text": "Let me look."}),
        ("tool_start", CALL),
        ("tool_start", {**CALL, "id": "c2", "arguments": "not json", "raw_arguments": "not json", "input": {}}),
        ("usage", {"prompt_tokens": 20, "seed": 1, "finish_reason": "tool_calls"}),
        ("question", {"id": "c1", "tool": "exec_shell_command"}),
        ("status", {"status": "awaiting_input"}),
        ("answered", {"id": "c1", "tool": "exec_shell_command", "answer": "allow_once", "by": "alice"}),
        ("tool_running", {"id": "c1"}),
        ("tool_end", {"id": "c1", "output": "a.txt\n<b>b</b>.txt", "ok": True}),
        ("question", {"id": "c2", "tool": "exec_shell_command"}),
        ("settings", {"permission_mode": "bypassPermissions", "by": "alice"}),
        ("answered", {"id": "c2", "tool": "exec_shell_command", "answer": "refuse", "by": "", "reason": "stopped"}),
        ("tool_end", {"id": "c2", "output": "The user refused this call.", "ok": False}),
        ("server_stopped", {"reason": "stopped"}),
        ("turn_end", {"reason": "stopped"}),
    ),
    "a restart between turns": script(
        ("message_taken", {"text": "hi", "queued_id": None, "by": {"id": 1, "username": "alice"}}),
        ("assistant_text", {"text": "Hello"}),
        ("status", {"status": "loading", "by": {"id": 2, "username": "bob"}}),
        ("server_stopped", {"reason": "restart"}),
        ("server_ready", {"model_key": "m.gguf", "model": "M"}),
        ("status", {"status": "idle"}),
        ("message_taken", {"text": "again", "queued_id": None, "by": {"id": 1, "username": "alice"}}),
    ),
    "messages with images, queued and taken": script(
        ("message_taken", {"text": "what is this?", "queued_id": None, "by": {"id": 1, "username": "alice"},
                           "images": [IMAGE_A, IMAGE_B]}),
        ("assistant_text", {"text": "A red square"}),
        ("message_queued", {"id": "q1", "text": "", "by": {"id": 2, "username": "bob"}, "images": [IMAGE_B]}),
        ("usage", {"seed": 2}),
        ("turn_end", {"reason": "done"}),
        ("message_taken", {"text": "", "queued_id": "q1", "by": {"id": 2, "username": "bob"}, "images": [IMAGE_B]}),
        ("settings", {"model_key": "smol.gguf", "model": "SmolLM2", "takes_images": False}),
        ("turn_end", {"reason": "done"}),
    ),
    "versions: regenerate, edit, choose an earlier one, go on": script(
        ("message_taken", {"text": "a poem", "queued_id": None, "by": {"id": 1, "username": "alice"}}),
        ("assistant_text", {"text": "Roses"}),
        ("usage", {"seed": 1}),
        ("turn_end", {"reason": "done"}),
        ("message_taken", {"text": "a poem", "queued_id": None, "by": {"id": 1, "username": "alice"},
                           "replaces": 1}),
        ("assistant_text", {"text": "Violets"}),
        ("usage", {"seed": 2}),
        ("turn_end", {"reason": "done"}),
        ("message_taken", {"text": "a haiku", "queued_id": None, "by": {"id": 1, "username": "alice"},
                           "replaces": 5, "edited": True}),
        ("assistant_text", {"text": "Old pond"}),
        ("turn_end", {"reason": "done"}),
        ("version_chosen", {"seq": 1, "by": {"id": 2, "username": "bob"}}),
        ("message_taken", {"text": "shorter", "queued_id": None, "by": {"id": 1, "username": "alice"}}),
        ("assistant_text", {"text": "Ro"}),
        ("turn_end", {"reason": "done"}),
    ),
    "math while it streams": script(
        ("message_taken", {"text": "energy?", "queued_id": None, "by": {"id": 1, "username": "alice"}}),
        ("assistant_text", {"text": "It is $E=m"}),
        ("assistant_text", {"text": "c^2$, not $5 and $10."}),
        ("assistant_text", {"text": "\n\n$$\n\\int_0^1 x\\,dx\n"}),
        ("assistant_text", {"text": "$$\n\nand `$x$` again $E=mc^2$."}),
        ("usage", {"seed": 1}),
        ("turn_end", {"reason": "done"}),
    ),
}


def page(events) -> BeautifulSoup:
    """The session page's live parts as first paint draws them."""
    items = "".join(render_item(item) for item in build_items(events, SESSION))
    queue = "".join(render_queued(SESSION, q) for q in transcript.pending_queue(events))
    return BeautifulSoup(f'<div id="transcript">{items}</div><div id="queue">{queue}</div>', "html.parser")


def apply(soup: BeautifulSoup, op: dict) -> None:
    """One operation, as static/corral/session.js applies it (missing targets ignored)."""
    if op["op"] == "append":
        target = soup.find(id=op["target"])
        if target is not None:
            for node in list(BeautifulSoup(op["html"], "html.parser").contents):
                target.append(node)
    elif op["op"] == "replace":
        element = soup.find(id=op["id"])
        if element is not None:
            element.replace_with(*BeautifulSoup(op["html"], "html.parser").contents)
    elif op["op"] == "remove":
        element = soup.find(id=op["id"])
        if element is not None:
            element.decompose()
    elif op["op"] == "text":
        element = soup.find(id=op["id"])
        raw = element.select_one(".raw") if element is not None else None
        tail = raw.select_one(".tail") if raw is not None else None
        if tail is not None:
            tail.insert_before(op["text"])
            tail.clear()
        elif raw is not None:
            raw.append(op["text"])
    elif op["op"] == "exchange":
        for element in soup.select(f'#transcript [data-exchange="{int(op["seq"])}"]'):
            if op["hidden"]:
                element["hidden"] = ""
            elif element.has_attr("hidden"):
                del element["hidden"]
    elif op["op"] == "tail":
        element = soup.find(id=op["id"])
        tail = element.select_one(".raw .tail") if element is not None else None
        if tail is not None:
            tail.clear()
            tail.append(op["text"])


def dom(soup: BeautifulSoup) -> str:
    """The DOM as text, blind to how text nodes are split and to whitespace between tags."""
    return re.sub(r">\s+<", "><", BeautifulSoup(str(soup), "html.parser").decode()).strip()


def live_from(events, k: int) -> BeautifulSoup:
    soup = page(events[:k])

    def call_events(call_id: str, before_seq: int):
        return [e for e in events if e.kind in TOOL_KINDS and e.payload.get("id") == call_id and e.seq < before_seq]

    view = TranscriptView(SESSION, call_events=call_events)
    # As the consumer does for a page that has events[:k]: every message's versions, then the window.
    view.know_messages([e for e in events[:k] if e.kind in VERSION_KINDS])
    view.prime(prime_window(events[:k]))
    for event in events[k:]:
        for op in view.feed(event):
            apply(soup, op)
    return soup


def live_with_tails_from(events, k: int) -> BeautifulSoup:
    """As live_from, with the tails a streaming reply shows between its stored events: after
    every stored fragment, the next fragments' text as the tail of the open block (what
    the consumer sends: docs/live-page.md)."""
    soup = page(events[:k])

    def call_events(call_id: str, before_seq: int):
        return [e for e in events if e.kind in TOOL_KINDS and e.payload.get("id") == call_id and e.seq < before_seq]

    view = TranscriptView(SESSION, call_events=call_events)
    view.know_messages([e for e in events[:k] if e.kind in VERSION_KINDS])
    view.prime(prime_window(events[:k]))
    for index, event in enumerate(events[k:], start=k):
        for op in view.feed(event):
            apply(soup, op)
        block = view.block
        if block is None or event.kind not in ("assistant_text", "reasoning"):
            continue
        coming = [e.payload["text"] for e in events[index + 1:index + 3] if e.kind == event.kind]
        if coming:
            apply(soup, {"op": "tail", "id": block.dom_id, "text": "".join(coming)})
    return soup


def assert_one_renderer(events) -> None:
    whole = dom(page(events))
    for k in range(len(events) + 1):
        assert dom(live_from(events, k)) == whole, f"page(events[:{k}]) + live(events[{k}:]) differs"


@pytest.mark.parametrize("events", TRANSCRIPTS.values(), ids=TRANSCRIPTS.keys())
def test_page_plus_live_equals_page_at_every_cut(events):
    assert_one_renderer(events)


def test_thumbnails_are_part_of_what_both_ways_draw():
    events = TRANSCRIPTS["messages with images, queued and taken"]
    whole = page(events)
    assert [img["src"].rsplit("/", 1)[1] for img in whole.select("#transcript .msg.user img.thumb")] == [
        "a" * 64 + ".png", "b" * 64 + ".gif", "b" * 64 + ".gif"]
    assert len(page(events[:3]).select("#queue img.thumb")) == 1  # the queued bubble shows it too


@pytest.mark.parametrize("events", TRANSCRIPTS.values(), ids=TRANSCRIPTS.keys())
def test_tails_shown_between_stored_fragments_leave_the_page_as_page_at_every_cut(events):
    whole = dom(page(events))
    for k in range(len(events) + 1):
        assert dom(live_with_tails_from(events, k)) == whole, f"page(events[:{k}]) + live with tails differs"


def test_a_tail_shows_in_the_open_block_and_the_stored_text_replaces_it():
    events = script(("message_taken", {"text": "hi", "queued_id": None, "author": "alice"}),
                    ("assistant_text", {"text": "Hel"}))
    soup = page(events)
    apply(soup, {"op": "tail", "id": "a-2", "text": "lo wor"})
    assert soup.find(id="a-2").select_one(".raw").get_text() == "Hello wor"
    apply(soup, {"op": "tail", "id": "a-2", "text": "lo world"})  # each tail replaces the last
    assert soup.find(id="a-2").select_one(".raw").get_text() == "Hello world"
    apply(soup, {"op": "text", "id": "a-2", "text": "lo world!"})
    assert soup.find(id="a-2").select_one(".raw").get_text() == "Hello world!"
    assert soup.find(id="a-2").select_one(".tail").get_text() == ""


@pytest.mark.django_db
def test_a_recorded_turn_with_a_question_renders_the_same_either_way(alice, tmp_path):
    """A transcript the product itself recorded (the agent loop against a scripted model)."""
    server = ScriptedServer()
    try:
        machine = Machine.objects.create(name="scripted", models_dir=str(tmp_path))
        session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf",
                                              working_dir=str(tmp_path), status="idle")
        ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=1, start_time="0",
                                    port=int(server.url.rsplit(":", 1)[1]), log_path="/dev/null")
        from sessions_app.events import record_event

        record_event(session.pk, "catalogue", {"tools": [{"name": "read_file", "display_name": "Read file",
                                                           "origin": "machine", "writes": False}]})
        server.will_answer(sse(chunk({"reasoning_content": "hmm"})), sse(chunk({"content": "Reading it."})),
                           sse(chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                      "function": {"name": "read_file",
                                                                   "arguments": '{"path": "x"}'}}]})),
                           sse(chunk({}, finish_reason="tool_calls")), b"data: [DONE]\n\n")
        actions.do_send_message(session, alice, "read x")
        agent.run_turn_step(session.pk)
        actions.do_answer(AgentSession.objects.get(pk=session.pk), alice, "call_a", "refuse")
        server.will_answer(sse(chunk({"content": "Fine, I won't."})), sse(chunk({}, finish_reason="stop")),
                           b"data: [DONE]\n\n")
        agent.run_turn_step(session.pk)
        events = load_events(session.pk)
        assert {"question", "answered", "tool_end", "reasoning", "usage", "turn_end"} <= {e.kind for e in events}
        assert_one_renderer(events)
    finally:
        server.close()


# --- a long transcript is paged by turns (docs/live-page.md) ------------------------------------

def resequenced(*runs) -> list[Event]:
    """The transcripts above one after another, as one session's: seq renumbered, and call
    and queue ids made unique to their run (the agent never reuses a call id in a session)."""

    def renamed(payload: dict, n: int) -> dict:
        ids = {key: f"{payload[key]}-{n}" for key in ("id", "queued_id") if payload.get(key)}
        return {**payload, **ids}

    events = [(e, n) for n, run in enumerate(runs) for e in run]
    return [Event(seq=i + 1, kind=e.kind, payload=renamed(e.payload, n)) for i, (e, n) in enumerate(events)]


#: Many turns of every shape, one cut off mid-reply (a worker died: no turn_end, the next
#: message closes its block), and the last one still streaming.
LONG = resequenced(
    *TRANSCRIPTS.values(),
    script(("message_taken", {"text": "cut", "queued_id": None, "author": "alice"}),
           ("assistant_text", {"text": "half a "}), ("assistant_text", {"text": "*reply*"})),
    *TRANSCRIPTS.values(),
    script(("message_taken", {"text": "last", "queued_id": None, "author": "alice"}),
           ("reasoning", {"text": "so"}), ("assistant_text", {"text": "still "}), ("assistant_text", {"text": "going"})),
)


def whole_page(events, session_id: int) -> str:
    items = "".join(render_item(item) for item in build_items(events, session_id))
    queue = "".join(render_queued(session_id, q) for q in transcript.pending_queue(events))
    return dom(BeautifulSoup(f'<div id="transcript">{items}</div><div id="queue">{queue}</div>', "html.parser"))


def served_page(client, session_id: int) -> BeautifulSoup:
    """The session page as served, its transcript and queue only."""
    response = client.get(f"/sessions/{session_id}/")
    assert response.status_code == 200
    served = BeautifulSoup(response.content.decode(), "html.parser")
    inner = {part: "".join(str(node) for node in served.find(id=part).contents) for part in ("transcript", "queue")}
    return BeautifulSoup(f'<div id="transcript">{inner["transcript"]}</div><div id="queue">{inner["queue"]}</div>',
                         "html.parser")


def show_all_earlier(client, soup: BeautifulSoup) -> int:
    """Click "Show earlier turns" until there is none, swapping as htmx does (outerHTML of
    the control); how many clicks it took."""
    clicks = 0
    while (control := soup.select_one("#transcript > .earlier")) is not None:
        assert control.get("id"), "a control htmx swaps must have an id (C19)"
        button = control.find("button")
        assert button["hx-target"] == f"#{control['id']}" and button["hx-swap"] == "outerHTML"
        response = client.get(button["hx-get"])
        assert response.status_code == 200
        control.replace_with(*BeautifulSoup(response.content.decode(), "html.parser").contents)
        clicks += 1
    return clicks


@pytest.mark.django_db
@pytest.mark.parametrize("turns", [2])
def test_a_paged_page_plus_live_plus_earlier_turns_equals_the_whole_page_at_every_cut(alice, client, tmp_path,
                                                                                     monkeypatch, turns):
    """page(events[:k]) drawn with only its last turns, brought up to date by the live
    operations for events[k:], then every earlier page shown, is page(events)."""
    from sessions_app import views
    from sessions_app.models import TranscriptEvent

    monkeypatch.setattr(views, "TURNS_PER_PAGE", turns)
    machine = Machine.objects.create(name="paged", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle")
    client.force_login(alice)
    whole = whole_page(LONG, session.pk)
    total_turns = sum(e.kind == "message_taken" for e in LONG)
    stored = 0
    for k in range(len(LONG) + 1):
        TranscriptEvent.objects.bulk_create(
            TranscriptEvent(session=session, seq=e.seq, kind=e.kind, payload=e.payload) for e in LONG[stored:k])
        stored = k
        AgentSession.objects.filter(pk=session.pk).update(last_seq=k)
        soup = served_page(client, session.pk)
        shown_turns = len(soup.select("#transcript > .msg.user"))
        assert shown_turns == min(turns, sum(e.kind == "message_taken" for e in LONG[:k]))

        def call_events(call_id: str, before_seq: int):
            return [e for e in LONG if e.kind in TOOL_KINDS and e.payload.get("id") == call_id and e.seq < before_seq]

        view = TranscriptView(session.pk, call_events=call_events)
        # As the consumer does for a page that has events[:k].
        view.know_messages([e for e in LONG[:k] if e.kind in VERSION_KINDS])
        view.prime(prime_window(LONG[:k]))
        for event in LONG[k:]:
            for op in view.feed(event):
                apply(soup, op)
        TranscriptEvent.objects.bulk_create(
            TranscriptEvent(session=session, seq=e.seq, kind=e.kind, payload=e.payload) for e in LONG[k:])
        show_all_earlier(client, soup)
        assert dom(soup) == whole, f"paged page(events[:{k}]) + live + earlier turns differs"
        TranscriptEvent.objects.filter(session=session, seq__gt=k).delete()
    assert total_turns > 3 * turns


@pytest.mark.django_db
def test_earlier_turns_refuse_a_before_that_is_not_a_seq_with_a_sentence(alice, bob, client, tmp_path):
    machine = Machine.objects.create(name="paged", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle", last_seq=3)
    client.force_login(alice)
    for before in ["", "x", "-1", "0", "5", "١"]:
        response = client.get(f"/sessions/{session.pk}/earlier/", {"before": before})
        assert response.status_code == 400 and b"sequence number" in response.content, before
    assert client.get(f"/sessions/{session.pk}/earlier/", {"before": "4"}).status_code == 200
    client.force_login(bob)  # a private session of someone else: as if missing
    assert client.get(f"/sessions/{session.pk}/earlier/", {"before": "4"}).status_code == 404
