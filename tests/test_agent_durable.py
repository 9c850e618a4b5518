"""The gate and the loop with the real worker, daphne and websockets: questions reach every
watcher, a waiting question holds no worker, and a worker killed mid-step neither runs
anything twice nor leaves the session stuck.

The model side is the stand-in llama-server (a 135M model will not call a tool on demand);
the product, the worker, Redis, the database and the websockets are real.
"""

from __future__ import annotations

import signal
import time

import pytest
from django.test import Client

from sessions_app import actions, agent
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import WSRecorder, grant_bypass, model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def start_session(machine, user, tmp_path, **kw) -> AgentSession:
    session = actions.do_create_session(
        user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode=kw.get("mode", "manual"),
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    return AgentSession.objects.get(pk=session.pk)


def kinds(session, kind):
    return [e.payload for e in TranscriptEvent.objects.filter(session=session, kind=kind).order_by("seq")]


def watch(stack, session, user):
    client = Client()
    client.force_login(user)
    return client, WSRecorder(stack.ws_url(session.pk), cookie=f"sessionid={client.cookies['sessionid'].value}",
                              origin=stack.base_url)


def test_a_question_reaches_every_watcher_and_an_answer_from_one_runs_the_call(stack, fake_machine, alice, charlie_staff, tmp_path):
    (tmp_path / "plan.txt").write_text("graze the east meadow")
    machine = fake_machine([{"tool_calls": [{"name": "read_file", "arguments": '{"path": "plan.txt"}'}]},
                            {"text": "The plan is to graze the east meadow."}])
    session = start_session(machine, alice, tmp_path)
    alice_client, alice_ws = watch(stack, session, alice)
    _, charlie_ws = watch(stack, session, charlie_staff)
    try:
        alice_client.post(f"/sessions/{session.pk}/send/", {"text": "What is the plan?"})
        wait_for(lambda: kinds(session, "question"), 20, what="the question")
        call_id = kinds(session, "question")[0]["id"]

        def saw_question(ws):
            return any(f'id="question-{call_id}"' in op.get("html", "") for m in ws.messages for op in m["ops"])

        wait_for(lambda: saw_question(alice_ws) and saw_question(charlie_ws), 10, what="both browsers to see it")
        assert AgentSession.objects.get(pk=session.pk).status == "awaiting_input"
        response = alice_client.post(f"/sessions/{session.pk}/calls/{call_id}/answer/", {"answer": "allow_once"})
        assert response.status_code in (200, 302)
        wait_for(lambda: kinds(session, "turn_end"), 20, what="the turn to end")
        assert "graze the east meadow" in kinds(session, "tool_end")[0]["output"]

        def saw_output(ws):
            return any("graze the east meadow" in op.get("html", "") and "question-" not in op.get("html", "")
                       for m in ws.messages for op in m["ops"])

        wait_for(lambda: saw_output(alice_ws) and saw_output(charlie_ws), 10, what="the output on both pages")
    finally:
        alice_ws.close()
        charlie_ws.close()


def test_an_open_question_holds_no_worker(stack, fake_machine, alice, bob, tmp_path):
    stack.stop_worker()
    stack.start_worker(concurrency=1)
    try:
        asking = start_session(fake_machine([{"tool_calls": [{"name": "exec_shell_command", "arguments": '{"command": "ls"}'}]}]),
                               alice, tmp_path)
        other = start_session(fake_machine([{"text": "Hello from the other session."}]), bob, tmp_path)
        actions.do_send_message(asking, alice, "list files")
        wait_for(lambda: kinds(asking, "question"), 20, what="the question")
        actions.do_send_message(other, bob, "hello")
        wait_for(lambda: kinds(other, "turn_end"), 20, what="the other session's turn on the single-slot worker")
        assert "".join(p["text"] for p in kinds(other, "assistant_text")) == "Hello from the other session."
        assert AgentSession.objects.get(pk=asking.pk).status == "awaiting_input"
    finally:
        stack.stop_worker()
        stack.start_worker()


def test_a_worker_killed_mid_reply_ends_the_turn_once_and_the_session_goes_on(stack, fake_machine, alice, tmp_path):
    long_text = " ".join(f"word{i}" for i in range(60))
    machine = fake_machine([{"text": long_text, "delay": 0.25}, {"text": "Back again."}])
    session = start_session(machine, alice, tmp_path)
    actions.do_send_message(session, alice, "talk slowly")
    wait_for(lambda: len(kinds(session, "assistant_text")) >= 5, 20, what="the stream to start")
    stack.stop_worker(sig=signal.SIGKILL)
    partial = len(kinds(session, "assistant_text"))
    assert not kinds(session, "turn_end")
    stack.start_worker()
    wait_for(lambda: kinds(session, "turn_end"), 40, what="recovery to end the turn")
    assert [p["reason"] for p in kinds(session, "turn_end")] == ["interrupted"]
    assert kinds(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
    assert len(kinds(session, "assistant_text")) == partial  # nothing answered twice
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "are you there?")
    wait_for(lambda: len(kinds(session, "turn_end")) == 2, 30, what="the next turn")
    assert "Back again." in "".join(p["text"] for p in kinds(session, "assistant_text"))
    assert AgentSession.objects.get(pk=session.pk).status == "idle"


def test_a_worker_killed_while_a_command_runs_never_runs_it_again(stack, fake_machine, alice, tmp_path):
    counter = tmp_path / "runs"
    command = f"echo run >> {counter}; sleep 6"
    machine = fake_machine([{"tool_calls": [{"name": "exec_shell_command", "arguments": f'{{"command": "{command}"}}'}]},
                            {"text": "ok"}])
    grant_bypass(alice)
    session = start_session(machine, alice, tmp_path, mode="bypassPermissions")
    actions.do_send_message(session, alice, "run it")
    wait_for(lambda: kinds(session, "tool_running") and counter.exists(), 20, what="the command to start")
    stack.stop_worker(sig=signal.SIGKILL)
    stack.start_worker()
    wait_for(lambda: kinds(session, "turn_end"), 40, what="the turn to end after recovery")
    assert kinds(session, "tool_end")[0]["output"] == agent.WORKER_LOST_RESULT
    time.sleep(7)
    assert counter.read_text().count("run") == 1


def test_a_worker_killed_while_the_stream_is_quiet_has_stored_everything_before_the_last_window(
        stack, fake_machine, alice, tmp_path):
    """Streamed text waits at most agent.FRAGMENT_FLUSH_EVERY to be stored, even when no
    fragment follows it (docs/live-page.md): "beta" comes right after "alpha", then the
    model goes quiet for a long time. Both are stored during the pause, and a worker
    killed then has lost nothing of them; the recovery says the reply is partial."""
    machine = fake_machine([{"text": "alpha beta gamma", "delays": [0, 30, 0]}, {"text": "Back again."}])
    session = start_session(machine, alice, tmp_path)
    actions.do_send_message(session, alice, "talk, then pause")

    def stored_text():
        return "".join(p["text"] for p in kinds(session, "assistant_text"))

    wait_for(lambda: stored_text() == "alpha beta", 20, what="the text before the pause to be stored")
    stack.stop_worker(sig=signal.SIGKILL)
    stack.start_worker()
    wait_for(lambda: kinds(session, "turn_end"), 40, what="recovery to end the turn")
    assert [p["reason"] for p in kinds(session, "turn_end")] == ["interrupted"]
    assert kinds(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
    assert stored_text() == "alpha beta"  # all of it, once
