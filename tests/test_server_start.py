"""Starting, watching and stopping llama-server (docs/behaviour.md §5; docs/behaviour.md C08, C09, C21).

The real llama-server is used for C08 (a bad flag, a taken port, a file that is not a
model) and for the stop and watch paths; a stand-in only for a long 503 load (C09) and a
server that ignores SIGTERM (C21).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import httpx
import pytest

from machines_app import catalog
from machines_app.llama_server import ServerSpec, ServerStartError, build_argv, wait_until_ready
from machines_app.models import Machine
from machines_app.transports import LocalTransport, ProcessId
from sessions_app import actions
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.logs import log_path_for
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import model_key, wait_for

# --- the command line -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "has_mtp", "present", "absent"),
    [
        ({}, False, ["--host 127.0.0.1", "--tools all", "-np 1"], ["--spec-type", "-c ", "-ngl", "-t "]),
        ({"contextSize": 4096, "gpuLayers": 99, "threads": 4}, False, ["-c 4096", "-ngl 99", "-t 4"], []),
        ({}, True, ["--spec-type draft-mtp"], []),
        ({"speculative": "off"}, True, [], ["--spec-type"]),
        ({"speculative": "auto"}, False, [], ["--spec-type"]),
    ],
)
def test_it_builds_the_command_line_as_spec_5_says(params, has_mtp, present, absent):
    argv = build_argv(ServerSpec("/bin/llama-server", "/m/x.gguf", 8123, params, has_mtp))
    line = " ".join(argv) + " "
    assert argv[:3] == ["/bin/llama-server", "-m", "/m/x.gguf"]
    assert "--port 8123" in line
    assert "0.0.0.0" not in line
    for part in present:
        assert part + " " in line or line.endswith(part + " ")
    for part in absent:
        assert part not in line


# --- C08: the server dies at start, reported fast with its last words ---------------------


def _start_and_wait(argv: list[str], log: Path, port: int) -> str:
    """The ServerStartError of a start that must fail, once its process is gone. The 120 s
    wait is never reached: the message says the process exited (not "did not become ready
    within 120 s"), which is the "at once" path of wait_until_ready."""
    transport = LocalTransport()
    proc = transport.spawn(argv, str(log))
    with pytest.raises(ServerStartError) as info:
        wait_until_ready(transport, proc, transport.base_url(port), str(log), timeout=120)
    assert not transport.process_alive(proc)
    message = str(info.value)
    assert "llama-server exited while starting" in message and "did not become ready" not in message
    return message


def test_case_c08_bad_flag_is_reported_at_once_with_the_log_tail(llama_server_bin, real_models_dir, tmp_path):
    model = next(real_models_dir.glob("*SmolLM2*")) if list(real_models_dir.glob("*SmolLM2*")) else next(real_models_dir.iterdir())
    port = LocalTransport().free_port()
    argv = build_argv(ServerSpec(llama_server_bin, str(model), port, {})) + ["--something-bogus"]
    message = _start_and_wait(argv, tmp_path / "s.log", port)
    assert "--something-bogus" in message  # its own words: error: invalid argument: --something-bogus


def test_case_c08_taken_port_is_reported_with_the_log_tail(llama_server_bin, real_models_dir, tmp_path):
    model = sorted(real_models_dir.iterdir())[-1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = _start_and_wait(
            build_argv(ServerSpec(llama_server_bin, str(model), port, {"contextSize": 512})), tmp_path / "s.log", port
        )
    assert "bind" in message.lower()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_case_c08_a_file_that_is_not_a_model_ends_the_session_exited(stack, alice, hollow_machine, tmp_path):
    session = actions.do_create_session(
        alice, machine=hollow_machine, model_key="hollow.gguf", working_dir=str(tmp_path), server_params={},
        sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "exited", 60, what="exited")
    error = TranscriptEvent.objects.filter(session=session, kind="error").last()
    # One plain sentence first (what failed, what to try); the server's own last words beside it.
    assert error.payload["message"].startswith("llama-server could not load the model file")
    assert "\n" not in error.payload["message"] and error.payload["log"].strip()
    assert not ServerRecord.objects.filter(session=session).exists()


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_model_the_machine_does_not_have_before_starting_anything(stack, alice, local_machine, tmp_path):
    session = actions.do_create_session(
        alice, machine=local_machine, model_key="elsewhere/missing.gguf", working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "exited", 30, what="exited")
    error = TranscriptEvent.objects.filter(session=session, kind="error").last().payload["message"]
    assert "Machine 'local' has no model 'elsewhere/missing.gguf'" in error
    assert not ServerRecord.objects.filter(session=session).exists()


# --- C09 and C21 with the stand-in ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_case_c09_health_503_shows_loading_and_a_message_waits(stack, alice, fake_machine, tmp_path):
    machine = fake_machine(FAKE_LOADING_SECONDS="4")
    session = actions.do_create_session(
        alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: ServerRecord.objects.filter(session=session).exists(), 20, what="the server record")
    time.sleep(1.5)
    assert AgentSession.objects.get(pk=session.pk).status == "loading"
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "are you there?")  # accepted, waits
    assert TranscriptEvent.objects.filter(session=session, kind="message_taken").exists()
    assert not TranscriptEvent.objects.filter(session=session, kind="error").exists()
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status != "loading", 20, what="ready")
    # Once ready, the waiting message is taken up by a turn (the stand-in has no chat, so
    # the turn ends with the server's refusal — what matters is that it ran).
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 20, what="the turn")


@pytest.mark.django_db(transaction=True)
def test_case_c21_stop_kills_a_server_that_ignores_sigterm(stack, alice, fake_machine, tmp_path):
    machine = fake_machine(FAKE_IGNORE_TERM="1")
    session = actions.do_create_session(
        alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    record = ServerRecord.objects.get(session=session)
    proc = ProcessId(record.pid, record.start_time)
    stop_server(session.pk)
    # The stand-in ignores SIGTERM (its log says it got one): gone now, only SIGKILL after
    # the grace can have ended it.
    assert not LocalTransport().process_alive(proc)
    assert "cleaning up before exit" in Path(record.log_path).read_text()
    assert AgentSession.objects.get(pk=session.pk).status == "stopped"  # stopped on purpose, not exited
    assert not ServerRecord.objects.filter(session=session).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_start_reads_props_once_for_both_the_slot_key_and_the_ready_facts(stack, alice, fake_machine, tmp_path):
    machine = fake_machine(FAKE_BUILD_INFO="b1-stand-in")
    session = actions.do_create_session(
        alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 2048}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    record = ServerRecord.objects.get(session=session)
    asked = httpx.get(f"http://127.0.0.1:{record.port}/asked", headers={"Authorization": f"Bearer {record.api_key}"},
                      timeout=5).json()
    assert asked.count("GET /props") == 1
    assert record.slot_key  # the slot fingerprint came from it (it needs n_ctx and build_info) …
    ready = TranscriptEvent.objects.get(session=session, kind="server_ready").payload
    assert ready["n_ctx"] == 2048  # … and so did the server_ready facts


# --- the real server: stop, watch, adopt --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_it_notices_a_real_server_killed_from_outside_and_adopts_a_live_one(stack, alice, local_machine, tmp_path):
    session = actions.do_create_session(
        alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="idle")
    record = ServerRecord.objects.get(session=session)
    assert Path(record.log_path).stat().st_mode & 0o077 == 0, "the log must be owner-only"

    # Adoption: starting again while the recorded server lives does not start a second one.
    start_server(session.pk)
    assert ServerRecord.objects.get(session=session).pid == record.pid

    os.kill(record.pid, signal.SIGKILL)
    # Nobody acts on the session: only the watch (every 2 s) can see the death; "exited" (not
    # the health check's "unknown") says its process check did. 60 s only guards a hang.
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "exited", 60, what="exited after kill")
    error = TranscriptEvent.objects.filter(session=session, kind="error").last().payload["message"]
    assert error.startswith("llama-server exited")
    with pytest.raises(actions.SessionError, match="not running"):
        actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "hello?")


@pytest.mark.django_db(transaction=True)
def test_case_c21_stop_leaves_no_real_server_behind(stack, alice, local_machine, tmp_path):
    session = actions.do_create_session(
        alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="idle")
    record = ServerRecord.objects.get(session=session)
    stop_server(session.pk)
    assert not LocalTransport().process_alive(ProcessId(record.pid, record.start_time))
    assert not Path(f"/proc/{record.pid}").exists() or "Z" in Path(f"/proc/{record.pid}/stat").read_text().split()[2]


@pytest.mark.django_db(transaction=True)
def test_a_model_file_removed_after_discovery_is_refused_in_the_machines_terms(stack, alice, llama_server_bin,
                                                                              real_models_dir, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    source = next(p for p in real_models_dir.iterdir() if "SmolLM2" in p.name)
    (models / source.name).symlink_to(source.resolve())
    machine = Machine.objects.create(name="shrinking", models_dir=str(models), llama_server_path=llama_server_bin)
    catalog.refresh_models(machine)
    (models / source.name).unlink()
    session = actions.do_create_session(
        alice, machine=machine, model_key=source.name, working_dir=str(tmp_path), server_params={}, sampling={},
        permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "exited", 30, what="exited")
    error = TranscriptEvent.objects.filter(session=session, kind="error").last().payload["message"]
    assert "Machine 'shrinking' has no file" in error and "has to be on that machine" in error
    assert not ServerRecord.objects.filter(session=session).exists()


# --- found by trying to break it: a start's log is its own (docs/behaviour.md C08, C43) --------


def _machine_running(binary: str, models_dir) -> Machine:
    machine = Machine.objects.create(name=f"m-{time.monotonic_ns()}", models_dir=str(models_dir),
                                     llama_server_path=binary, workspace_roots="")
    catalog.refresh_models(machine)
    return machine


def _script(tmp_path, body: str) -> str:
    path = tmp_path / f"server-{time.monotonic_ns()}"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.django_db(transaction=True)
def test_the_last_words_of_a_failed_start_are_its_own(alice, real_models_dir, tmp_path):
    counter = tmp_path / "n"
    counter.write_text("0")
    binary = _script(tmp_path, f"n=$(cat {counter}); n=$((n+1)); echo $n > {counter}; "
                               "echo \"start $n: error: invalid argument: --flag$n\" >&2; exit 1")
    machine = _machine_running(binary, real_models_dir)
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    start_server(session.pk)
    AgentSession.objects.filter(pk=session.pk).update(status="loading")
    start_server(session.pk)
    errors = [e.payload for e in TranscriptEvent.objects.filter(session=session, kind="error").order_by("seq")]
    assert "--flag1" in errors[0]["log"] and "--flag1" in errors[0]["message"]  # the setting it refused, named
    assert "--flag2" in errors[1]["log"] and "--flag1" not in errors[1]["log"] + errors[1]["message"]


@pytest.mark.django_db(transaction=True)
def test_a_link_planted_at_the_log_path_is_not_written_through(alice, real_models_dir, tmp_path):
    machine = _machine_running(_script(tmp_path, "echo 'SERVER OUTPUT LINE'; exit 1"), real_models_dir)
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    transport = LocalTransport()
    Path(transport.private_dir()).mkdir(parents=True, exist_ok=True)
    port = transport.free_port()  # the start is made to pick this port, where the link waits
    link = Path(log_path_for(session, transport, port))
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    from unittest import mock

    with mock.patch("machines_app.transports.LocalTransport.free_port", return_value=port):
        start_server(session.pk)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not link.is_symlink() and "SERVER OUTPUT LINE" in link.read_text()
