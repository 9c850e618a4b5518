"""The transcript tells the whole story — reasoning whose opening tag was in the
prompt, a person's stop said as a stop, a cut-off non-streamed reply, exports that leave
nothing out, and import.

The shapes the real server cannot make on demand (a reply carrying only ``</think>`` from
a model that writes it, a JSON body with ``finish_reason: null``, a broken link) come from
the scripted server (tests/scripted_server.py) or the llama-server stand-in
(tests/fake_llama_server.py, a process of its own that a stop really kills); that a real
llama-server's prompt opens the block is learnt from the real server.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading

import pytest
from django.test import Client
from PIL import Image

from machines_app.llama_server import (
    Endpoint,
    ServerSpec,
    build_argv,
    opens_thinking,
    prompt_opens_thinking,
    wait_until_ready,
)
from machines_app.models import Machine
from machines_app.transports import LocalTransport, TransportError
from sessions_app import actions, agent, callcard, export, images, importing, transcript
from sessions_app.completions import INCOMPLETE_REPLY, CompletionClient, ReasoningDelta, TextDelta
from sessions_app.events import load_events, record_event
from sessions_app.models import AgentSession, StoredImage, TranscriptEvent
from sessions_app.servers import watch
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server
from sessions_app.transcript import Event

from .conftest import KEY, model_key, wait_for
from .helpers import DONE, fresh, payloads, run_message, text_of
from .scripted_server import chunk, sse

STOP = sse(chunk({}, finish_reason="stop"))


# --- 1. reasoning whose opening tag was in the prompt -------------------------------------------

OPENED = {
    "in one chunk": [sse(chunk({"content": "Thinking C</think>Answer C"}))],
    "split across chunks": [sse(chunk({"content": c})) for c in ["Think", "ing C</th", "ink>", "\n\nAns", "wer C"]],
    "a character a chunk": [sse(chunk({"content": c})) for c in "Thinking C</think>Answer C"],
    "the server splits it itself": [sse(chunk({"reasoning_content": "Thinking C"})),
                                    sse(chunk({"content": "Answer C"}))],
}


@pytest.mark.django_db
@pytest.mark.parametrize("body", OPENED.values(), ids=OPENED.keys())
def test_reasoning_opened_by_the_prompt_is_reasoning_and_never_sent_back(session, alice, server, body):
    record_event(session.pk, "server_ready", {"model_key": "m.gguf", "model": "M", "opens_thinking": True})
    server.will_answer(*body, STOP, DONE)
    server.will_answer(sse(chunk({"content": "ok"})), STOP, DONE)
    events = run_message(session, alice, "first")
    assert text_of(events, "reasoning") == "Thinking C"
    assert text_of(events) == "Answer C"
    run_message(session, alice, "second")
    sent = json.dumps(server.requests[1]["messages"])
    assert "Thinking" not in sent and "think>" not in sent
    assert server.requests[1]["messages"][1] == {"role": "assistant", "content": "Answer C"}


@pytest.mark.django_db
def test_a_whole_json_body_with_an_opened_block_is_split_too(session, alice, server):
    record_event(session.pk, "server_ready", {"model_key": "m.gguf", "model": "M", "opens_thinking": True})
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Thinking C</think>Answer C"},
                         "finish_reason": "stop"}]}
    server.will_answer(json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = run_message(session, alice)
    assert (text_of(events, "reasoning"), text_of(events)) == ("Thinking C", "Answer C")


@pytest.mark.parametrize(("prompt", "opened"), [
    ("<｜User｜>Hello<｜Assistant｜><think>\n", True),  # DeepSeek-R1 distills
    ("<|im_start|>assistant\n<think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking turned off by the template
    ("<|im_start|>assistant\n", False),
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", False),
])
def test_whether_a_rendered_prompt_opens_a_thinking_block(prompt, opened):
    assert opens_thinking(prompt) is opened


def test_the_real_server_says_its_prompt_opens_thinking_and_its_reply_is_reasoning(tmp_path, llama_server_bin,
                                                                                    real_models_dir):
    """The real llama-server with a custom Jinja template that ends the generation prompt
    with ``<think>`` (and ``--reasoning-format none``: the server splits nothing itself)."""
    template = tmp_path / "opens.jinja"
    template.write_text(
        "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}"
    )
    transport = LocalTransport()
    model = next(p for p in real_models_dir.iterdir() if "mollm" in p.name.lower())
    key_file = tmp_path / "key"
    transport.write_private(str(key_file), KEY)
    spec = ServerSpec(binary=llama_server_bin, model_path=str(model), port=transport.free_port(),
                      params={"contextSize": 1024}, api_key_file=str(key_file))
    argv = [*build_argv(spec), "--chat-template-file", str(template), "--jinja", "--reasoning-format", "none"]
    proc = transport.spawn(argv, str(tmp_path / "log"))
    try:
        base = transport.base_url(spec.port)
        wait_until_ready(transport, proc, base, str(tmp_path / "log"), timeout=120, api_key=KEY)
        assert prompt_opens_thinking(Endpoint(base, KEY)) is True
        deltas = list(CompletionClient(base, api_key=KEY).stream(
            [{"role": "user", "content": "hi"}], sampling={"max_tokens": 8, "temperature": 0}, opens_thinking=True))
        # SmolLM2 never writes </think>: all it says is inside the block the prompt opened.
        assert [d for d in deltas if isinstance(d, ReasoningDelta)]
        assert not [d for d in deltas if isinstance(d, TextDelta)]
    finally:
        transport.stop(proc, grace=2)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
@pytest.mark.parametrize("opens", [True, False])
def test_a_start_learns_once_whether_the_prompt_opens_thinking(fake_machine, alice, tmp_path, opens):
    machine = fake_machine([{"text": "Thinking C</think>Answer C"}], **({"FAKE_OPENS_THINKING": "1"} if opens else {}))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    start_server(session.pk)
    assert payloads(session, "server_ready")[0].get("opens_thinking", False) is opens
    actions.do_send_message(fresh(session), alice, "hi")
    agent.run_turn_step(session.pk)
    reasoning = "".join(p["text"] for p in payloads(session, "reasoning"))
    reply = "".join(p["text"] for p in payloads(session, "assistant_text"))
    assert (reasoning, reply) == (("Thinking C", "Answer C") if opens else ("", "Thinking C</think>Answer C"))


# --- 3. a non-streamed body with finish_reason null --------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("finish", [{"finish_reason": None}, {}], ids=["null", "missing"])
def test_a_whole_json_body_without_a_finish_reason_is_a_cut_off_reply(session, alice, server, finish):
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "def f(x):\n    return"}, **finish}]}
    server.will_answer(json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = run_message(session, alice)
    assert text_of(events) == "def f(x):\n    return"
    assert [e.payload["message"] for e in events if e.kind == "error"] == [INCOMPLETE_REPLY]
    assert [e.payload["reason"] for e in events if e.kind == "turn_end"] == ["error"]


# --- 2. a person's stop is said as a stop ------------------------------------------------------

def _streaming_session(fake_machine, alice, tmp_path, **env):
    machine = fake_machine([{"text": " ".join(["baa"] * 400), "delay": 0.05}], **env)
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    start_server(session.pk)
    assert fresh(session).status == "idle"
    actions.do_send_message(fresh(session), alice, "count the sheep")
    step = threading.Thread(target=agent.run_turn_step, args=(session.pk,))
    step.start()
    wait_for(lambda: payloads(session, "assistant_text"), 30, what="the reply to stream")
    return session, step


def _ends_as_stopped_by(session, who) -> None:
    assert not payloads(session, "error"), payloads(session, "error")  # a stop is no failure
    assert [p["reason"] for p in payloads(session, "turn_end")] == ["stopped"]
    assert "baa baa" in "".join(p["text"] for p in payloads(session, "assistant_text"))  # the reply kept
    assert agent.STOPPED_REPLY in [p["message"] for p in payloads(session, "notice")]  # … and marked cut
    assert payloads(session, "server_stopped") == [{"reason": "stopped", "by": actions.by(who)}]
    assert fresh(session).status == "stopped" and not fresh(session).turn_active
    markdown = export.to_markdown(load_events(session.pk))
    assert "Error" not in markdown
    assert agent.STOPPED_REPLY in markdown and "*llama-server stopped by alice.*" in markdown


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
def test_stop_server_while_a_reply_streams_the_kill_winning(fake_machine, alice, tmp_path):
    """The stop task kills the server at once, before the step's interrupt poll sees the
    flag: the broken stream is read as the stop it was."""
    session, step = _streaming_session(fake_machine, alice, tmp_path)
    actions.do_stop(fresh(session), alice)
    stop_server(session.pk, by=actions.by(alice))  # what the stop task does, now
    step.join(30)
    _ends_as_stopped_by(session, alice)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
def test_stop_server_while_a_reply_streams_the_poll_winning(fake_machine, alice, tmp_path):
    """The step sees the flag before the stop task runs: still a stop, and it hands the
    queued message to nobody while the server goes away."""
    session, step = _streaming_session(fake_machine, alice, tmp_path)
    actions.do_send_message(fresh(session), alice, "queued")
    actions.do_stop(fresh(session), alice)
    step.join(30)
    assert [p["reason"] for p in payloads(session, "turn_end")] == ["stopped"]
    stop_server(session.pk, by=actions.by(alice))
    _ends_as_stopped_by(session, alice)
    assert [q["text"] for q in transcript.pending_queue(load_events(session.pk))] == ["queued"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
def test_stop_then_restart_are_said_in_that_order(fake_machine, alice, tmp_path, settings):
    """The stand-in ignores SIGTERM, so the stop takes its grace period: the status stays
    until the process is gone, a Restart meanwhile is refused, and one after follows it."""
    settings.CORRAL_STOP_GRACE = 2.0
    machine = fake_machine(FAKE_IGNORE_TERM="1")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    start_server(session.pk)
    stopping = threading.Thread(target=stop_server, args=(session.pk,), kwargs={"by": actions.by(alice)})
    stopping.start()
    wait_for(lambda: ServerRecord.objects.filter(session=session, stopping=True).exists(), 10, interval=0.02,
             what="the stop to begin")
    assert fresh(session).status == "idle"  # not "stopped" before it is
    with pytest.raises(actions.SessionError, match="still stopping"):
        actions.do_restart(fresh(session), alice)
    stopping.join(30)
    assert fresh(session).status == "stopped"
    actions.do_restart(fresh(session), alice)
    kinds = [(e.kind, e.payload) for e in load_events(session.pk) if e.kind in ("server_stopped", "status")]
    stopped = kinds.index(("server_stopped", {"reason": "stopped", "by": actions.by(alice)}))
    restarted = kinds.index(("status", {"status": "loading", "by": actions.by(alice)}))
    assert stopped < kinds.index(("status", {"status": "stopped"})) < restarted
    markdown = export.to_markdown(load_events(session.pk))
    assert markdown.index("*llama-server stopped by alice.*") < markdown.index("*llama-server restarted by alice.*")


class _LostLink(LocalTransport):
    def process_alive(self, proc):
        raise TransportError("Machine 'scripted' is unreachable: the SSH connection was lost")


@pytest.mark.django_db
def test_a_link_that_breaks_mid_reply_is_named_not_the_server(session, alice, server, monkeypatch):
    monkeypatch.setattr(watch, "transport_for", lambda machine: _LostLink())
    server.will_answer(sse(chunk({"content": "half a rep"})))  # the forward closes: no finish
    events = run_message(session, alice)
    errors = [e.payload["message"] for e in events if e.kind == "error"]
    assert len(errors) == 1 and "The link to machine 'scripted' broke" in errors[0], errors
    assert "SSH connection was lost" in errors[0] and "llama-server closed" not in errors[0]
    assert "cut off" in errors[0]
    assert text_of(events) == "half a rep"
    assert fresh(session).status == "unknown"


# --- 4. exports leave nothing out --------------------------------------------------------------

def _png(colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buffer, "PNG")
    return buffer.getvalue()


def every_kind(alice_actor: dict, image: dict) -> list[tuple[str, dict]]:
    """A transcript holding every event kind, the hard shapes among them."""
    malformed = {"id": "call_bad", "tool": "read_file", "arguments": "{}", "raw_arguments": '{"path": "a',
                 "origin": "builtin", "server": None, "writes": False, "display_name": "Read file"}
    malformed.update(callcard.recorded("read_file", '{"path": "a', working_dir="/w"))
    good = {"id": "call_ok", "tool": "read_file", "arguments": '{"path": "notes.txt"}', "raw_arguments": None,
            "origin": "builtin", "server": None, "writes": False, "display_name": "Read file"}
    good.update(callcard.recorded("read_file", '{"path": "notes.txt"}', working_dir="/w"))
    scope = {"kind": "path", "path": "notes.txt"}
    return [
        ("settings", {"model_key": "m.gguf", "model": "M", "permission_mode": "manual", "title": "Flock",
                      "by": alice_actor}),
        ("status", {"status": "loading"}),
        ("server_ready", {"model_key": "m.gguf", "model": "M", "chat_template": "", "jinja": True,
                          "opens_thinking": True}),
        ("catalogue", {"tools": []}),
        ("status", {"status": "idle"}),
        ("message_taken", {"text": "look at this", "queued_id": None, "by": alice_actor, "images": [image]}),
        ("reasoning", {"text": "Thinking C"}),
        ("assistant_text", {"text": "A sheep."}),
        ("usage", {"prompt_tokens": 10, "completion_tokens": 2, "finish_reason": "stop"}),
        ("turn_end", {"reason": "done"}),
        ("message_taken", {"text": "again", "queued_id": None, "by": alice_actor, "replaces": 6}),
        ("assistant_text", {"text": "A goat."}),
        ("message_queued", {"id": "q1", "text": "later", "by": alice_actor}),
        ("message_dropped", {"id": "q1", "by": alice_actor}),
        ("message_queued", {"id": "q2", "text": "still queued", "by": alice_actor}),
        ("turn_end", {"reason": "done"}),
        ("message_taken", {"text": "read it", "queued_id": None, "by": alice_actor, "replaces": 11, "edited": True}),
        ("tool_start", malformed),
        ("tool_end", {"id": "call_bad", "output": agent.MALFORMED_RESULT.format(tool="read_file", error="x"),
                      "ok": False}),
        ("tool_start", good),
        ("question", {"id": "call_ok", "tool": "read_file", "offers": [{"scope": scope}]}),
        ("answered", {"id": "call_ok", "tool": "read_file", "answer": "allow_always", "by": alice_actor,
                      "scope": scope}),
        ("tool_running", {"id": "call_ok"}),
        ("tool_end", {"id": "call_ok", "output": "the sheep are in the north field", "ok": True}),
        ("allowance_revoked", {"seq": 22, "tool": "read_file", "scope": scope, "by": alice_actor}),
        ("answered", {"id": "call_ok", "tool": "read_file", "answer": "allow_always", "by": alice_actor,
                      "scope": scope}),
        ("assistant_text", {"text": "The sheep are north and I will"}),
        ("notice", {"message": agent.STOPPED_REPLY}),
        ("turn_end", {"reason": "stopped"}),
        ("server_stopped", {"reason": "stopped", "by": alice_actor}),
        ("status", {"status": "stopped"}),
        ("status", {"status": "loading", "by": alice_actor}),
        ("server_stopped", {"reason": "restart"}),
        ("server_stopped", {"reason": "idle"}),
        ("status", {"status": "loading", "by": alice_actor}),
        ("message_taken", {"text": "go on", "queued_id": None, "by": alice_actor}),
        ("interrupted", {"by": alice_actor}),
        ("error", {"message": "llama-server stopped mid-reply", "log": "raw"}),
        ("turn_end", {"reason": "interrupted"}),
        ("version_chosen", {"seq": 6, "by": alice_actor}),
        ("cleared", {"by": alice_actor}),
        ("imported", {"by": alice_actor, "events": 3, "first_seq": 1}),
    ]


def _events(steps) -> list[Event]:
    return [Event(seq, kind, payload) for seq, (kind, payload) in enumerate(steps, 1)]


def test_the_every_kind_transcript_holds_every_kind():
    kinds = {kind for kind, _ in every_kind({"id": 1, "username": "alice"}, {"sha256": "0" * 64,
                                                                          "media_type": "image/png", "size": 1})}
    assert kinds == {str(k) for k in transcript.Kind}


def test_the_markdown_export_leaves_nothing_out():
    alice = {"id": 1, "username": "alice"}
    markdown = export.to_markdown(_events(every_kind(alice, {"sha256": "a" * 64, "media_type": "image/png",
                                                             "size": 9})))
    for note in ("*llama-server stopped by alice.*", "*llama-server stopped for the restart.*",
                 "*llama-server restarted by alice.*", "*llama-server put to sleep after its idle time.",
                 "*llama-server woken by alice.*", "*Interrupted by alice.*", "Conversation cleared by alice",
                 "Imported by alice from an export"):
        assert note in markdown, note
    # Sleep, then wake, in that order, after the stop and the restart.
    assert (markdown.index("stopped by alice.") < markdown.index("restarted by alice")
            < markdown.index("put to sleep") < markdown.index("woken by alice"))
    # The reply cut by Stop server reads as cut, right after it.
    assert markdown.index("The sheep are north and I will") < markdown.index(agent.STOPPED_REPLY)
    # Regenerate and Edit say which message they replaced: the model no longer saw its reply.
    assert "*Sent again (Regenerate) in place of alice's message “look at this”" in markdown
    assert "*Edited and sent again in place of alice's message “again”" in markdown
    assert "*alice went back to the version “look at this”: from here the model sees that message" in markdown
    assert markdown.count("the model no longer saw that message, its reply or anything after it") == 2
    # The malformed call: the text the model wrote, the page's flag, and why it did not run.
    assert '{"path": "a' in markdown
    assert "did not parse as a JSON object" in markdown and "this call is not run" in markdown
    assert "its arguments were not valid JSON" in markdown


def test_an_old_transcript_whose_turn_ended_stopped_mid_reply_reads_as_cut():
    events = _events([("message_taken", {"text": "hi", "queued_id": None}),
                      ("assistant_text", {"text": "Hello the"}),
                      ("turn_end", {"reason": "stopped"}),
                      ("server_stopped", {"reason": "stopped", "by": {"id": 1, "username": "bob"}})])
    markdown = export.to_markdown(events)
    assert markdown.index("Hello the") < markdown.index("cut off") < markdown.index("stopped by bob")


# --- 5. import ---------------------------------------------------------------------------------

@pytest.fixture
def original(alice, bob, tmp_path, settings):
    """A stored session whose transcript holds every kind, with a real stored image."""
    settings.DATA_DIR = str(tmp_path / "data")
    data = _png()
    ref = images.check_image(images.Upload("sheep.png", data))
    images.store(images.Upload("sheep.png", data), ref)
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=bob, machine=machine, model_key="m.gguf", working_dir="/",
                                          title="Flock", status="stopped")
    for kind, payload in every_kind(actions.by(bob), ref):
        record_event(session.pk, kind, payload)
    return session, ref, data


def _export(user, session) -> bytes:
    client = Client()
    client.force_login(user)
    response = client.get(f"/sessions/{session.pk}/export.jsonl")
    assert response.status_code == 200
    return response.content


def _import_form(machine, tmp_path, content: bytes, name="session.jsonl") -> dict:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return {"machine": machine.pk, "model_key": model_key(machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto",
            "transcript": SimpleUploadedFile(name, content, content_type="application/x-ndjson")}


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_export_then_import_round_trip_on_every_kind(original, alice, bob, fake_machine, tmp_path):
    session, ref, data = original
    body = _export(bob, session)
    stored = list(TranscriptEvent.objects.filter(session=session).order_by("seq"))
    assert body.decode().count("\n") == len(stored) + 1  # every event, then the image
    assert [(e.seq, e.kind, e.payload) for e in export.read_jsonl(body.decode())] == [
        (e.seq, e.kind, e.payload) for e in stored]

    machine = fake_machine()
    StoredImage.objects.filter(pk=ref["sha256"]).delete()  # the image comes back from the file, not from the database
    client = Client()
    client.force_login(alice)  # someone else imports bob's export: it becomes alice's session
    response = client.post("/sessions/new/", _import_form(machine, tmp_path, body))
    assert response.status_code == 302, response.content.decode()[:2000]
    new = AgentSession.objects.exclude(pk=session.pk).get()
    assert new.owner == alice and new.title == "Flock" and new.machine == machine
    assert images.read(ref) == data  # re-attached from the file

    events = load_events(new.pk)
    assert events[0].kind == "settings" and events[0].payload["by"] == actions.by(alice)
    imported = events[1:1 + len(stored)]
    delta = imported[0].seq - stored[0].seq
    for before, after in zip(stored, imported, strict=True):
        assert after.seq == before.seq + delta and after.kind == before.kind
        expected = dict(before.payload)
        if "by" in expected:
            expected["by"] = "bob"  # who did what kept as text only
        if before.kind == "message_taken" and "replaces" in expected:
            expected["replaces"] += delta
        if before.kind in ("allowance_revoked", "version_chosen"):
            expected["seq"] += delta
        assert after.payload == expected
        assert transcript.actor(after.payload) in (None, {"id": None, "username": "bob"})
    last = events[-1]
    assert last.kind == "imported" and last.payload == {"by": actions.by(alice), "events": len(stored),
                                                        "first_seq": 1}
    # Nothing granted or queued there is in force here; the conversation is.
    assert transcript.allowances(events) == []
    assert transcript.pending_queue(events) == []
    assert transcript.last_server_ready(events) == {} and transcript.last_catalogue(events) == []
    assert not transcript.open_turn(events)
    page = client.get(f"/sessions/{new.pk}/")
    assert page.status_code == 200 and "Imported by alice from an export" in page.content.decode()
    assert '<div id="allowances"></div>' in page.content.decode()  # nothing allowed here
    assert [m["role"] for m in transcript.build_messages(events)] == []  # the file's last act was a Clear
    # The imported session's own export reads back into its own events again.
    again = export.read_jsonl(_export(alice, new).decode())
    assert [(e.seq, e.kind, e.payload) for e in again] == [(e.seq, e.kind, e.payload) for e in load_events(new.pk)]


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_an_import_continues_the_conversation_and_closes_what_was_left_open(alice, bob, fake_machine, tmp_path):
    bobs = {"id": alice.pk, "username": "bob"}  # an id that is alice's here: it must not make bob alice
    open_call = {"id": "call_1", "tool": "exec_shell_command", "arguments": '{"command": "rm -rf ~"}',
                 "raw_arguments": None, "input": {"command": "rm -rf ~"}, "origin": "builtin", "server": None,
                 "writes": True, "display_name": "Run a command"}
    lines = [
        {"seq": 1, "kind": "message_taken", "payload": {"text": "hi", "queued_id": None, "by": bobs}},
        {"seq": 2, "kind": "assistant_text", "payload": {"text": "Hello."}},
        {"seq": 3, "kind": "turn_end", "payload": {"reason": "done"}},
        {"seq": 4, "kind": "message_taken", "payload": {"text": "clean up", "queued_id": None, "by": bobs}},
        {"seq": 5, "kind": "tool_start", "payload": open_call},
        {"seq": 6, "kind": "question", "payload": {"id": "call_1", "tool": "exec_shell_command"}},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    client = Client()
    client.force_login(alice)
    response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, body))
    assert response.status_code == 302
    new = AgentSession.objects.get(owner=alice)
    events = load_events(new.pk)
    assert all(transcript.actor(e.payload) != actions.by(alice) for e in events[1:-1])
    assert [e.payload["by"] for e in events if e.kind == "message_taken"] == ["bob", "bob"]
    assert transcript.pending_calls(events) == [] and transcript.open_questions(events) == []
    assert not transcript.open_turn(events)
    assert [p["output"] for p in (e.payload for e in events if e.kind == "tool_end")] == [importing.NOT_RUN_HERE]
    # The model is sent the imported conversation, and never asked to run the open call.
    messages = transcript.build_messages(events)
    assert messages[:2] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    assert messages[-1]["role"] == "tool" and messages[-1]["content"] == importing.NOT_RUN_HERE


def _file(*lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


MSG = {"seq": 1, "kind": "message_taken", "payload": {"text": "hi", "queued_id": None}}
PNG = _png()
HOSTILE = {
    "not JSON": (_file(MSG, "{not json"), "Line 2: not an exported event"),
    "an unknown kind": (_file(MSG, {"seq": 2, "kind": "become_admin", "payload": {}}), "Line 2: unknown event kind"),
    "a payload of the wrong shape": (_file({"seq": 1, "kind": "message_taken", "payload": {"text": "x"}}),
                                     "Line 1: message_taken payload: missing ['queued_id']"),
    "a seq gap": (_file(MSG, {**MSG, "seq": 5}), "Line 2: seq 5 does not follow seq 1"),
    "text that is not text": (_file({**MSG, "payload": {"text": 7, "queued_id": None}}),
                              "Line 1: message_taken's text must be text"),
    "a by that is a number": (_file({**MSG, "payload": {"text": "x", "queued_id": None, "by": 1}}),
                              "Line 1: who did it (by) must be a name"),
    "an image path": (_file({**MSG, "payload": {"text": "x", "queued_id": None, "images": [
        {"sha256": "../../../../etc/passwd", "media_type": "image/png", "size": 1}]}}),
        "Line 1: an image reference needs sha256 (64 hex digits)"),
    "a replaces ahead": (_file({**MSG, "payload": {"text": "x", "queued_id": None, "replaces": 2}}, {**MSG, "seq": 2}),
                         "Line 1: replaces names seq 2, which is not an earlier message"),
    "a result for no call": (_file(MSG, {"seq": 2, "kind": "tool_end", "payload": {"id": "c", "output": "x", "ok": True}}),
                             "Line 2: tool_end names call 'c', which no earlier tool_start"),
    "image data that is not its hash": (_file(MSG, {"image": {"sha256": "0" * 64, "media_type": "image/png",
                                                              "data": base64.b64encode(PNG).decode()}}),
                                        "Line 2: not an exported event (the image data does not hash to"),
    "image bytes that are not an image": (
        _file({**MSG, "payload": {"text": "x", "queued_id": None, "images": [
            {"sha256": hashlib.sha256(b"#!/bin/sh").hexdigest(), "media_type": "image/png", "size": 9}]}},
            {"image": {"sha256": hashlib.sha256(b"#!/bin/sh").hexdigest(), "media_type": "image/png",
                       "data": base64.b64encode(b"#!/bin/sh").decode()}}),
        "is not a PNG, JPEG, WebP or GIF image"),
    "a usage count that is not a number": (_file(MSG, {"seq": 2, "kind": "usage", "payload": {"prompt_tokens": "9"}}),
                                           "Line 2: usage's prompt_tokens must be a whole number"),
    "settings sampling that is not an object": (
        _file({"seq": 1, "kind": "settings", "payload": {"sampling": "hot"}}),
        "Line 1: settings's sampling must be an object"),
    "not UTF-8": (_file(MSG) + b"\xff\xfe", "Line 2: the file is not UTF-8 text"),
    "empty": (b"\n\n", "The file holds no events"),
}


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize(("content", "said"), HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_file_is_refused_naming_the_line_and_the_reason(alice, fake_machine, tmp_path, settings, content,
                                                                   said):
    settings.DATA_DIR = str(tmp_path / "data")
    client = Client()
    client.force_login(alice)
    response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, content))
    assert response.status_code == 200
    page = response.content.decode()
    from html import unescape

    assert said in unescape(page), unescape(page)[:3000]
    assert not AgentSession.objects.exists()  # nothing created, nothing half imported


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_a_bare_image_hash_never_reaches_an_image_stored_here(alice, bob, fake_machine, tmp_path, settings):
    """bob's private picture is stored here; alice knows its hash. Importing a file that
    names it without carrying it gives her nothing: the reference is left out."""
    settings.DATA_DIR = str(tmp_path / "data")
    secret = _png((1, 2, 3))
    ref = images.check_image(images.Upload("secret.png", secret))
    images.store(images.Upload("secret.png", secret), ref)
    line = {**MSG, "payload": {"text": "show me", "queued_id": None, "images": [ref]}}
    client = Client()
    client.force_login(alice)
    assert client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(line))).status_code == 302
    new = AgentSession.objects.get(owner=alice)
    events = load_events(new.pk)
    taken = [e.payload for e in events if e.kind == "message_taken"]
    assert taken == [{"text": "show me", "queued_id": None}]
    assert importing.IMAGES_LEFT_OUT.format(count=1) in [e.payload["message"] for e in events if e.kind == "notice"]
    assert client.get(f"/sessions/{new.pk}/images/{ref['sha256']}.png").status_code == 404


@pytest.mark.django_db
def test_import_is_only_for_someone_signed_in(fake_machine, tmp_path):
    response = Client().post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(MSG)))
    assert response.status_code in (302, 401, 403) and "/login" in response.get("Location", "/login")
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
def test_the_session_list_offers_the_import(alice):
    client = Client()
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert 'id="import-session"' in page
    form = client.get("/sessions/new/?import=1").content.decode()
    assert "Import a session" in form and 'enctype="multipart/form-data"' in form and 'name="transcript"' in form
