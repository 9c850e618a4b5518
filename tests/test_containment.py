"""A tool call cannot reach Corral (docs/security.md "What a tool
can reach").

The model side is scripted (tests/scripted_server.py); the tools are llama-server's own
``exec_shell_command``, run by the REAL server of a session, approved by its owner. Each
command tries something a tool must not be able to do, and prints ``LEAK-…`` only if it
worked.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

import paramiko
import pytest
import redis
from django.conf import settings
from django.test import Client

from machines_app import actions as machine_actions
from machines_app.llama_server import slot_dir, slot_file_name
from machines_app.models import Machine
from machines_app.sandbox import Sandbox, bwrap_argv, server_environment
from machines_app.transports import ProcessId, transport_for
from project import launcher
from sessions_app import actions
from sessions_app.models import AgentSession
from sessions_app.servers.containment import tool_view
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import grant_bypass, make_ssh_machine, model_key, wait_for
from .helpers import events_of, fresh, step, text_reply, tool_call_reply

#: A loopback client for Redis's protocol in the system's Python (a tool has no redis-cli).
REDIS_PROBE = (
    "python3 -c 'import socket,sys,time; s=socket.create_connection((\"127.0.0.1\",int(sys.argv[1])),3); "
    "s.sendall(b\"PING\\r\\nKEYS *\\r\\n\"); time.sleep(0.5); print(s.recv(4096))' {port}"
)


def start(machine, user, workdir: Path, **fields) -> AgentSession:
    session = AgentSession.objects.create(
        owner=user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(workdir),
        server_params={"contextSize": 1024}, status="loading", **fields,
    )
    start_server(session.pk)
    return fresh(session)


def run_approved(session, user, model_side, commands: list[str]) -> list[str]:
    """The model asks for each command through ``exec_shell_command``; the owner allows
    each one once; every call runs on the session's machine, as a tool of its real server
    would (Corral runs the shell itself, in the same sandbox). Their outputs, in order."""
    calls = [("exec_shell_command", json.dumps({"command": command})) for command in commands]
    model_side.will_answer(*tool_call_reply(*calls))
    model_side.will_answer(*text_reply("Done."))
    actions.do_send_message(fresh(session), user, "Run these, please.")
    step(fresh(session), model_side)
    for _ in commands:
        asked = {e.payload["id"] for e in events_of(session, "question")}
        answered = {e.payload["id"] for e in events_of(session, "answered")}
        waiting = [q for q in asked - answered]
        if not waiting:
            break
        question = next(e.payload for e in events_of(session, "question") if e.payload["id"] == waiting[0])
        assert question["tool"] == "exec_shell_command"
        actions.do_answer(fresh(session), user, question["id"], "allow_once")
        step(fresh(session), model_side)
    ends = [e.payload for e in events_of(session, "tool_end")][-len(commands):]
    assert len(ends) == len(commands)
    return [end["output"] for end in ends]


def a_private_key() -> str:
    import io

    out = io.StringIO()
    paramiko.RSAKey.generate(2048).write_private_key(out)
    return out.getvalue()


@pytest.fixture
def embedded_redis(tmp_path, monkeypatch):
    """An embedded Redis as ``./corral run`` starts it (the launcher's own function, in a
    data directory of its own), whatever Redis this test run was given."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("CORRAL_DATA_DIR", str(tmp_path / "redis-data"))
    proc = launcher.ensure_redis()
    url = os.environ["REDIS_URL"]
    yield url
    proc.stop()


# --- the embedded Redis asks for a password -------------------------------------------------------


def test_the_embedded_redis_answers_only_with_its_password(embedded_redis, tmp_path):
    url = redis.connection.parse_url(embedded_redis)
    assert len(url["password"]) >= 40 and url["host"] == "127.0.0.1"
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=url["port"]).ping()
    assert redis.Redis.from_url(embedded_redis).ping()
    # Not on any command line (``ps`` shows those to every user); its URL only in an
    # owner-only file of the data directory, the configuration file gone once read.
    redis_dir = tmp_path / "redis-data" / "redis"
    assert all(url["password"] not in " ".join(cmd) for cmd in _command_lines())
    assert stat.S_IMODE((redis_dir / "url").stat().st_mode) == 0o600
    assert (redis_dir / "url").read_text().strip() == embedded_redis
    assert not list(redis_dir.glob("*.conf"))
    # Celery's broker and the Channels layer take the same URL, password included.
    from project.broker import celery_broker

    assert f":{url['password']}@127.0.0.1:{url['port']}/0" in celery_broker(embedded_redis).url


def _command_lines() -> list[list[str]]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            pass
    return lines


# --- the sandbox's command line and environment --------------------------------------------------


def test_a_server_gets_no_secret_in_its_environment():
    environ = {"PATH": "/usr/bin", "HOME": "/home/c", "CUDA_VISIBLE_DEVICES": "0", "SECRET_KEY": "s",
               "DATABASE_URL": "postgres://x", "REDIS_URL": "redis://:pw@h/0", "CORRAL_DATA_DIR": "/d",
               "PGPASSWORD": "pw", "HF_TOKEN": "t", "SSH_AUTH_SOCK": "/tmp/agent", "GGML_CUDA_NO_VMM": "1"}
    assert server_environment(environ) == {"PATH": "/usr/bin", "HOME": "/home/c", "CUDA_VISIBLE_DEVICES": "0",
                                           "GGML_CUDA_NO_VMM": "1"}


def test_the_sandbox_hides_first_and_binds_back_after():
    argv = bwrap_argv("/usr/bin/bwrap", Sandbox(
        hide=("/srv/corral/data",), read_only=("/srv/corral",), mask=("/keys/gpu.key", "/srv/corral/data/x.key"),
        read=("/srv/corral/data/models/m.gguf", "/models/outside.gguf", ""), write=("/srv/corral/data/logs/slots/s-1",),
    ), ["/bin/llama-server", "-m", "/srv/corral/data/models/m.gguf"])
    assert argv[:8] == ["/usr/bin/bwrap", "--bind", "/", "/", "--unshare-pid", "--unshare-ipc", "--proc", "/proc"]
    assert "--die-with-parent" not in argv and "--new-session" not in argv  # servers outlive Corral, stops reach all
    text = " ".join(argv)
    assert text.index("--ro-bind /srv/corral /srv/corral") < text.index("--tmpfs /srv/corral/data") < text.index(
        "--ro-bind /srv/corral/data/models/m.gguf") < text.index("--bind /srv/corral/data/logs/slots/s-1")
    assert "--ro-bind /dev/null /keys/gpu.key" in text and "x.key" not in text  # inside the hidden dir: gone anyway
    assert "outside.gguf" not in text  # visible anyway
    assert argv[-3:] == ["/bin/llama-server", "-m", "/srv/corral/data/models/m.gguf"]


# --- the local machine: a tool cannot reach Corral ------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_an_approved_tool_on_the_local_machine_cannot_reach_corral(
    local_machine, alice, tmp_path, model_side, embedded_redis, steps_run_here
):
    data = Path(settings.DATA_DIR)
    secret = (data / "secret_key").read_text().strip()
    assert secret

    # A remote machine's key as the admin stores it: in the database (encrypted), whose file
    # is in the data directory.
    gpu = Machine.objects.create(name="gpu1", transport="ssh", host="gpu1.example", user="corral")
    machine_actions.do_store_private_key(gpu, a_private_key())
    assert Machine.objects.get(pk=gpu.pk).private_key_sealed

    # Another member's session, its server up, with a saved slot on disk.
    other_dir = tmp_path / "bob-work"
    other_dir.mkdir()
    other = start(local_machine, alice, other_dir)
    assert other.status == "idle", [e.payload for e in events_of(other, "error")]
    other_record = ServerRecord.objects.get(session=other)
    other_slot = Path(slot_dir(transport_for(local_machine).private_dir(), other.pk)) / slot_file_name(other.pk, 1)
    other_slot.write_text("bob's KV cache\n")

    workdir = tmp_path / "alice-work"
    workdir.mkdir()
    session = start(local_machine, alice, workdir)
    assert session.status == "idle", [e.payload for e in events_of(session, "error")]
    record = ServerRecord.objects.get(session=session)
    assert Machine.objects.get(pk=local_machine.pk).containment == Machine.Containment.CONTAINED
    # The recorded pid is the server itself (liveness, memory, adoption follow it).
    assert Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"llama-server")

    database = settings.DATABASES["default"]
    db_file = str(database.get("TEST", {}).get("NAME") or database["NAME"]) if "sqlite" in database["ENGINE"] else ""
    corral_redis = redis.connection.parse_url(settings.REDIS_URL)
    embedded_port = redis.connection.parse_url(embedded_redis)["port"]
    attempts = {
        "secret key": f"cat {shlex.quote(str(data / 'secret_key'))} && echo LEAK-secret",
        "data directory": f"ls -A {shlex.quote(str(data))} | grep -e secret_key -e sqlite3 -e ssh && echo LEAK-data",
        "other slot": f"cat {shlex.quote(str(other_slot))} && echo LEAK-slot",
        "embedded redis": REDIS_PROBE.format(port=embedded_port),
        "kill corral": f"kill -9 {os.getpid()} && echo LEAK-killed-corral",
        "kill other server": f"kill -9 {other_record.pid} && echo LEAK-killed-other",
        "corral environ": f"cat /proc/{os.getpid()}/environ && echo LEAK-environ",
        "own environment": "env",
        "corral code": f"touch {shlex.quote(str(Path(settings.BASE_DIR) / 'manage.py'))} && echo LEAK-code",
        "working directory": "echo 'the sheep are in the north field' > made.txt && cat made.txt",
    }
    if db_file:
        attempts["database file"] = f"head -c 16 {shlex.quote(db_file)} && echo LEAK-database"
    if corral_redis.get("password"):  # the run's own Redis is the embedded one
        attempts["corral redis"] = REDIS_PROBE.format(port=corral_redis["port"])
    outputs = dict(zip(attempts, run_approved(session, alice, model_side, list(attempts.values())), strict=True))

    for name, output in outputs.items():
        assert "LEAK-" not in output, (name, output)
        assert secret not in output and "PRIVATE KEY" not in output and "bob's KV cache" not in output, (name, output)
    assert "NOAUTH" in outputs["embedded redis"] and "PONG" not in outputs["embedded redis"]
    if "corral redis" in outputs:
        assert "NOAUTH" in outputs["corral redis"] and "PONG" not in outputs["corral redis"]
    for name in ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "CORRAL_"):
        assert name not in outputs["own environment"]
    assert "the sheep are in the north field" in outputs["working directory"]
    assert (workdir / "made.txt").read_text() == "the sheep are in the north field\n"
    # Nothing happened to what the tools went for.
    transport = transport_for(local_machine)
    assert transport.process_alive(ProcessId(other_record.pid, other_record.start_time))
    assert other_slot.read_text() == "bob's KV cache\n" and (data / "secret_key").read_text().strip() == secret
    assert fresh(session).status == "idle"


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_stop_ends_the_whole_sandbox_and_a_restarted_corral_adopts_the_server(local_machine, alice, tmp_path):
    session = start(local_machine, alice, tmp_path)
    assert session.status == "idle", [e.payload for e in events_of(session, "error")]
    record = ServerRecord.objects.get(session=session)
    transport = transport_for(local_machine)
    group = _group(record.pid)
    sandbox = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _group(pid) == group]
    assert len(sandbox) >= 3 and group != os.getpgrp()  # bubblewrap, its init, the server: a group of their own

    start_server(session.pk)  # as after a restart: the recorded server is adopted
    assert ServerRecord.objects.get(session=session).pid == record.pid

    stop_server(session.pk)
    assert not transport.process_alive(ProcessId(record.pid, record.start_time))
    wait_for(lambda: not [pid for pid in sandbox if _group(pid) == group] or not transport.process_alive(
        ProcessId(record.pid, record.start_time)), 10, what="every process of the sandbox, reaped")


def _group(pid: int) -> int | None:
    """The process group of a live process; None for one gone (or a zombie, ended)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[2])


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_without_bubblewrap_a_local_server_is_not_started_and_the_admin_says_why(
    local_machine, alice, django_user_model, tmp_path
):
    Machine.objects.filter(pk=local_machine.pk).update(bwrap_path="/nonexistent/bwrap")
    session = start(Machine.objects.get(pk=local_machine.pk), alice, tmp_path)
    assert session.status == "exited"
    error = events_of(session, "error")[-1].payload["message"]
    assert "was not started" in error and "bubblewrap (/nonexistent/bwrap) is not installed" in error
    assert not ServerRecord.objects.filter(session=session).exists()
    machine = Machine.objects.get(pk=local_machine.pk)
    assert machine.containment == Machine.Containment.EXPOSED

    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="root-password-1"))
    page = client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()
    assert "Tools on local are not contained" in page and "apt-get install bubblewrap" in page


# --- SSH machines ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_on_an_ssh_machine_with_bubblewrap_tools_cannot_read_corrals_private_directory(
    sshd, real_models_dir, llama_server_bin, alice, tmp_path, model_side, steps_run_here
):
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin)
    from machines_app import catalog

    catalog.refresh_models(machine)
    transport = transport_for(machine)
    private = Path(transport.private_dir())  # the test sshd is this very machine
    other = start(machine, alice, tmp_path)
    assert other.status == "idle", [e.payload for e in events_of(other, "error")]
    other_record = ServerRecord.objects.get(session=other)
    other_slot = Path(slot_dir(str(private), other.pk)) / slot_file_name(other.pk, 1)
    other_slot.write_text("bob's KV cache\n")

    workdir = tmp_path / "alice-work"
    workdir.mkdir()
    session = start(machine, alice, workdir)
    assert session.status == "idle", [e.payload for e in events_of(session, "error")]
    assert Machine.objects.get(pk=machine.pk).containment == Machine.Containment.CONTAINED
    outputs = run_approved(session, alice, model_side, [
        f"ls -A {shlex.quote(str(private))} | grep -e '^session-{other.pk}-' && echo LEAK-listing",
        f"cat {shlex.quote(str(other_slot))} && echo LEAK-slot",
        f"cat {shlex.quote(other_record.log_path)} && echo LEAK-log",
        f"kill -9 {other_record.pid} && echo LEAK-killed-other",
        "echo 'written over ssh' > made.txt && cat made.txt",
    ])
    for output in outputs[:4]:
        assert "LEAK-" not in output and "bob's KV cache" not in output, output
    assert "written over ssh" in outputs[4] and (workdir / "made.txt").exists()
    assert transport.process_alive(ProcessId(other_record.pid, other_record.start_time))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_on_an_ssh_machine_without_bubblewrap_the_server_starts_and_the_admin_warns(
    sshd, real_models_dir, llama_server_bin, alice, django_user_model, tmp_path, model_side, steps_run_here
):
    # "Not there": the name given for bubblewrap is found on no PATH of that machine.
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, bwrap_path="bwrap-not-installed-here")
    from machines_app import catalog

    catalog.refresh_models(machine)
    private = Path(transport_for(machine).private_dir())
    canary = private / f"canary-{time.time_ns()}.txt"
    canary.write_text("corral's private file\n")
    session = start(machine, alice, tmp_path)
    assert session.status == "idle", [e.payload for e in events_of(session, "error")]
    machine = Machine.objects.get(pk=machine.pk)
    assert machine.containment == Machine.Containment.EXPOSED
    assert "bwrap-not-installed-here) is not installed" in machine.containment_reason

    # What the warning says is true: a tool there reads Corral's files.
    outputs = run_approved(session, alice, model_side, [f"cat {shlex.quote(str(canary))}"])
    assert "corral's private file" in outputs[0]
    canary.unlink()

    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="root-password-1"))
    page = client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()
    assert f"Tools on {machine.name} are not contained" in page
    assert "can read Corral&#x27;s files in ~/.corral on that machine" in page
    assert "Install bubblewrap there" in page
    listing = client.get("/admin/machines_app/machine/").content.decode()
    assert "NOT contained" in listing

    assert "tools NOT contained" in machine_actions.do_test_connection(machine)
    Machine.objects.filter(pk=machine.pk).update(bwrap_path="bwrap")
    assert "tools contained by bubblewrap" in machine_actions.do_test_connection(Machine.objects.get(pk=machine.pk))
    assert Machine.objects.get(pk=machine.pk).containment == Machine.Containment.CONTAINED
    assert "are not contained" not in client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()


def test_the_launcher_says_loudly_when_bubblewrap_is_missing(monkeypatch, capsys):
    assert launcher.say_containment()
    assert "bubblewrap sandbox" in capsys.readouterr().out
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not launcher.say_containment()
    assert "WARNING: bubblewrap (bwrap) is not installed" in capsys.readouterr().err


def test_the_corral_script_installs_bubblewrap_when_it_is_missing():
    script = (Path(settings.BASE_DIR) / "corral").read_text()
    install = script.index("apt-get install -y -qq bubblewrap")
    # Before run, setup and test part ways: every command gets it.
    assert install < script.index('run) shift || true; exec')
    assert subprocess.run(["bash", "-n", str(Path(settings.BASE_DIR) / "corral")]).returncode == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_what_corral_reads_or_runs_for_a_tool_reaches_no_more_than_the_sandbox(
    local_machine, alice, tmp_path, model_side, steps_run_here
):
    # Corral runs read_file, grep_search and the shell itself (bounded), and reads the file a
    # write would change for its card: none of it may show what the server's sandbox hides.
    data = Path(settings.DATA_DIR)
    secret = (data / "secret_key").read_text().strip()
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("the sheep are in the north field\n")
    (workdir / "link").symlink_to(data / "secret_key")
    session = start(local_machine, alice, workdir)
    assert session.status == "idle", [e.payload for e in events_of(session, "error")]
    grant_bypass(alice)
    actions.do_set_permission_mode(fresh(session), alice, "bypassPermissions")
    calls = [
        ("read_file", json.dumps({"path": str(data / "secret_key")})),
        ("read_file", json.dumps({"path": "link"})),
        ("grep_search", json.dumps({"path": str(data), "pattern": secret[:12], "literal": True})),
        ("read_file", json.dumps({"path": "notes.txt"})),
    ]
    model_side.will_answer(*tool_call_reply(*calls))
    model_side.will_answer(*text_reply("Done."))
    actions.do_send_message(fresh(session), alice, "Look around.")
    step(fresh(session), model_side)
    outputs = [e.payload["output"] for e in events_of(session, "tool_end")]
    assert len(outputs) == len(calls)
    for (name, arguments), output in zip(calls[:-1], outputs[:-1], strict=True):
        assert secret[:12] not in output, (name, arguments, output)
    assert "the sheep are in the north field" in outputs[-1]  # the working directory still reads

    # The card of a write to Corral's secret key shows nothing of it (not even as "before").
    from sessions_app import callcard

    payload = callcard.recorded("write_file", json.dumps({"path": str(data / "secret_key"), "content": "x"}),
                                working_dir=str(workdir), transport=lambda: tool_view(local_machine))
    assert secret not in json.dumps(payload) and payload["file_before"]["state"] != "text"


def test_the_embedded_redis_url_file_names_a_running_redis_only(monkeypatch, tmp_path):
    """A newcomer's find: ``data/redis/url`` outlived its Redis (a stopped run's port), and a
    test run's Redis replaced the running product's URL there. The file is removed when its
    Redis stops, and a test run's Redis does not write it."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("CORRAL_DATA_DIR", str(tmp_path / "redis-data"))
    url_file = tmp_path / "redis-data" / "redis" / "url"
    running = launcher.ensure_redis()
    assert url_file.read_text().strip() == running.url
    monkeypatch.delenv("REDIS_URL")
    for_tests = launcher.ensure_redis(keep_url=False)
    try:
        assert for_tests.url_file is None
        assert url_file.read_text().strip() == running.url  # the product's URL, untouched
    finally:
        for_tests.stop()
    assert url_file.read_text().strip() == running.url
    running.stop()
    assert not url_file.exists()
