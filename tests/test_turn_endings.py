"""Every turn ends truthfully and the next one always works.

The server side of each stream is scripted (the real llama-server cannot cut a stream or
send every reasoning form on demand); the turn loop, the database and the transcript are
the product's own. The alternation rule is also proven against the real llama-server
(``test_a_template_that_enforces_alternation_accepts_the_fold``).
"""

from __future__ import annotations

import pytest

from machines_app.llama_server import ServerSpec, build_argv, wait_until_ready
from machines_app.transports import LocalTransport
from sessions_app import actions, agent, transcript
from sessions_app.completions import INCOMPLETE_REPLY, CompletionClient, CompletionError
from sessions_app.live.sentences import usage_line
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import KEY, wait_for
from .helpers import DONE, run_message, text_of
from .scripted_server import chunk, sse

pytestmark = pytest.mark.django_db

USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 0},
         "timings": {"prompt_n": 12, "cache_n": 0, "predicted_n": 0}}


def last_turn_end(events) -> str:
    return [e.payload["reason"] for e in events if e.kind == "turn_end"][-1]


# --- 1. a reply that ended without saying it ended ---------------------------------------

CUT_OFF = {
    "EOF after text with finish_reason null": [sse(chunk({"content": "def f(x):\n    return"}))],
    "a last zero-length chunk, then EOF": [sse(chunk({"content": "def f(x):\n    return"})), sse(chunk({}))],
    "usage but no finish_reason, then EOF": [sse(chunk({"content": "def f(x):\n    return"})), sse(USAGE)],
    "no trailing blank line, then EOF": [sse(chunk({"content": "def f(x):\n    return"}))[:-1]],
}


@pytest.mark.parametrize("body", CUT_OFF.values(), ids=CUT_OFF.keys())
def test_a_stream_that_stops_without_finishing_is_a_cut_off_reply(session, alice, server, body):
    server.will_answer(*body)
    events = run_message(session, alice)
    assert text_of(events) == "def f(x):\n    return"  # the text is kept
    errors = [e.payload["message"] for e in events if e.kind == "error"]
    assert errors == [INCOMPLETE_REPLY]
    assert "cut off" in errors[0]
    assert last_turn_end(events) == "error"
    assert server.authorizations == [f"Bearer {KEY}"]  # the server's own key went with it


FINISHED = {
    "finish_reason without [DONE]": [sse(chunk({"content": "Done."})), sse(chunk({}, finish_reason="stop"))],
    "[DONE] without finish_reason": [sse(chunk({"content": "Done."})), DONE],
    "finish_reason length, then EOF": [sse(chunk({"content": "Done."})), sse(chunk({}, finish_reason="length"))],
}


@pytest.mark.parametrize("body", FINISHED.values(), ids=FINISHED.keys())
def test_a_stream_that_says_it_finished_is_a_normal_reply(session, alice, server, body):
    server.will_answer(*body)
    events = run_message(session, alice)
    assert text_of(events) == "Done."
    assert not [e for e in events if e.kind == "error"]
    assert last_turn_end(events) == "done"


@pytest.mark.parametrize(
    "body",
    [[DONE], [sse(chunk({}, finish_reason="stop")), DONE], [sse(chunk({"content": ""}, finish_reason="stop")),
                                                             sse(USAGE), DONE]],
    ids=["only [DONE]", "only a finish", "empty content, usage"],
)
def test_an_empty_reply_is_said_to_be_empty(session, alice, server, body):
    server.will_answer(*body)
    events = run_message(session, alice)
    notices = [e.payload["message"] for e in events if e.kind == "notice"]
    assert notices == [agent.EMPTY_REPLY]
    assert last_turn_end(events) == "done"
    from sessions_app.live.transcript_view import build_items

    assert any(item.get("text") == agent.EMPTY_REPLY for item in build_items(events))
    if any(b is not DONE and b"usage" in b for b in body):
        assert [e for e in events if e.kind == "usage"]


# --- 2. reasoning in every form ----------------------------------------------------------

REASONING = {
    "reasoning_content": ([sse(chunk({"reasoning_content": "Let me think."})), sse(chunk({"content": "Answer."}))],
                          "Let me think.", "Answer."),
    "reasoning": ([sse(chunk({"reasoning": "Let me think."})), sse(chunk({"content": "Answer."}))],
                  "Let me think.", "Answer."),
    "<think> inline in one chunk": ([sse(chunk({"content": "<think>Let me think.</think>\n\nAnswer."}))],
                                    "Let me think.", "Answer."),
    "<think> split across chunks": (
        [sse(chunk({"content": c})) for c in ["\n<th", "ink>Let me", " think.</th", "ink>", "\n", "Ans", "wer."]],
        "Let me think.", "Answer."),
    "<think> never closed": ([sse(chunk({"content": "<think>Let me think."}))], "Let me think.", ""),
    "a <think> inside the answer stays text": ([sse(chunk({"content": "Use <think> tags."}))], "", "Use <think> tags."),
    "a lone < at the start stays text": ([sse(chunk({"content": "<"})), sse(chunk({"content": "b>bold</b>"}))],
                                         "", "<b>bold</b>"),
}


@pytest.mark.parametrize(("body", "thought", "answer"), REASONING.values(), ids=REASONING.keys())
def test_reasoning_in_every_form_is_kept_as_reasoning_and_never_sent_back(session, alice, server, body,
                                                                           thought, answer):
    server.will_answer(*body, sse(chunk({}, finish_reason="stop")), DONE)
    server.will_answer(sse(chunk({"content": "ok"})), sse(chunk({}, finish_reason="stop")), DONE)
    events = run_message(session, alice, "first")
    assert text_of(events, "reasoning") == thought
    assert text_of(events) == answer
    assert not [e for e in events if e.kind in ("error", "notice")]  # reasoning only is not empty
    run_message(session, alice, "second")
    sent = server.requests[1]["messages"]
    assert all("think" not in m["content"].replace("<think> tags", "") for m in sent)
    assert all(thought not in m["content"] for m in sent if thought)
    roles = [m["role"] for m in sent]
    assert all(a != b for a, b in zip(roles, roles[1:], strict=False)), roles


# --- 3. never two user messages in a row -------------------------------------------------

def test_after_a_refused_request_the_next_one_still_alternates(session, alice, server):
    server.will_answer(b'{"error": {"code": 400, "message": "request exceeds the available context size"}}',
                       status=400, headers={"Content-Type": "application/json"})
    server.will_answer(sse(chunk({"content": "Hello."})), sse(chunk({}, finish_reason="stop")), DONE)
    run_message(session, alice, "hi")
    run_message(session, alice, "second")
    assert server.requests[1]["messages"] == [{"role": "user", "content": "hi\n\nsecond"}]


def test_a_template_that_enforces_alternation_accepts_the_fold(tmp_path, llama_server_bin, real_models_dir):
    """The real llama-server with a Gemma/Mistral-style template that raises on two user
    messages in a row: the unfolded history is refused, the folded one is answered."""
    template = tmp_path / "alternate.jinja"
    template.write_text(
        "{%- for message in messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif -%}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )
    transport = LocalTransport()
    model = next(p for p in real_models_dir.iterdir() if "mollm" in p.name.lower())
    key_file = tmp_path / "key"
    transport.write_private(str(key_file), KEY)
    spec = ServerSpec(binary=llama_server_bin, model_path=str(model), port=transport.free_port(),
                      params={"contextSize": 1024}, api_key_file=str(key_file))
    argv = [*build_argv(spec), "--chat-template-file", str(template), "--jinja"]
    proc = transport.spawn(argv, str(tmp_path / "log"))
    try:
        base = transport.base_url(spec.port)
        wait_until_ready(transport, proc, base, str(tmp_path / "log"), timeout=120, api_key=KEY)
        client = CompletionClient(base, api_key=KEY)
        sampling = {"max_tokens": 4, "temperature": 0}
        with pytest.raises(CompletionError, match="alternate"):
            list(client.stream([{"role": "user", "content": "hi"}, {"role": "user", "content": "second"}],
                               sampling=sampling))
        events = transcript_of(("message_taken", {"text": "hi"}), ("error", {"message": "context overflow"}),
                               ("turn_end", {"reason": "error"}), ("message_taken", {"text": "second"}))
        deltas = list(client.stream(transcript.build_messages(events), sampling=sampling))
        assert deltas, "the real server answered the folded conversation"
    finally:
        transport.stop(proc, grace=2)


def transcript_of(*steps):
    return [transcript.Event(seq=i, kind=kind, payload=payload) for i, (kind, payload) in enumerate(steps, 1)]


# --- 5. small ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("usage", "line"),
    [
        ({"seed": 1751817247}, "seed 1751817247"),
        ({"seed": 3, "finish_reason": "length"}, "seed 3 · finish: length"),
        ({"prompt_tokens": 10, "cached_tokens": 8, "completion_tokens": 2, "predicted_per_second": 31.25, "seed": 1,
          "finish_reason": "stop"}, "context 10 tokens · 8 warm · reply 2 tokens · 31.2 tok/s · seed 1"),
        # llama-server's own count when the OpenAI field is missing (docs/behaviour.md §5 warm prompts)
        ({"prompt_tokens": 812, "cache_n": 790}, "context 812 tokens · 790 warm"),
        ({}, ""),
    ],
)
def test_the_usage_line_has_no_stray_separator(usage, line):
    assert usage_line(usage) == line


# --- a step that lost its lease stops writing (two steps never write one turn) -----------------

@pytest.mark.django_db(transaction=True)  # the step runs in a thread of its own, on its own connection
def test_a_step_taken_over_mid_reply_stops_and_writes_nothing_more(session, alice, server, steps_run_here):
    import threading

    from django.db import connection

    server.will_answer(*[piece for i in range(40) for piece in (sse(chunk({"content": f"w{i} "})), 0.05)],
                       sse(chunk({}, finish_reason="stop")), DONE)
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "count")
    def run_step() -> None:
        try:
            agent.run_turn_step(session.pk)
        finally:
            connection.close()

    step = threading.Thread(target=run_step)
    step.start()
    try:
        wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="assistant_text").exists(), 20,
                 what="text to stream")
        # Another step takes the turn over (its worker thought this one dead).
        AgentSession.objects.filter(pk=session.pk).update(lease_owner="someone-else")
        last_seq = AgentSession.objects.get(pk=session.pk).last_seq
    finally:
        step.join(30)
    assert not step.is_alive()
    later = list(TranscriptEvent.objects.filter(session=session, seq__gt=last_seq))
    # At most the fragment being written at that instant: never a usage, an error or an end.
    assert all(e.kind == "assistant_text" for e in later) and len(later) <= 1, [e.kind for e in later]
    fresh = AgentSession.objects.get(pk=session.pk)
    assert fresh.turn_active and fresh.lease_owner == "someone-else"  # the turn is the new holder's
    text = "".join(e.payload["text"] for e in TranscriptEvent.objects.filter(session=session, kind="assistant_text"))
    assert "w39" not in text  # the stream was broken off, not read to its end


# --- found by trying to break it (docs/behaviour.md C31, C32, C01) -----------------------------

STOP = sse(chunk({}, finish_reason="stop"))


def test_a_byte_order_mark_before_think_is_still_reasoning(session, alice, server):
    server.will_answer(sse(chunk({"content": "\ufeff<think>plan</think>answer"})), STOP, DONE)
    events = run_message(session, alice)
    assert text_of(events, "reasoning") == "plan"
    assert text_of(events) == "answer"


@pytest.mark.parametrize("content", ["<think>\n\n</think>\n\n", "<think> </think>", "\n \n"])
def test_a_blank_think_block_or_blank_text_is_an_empty_reply(session, alice, server, content):
    server.will_answer(sse(chunk({"content": content})), STOP, DONE)
    events = run_message(session, alice)
    assert [e.payload["message"] for e in events if e.kind == "notice"] == [agent.EMPTY_REPLY]


def test_a_tool_call_the_server_never_named_is_not_silence(session, alice, server):
    server.will_answer(sse(chunk({"tool_calls": [{"index": 0, "id": "X", "type": "function",
                                                  "function": {"arguments": "{}"}}]})),
                       sse(chunk({}, finish_reason="tool_calls")), DONE)
    events = run_message(session, alice)
    assert [e.payload["message"] for e in events if e.kind == "notice"] == [agent.EMPTY_REPLY]


def test_a_call_begun_without_an_index_keeps_its_indexed_pieces(session, alice, server):
    server.will_answer(
        sse(chunk({"tool_calls": [{"id": "X", "type": "function", "function": {"name": "web_search", "arguments": ""}}]})),
        sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\": \"cats\"}"}}]})),
        sse(chunk({}, finish_reason="tool_calls")), DONE)
    events = run_message(session, alice)
    [start] = [e.payload for e in events if e.kind == "tool_start"]
    assert start["arguments"] == '{"q": "cats"}'
