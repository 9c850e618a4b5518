"""Session lifecycle with the real llama-server (docs/behaviour.md §4, §5, §10): queue,
withdraw, interrupt, clear, model switch, a server killed from outside, restarts."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from sessions_app import actions, transcript
from sessions_app.events import load_events
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import WSRecorder, model_key, wait_for
from .helpers import fresh, idle_session, llama_servers_on, payloads, replies_run_to_max_tokens, turns_ended

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def test_queued_messages_are_answered_in_order_and_a_withdrawn_one_never_sent(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=120)
    client = Client()
    client.force_login(alice)
    watcher = WSRecorder(stack.ws_url(session.pk), cookie=f"sessionid={client.cookies['sessionid'].value}",
                         origin=stack.base_url)
    try:
        actions.do_send_message(session, alice, "Tell me a long story about a shepherd.")
        actions.do_send_message(fresh(session), alice, "second: never mind")
        actions.do_send_message(fresh(session), alice, "third: and a short poem")
        queued = payloads(session, "message_queued")
        assert [q["text"] for q in queued] == ["second: never mind", "third: and a short poem"]
        client.post(f"/sessions/{session.pk}/queue/{queued[0]['id']}/drop/")
        turns_ended(session, 2)
        taken = payloads(session, "message_taken")
        assert [t["text"] for t in taken] == ["Tell me a long story about a shepherd.", "third: and a short poem"]
        assert taken[1]["queued_id"] == queued[1]["id"]
        assert all("never mind" not in t["text"] for t in taken)
        # one turn at a time: taken, end, taken, end
        order = [e.kind for e in TranscriptEvent.objects.filter(session=session, kind__in=["message_taken", "turn_end"])
                 .order_by("seq")]
        assert order == ["message_taken", "turn_end", "message_taken", "turn_end"]

        def ops_for(dom_id, op):
            return [o for m in watcher.messages for o in m["ops"] if o.get("id") == dom_id and o["op"] == op]

        wait_for(lambda: ops_for(f"q-{queued[0]['id']}", "remove") and ops_for(f"q-{queued[1]['id']}", "remove"),
                 10, what="both bubbles to resolve on the second client")
    finally:
        watcher.close()


def test_concurrent_senders_at_turn_boundaries_lose_nothing_and_never_overlap(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=4)
    texts = [f"client {c} message {m}" for c in range(4) for m in range(3)]

    def sender(c):
        client = Client()
        client.force_login(alice)
        for m in range(3):
            assert client.post(f"/sessions/{session.pk}/send/", {"text": f"client {c} message {m}"}).status_code == 200
            time.sleep(0.15 * (c + 1))
        connection.close()  # this thread's own connection

    threads = [threading.Thread(target=sender, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    turns_ended(session, len(texts), timeout=180)
    taken = [t["text"] for t in payloads(session, "message_taken")]
    assert sorted(taken) == sorted(texts)  # none lost, none twice
    kinds = [e.kind for e in TranscriptEvent.objects.filter(session=session, kind__in=["message_taken", "turn_end"])
             .order_by("seq")]
    assert kinds == ["message_taken", "turn_end"] * len(texts)  # never two turns at once
    assert transcript.pending_queue(load_events(session.pk)) == []


def test_interrupt_stops_a_real_stream_quickly_and_keeps_the_partial_reply(stack, local_machine, alice, tmp_path):
    replies_run_to_max_tokens(local_machine, tmp_path)  # SmolLM2 ended its essay before the kill in CI
    session = idle_session(local_machine, alice, tmp_path, max_tokens=1500)
    actions.do_send_message(session, alice, "Write a very long essay about wool, with many sections.")
    wait_for(lambda: len(payloads(session, "assistant_text")) >= 5, 60, what="streaming")
    actions.do_interrupt(fresh(session), alice)
    # 60 s only guards against a hang; what shows the stream was cut is below.
    wait_for(lambda: payloads(session, "turn_end"), 60, interval=0.02, what="the turn to end")
    assert payloads(session, "turn_end")[0]["reason"] == "interrupted"
    # llama-server reports usage only in a stream's last chunk: none means the 1500-token
    # reply was cut off, not waited out.
    assert not payloads(session, "usage")
    partial = "".join(p["text"] for p in payloads(session, "assistant_text"))
    assert partial
    messages = transcript.build_messages(load_events(session.pk))
    assert messages[-1] == {"role": "assistant", "content": partial}
    actions.do_send_message(fresh(session), alice, "Summarise that in one line.")
    turns_ended(session, 2)
    assert transcript.build_messages(load_events(session.pk))[1] == {"role": "assistant", "content": partial}


def test_model_switch_carries_the_conversation_to_the_other_real_model(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=30)
    first_pid = ServerRecord.objects.get(session=session).pid
    actions.do_send_message(session, alice, "My sheep is called Dolly. Remember that.")
    with pytest.raises(actions.SessionError, match="Stop the turn first"):
        actions.do_change_model(fresh(session), alice, model_key(local_machine, "gemma3"))
    turns_ended(session, 1)
    first_prompt = payloads(session, "usage")[-1]["prompt_tokens"]

    actions.do_change_model(fresh(session), alice, model_key(local_machine, "gemma3"))
    wait_for(lambda: fresh(session).status == "idle" and ServerRecord.objects.filter(session=session).exists(),
             120, what="the new model to load")
    record = ServerRecord.objects.get(session=session)
    assert record.pid != first_pid and record.model_key.startswith("gemma")
    assert not Path(f"/proc/{first_pid}").exists() or "Z" in Path(f"/proc/{first_pid}/stat").read_text().split()[2]
    assert payloads(session, "settings")[-1]["model_key"] == record.model_key

    actions.do_send_message(fresh(session), alice, "What is my sheep called?")
    turns_ended(session, 2)
    sent = transcript.build_messages(load_events(session.pk))
    assert [m["role"] for m in sent[:3]] == ["user", "assistant", "user"]
    # The second model was given the whole conversation: more prompt tokens than the
    # first request held, though its own message is short.
    assert payloads(session, "usage")[-1]["prompt_tokens"] > first_prompt


def test_a_killed_server_shows_exited_quickly_and_restart_brings_it_back(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=10)
    record = ServerRecord.objects.get(session=session)
    os.kill(record.pid, 9)
    # Nobody acts on the session: only the watch (every 2 s, a housekeeping round) can see the death, and
    # "exited" (not the health check's "unknown") says the process check saw it. 60 s only
    # guards against a hang.
    wait_for(lambda: fresh(session).status == "exited", 60, interval=0.05, what="exited")
    assert payloads(session, "error")[-1]["message"].startswith("llama-server exited")
    actions.do_restart(fresh(session), alice)
    wait_for(lambda: fresh(session).status == "idle", 120, what="idle again")
    assert ServerRecord.objects.get(session=session).pid != record.pid
    actions.do_send_message(fresh(session), alice, "hello again")
    turns_ended(session, 1)
    assert "".join(p["text"] for p in payloads(session, "assistant_text"))


def test_a_live_server_is_adopted_after_the_worker_and_daphne_restart(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=10)
    record = ServerRecord.objects.get(session=session)
    stack.stop_web()
    stack.stop_worker()
    stack.start_worker()
    stack.start_web()
    client = Client()
    client.force_login(alice)
    assert client.post(f"/sessions/{session.pk}/send/", {"text": "still there?"}).status_code == 200
    turns_ended(session, 1)
    assert "".join(p["text"] for p in payloads(session, "assistant_text"))
    adopted = ServerRecord.objects.get(session=session)
    assert (adopted.pid, adopted.api_key) == (record.pid, record.api_key)  # the same server keeps its key
    assert llama_servers_on(record.port) == [record.pid]  # no second server
    assert fresh(session).status == "idle"


def test_clear_makes_the_next_request_start_after_the_marker(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=40)
    actions.do_send_message(session, alice, "Tell me three facts about the wool of merino sheep in detail.")
    turns_ended(session, 1)
    actions.do_send_message(fresh(session), alice, "hi")
    turns_ended(session, 2)
    with_history = payloads(session, "usage")[-1]["prompt_tokens"]
    actions.do_clear(fresh(session), alice)
    actions.do_send_message(fresh(session), alice, "hi")
    turns_ended(session, 3)
    after_clear = payloads(session, "usage")[-1]["prompt_tokens"]
    assert after_clear < with_history / 2  # what the real server processed: only the new message
    assert transcript.build_messages(load_events(session.pk))[0] == {"role": "user", "content": "hi"}
    with pytest.raises(actions.SessionError, match="not supported for llama.cpp sessions"):
        actions.do_send_message(fresh(session), alice, "/compact")


def test_a_server_killed_mid_reply_goes_straight_to_exited(stack, local_machine, alice, tmp_path):
    replies_run_to_max_tokens(local_machine, tmp_path)  # SmolLM2 ended its essay before the kill in CI
    session = idle_session(local_machine, alice, tmp_path, max_tokens=1500)
    record = ServerRecord.objects.get(session=session)
    actions.do_send_message(session, alice, "Write a very long essay about shearing.")
    wait_for(lambda: len(payloads(session, "assistant_text")) >= 3, 60, what="streaming")
    os.kill(record.pid, 9)
    turns_ended(session, 1, timeout=20)
    wait_for(lambda: fresh(session).status == "exited", 5, what="exited")
    statuses = [p["status"] for p in payloads(session, "status")]
    assert statuses[-2:] == ["running", "exited"], statuses  # never shown idle on a dead server
    assert "".join(p["text"] for p in payloads(session, "assistant_text"))  # the partial reply stays


def _gone_or_zombie(pid: int) -> bool:
    """Whether the process has exited: no /proc entry, or a zombie. The entry can vanish
    between a check and a read (the process reaped meanwhile): that is gone too."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_deleting_a_session_hands_the_stop_to_a_task_and_leaves_no_process(stack, fake_machine, alice, tmp_path):
    """The stand-in ignores SIGTERM, so stopping takes the whole grace period and SIGKILL:
    the page's request must not wait for that; the worker does it."""
    machine = fake_machine(FAKE_IGNORE_TERM="1")
    session = idle_session(machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    client = Client()
    client.force_login(alice)
    response = client.post(f"/sessions/{session.pk}/delete/")
    assert response.status_code == 302
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    assert not ServerRecord.objects.filter(pk=record.pk).exists()
    wait_for(lambda: _gone_or_zombie(record.pid),
             30, what="the deleted session's server to be stopped")
