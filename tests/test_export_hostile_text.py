"""Attacks on the transcript export (docs/behaviour.md §18): hostile Markdown in every field a
session stores must stay inside its own block of the Markdown file, and every stored text
must come back out of the JSON Lines file unchanged."""

from __future__ import annotations

import pytest
from django.test import Client
from markdown_it import MarkdownIt

from machines_app.models import Machine
from sessions_app import export
from sessions_app.events import record_event
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.transcript import Event

pytestmark = pytest.mark.django_db

#: A forge renders raw HTML (GitHub does, sanitised), so the file is read with html on.
FORGE = MarkdownIt("commonmark", {"html": True})

HOSTILE = "x`\n\n# Heading <script>alert(1)</script>\n\n- item\n1. one\n> quote\n<details><summary>s</summary>"


def blocks(markdown: str) -> list[str]:
    """The top-level block kinds of ``markdown`` as a forge parses them."""
    return [t.type for t in FORGE.parse(markdown) if t.level == 0 and not t.type.endswith("_close")]


def test_hostile_names_and_messages_stay_on_their_own_line_and_inside_their_quote():
    events = [
        Event(1, "message_taken", {"text": "hi", "queued_id": None,
                                   "by": {"id": 1, "username": "a_b"}}),
        Event(2, "tool_start", {"id": "c1", "tool": HOSTILE, "display_name": HOSTILE, "input": {"a": 1}}),
        Event(3, "tool_end", {"id": "c1", "ok": False, "output": "```\n</details>\n# inside"}),
        Event(4, "answered", {"id": "c1", "answer": HOSTILE, "tool": HOSTILE}),
        Event(5, "error", {"message": "HTTP 500\n\n" + HOSTILE}),
        Event(6, "notice", {"message": HOSTILE}),
        Event(7, "server_ready", {"model": HOSTILE}),
    ]
    markdown = export.to_markdown(events, title=HOSTILE)

    # The title's heading; who wrote and what; the call, its card's one field (label, value);
    # the failed output; the answer; the error and the note each one block quote; the ready
    # line. Nothing the hostile text wrote adds or ends a block.
    assert blocks(markdown) == ["heading_open", "paragraph_open", "paragraph_open",
                                "paragraph_open", "paragraph_open", "fence", "paragraph_open", "fence", "paragraph_open",
                                "blockquote_open", "blockquote_open", "paragraph_open"]
    html = FORGE.render(markdown)
    assert "<script>" not in html and "<details>" not in html and "<li>" not in html
    assert html.count("<h1>") == 1 and "<h2>" not in html
    # What was written is still all there, shown as text.
    assert "# Heading &lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<code>x` # Heading &lt;script&gt;" in html  # the tool name: one code span, not closed by its backtick


def test_a_stored_image_name_or_address_cannot_leave_its_link():
    events = [Event(1, "message_taken", {"text": "Look", "queued_id": None, "images": [
        {"url": "https://x/a>b<c d\\e.png", "name": "n\\]](javascript:alert(1))"},
        {"url": "https://x/f.png\n\n# H", "name": "f"},
    ]})]
    markdown = export.to_markdown(events)
    tokens = [t for t in FORGE.parse(markdown) if t.type == "inline"]
    images = [child for t in tokens for child in t.children or () if child.type == "image"]
    assert [image.attrGet("src") for image in images] == ["https://x/a%3Eb%3Cc%20d%5Ce.png", "https://x/f.png%0A%0A#%20H"]
    assert "javascript" not in "".join(image.attrGet("src") for image in images)
    assert "heading_open" not in blocks(markdown)


@pytest.mark.parametrize("kind", ["assistant_text", "message_taken"])
def test_a_reply_cut_off_inside_a_code_block_does_not_turn_the_rest_of_the_file_into_code(kind):
    """finish_reason "length" or Stop in the middle of a fenced block leaves it open."""
    cut = {"text": "Here:\n\n````python\ndef f():\n    return 1", "queued_id": None}
    events = [Event(1, kind, cut), Event(2, "error", {"message": "The reply hit max_tokens."})]
    markdown = export.to_markdown(events)
    assert blocks(markdown) == ["paragraph_open", "paragraph_open", "fence", "blockquote_open"]
    fence = next(t for t in FORGE.parse(markdown) if t.type == "fence")
    assert fence.content == "def f():\n    return 1\n"  # the code itself, untouched

    # A block that was closed, by a longer or a tilde fence, is left as written.
    for closed in ("```\na\n````", "~~~\na\n~~~", "```\n```"):
        events = [Event(1, kind, {"text": closed, "queued_id": None}), Event(2, "notice", {"message": "n"})]
        assert export.to_markdown(events).count(closed[0] * 3) == closed.count(closed[0] * 3)


def test_the_jsonl_export_gives_back_every_text_including_unicode_line_breaks_and_200k_characters(alice, tmp_path):
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir="/",
                                          title="T", status="idle")
    texts = ["line\u2028separator", "para\u2029separator", "next\x85line", "tab\tvt\x0bff\x0cfs\x1cgs\x1drs\x1e",
             "cr\r\nlf\n", "nul-free but \x07bell \x1b[31mred", "x" * 200_000]
    for text in texts:
        record_event(session.pk, "message_taken", {"text": text, "queued_id": None})
    client = Client()
    client.force_login(alice)

    body = client.get(f"/sessions/{session.pk}/export.jsonl").content.decode()
    assert body.count("\n") == len(texts)  # one event, one line, for any reader
    assert len(body.splitlines()) == len(texts)
    again = export.read_jsonl(body)
    stored = TranscriptEvent.objects.filter(session=session).order_by("seq")
    assert [(e.seq, e.kind, e.payload) for e in again] == [(e.seq, e.kind, e.payload) for e in stored]
    assert [e.payload["text"] for e in again] == texts

    # A file written by another tool, with raw U+2028 and CRLF line ends, reads the same.
    raw = body.replace("\\u2028", "\u2028").replace("\n", "\r\n")
    assert [e.payload for e in export.read_jsonl(raw)] == [e.payload for e in again]

    markdown = client.get(f"/sessions/{session.pk}/export.md").content.decode()
    assert "x" * 200_000 in markdown


def test_an_interrupt_recorded_mid_reply_is_written_after_the_reply_not_inside_it():
    """The interrupt is stored at the click; the reply's last fragments after it. The
    export joins the reply and writes the note after it, as the page does."""
    events = [
        Event(1, "message_taken", {"text": "tell me", "queued_id": None, "author": "alice"}),
        Event(2, "assistant_text", {"text": "the dragons. Aethe"}),
        Event(3, "interrupted", {"by": {"username": "alice"}}),
        Event(4, "assistant_text", {"text": "ra had a strong"}),
        Event(5, "turn_end", {"reason": "interrupted"}),
        Event(6, "interrupted", {"by": {"username": "bob"}}),
    ]
    markdown = export.to_markdown(events)
    assert "the dragons. Aethera had a strong" in markdown
    assert markdown.index("Aethera had a strong") < markdown.index("*Interrupted by alice.*")
    assert markdown.count("**Model:**") == 1
    assert markdown.rstrip().endswith("*Interrupted by bob.*")  # with no reply open: where it stands


def test_a_reply_cut_by_stop_server_is_one_reply_not_two():
    """Stop server mid-reply: the ``stopped`` status is stored before the reply's last
    fragment. A status writes nothing in the file, so it must not split the reply."""
    events = [
        Event(1, "message_taken", {"text": "say hi", "queued_id": None, "author": "alice"}),
        Event(2, "status", {"status": "running"}),
        Event(3, "assistant_text", {"text": "I am a great dragon,"}),
        Event(4, "status", {"status": "stopped"}),
        Event(5, "assistant_text", {"text": " and I will take you"}),
        Event(6, "turn_end", {"reason": "interrupted"}),
        Event(7, "server_stopped", {"reason": "stopped", "by": {"username": "alice"}}),
    ]
    markdown = export.to_markdown(events)
    assert "I am a great dragon, and I will take you" in markdown
    assert markdown.count("**Model:**") == 1
