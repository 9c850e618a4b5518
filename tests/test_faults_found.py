"""Faults found by trying to break Corral (each now a test). Names give the failure where
one applies (the list at the end of docs/behaviour.md)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from django.test import Client
from gguf import GGUFWriter

from machines_app import catalog
from machines_app.models import Machine, ModelFile
from sessions_app import actions, agent, transcript
from sessions_app.completions import CompletionClient
from sessions_app.events import load_events, record_event
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import grant_bypass, model_key, wait_for
from .helpers import fresh, payloads, text_reply, tool_call_reply
from .scripted_server import chunk, sse


@pytest.fixture
def scripted_session(alice, model_side, tmp_path, db):
    grant_bypass(alice)
    machine = Machine.objects.create(name="scripted", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle", permission_mode="bypassPermissions")
    port = int(model_side.url.rsplit(":", 1)[1])
    ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=1, start_time="0",
                                port=port, log_path="/dev/null")
    return session


# --- what a database cannot store ------------------------------------------------------


@pytest.mark.django_db
def test_a_nul_or_lone_surrogate_in_a_reply_is_stored_not_fatal(scripted_session, alice, model_side):
    lone_surrogate = b'data: {"choices": [{"index": 0, "delta": {"content": " \\ud800x"}}]}\n\n'
    model_side.will_answer(sse(chunk({"content": "before\u0000after"})), lone_surrogate,
                           sse(chunk({}, finish_reason="stop")), b"data: [DONE]\n\n")
    actions.do_send_message(scripted_session, alice, "hi")
    agent.run_turn_step(scripted_session.pk)
    text = "".join(p["text"] for p in payloads(scripted_session, "assistant_text"))
    assert text.startswith("before\ufffdafter") and not payloads(scripted_session, "error")
    assert payloads(scripted_session, "turn_end")[0]["reason"] == "done"


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_nul_bytes_in_a_real_commands_output_still_make_a_result(local_machine, alice, tmp_path, model_side):
    grant_bypass(alice)
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading", permission_mode="bypassPermissions",
    )
    start_server(session.pk)
    model_side.will_answer(*tool_call_reply(("exec_shell_command", '{"command": "printf \'a\\\\000b\'"}')))
    model_side.will_answer(*text_reply("ok"))
    actions.do_send_message(session, alice, "print a NUL")
    agent.run_turn_step(session.pk, client_factory=lambda _url, **kw: CompletionClient(model_side.url, **kw))
    output = payloads(session, "tool_end")[0]["output"]
    assert output.startswith("a\ufffdb") and not payloads(session, "error")


# --- C13: odd metadata never breaks the list ---------------------------------------------


def write_gguf(path, **kv):
    writer = GGUFWriter(str(path), kv.pop("arch", "llama"))
    for key, value in kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint64(key, value) if value >= 0 else writer.add_int32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.django_db
def test_case_c13_odd_metadata_is_listed_without_crashing_the_refresh(tmp_path):
    write_gguf(tmp_path / "nul.gguf", **{"general.name": "evil\x00name"})
    write_gguf(tmp_path / "long.gguf", **{"general.name": "n" * 400, "general.size_label": "s" * 200})
    write_gguf(tmp_path / "huge.gguf", **{"general.name": "Huge", "llama.context_length": 2**40})
    write_gguf(tmp_path / "neg.gguf", **{"general.name": "Neg", "llama.context_length": -5})
    write_gguf(tmp_path / "fine.gguf", **{"general.name": "Fine"})
    machine = Machine.objects.create(name="odd", models_dir=str(tmp_path))
    found = {m.key: m for m in catalog.refresh_models(machine)}
    assert set(found) == {"nul.gguf", "long.gguf", "huge.gguf", "neg.gguf", "fine.gguf"}
    assert "\x00" not in found["nul.gguf"].display_name
    assert len(found["long.gguf"].size_label) <= 50 and len(found["long.gguf"].display_name) <= 300
    assert found["huge.gguf"].context_length is None and found["neg.gguf"].context_length is None


# --- tool-call ids go into URLs -------------------------------------------------------------


@pytest.mark.django_db
def test_a_call_id_that_is_not_a_plain_token_is_replaced_and_the_page_renders(scripted_session, alice, model_side):
    AgentSession.objects.filter(pk=scripted_session.pk).update(permission_mode="manual")
    catalogue = [{"name": "get_info", "display_name": "Info", "writes": False, "origin": "machine", "server": None,
                  "remote_name": "get_info", "definition": {"type": "function", "function": {"name": "get_info"}}}]
    record_event(scripted_session.pk, "catalogue", {"tools": catalogue})
    model_side.will_answer(
        sse(chunk({"tool_calls": [{"index": 0, "id": "call/1 <x>", "function": {"name": "get_info", "arguments": ""}}]})),
        sse(chunk({}, finish_reason="tool_calls")), b"data: [DONE]\n\n",
    )
    actions.do_send_message(scripted_session, alice, "info")
    agent.run_turn_step(scripted_session.pk)
    call_id = payloads(scripted_session, "question")[0]["id"]
    assert call_id.startswith("call_") and "/" not in call_id
    client = Client()
    client.force_login(alice)
    assert client.get(f"/sessions/{scripted_session.pk}/").status_code == 200


# --- interrupt while llama-server sends nothing -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_interrupt_works_while_the_stream_stalls(scripted_session, alice, model_side, steps_run_here):
    model_side.will_answer(120.0, sse(chunk({"content": "late"})), b"data: [DONE]\n\n")  # a long prompt: nothing for 120 s
    actions.do_send_message(scripted_session, alice, "a very long prompt")
    def run_step() -> None:
        try:
            agent.run_turn_step(scripted_session.pk)
        finally:
            connection.close()  # this thread's own connection

    step = threading.Thread(target=run_step)
    step.start()
    wait_for(lambda: fresh(scripted_session).status == "running", 10, what="the step to start")
    time.sleep(0.5)
    actions.do_interrupt(fresh(scripted_session), alice)
    # 60 s only guards against a hang; it is half the stall, so a turn that ends proves it did not wait.
    wait_for(lambda: payloads(scripted_session, "turn_end"), 60, interval=0.02, what="the turn to end")
    assert payloads(scripted_session, "turn_end")[0]["reason"] == "interrupted"
    assert not model_side.finished.is_set(), "the step waited out the stall"
    assert "late" not in "".join(p["text"] for p in payloads(scripted_session, "assistant_text"))
    assert not payloads(scripted_session, "error")  # an interrupt is not a failure
    step.join(5)


# --- stop, restart and model change in awkward moments -------------------------------------------




@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_stop_with_an_open_question_refuses_it_and_the_queue_waits_for_a_restart(stack, fake_machine, alice, tmp_path):
    machine = fake_machine([{"tool_calls": [{"name": "exec_shell_command", "arguments": '{"command": "ls"}'}]},
                            {"text": "answer to the queued one"}])
    session = actions.do_create_session(alice, machine=machine, model_key=model_key(machine, "llama"),
                                        working_dir=str(tmp_path), server_params={}, sampling={}, permission_mode="manual")
    wait_for(lambda: fresh(session).status == "idle", 30, what="idle")
    actions.do_send_message(fresh(session), alice, "list")
    wait_for(lambda: payloads(session, "question"), 20, what="the question")
    actions.do_send_message(fresh(session), alice, "queued while asking")
    stop_server(session.pk)
    assert payloads(session, "answered")[0]["answer"] == "refuse"
    assert transcript.open_questions(load_events(session.pk)) == []
    assert fresh(session).status == "stopped" and not fresh(session).turn_active
    assert [q["text"] for q in transcript.pending_queue(load_events(session.pk))] == ["queued while asking"]
    actions.do_restart(fresh(session), alice)
    wait_for(lambda: len(payloads(session, "turn_end")) == 2 and not fresh(session).turn_active, 30,
             what="the queued message to run after the restart")
    assert payloads(session, "message_taken")[-1]["text"] == "queued while asking"
    assert "answer to the queued one" in "".join(p["text"] for p in payloads(session, "assistant_text"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_stop_mid_stream_keeps_the_queued_message_for_the_next_server(stack, fake_machine, alice, tmp_path):
    machine = fake_machine([{"text": " ".join(["baa"] * 200), "delay": 0.1}, {"text": "queued answered"}])
    session = actions.do_create_session(alice, machine=machine, model_key=model_key(machine, "llama"),
                                        working_dir=str(tmp_path), server_params={}, sampling={}, permission_mode="manual")
    wait_for(lambda: fresh(session).status == "idle", 30, what="idle")
    actions.do_send_message(fresh(session), alice, "talk")
    wait_for(lambda: payloads(session, "assistant_text"), 20, what="streaming")
    actions.do_send_message(fresh(session), alice, "QUEUED-MSG")
    stop_server(session.pk)
    wait_for(lambda: not fresh(session).turn_active, 10, what="the turn to end")
    assert [t["text"] for t in payloads(session, "message_taken")] == ["talk"]
    assert fresh(session).status == "stopped"
    actions.do_restart(fresh(session), alice)
    wait_for(lambda: len(payloads(session, "message_taken")) == 2 and not fresh(session).turn_active, 30,
             what="the queued message after restart")
    assert "queued answered" in "".join(p["text"] for p in payloads(session, "assistant_text"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_changing_the_model_while_loading_ends_idle_on_the_new_model(stack, fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_LOADING_SECONDS="3")
    session = actions.do_create_session(alice, machine=machine, model_key=model_key(machine, "llama"),
                                        working_dir=str(tmp_path), server_params={}, sampling={}, permission_mode="manual")
    wait_for(lambda: ServerRecord.objects.filter(session=session).exists(), 20, what="the first server")
    actions.do_change_model(fresh(session), alice, model_key(machine, "gemma3"))
    wait_for(lambda: fresh(session).status == "idle", 30, what="idle on the new model")
    time.sleep(1)
    assert fresh(session).status == "idle"
    assert ServerRecord.objects.get(session=session).model_key == model_key(machine, "gemma3")
    assert not [e for e in payloads(session, "error") if "exited" in e["message"]]


# --- hostile form input -----------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("overrides", [{"working_dir": "/tmp/" + "a" * 300}, {"working_dir": "/tmp/a\x00b"},
                                       {"machine": "abc"}])
def test_hostile_form_input_gets_a_form_error_not_a_500(local_machine, alice, tmp_path, overrides):
    client = Client()
    client.force_login(alice)
    data = {"machine": local_machine.pk, "model_key": model_key(local_machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto", **overrides}
    response = client.post("/sessions/new/", data)
    assert response.status_code == 200 and response.context["form"].errors
    assert not AgentSession.objects.exists() and ModelFile.objects.exists()
