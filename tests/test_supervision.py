"""``./corral run`` as an operator meets it: a crashed process is restarted and the others
keep running; SIGTERM or SIGINT on the launcher stops every Corral process and the
embedded Redis; a second run on the same data directory starts cleanly.

The launcher runs for real (``python -m project.launcher run``) on a data directory of its
own, with its own SQLite file and embedded Redis (DATABASE_URL and REDIS_URL unset), and
is watched through supervisord's own ``supervisorctl`` and the process table (psutil).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from django.conf import settings

from project import launcher as launcher_module
from sessions_app import actions, agent, dispatch, turns
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord

from .conftest import ROOT, _database_url, model_key, wait_for
from .helpers import payloads

# No beat: the periodic rounds run in the housekeeping worker (sessions_app/rounds.py).
PROGRAMS = {"web", "worker-turns", "worker-servers", "worker-housekeeping"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """One ``./corral run`` on ``data``: start, look at its programs, stop."""

    def __init__(self, data: Path, port: int) -> None:
        self.data, self.port = data, port
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DEBUG")}
        self.env.update(CORRAL_DATA_DIR=str(data), CORRAL_ADMIN_PASSWORD="admin-password-1", CORRAL_TURN_WORKERS="2")
        self.proc: subprocess.Popen | None = None

    def start(self, *, own_group: bool = False) -> None:
        """``own_group``: the launcher leads a process group of its own, as in a terminal,
        where a Ctrl-C goes to every process of the foreground group."""
        self.proc = subprocess.Popen(
            # --port=N here, --port N in the port-in-use test below: both spellings serve.
            [sys.executable, "-m", "project.launcher", "run", f"--port={self.port}"],
            cwd=ROOT, env=self.env, stdout=open(self.data.parent / "launcher.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=own_group,
        )
        wait_for(lambda: set(self.running()) == PROGRAMS, 120, interval=0.5, what="every program RUNNING")
        # On a loaded host (two cores, several test runs) daphne took over a minute to import.
        wait_for(self.serves, 180, interval=0.5, what="daphne to answer")

    def running(self) -> dict[str, int]:
        """program name → pid of each program supervisord reports RUNNING."""
        out = subprocess.run(
            [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.data / "run" / "supervisord.conf"),
             "status"], capture_output=True, text=True, env=self.env,
        ).stdout
        pids = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[1] == "RUNNING":
                pids[parts[0].split(":")[-1]] = int(parts[3].rstrip(","))
        return pids

    def serves(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/login/", timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    def tree(self) -> list[psutil.Process]:
        """The launcher and everything under it (supervisord, programs, their children, Redis)."""
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for p in reversed(self.tree()):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait()


def _group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None


def _gone(processes: list[psutil.Process]) -> list[str]:
    """Those of ``processes`` still alive, described (empty when all are gone)."""
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def launcher(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    run = Launcher(data, _free_port())
    yield run
    run.kill_all()


def _restarted_alone(launcher: Launcher, name: str) -> None:
    before = launcher.running()
    os.kill(before[name], signal.SIGKILL)
    after = wait_for(
        lambda: (now := launcher.running()).get(name, before[name]) != before[name] and set(now) == PROGRAMS and now,
        60, interval=0.5, what=f"{name} restarted",
    )
    assert {k: v for k, v in after.items() if k != name} == {k: v for k, v in before.items() if k != name}


def test_a_crash_restarts_that_process_only_and_sigterm_stops_everything(launcher):
    launcher.start()
    redis = [p for p in launcher.tree() if "redis-server" in p.name()]
    assert len(redis) == 1

    _restarted_alone(launcher, "worker-turns")
    _restarted_alone(launcher, "web")
    wait_for(launcher.serves, 60, interval=0.5, what="daphne to answer again")
    log = (launcher.data.parent / "launcher.log").read_text()
    assert "exited: worker-turns (terminated by SIGKILL; not expected)" in log
    assert "exited: web (terminated by SIGKILL; not expected)" in log

    everything = launcher.tree()
    assert len(everything) >= 1 + 1 + len(PROGRAMS) + 1  # launcher, supervisord, programs, Redis
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0
    assert _gone(everything) == []
    assert not (launcher.data / "run" / "supervisor.sock").exists()


def test_sigint_stops_everything_and_a_second_run_starts_over_stale_files(launcher):
    run_dir = launcher.data / "run"
    run_dir.mkdir()
    # What a run killed outright leaves: a control socket nobody listens on, a pid file.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "supervisor.sock"))
    stale.close()
    (run_dir / "supervisord.pid").write_text("999999\n")

    launcher.start()
    everything = launcher.tree()
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.proc.wait(60) == 0
    assert _gone(everything) == []

    launcher.start()  # the same data directory and port, at once
    assert set(launcher.running()) == PROGRAMS


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c", "slow exits"])
def test_an_idle_stack_stops_cleanly_and_logs_each_line_once(launcher, stop):
    """No program is killed (supervisord's SIGKILL after stopwaitsecs), nothing fails on
    the way out, and each supervisord line appears once (it printed each twice: its log
    file was /dev/stdout, and in the foreground it copies its log to stdout too). A Ctrl-C
    in a terminal reaches the launcher's whole process group: the embedded Redis must not
    be in it, or it is gone before the workers' warm shutdown. "slow exits": on a busy
    host beat (a program then) and worker-turns took 5–6 s to exit cleanly and were killed
    at 5 s; here worker-housekeeping (its rounds' threads stopping too) and worker-turns
    are held (SIGSTOP) for 7 s of their stop, then let go."""
    launcher.start(own_group=True)
    log_file = launcher.data.parent / "launcher.log"
    # Consumers up (workers at INFO say so), so each stop goes through Celery's warm shutdown.
    wait_for(lambda: re.search(r"turns@\S+ ready", (text := log_file.read_text())) and re.search(r"servers@\S+ ready",
             text), 60, interval=0.5, what="the turns and servers workers ready")
    everything = launcher.tree()
    held = [launcher.running()[name] for name in ("worker-housekeeping", "worker-turns")] if stop == "slow exits" else []
    for pid in held:
        os.kill(pid, signal.SIGSTOP)  # the SIGTERM supervisord sends waits until SIGCONT
    if stop == "ctrl-c":
        os.killpg(launcher.proc.pid, signal.SIGINT)
    else:
        launcher.proc.send_signal(signal.SIGTERM)
    if held:
        wait_for(lambda: "waiting for" in log_file.read_text(), 30, interval=0.2, what="supervisord stopping them")
        time.sleep(7)
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    assert launcher.proc.wait(60) == 0
    assert _gone(everything) == []
    log = log_file.read_text()
    for name in PROGRAMS:
        assert log.count(f"spawned: '{name}' with pid") == 1, name
        assert log.count(f"stopped: {name} (") == 1, name
    assert "SIGKILL" not in log
    assert "Traceback" not in log


def test_a_launcher_killed_outright_takes_every_corral_process_with_it(launcher):
    launcher.start()
    everything = launcher.tree()
    launcher.proc.kill()  # SIGKILL: no handler runs; the kernel tells supervisord and Redis
    launcher.proc.wait()
    wait_for(lambda: _gone(everything) == [], 60, interval=0.5, what="every Corral process to stop")


def test_supervisord_killed_outright_takes_its_programs_with_it(launcher):
    """supervisord killed with -9 used to leave daphne and the Celery processes
    running: the next ``./corral run`` refused with "port already in use". Each program
    now has supervisord's death signalled to it (PR_SET_PDEATHSIG through setpriv)."""
    launcher.start()
    supervisord = next(p for p in launcher.tree() if "supervisord" in " ".join(p.cmdline()))
    programs = [psutil.Process(pid) for pid in launcher.running().values()]
    supervisord.kill()
    wait_for(lambda: _gone(programs) == [], 60, interval=0.5, what="every program to die with supervisord")
    launcher.proc.wait(60)
    launcher.start()  # the same port and data directory: nothing stands in the way
    assert set(launcher.running()) == PROGRAMS


def test_the_run_a_team_gets_has_debug_off_and_prints_its_url_once_it_answers(launcher):
    """A member opening a page that is not there met Django's debug 404 listing every URL
    pattern; the launcher printed its URL about 40 s before that URL answered."""
    launcher.start()
    response = httpx.get(f"http://127.0.0.1:{launcher.port}/sessions/no-such-page/", timeout=10)
    assert response.status_code == 404
    assert "Nothing here" in response.text and "URLconf" not in response.text
    log = (launcher.data.parent / "launcher.log").read_text()
    assert "DEBUG off" in log
    assert log.count(f"Corral is running at http://127.0.0.1:{launcher.port}/") == 1


def test_the_url_is_said_only_once_it_answers(tmp_path):
    """``wait_until_answering``: False while nothing listens and the process exits; True
    once an HTTP server answers, whatever its status."""
    quits = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    assert launcher_module.wait_until_answering(f"http://127.0.0.1:{_free_port()}/", quits, timeout=30) is False
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert launcher_module.wait_until_answering(f"http://127.0.0.1:{port}/missing", server, timeout=30) is True
    finally:
        server.kill()
        server.wait()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_turn_whose_worker_is_killed_ends_truthfully_and_its_server_outlives_the_stop(
    launcher, fake_machine, alice, tmp_path, monkeypatch
):
    """The launcher on the test database (its own embedded Redis): the product's own
    actions hand their tasks to that Redis, so the launcher's workers run them."""
    from project.celery import app

    # The same host as this process, which makes the machine (docs/operations.md "More
    # hosts": another host's workers would leave its local machine alone).
    launcher.env.update(DATABASE_URL=_database_url(), CORRAL_LEASE_SECONDS="60", CORRAL_HOST_ID=settings.CORRAL_HOST_ID)
    launcher.start()
    redis_url = (launcher.data / "redis" / "url").read_text().strip()  # password-protected: docs/security.md

    def enqueue(task: str, *args: object) -> bool:
        with app.connection_for_write(redis_url) as connection:
            app.send_task(task, args=args, connection=connection)
        return True

    monkeypatch.setattr(dispatch, "enqueue", enqueue)
    machine = fake_machine([{"text": " ".join(f"word{i}" for i in range(80)), "delay": 0.25}])
    session = actions.do_create_session(
        alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 60, what="the server to be ready")
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "talk slowly")
    wait_for(lambda: len(payloads(session, "assistant_text")) >= 3, 60, what="the stream to start")

    _restarted_alone(launcher, "worker-turns")
    wait_for(lambda: payloads(session, "turn_end"), 10, what="the turn taken over (not the 60 s lease)")
    assert {"message": turns.RESUMING_NOTICE} in payloads(session, "notice")
    assert payloads(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
    assert AgentSession.objects.get(pk=session.pk).status == "idle"

    server = psutil.Process(ServerRecord.objects.get(session=session).pid)
    # The server's sandbox (bubblewrap and its init, docs/security.md) is its process group
    # and outlives Corral with it.
    sandbox = os.getpgid(server.pid)
    everything = [p for p in launcher.tree() if p.pid != server.pid and _group_of(p) != sandbox]
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0
    assert _gone(everything) == []
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE  # the README's promise
    # ... and the stop says so: the server still holds its memory, and whose it is.
    log = (launcher.data.parent / "launcher.log").read_text()
    assert "1 llama-server keeps running, holding memory; the next ./corral run takes it over:" in log
    assert "Stop one now with kill <pid>" in log  # Corral is stopped: its pages cannot stop it now
    assert f"{AgentSession.objects.get(pk=session.pk).display_title} (" in log and f"pid {server.pid})" in log


def test_a_port_in_use_stops_the_launcher_with_a_message_before_it_starts_anything(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        result = subprocess.run(
            [sys.executable, "-m", "project.launcher", "run", "--port", str(port)], cwd=ROOT,
            env={**env, "CORRAL_DATA_DIR": str(tmp_path / "data")}, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 1
    assert f"corral: port {port} is already in use" in result.stderr
    assert not (tmp_path / "data" / "run" / "supervisord.conf").exists()


def test_a_second_run_on_a_busy_data_dir_stops_with_a_message_before_it_starts_anything(tmp_path):
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "supervisord.conf").write_text("the first run's\n")
    with socket.socket(socket.AF_UNIX) as first:  # the first run's supervisord, answering
        first.bind(str(run_dir / "supervisor.sock"))
        first.listen()
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        result = subprocess.run(
            [sys.executable, "-m", "project.launcher", "run", "--port", str(_free_port())], cwd=ROOT,
            env={**env, "CORRAL_DATA_DIR": str(tmp_path / "data")}, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 1
    assert "corral: another ./corral run is using the data directory" in result.stderr
    assert "embedded Redis" not in result.stdout and "Corral is starting" not in result.stdout
    assert (run_dir / "supervisord.conf").read_text() == "the first run's\n"


class _HangUp:
    """A listener on 127.0.0.1:``port`` that accepts and closes every connection."""

    def __init__(self, port: int) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_for(lambda: self._bind(port), 10, interval=0.05, what=f"port {port} to be free")
        self.sock.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _bind(self, port: int) -> bool:
        try:
            self.sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def _embedded_redis(launcher: Launcher) -> psutil.Process:
    found = [p for p in launcher.tree() if "redis-server" in p.name()]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_an_embedded_redis_killed_comes_back_on_its_port_and_what_was_sent_meanwhile_runs(
    launcher, fake_machine, alice, tmp_path, monkeypatch
):
    """The embedded Redis killed outright used to stay dead: every new message
    showed "waiting for a worker" for ever. It is started again on the same port with the
    same password (REDIS_URL stays valid for every program), and a message sent while it
    was down — its step lost with the broker — is answered once it is back (the turn
    recovery re-queues it)."""
    from project import queues
    from project.celery import app

    # The launcher is this test process's host: the fake machine below is this host's local
    # machine, which another host's workers refuse to touch (docs/operations.md "More hosts").
    launcher.env.update(DATABASE_URL=_database_url(), CORRAL_LEASE_SECONDS="60",
                        CORRAL_HOST_ID=settings.CORRAL_HOST_ID)
    launcher.start()
    url_file = launcher.data / "redis" / "url"
    redis_url = url_file.read_text().strip()
    sent: list[tuple[str, bool]] = []

    def enqueue(task: str, *args: object) -> bool:
        try:
            host = dispatch.owner_host(task, args)  # routed as dispatch.enqueue routes it
            queue = queues.on_host(queues.ROUTES[task]["queue"], host) if host else None
            with app.connection_for_write(redis_url) as connection:
                app.send_task(task, args=args, connection=connection, retry=False, queue=queue)
        except Exception:  # as dispatch.enqueue: the broker is down, the caller goes on
            sent.append((task, False))
            return False
        sent.append((task, True))
        return True

    monkeypatch.setattr(dispatch, "enqueue", enqueue)
    machine = fake_machine([{"text": "answered after the outage"}])
    session = actions.do_create_session(
        alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 60, what="the server to be ready")

    redis = _embedded_redis(launcher)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    redis.kill()
    redis.wait(10)
    # The port is held for a while by a listener that hangs up on everyone: Redis stays
    # down however fast it would come back (its restarts fail to bind, and it tries again
    # later), so the message below surely meets no broker.
    log_file = launcher.data.parent / "launcher.log"
    squatter = _HangUp(port)
    try:
        actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "sent while Redis is down")
        assert sent[-1] == (dispatch.RUN_TURN, False)  # its step never reached a broker
        wait_for(lambda: "embedded Redis exited (exit status" in log_file.read_text(), 60, interval=0.5,
                 what="a restart that found the port taken")
    finally:
        squatter.close()
    wait_for(lambda: "embedded Redis is back" in log_file.read_text(), 60, interval=0.5, what="Redis started again")
    assert "embedded Redis exited (killed by SIGKILL)" in log_file.read_text()
    again = _embedded_redis(launcher)
    assert again.pid != redis.pid
    assert url_file.read_text().strip() == redis_url  # same port, same password
    assert f"127.0.0.1:{port}" in " ".join(again.cmdline())  # Redis's own process title

    wait_for(lambda: payloads(session, "turn_end"), 120, interval=0.5, what="the message sent meanwhile answered")
    assert [p["text"] for p in payloads(session, "message_taken")] == ["sent while Redis is down"]
    assert "".join(p["text"] for p in payloads(session, "assistant_text")) == "answered after the outage"
    assert payloads(session, "turn_end") == [{"reason": "done"}]
    assert set(launcher.running()) == PROGRAMS  # no program had to be restarted for it


def test_the_launchers_output_is_kept_in_a_rotated_log_file(launcher):
    """The output of ``./corral run`` grew without bound wherever it was sent.
    It is copied to ``data/logs/corral.log``, rotated at CORRAL_LOG_MAX_BYTES with
    CORRAL_LOG_BACKUPS older files kept, while the terminal still gets every line."""
    launcher.env.update(CORRAL_LOG_MAX_BYTES="1000", CORRAL_LOG_BACKUPS="2")
    launcher.start()
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0
    logs = launcher.data / "logs"
    kept = sorted(p.name for p in logs.glob("corral.log*"))
    assert kept == ["corral.log", "corral.log.1", "corral.log.2"], kept
    longest = max(len(line) for line in (launcher.data.parent / "launcher.log").read_bytes().splitlines())
    for name in kept:
        assert (logs / name).stat().st_size <= 1000 + longest + 1, name
    # The file holds the same lines, the newest last: the run's end is there.
    terminal = (launcher.data.parent / "launcher.log").read_text().splitlines()
    newest = (logs / "corral.log").read_text().splitlines()
    assert newest and newest == terminal[-len(newest):]
    assert any("stopped: web (" in line for line in newest + (logs / "corral.log.1").read_text().splitlines())
