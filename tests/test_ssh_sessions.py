"""Sessions on a remote machine, end to end: the real llama-server started over SSH on the
test sshd (tests/sshd.py), replies streamed through the forward, tools run there in the
session's working directory, a dead peer, adoption after a restart (docs/ssh.md)."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import pytest
from django.test import Client

from machines_app import ssh
from machines_app.models import Machine
from machines_app.transports import ProcessId, SSHTransport, transport_for
from sessions_app import actions
from sessions_app.forms import NewSessionForm
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.records import key_path_for
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import grant_bypass, make_ssh_machine, model_key, wait_for
from .helpers import (
    events_of,
    fresh,
    idle_session,
    llama_servers_on,
    payloads,
    replies_run_to_max_tokens,
    step,
    text_reply,
    tool_call_reply,
    turns_ended,
)
from .sshd import SshServer

HOSTILE_DIRS = ["$(touch /tmp/pwned)", "'; rm -rf ~ #"]


def proc_of(record: ServerRecord) -> ProcessId:
    return ProcessId(record.pid, record.start_time)


# --- in this process: tools through the forward -----------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
@pytest.mark.parametrize("name", HOSTILE_DIRS)
def test_tools_run_on_the_remote_machine_in_a_hostile_working_directory(ssh_machine, alice, tmp_path, model_side,
                                                                        name):
    Path("/tmp/pwned").unlink(missing_ok=True)
    canary = Path.home() / f".corral-canary-{time.time_ns()}"
    canary.write_text("still here")
    workdir = tmp_path / name
    workdir.mkdir(parents=True)
    (workdir / "notes.txt").write_text("the sheep are in the north field\n")
    grant_bypass(alice)
    form = NewSessionForm(
        data={"machine": ssh_machine.pk, "model_key": model_key(ssh_machine, "llama"), "working_dir": str(workdir),
              "permission_mode": "bypassPermissions", "speculative": "auto"},
        user=alice,
    )
    assert form.is_valid(), form.errors
    assert form.cleaned_data["working_dir"] == str(workdir)
    session = AgentSession.objects.create(
        owner=alice, machine=ssh_machine, model_key=model_key(ssh_machine, "llama"), working_dir=str(workdir),
        server_params={"contextSize": 1024}, status="loading", permission_mode="bypassPermissions",
    )
    start_server(session.pk)
    assert fresh(session).status == "idle", [e.payload for e in events_of(session, "error")]
    record = ServerRecord.objects.get(session=session)
    transport = transport_for(ssh_machine)
    assert record.log_path == f"{transport.private_dir()}/session-{session.pk}-{record.port}.log"
    assert stat.S_IMODE(Path(record.log_path).stat().st_mode) == 0o600
    assert not Path(key_path_for(session, transport, record.port)).exists()  # read at start, then removed

    model_side.will_answer(*tool_call_reply(("exec_shell_command", '{"command": "pwd"}'),
                                            ("read_file", '{"path": "notes.txt"}')))
    model_side.will_answer(*text_reply("The sheep are in the north field."))
    actions.do_send_message(fresh(session), alice, "Where am I, and where are the sheep?")
    step(fresh(session), model_side)
    outputs = [e.payload for e in events_of(session, "tool_end")]
    assert outputs[0]["output"].startswith(str(workdir) + "\n") and outputs[0]["ok"]  # ran there, literally
    assert "north field" in outputs[1]["output"] and outputs[1]["ok"]
    assert events_of(session, "turn_end")[-1].payload["reason"] == "done"

    stop_server(session.pk)
    assert not transport.process_alive(proc_of(record)) and not llama_servers_on(record.port)
    assert not ServerRecord.objects.filter(session=session).exists()
    assert (ssh_machine.host_entry, record.port) not in ssh.open_forwards()  # no forward kept for it here
    assert canary.read_text() == "still here"
    canary.unlink()
    assert not Path("/tmp/pwned").exists()


@pytest.mark.django_db
def test_a_working_directory_missing_on_the_machine_is_refused_naming_it(ssh_machine, alice, tmp_path):
    missing = tmp_path / "not-there"
    form = NewSessionForm(
        data={"machine": ssh_machine.pk, "model_key": model_key(ssh_machine, "llama"), "working_dir": str(missing),
              "permission_mode": "manual", "speculative": "auto"},
        user=alice,
    )
    assert not form.is_valid()
    assert form.errors["working_dir"] == [f"There is no directory {missing} on {ssh_machine.name}."]


@pytest.mark.django_db
def test_a_session_on_an_unreachable_machine_is_refused_in_words(sshd, real_models_dir, llama_server_bin, alice,
                                                                tmp_path):
    from machines_app.transports import LocalTransport

    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, port=LocalTransport().free_port())
    form = NewSessionForm(data={"machine": machine.pk, "model_key": "x.gguf", "working_dir": str(tmp_path),
                                "permission_mode": "manual", "speculative": "auto"}, user=alice)
    assert not form.is_valid()
    assert any("is unreachable" in e for e in form.errors["machine"]), form.errors


# --- the running product: worker and daphne as subprocesses ------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_remote_session_streams_a_reply_and_stops_leaving_nothing(stack, ssh_machine, alice, tmp_path):
    session = idle_session(ssh_machine, alice, tmp_path, max_tokens=60)
    record = ServerRecord.objects.get(session=session)
    transport = transport_for(ssh_machine)
    assert transport.process_alive(proc_of(record))
    actions.do_send_message(session, alice, "Tell me a story about a shepherd.")
    turns_ended(session, 1)
    texts = [p["text"] for p in payloads(session, "assistant_text")]
    assert len(texts) >= 2 and "".join(texts).strip()  # streamed in pieces through the forward
    assert payloads(session, "turn_end")[-1]["reason"] in ("done", "length")
    client = Client()
    client.force_login(alice)
    page = client.get(f"/sessions/{session.pk}/").content.decode()
    assert ssh_machine.name in page  # the header names the machine
    client.post(f"/sessions/{session.pk}/stop/")
    wait_for(lambda: not ServerRecord.objects.filter(session=session).exists(), 30, what="the stop")
    assert fresh(session).status == "stopped"
    assert not transport.process_alive(proc_of(record)) and not llama_servers_on(record.port)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_dead_peer_makes_the_session_unknown_then_it_recovers(stack, tmp_path, real_models_dir, llama_server_bin,
                                                                 alice):
    from machines_app import catalog

    server = SshServer(tmp_path / "sshd")
    server.start()
    try:
        machine = make_ssh_machine(server, real_models_dir, llama_server_bin)
        catalog.refresh_models(machine)
        workdir = tmp_path / "work"
        workdir.mkdir()
        replies_run_to_max_tokens(machine, tmp_path)  # the link is cut mid-reply, never after it
        session = idle_session(machine, alice, workdir, max_tokens=1500)
        record = ServerRecord.objects.get(session=session)
        actions.do_send_message(session, alice, "Write a very long essay about shearing sheep.")
        wait_for(lambda: len(payloads(session, "assistant_text")) >= 3, 60, what="streaming")

        server.kill()
        # 60 s only guards against a hang; the error below says which path noticed the loss.
        wait_for(lambda: fresh(session).status == "unknown", 60, what="status unknown")
        errors = [p["message"] for p in payloads(session, "error")]
        assert any(f"Machine '{machine.name}' is unreachable" in m and "unknown until the machine answers" in m
                   for m in errors), errors
        # It was the link that broke, not llama-server: the reply's end says so.
        assert any(f"The link to machine '{machine.name}' broke while llama-server was replying" in m
                   for m in errors), errors
        assert not any("llama-server closed the connection" in m for m in errors), errors
        # The turn ended and its step let go of the lease: no worker thread waits on the dead link.
        turns_ended(session, 1, timeout=30)
        wait_for(lambda: not fresh(session).lease_owner, 30, what="the step's lease to be released")
        assert Machine.objects.get(pk=machine.pk).link_state == "unreachable"
        client = Client()
        client.force_login(alice)
        page = client.get(f"/sessions/{session.pk}/").content.decode()
        assert 'id="status-badge" data-status="unknown"' in page and machine.name in page

        server.start()  # the machine answers again; its llama-server never stopped
        wait_for(lambda: fresh(session).status == "idle", 30, what="back to idle")
        assert transport_for(machine).process_alive(proc_of(record))
        actions.do_send_message(fresh(session), alice, "Are you still there?")
        turns_ended(session, 2)
        assert payloads(session, "turn_end")[-1]["reason"] in ("done", "length")
        assert ServerRecord.objects.get(session=session).pid == record.pid
        assert Machine.objects.get(pk=machine.pk).link_state == "reachable"
    finally:
        for rec in ServerRecord.objects.filter(machine__port=server.port):
            if server.proc is None:
                server.start()
            transport_for(rec.machine).stop(proc_of(rec), grace=2)
            rec.delete()
        server.kill()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_dead_peer_whose_server_died_is_shown_exited(stack, tmp_path, real_models_dir, llama_server_bin, alice):
    import os
    import signal

    from machines_app import catalog

    server = SshServer(tmp_path / "sshd")
    server.start()
    try:
        machine = make_ssh_machine(server, real_models_dir, llama_server_bin)
        catalog.refresh_models(machine)
        session = idle_session(machine, alice, tmp_path, max_tokens=20)
        record = ServerRecord.objects.get(session=session)
        server.kill()
        wait_for(lambda: fresh(session).status == "unknown", 30, what="status unknown")
        os.kill(record.pid, signal.SIGKILL)  # the machine rebooted meanwhile, say
        server.start()
        wait_for(lambda: fresh(session).status == "exited", 30, what="exited")
        assert any("llama-server exited" in p["message"] for p in payloads(session, "error"))
    finally:
        server.kill()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_remote_server_is_adopted_after_corral_restarts(stack, ssh_machine, alice, tmp_path):
    session = idle_session(ssh_machine, alice, tmp_path, max_tokens=10)
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
    assert (adopted.pid, adopted.start_time, adopted.api_key) == (record.pid, record.start_time, record.api_key)
    assert llama_servers_on(record.port) == [record.pid]  # not started twice
    assert fresh(session).status == "idle"


# --- a peer that hangs rather than closes --------------------------------------------------------


@pytest.mark.django_db
def test_a_frozen_peer_is_noticed_and_no_thread_stays_blocked(tmp_path, real_models_dir, llama_server_bin):
    """sshd stopped (SIGSTOP), TCP still open: nothing answers. The heartbeat closes the
    link within HEARTBEAT_INTERVAL + DEAD_AFTER seconds and every operation is bounded."""
    server = SshServer(tmp_path / "sshd")
    server.start()
    try:
        machine = make_ssh_machine(server, real_models_dir, llama_server_bin)
        # No link report: the probe thread below must not wait on this test's open transaction.
        transport = SSHTransport(machine.name, transport_for(machine).target)
        assert transport.is_dir("/")
        link = ssh.link_for(transport.target)
        threads_before = threading.active_count()
        pids = server.freeze()
        try:
            wait_for(lambda: not link.active, ssh.HEARTBEAT_INTERVAL + ssh.DEAD_AFTER + 5, what="the link to be closed")
            outcome: list[object] = []

            def probe():
                try:
                    outcome.append(transport.is_dir("/"))
                except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
                    outcome.append(exc)

            worker = threading.Thread(target=probe)
            worker.start()
            worker.join(ssh.CONNECT_TIMEOUT * 3 + 5)
            assert not worker.is_alive(), "an SSH operation blocked past its timeouts"
            # Each wait above is bounded by the link's own timeouts; what ended the probe is the
            # closed link, said in words (not a sum of seconds).
            assert "unreachable" in str(outcome[0])
        finally:
            server.thaw(pids)
        wait_for(lambda: threading.active_count() <= threads_before + 1, 20, what="helper threads to end")
    finally:
        server.kill()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_machine_lost_while_loading_keeps_its_server_and_resumes(stack, tmp_path, real_models_dir, alice):
    """A link lost during a long load (the stand-in answers 503 for 25 s, as a multi-GB load does) is
    unknown, not exited: the server keeps loading there, and when the machine answers
    again the same process is waited for and becomes ready — never a second one."""
    from machines_app import catalog

    from .conftest import fake_server

    server = SshServer(tmp_path / "sshd")
    server.start()
    try:
        machine = make_ssh_machine(server, real_models_dir, fake_server(tmp_path, FAKE_LOADING_SECONDS="25"))
        catalog.refresh_models(machine)
        session = actions.do_create_session(
            alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
            server_params={}, sampling={}, permission_mode="manual",
        )
        wait_for(lambda: ServerRecord.objects.filter(session=session).exists(), 60, what="the server record")
        record = ServerRecord.objects.get(session=session)
        assert fresh(session).status == "loading"
        server.kill()
        wait_for(lambda: fresh(session).status == "unknown", 30, what="unknown while loading")
        assert ServerRecord.objects.filter(session=session).exists()  # not given up, not orphaned
        server.start()
        wait_for(lambda: fresh(session).status == "idle", 90, what="ready after the machine came back")
        ready = ServerRecord.objects.get(session=session)
        assert (ready.pid, ready.start_time) == (record.pid, record.start_time)
        assert [p["status"] for p in payloads(session, "status")] == ["unknown", "loading", "idle"]  # created loading
    finally:
        for rec in ServerRecord.objects.filter(machine__port=server.port):
            if server.proc is None:
                server.start()
            transport_for(rec.machine).stop(proc_of(rec), grace=2)
            rec.delete()
        server.kill()
