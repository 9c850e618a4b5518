"""What the page shows of a transcript (docs/behaviour.md §12): first paint and live operations agree."""

from __future__ import annotations

from sessions_app.live.transcript_view import TranscriptView, build_items
from sessions_app.transcript import Event


def events(*specs):
    return [Event(seq=i + 1, kind=kind, payload=payload) for i, (kind, payload) in enumerate(specs)]


STREAM_WITH_INTERRUPT = events(
    ("message_taken", {"text": "count", "author": "alice"}),
    ("assistant_text", {"text": "one "}),
    ("interrupted", {"by": "alice"}),
    ("assistant_text", {"text": "two"}),
    ("turn_end", {"reason": "interrupted"}),
)


def test_it_keeps_a_reply_whole_when_the_interrupt_arrives_mid_stream():
    items = build_items(STREAM_WITH_INTERRUPT)
    assert [i["type"] for i in items] == ["user", "assistant", "note"]
    assert items[1]["text"] == "one two" and items[1]["open"] is False


def test_it_streams_into_one_block_live_and_closes_it_into_markdown():
    renderer = TranscriptView(1)
    ops = [op for e in STREAM_WITH_INTERRUPT for op in renderer.feed(e)]
    # user bubble, the block, the note (after the block, not splitting it), more text,
    # then turn_end closes the block into Markdown.
    assert [op["op"] for op in ops] == ["append", "append", "append", "text", "replace"]
    assert ops[1]["html"].count('id="a-2"') == 1 and ops[3] == {"op": "text", "id": "a-2", "text": "two"}
    assert ops[4]["id"] == "a-2" and "one two" in ops[4]["html"] and "streaming" not in ops[4]["html"]


def test_it_escapes_what_people_and_models_write():
    hostile = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    items = build_items(events(
        ("message_taken", {"text": hostile, "author": "<b>mallory</b>"}),
        ("assistant_text", {"text": hostile}),
        ("error", {"message": hostile}),
        ("tool_start", {"id": "c1", "tool": "read_file", "arguments": hostile, "display_name": hostile}),
        ("tool_end", {"id": "c1", "output": hostile}),
    ), session_id=1)
    from sessions_app.live.items import render_item

    html = "".join(render_item(item) for item in items)
    assert "<script>" not in html and "<img" not in html and "<b>mallory" not in html
    assert "&lt;script&gt;" in html


def test_queue_events_show_apart_and_resolve():
    renderer = TranscriptView(7)
    queued = renderer.feed(Event(1, "message_queued", {"id": "q1", "text": "later", "author": "bob"}))
    assert queued[0]["target"] == "queue" and 'id="q-q1"' in queued[0]["html"] and "/sessions/7/queue/q1/drop/" in queued[0]["html"]
    assert renderer.feed(Event(2, "message_dropped", {"id": "q1"})) == [{"op": "remove", "id": "q-q1"}]
    taken = renderer.feed(Event(3, "message_taken", {"text": "later", "queued_id": "q2", "author": "bob"}))
    assert taken[0] == {"op": "remove", "id": "q-q2"} and taken[1]["target"] == "transcript"


def test_a_mode_change_made_elsewhere_moves_every_pages_switch():
    ops = TranscriptView(1).feed(Event(1, "settings", {"permission_mode": "bypassPermissions", "by": "bob"}))
    assert {"op": "value", "id": "permission-mode", "value": "bypassPermissions"} in ops


def test_the_tool_list_and_a_ready_note_arrive_live():
    renderer = TranscriptView(1, machine_name="gpu-box")
    tools = [{"name": "read_file", "display_name": "Read file", "origin": "machine", "writes": False},
             {"name": "calc__add", "display_name": "add", "origin": "mcp", "server": "calc", "writes": True}]
    ops = renderer.feed(Event(1, "catalogue", {"tools": tools}))
    assert ops[0]["op"] == "replace" and ops[0]["id"] == "tool-list"
    assert "on gpu-box (the model's machine)" in ops[0]["html"] and "MCP server calc" in ops[0]["html"]
    ready = renderer.feed(Event(2, "server_ready", {"model_key": "g.gguf", "model": "Gemma 3 270m"}))
    assert "llama-server is ready with Gemma 3 270m." in ready[0]["html"]


def test_settings_and_usage_lines_read_the_same_whatever_order_the_database_keeps_keys_in():
    """PostgreSQL's jsonb stores a payload's keys in an order of its own (shorter keys
    first), so a line drawn from a stored event must not follow the payload's order: the
    page (read back) and the live op (the payload as written) would differ."""
    from sessions_app.live.sentences import settings_text, usage_line

    written = {"model_key": "m.gguf", "permission_mode": "manual", "server_params": {"threads": 2, "contextSize": 1024},
               "sampling": {"top_k": 40, "temperature": 0.2}, "by": {"id": 1, "username": "alice"}}
    read_back = dict(sorted(written.items(), key=lambda kv: (len(kv[0]), kv[0])))  # jsonb's order
    read_back["server_params"] = dict(reversed(written["server_params"].items()))
    read_back["sampling"] = dict(reversed(written["sampling"].items()))
    assert list(read_back) != list(written)
    assert settings_text(read_back, first=True) == settings_text(written, first=True)
    assert settings_text(read_back) == settings_text(written)

    usage = {"prompt_tokens": 10, "sampling": {"top_k": 40, "temperature": 0.25, "min_p": 0.05},
             "sampling_from": {"temperature": "model", "top_k": "server", "min_p": "session"}}
    shuffled = {**usage, "sampling": dict(reversed(usage["sampling"].items()))}
    assert usage_line(shuffled) == usage_line(usage)
    assert "temperature 0.25 (model), top_k 40 (server), min_p 0.05 (session)" in usage_line(usage)


def test_the_usage_line_shows_the_servers_float_defaults_as_they_were_set():
    # llama-server reports its defaults as 32-bit floats widened to 64 bits.
    from sessions_app.live.sentences import usage_line

    usage = {"sampling": {"temperature": 0.800000011920929, "top_p": 0.949999988079071, "top_k": 40},
             "sampling_from": {"temperature": "server", "top_p": "server", "top_k": "server"}}
    line = usage_line(usage)
    assert "temperature 0.8 (server)" in line and "top_p 0.95 (server)" in line and "top_k 40 (server)" in line
    assert "0000000" not in line
