"""The turn loop against a scripted completion server (docs/behaviour.md C07, C11; docs/behaviour.md §6, §14).

The real llama-server cannot overflow its context or break a stream on demand, so the
server side of the stream is scripted here; the loop, the database and the transcript are
the product's own. The real path is proven in test_e2e_real.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from machines_app.models import Machine
from sessions_app import actions, agent
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .scripted_server import ScriptedServer, chunk, sse

pytestmark = pytest.mark.django_db

USAGE = {
    "choices": [],
    "usage": {"completion_tokens": 2, "prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 100}},
    "timings": {"prompt_n": 20, "cache_n": 100, "predicted_n": 2, "predicted_per_second": 50.0},
}


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def session(alice, server, tmp_path):
    machine = Machine.objects.create(name="scripted", models_dir=str(tmp_path))
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
        sampling={"temperature": 0.2, "max_tokens": 64},
    )
    port = int(server.url.rsplit(":", 1)[1])
    ServerRecord.objects.create(
        session=session, machine=machine, model_key="m.gguf", pid=1, start_time="0", port=port, log_path="/dev/null"
    )
    return session


def run_message(session, user, text="hello") -> list[TranscriptEvent]:
    actions.do_send_message(session, user, text)
    agent.run_turn_step(session.pk)
    return list(TranscriptEvent.objects.filter(session=session).order_by("seq"))


def kinds(events):
    return [e.kind for e in events]


def test_case_c11_usage_after_the_last_choice_is_recorded_with_the_seed(session, alice, server):
    server.will_answer(
        sse(chunk({"role": "assistant", "content": ""})),
        sse(chunk({"content": "Hel"})),
        sse(chunk({"content": "lo"})),
        sse(chunk({}, finish_reason="stop")),
        sse(USAGE),
        b"data: [DONE]",  # no trailing blank line
    )
    events = run_message(session, alice)
    assert "".join(e.payload["text"] for e in events if e.kind == "assistant_text") == "Hello"
    usage = next(e.payload for e in events if e.kind == "usage")
    assert usage["prompt_tokens"] == 120 and usage["cached_tokens"] == 100 and usage["completion_tokens"] == 2
    assert usage["cache_n"] == 100 and usage["predicted_per_second"] == 50.0
    assert usage["finish_reason"] == "stop"
    # docs/behaviour.md §14: no fixed seed → one drawn per request, sent, and recorded.
    assert server.requests[0]["seed"] == usage["seed"]
    assert server.requests[0]["temperature"] == 0.2 and server.requests[0]["max_tokens"] == 64
    assert kinds(events)[-2:] == ["turn_end", "status"]
    assert AgentSession.objects.get(pk=session.pk).status == "idle"


def test_it_sends_the_folded_conversation_with_string_content(session, alice, server):
    for reply in ("One.", "Two."):
        server.will_answer(sse(chunk({"content": reply})), sse(chunk({}, finish_reason="stop")), b"data: [DONE]\n\n")
    run_message(session, alice, "first")
    run_message(session, alice, "second")
    first, second = server.requests
    assert second["messages"][: len(first["messages"])] == first["messages"]  # earlier turn byte-identical
    assert second["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "second"},
    ]
    assert second["stream"] is True and "tools" not in second


def test_a_session_without_max_tokens_gets_the_deployments_default(session, alice, server, settings):
    """A model that never emits its end token would otherwise generate until the context is
    full (minutes), and the next message would not fit (docs/behaviour.md §6)."""
    settings.CORRAL_DEFAULT_MAX_TOKENS = 333
    AgentSession.objects.filter(pk=session.pk).update(sampling={"temperature": 0.2})
    server.will_answer(sse(chunk({"content": "One."})), sse(chunk({}, finish_reason="length")), b"data: [DONE]\n\n")
    events = run_message(session, alice, "first")
    assert server.requests[0]["max_tokens"] == 333
    # A reply cut at the limit says so (it would look finished).
    assert [e.payload["message"] for e in events if e.kind == "notice"] == [
        'The reply stopped at its length limit (max_tokens 333). Send "go on" to continue it, or raise max_tokens '
        "in Settings."]
    AgentSession.objects.filter(pk=session.pk).update(sampling={"max_tokens": 12})
    server.will_answer(sse(chunk({"content": "Two."})), sse(chunk({}, finish_reason="stop")), b"data: [DONE]\n\n")
    run_message(session, alice, "second")
    assert server.requests[1]["max_tokens"] == 12  # the session's own wins


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            400,
            {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 9960, "n_ctx": 8192,
                       "message": "request (9960 tokens) exceeds the available context size (8192 tokens), try increasing it"}},
            "request (9960 tokens) exceeds the available context size (8192 tokens), try increasing it",
        ),
        (500, {"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}},
         "Context size has been exceeded."),
    ],
    ids=["a-400-with-counts", "b-500-no-counts"],
)
def test_case_c07_refusals_end_the_turn_in_the_servers_words(session, alice, server, status, body, expected):
    server.will_answer(json.dumps(body).encode(), status=status, headers={"Content-Type": "application/json"})
    events = run_message(session, alice)
    errors = [e.payload["message"] for e in events if e.kind == "error"]
    assert len(errors) == 1 and expected in errors[0]
    # The page offers Clear on it (docs/behaviour.md C07).
    assert [e.payload.get("context_exceeded") for e in events if e.kind == "error"] == [True]
    assert "HTTP 400" not in errors[0] and "HTTP 500" not in errors[0]
    assert not [e for e in events if e.kind == "assistant_text"]
    assert events[-2].kind == "turn_end" and events[-2].payload["reason"] == "error"
    assert AgentSession.objects.get(pk=session.pk).status == "idle"


def test_case_c07_c_error_frame_after_the_stream_started_keeps_the_partial_text(session, alice, server):
    server.will_answer(
        sse(chunk({"content": "Partial"})),
        sse({"error": {"code": 400, "message": "the request exceeds the available context size", "type": "exceed_context_size_error"}}),
    )
    events = run_message(session, alice)
    assert [e.payload["text"] for e in events if e.kind == "assistant_text"] == ["Partial"]
    assert "exceeds the available context size" in next(e.payload["message"] for e in events if e.kind == "error")
    assert next(e.payload for e in events if e.kind == "error").get("context_exceeded") is True
    assert AgentSession.objects.get(pk=session.pk).turn_active is False


def test_it_reports_an_unreachable_server_plainly(session, alice, server):
    server.close()
    events = run_message(session, alice)
    message = next(e.payload["message"] for e in events if e.kind == "error")
    assert "could not reach llama-server" in message or "closed the connection" in message
