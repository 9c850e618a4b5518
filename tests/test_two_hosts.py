"""Two Corral hosts against one PostgreSQL and one Redis (docs/operations.md, "More hosts").

Host 1 is this box; host 2 runs in network, PID, UTS and mount namespaces of its own
(tests/two_hosts.py), with its own data directory, so its own host id, and the same host
name (a cloned VM). It reaches PostgreSQL, Redis and the test sshd only through the
bridges the fixture makes. Each host runs the production workers
(``python -m project.launcher worker <kind>``); both housekeeping workers run the
periodic rounds, each its own host's share, one of them each round's shared part.

Before hosts had ids, a turn of a local session taken by host 2 dialled 127.0.0.1 there,
met "connection refused", looked the pid up in host 2's process table and recorded
"llama-server exited by itself" while the server ran on untracked on host 1; and two
hosts with one host name gave two workers the name ``turns@<host name>``, so the second
one's start cut the first one's turns.

A page on host 1 reads host 2's local machine through host 2 (its working directory
checked there, machines_app/transports/relay.py), and an image stored by one host is
read from the database by the other host's turn worker and seen by its server.

The shared database must be PostgreSQL (two hosts cannot share a SQLite file): the test
makes its own, ``corral_two_hosts``, on 127.0.0.1:5432 whatever the rest of the suite
runs on.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings

from sessions_app import turns

from .conftest import wait_for
from .helpers import ignore_eos_wrapper
from .two_hosts import Host

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "nsenter", "socat", "ip", "bash")),
    reason="a second host needs root and util-linux's unshare/nsenter, socat, iproute2 and bash",
)

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
DATABASE = "corral_two_hosts"


def _admin_connection():
    import psycopg

    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True)


def _fresh_database() -> None:
    with _admin_connection() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")


def _drop_database() -> None:
    with _admin_connection() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")


def _other_redis_db(url: str) -> str:
    """The suite's Redis in a database of its own (its stack works on another database
    through the shared queues' names: it must not take these hosts' tasks)."""
    parts = urlsplit(url)
    current = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{14 if current != 14 else 13}"))


class TwoHosts:
    """``one`` and ``two`` (:class:`tests.two_hosts.Host`), ``sql`` (a query on the shared
    database: rows as tuples), ``shell`` (Django code on host 1), ``sshd``."""

    def __init__(self, one: Host, two: Host, sshd) -> None:
        import psycopg

        self.one, self.two, self.sshd = one, two, sshd
        self.db = psycopg.connect(f"{PG_SERVER}/{DATABASE}", autocommit=True)
        self.shell = one.shell()

    def sql(self, query: str, *args) -> list[tuple]:
        return self.db.execute(query, args).fetchall()

    def status(self, session_id: int) -> str:
        return self.sql("SELECT status FROM sessions_app_agentsession WHERE id = %s", session_id)[0][0]

    def events(self, session_id: int, kind: str) -> list[dict]:
        return [row[0] for row in self.sql(
            "SELECT payload FROM sessions_app_transcriptevent WHERE session_id = %s AND kind = %s ORDER BY seq",
            session_id, kind)]

    def all_text(self, session_id: int) -> str:
        return " ".join(str(row) for row in self.sql(
            "SELECT kind, payload FROM sessions_app_transcriptevent WHERE session_id = %s ORDER BY seq", session_id))

    def new_session(self, machine_name: str, working_dir: str, **sampling) -> int:
        return self.shell.run(f"""
from django.contrib.auth import get_user_model
from machines_app.models import Machine
from sessions_app import actions
user, _ = get_user_model().objects.get_or_create(username="alice")
machine = Machine.objects.get(name={machine_name!r})
model = machine.model_files.get(architecture="llama")
result = actions.do_create_session(
    user, machine=machine, model_key=model.key, working_dir={working_dir!r},
    server_params={{"contextSize": 2048}}, sampling={{"temperature": 0, **{sampling!r}}},
    permission_mode="manual").pk
""")

    def send(self, session_id: int, text: str) -> None:
        self.shell.run(f"""
from django.contrib.auth import get_user_model
from sessions_app import actions
from sessions_app.models import AgentSession
actions.do_send_message(AgentSession.objects.get(pk={session_id}), get_user_model().objects.get(username="alice"),
                        {text!r})
""")

    def wait_idle(self, session_id: int, timeout: float = 240) -> None:
        wait_for(lambda: self.status(session_id) == "idle" or self.status(session_id) in ("exited", "error"),
                 timeout, interval=0.5, what=f"session {session_id} to be ready")
        assert self.status(session_id) == "idle", self.all_text(session_id)

    def turn_ended(self, session_id: int, timeout: float = 240) -> dict:
        wait_for(lambda: self.events(session_id, "turn_end"), timeout, interval=0.5,
                 what=f"the turn of session {session_id} to end")
        return self.events(session_id, "turn_end")[-1]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory, sshd):
    """Host 1 (this box) and host 2 (namespaces of its own) on one fresh PostgreSQL
    database and one Redis database, both set up with ``./corral setup``'s command (each
    makes its own local machine), no worker started yet. To extend: ``hosts.two.start_worker
    ("servers")``, ``hosts.two.shell().run(code)``, ``hosts.two.run(argv)``."""
    _fresh_database()
    redis_url = _other_redis_db(settings.REDIS_URL)
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    redis_port = urlsplit(redis_url).port or 6379
    root = tmp_path_factory.mktemp("hosts")
    env = {**os.environ, "DATABASE_URL": f"{PG_SERVER}/{DATABASE}", "REDIS_URL": redis_url,
           "SECRET_KEY": settings.SECRET_KEY, "CORRAL_LEASE_SECONDS": "60", "CORRAL_STOP_GRACE": "2",
           "CORRAL_ADMIN_PASSWORD": "admin-password-1", "PYTHONUNBUFFERED": "1"}
    one = Host("one", root, env)
    two = Host("two", root, env, isolated=True, ports=(5432, redis_port, sshd.port))
    hosts = None
    try:
        one.manage("setup")  # migrates, and makes host 1's local machine
        two.manage("setup")
        hosts = TwoHosts(one, two, sshd)
        yield hosts
    finally:
        if hosts is not None:
            try:  # host 1's servers and the SSH machine's (host 2's go with its namespaces)
                hosts.shell.run("""
from sessions_app.servers.models import ServerRecord
from machines_app.transports import ProcessId, TransportError, transport_for
for record in ServerRecord.objects.select_related("machine"):
    try:
        transport_for(record.machine).stop(ProcessId(record.pid, record.start_time), grace=2)
    except TransportError:
        pass
""")
            finally:
                hosts.db.close()
        two.close()
        one.close()
        redis.Redis.from_url(redis_url).flushdb()
        _drop_database()


def test_each_host_has_its_own_local_machine_and_its_workers_names_are_its_own(two_hosts):
    one, two = two_hosts.one, two_hosts.two
    assert one.id != two.id
    assert one.run(["hostname"]).stdout == two.run(["hostname"]).stdout  # a cloned VM's name
    machines = dict(two_hosts.sql("SELECT corral_host, name FROM machines_app_machine WHERE transport = 'local'"))
    assert machines == {one.id: "local", two.id: f"local-{two.id}"}
    one.start_worker("turns")
    # A worker started under a live worker's name (the same id on a clone of a data
    # directory) refuses, naming the other, and never consumes.
    clone = two.run([sys.executable, "-m", "project.launcher", "worker", "turns"], timeout=120,
                    env={**two.env, "CORRAL_HOST_ID": one.id})
    assert clone.returncode != 0
    assert f"a worker named turns@{one.id} is already running" in clone.stderr
    one.stop_worker("turns")


def test_each_host_answers_its_own_local_sessions_and_never_judges_the_others(two_hosts, tmp_path):
    one, two = two_hosts.one, two_hosts.two
    for host in (one, two):
        host.start_worker("servers")
        host.start_worker("turns")
    one.start_worker("housekeeping")
    two.start_worker("housekeeping")
    first = two_hosts.new_session("local", str(tmp_path), max_tokens=24)
    second = two_hosts.new_session(f"local-{two.id}", str(tmp_path), max_tokens=24)
    two_hosts.wait_idle(first)
    two_hosts.wait_idle(second)
    two_hosts.send(first, "Say hello in one short sentence.")
    two_hosts.send(second, "Say hello in one short sentence.")
    for session in (first, second):
        end = two_hosts.turn_ended(session)
        assert end["reason"] in ("done", "length"), two_hosts.all_text(session)
        assert "".join(p["text"] for p in two_hosts.events(session, "assistant_text")).strip()
    # Each server was started on its own host: host 2's answers on host 2's loopback only.
    port = two_hosts.sql("SELECT r.port FROM machines_app_serverrecord r WHERE r.session_id = %s", second)[0][0]
    assert two.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]).returncode == 0
    # Host 2's own watch works: its server stopped behind Corral's back is seen exited
    # there, while host 1's, and host 2's in all the rounds before, were never judged by
    # the other host (which would have met "connection refused" and no such pid).
    pid, start_time = two_hosts.sql("SELECT pid, start_time FROM machines_app_serverrecord WHERE session_id = %s",
                                    second)[0]
    two.shell().run(f"""
from machines_app.transports import LocalTransport, ProcessId
LocalTransport().stop(ProcessId({pid}, {start_time!r}), grace=1)
""")
    wait_for(lambda: two_hosts.status(second) == "exited", 60, interval=0.5, what="host 2 to see its server exit")
    assert any("Corral did not stop it" in p["message"] for p in two_hosts.events(second, "error"))
    assert two_hosts.status(first) == "idle"
    assert "exited" not in two_hosts.all_text(first)
    assert two_hosts.sql("SELECT count(*) FROM machines_app_serverrecord WHERE session_id = %s", first)[0][0] == 1


def test_the_turns_of_a_dead_hosts_worker_on_an_ssh_machine_go_on_on_the_other_host(two_hosts, tmp_path):
    one, two = two_hosts.one, two_hosts.two
    sshd = two_hosts.sshd
    for host in (one, two):  # what the previous test left running stays; the rest starts
        for kind in ("servers", "turns"):
            if kind not in host.workers:
                host.start_worker(kind)
    if "housekeeping" not in one.workers:
        one.start_worker("housekeeping")
    # The gpu machine's llama-server never ends a reply before max_tokens (llama.cpp's
    # --ignore-eos): SmolLM2 ends its count by itself within seconds, sometimes before
    # host 1's worker could be killed mid-reply (CI, twice). A wrapper adds the flag;
    # the server is the real one, started over SSH as always.
    real = two_hosts.sql("SELECT llama_server_path FROM machines_app_machine WHERE name = 'local'")[0][0]
    wrapper = ignore_eos_wrapper(real, tmp_path)
    two_hosts.shell.run(f"""
from pathlib import Path
from machines_app import catalog, keystore
from machines_app.models import Machine
machine = Machine.objects.create(
    name="gpu", transport="ssh", host="127.0.0.1", port={sshd.port}, user={sshd.user!r},
    private_key_sealed=keystore.seal_key(Path({str(sshd.client_key)!r}).read_text()), host_key={sshd.host_key_line!r},
    models_dir={str(one.data / "models")!r}, llama_server_path={str(wrapper)!r}, workspace_roots="")
catalog.refresh_models(machine)
""")
    session = two_hosts.new_session("gpu", str(tmp_path), max_tokens=800)
    two_hosts.wait_idle(session)
    two.stop_worker("turns")  # the turn starts on host 1
    two_hosts.send(session, "Count from 1 to 400, one number per line, and nothing else.")
    wait_for(lambda: two_hosts.events(session, "assistant_text"), 120, interval=0.5, what="the reply to stream")
    # The step's lease names its worker (read until it does: in CI once the lease read
    # empty just as the reply's first text was stored).
    owner = wait_for(lambda: two_hosts.sql("SELECT lease_owner FROM sessions_app_agentsession WHERE id = %s",
                                           session)[0][0], 60, interval=0.2, what="host 1's step to hold the lease")
    assert owner.endswith(f"turns@{one.id}")
    # Host 1's worker dies at once, while the reply streams (800 tokens: seconds even on a
    # fast box). Host 2's worker starts after it.
    before = len(two.log("turns"))
    one.stop_worker("turns", signal.SIGKILL)  # its host went down; nothing restarts it
    assert not two_hosts.events(session, "turn_end"), "the reply ended before host 1's worker could be killed"
    two.start_worker("turns")
    two_hosts.turn_ended(session, timeout=120)
    assert {"message": turns.RESUMING_NOTICE} in two_hosts.events(session, "notice")
    assert "sessions_app.tasks.run_turn" in two.log("turns")[before:]  # host 2 ran the step that ended it
    assert "turns" not in one.workers


def _check_on(shell, machine_name: str, path: str, bound: float) -> list:
    """Host 1's page check of ``path`` on ``machine_name`` (the new-session form's
    check_working_dir) run in ``shell``: ["ok", real path] or [error class, its sentence],
    then the seconds it took; the relay's bound is ``bound`` seconds for that call."""
    return shell.run(f"""
import time
from django.contrib.auth import get_user_model
from machines_app.models import Machine
from machines_app.transports import TransportError, relay
from machines_app.workspaces import WorkingDirRefused, check_working_dir
user, _ = get_user_model().objects.get_or_create(username="alice")
relay.ANSWER_SECONDS, bound = {bound}, relay.ANSWER_SECONDS
started = time.monotonic()
try:
    result = ["ok", check_working_dir(user, Machine.objects.get(name={machine_name!r}), {path!r})]
except (WorkingDirRefused, TransportError) as exc:
    result = [type(exc).__name__, str(exc)]
finally:
    relay.ANSWER_SECONDS = bound
result.append(time.monotonic() - started)
""")


def test_a_page_on_host_1_checks_a_working_directory_on_host_2s_machine_through_host_2(two_hosts, tmp_path):
    two = two_hosts.two
    if "housekeeping" not in two.workers:
        two.start_worker("housekeeping")
    theirs = f"local-{two.id}"
    # A directory only host 2 sees: a tmpfs mounted in its own mount namespace, so an
    # answer that names it can only have come from host 2.
    only_there = tmp_path / "only-on-two"
    only_there.mkdir()
    mounted = two.run(["mount", "-t", "tmpfs", "tmpfs", str(only_there)])
    assert mounted.returncode == 0, mounted.stderr
    assert two.run(["mkdir", str(only_there / "work")]).returncode == 0
    assert not (only_there / "work").exists()
    # Alice is a member: the machine's workspace roots bind her, resolved there too.
    roots = two_hosts.sql("SELECT workspace_roots FROM machines_app_machine WHERE name = %s", theirs)[0][0]
    two_hosts.sql("UPDATE machines_app_machine SET workspace_roots = %s WHERE name = %s RETURNING id", str(tmp_path),
                  theirs)
    ok, real, _took = _check_on(two_hosts.shell, theirs, str(only_there / "work" / "."), 10)
    assert (ok, real) == ("ok", str(only_there / "work"))
    missing = _check_on(two_hosts.shell, theirs, str(tmp_path / "missing"), 10)
    assert missing[:2] == ["WorkingDirRefused", f"There is no directory {tmp_path / 'missing'} on {theirs}."]
    # The same check of host 1's own local machine is answered here: no such directory.
    assert _check_on(two_hosts.shell, "local", str(only_there / "work"), 10)[0] == "WorkingDirRefused"

    two.stop_worker("housekeeping")
    try:
        kind, sentence, took = _check_on(two_hosts.shell, theirs, str(only_there / "work"), 4)
        assert (kind, sentence) == ("TransportError", f"the Corral host {two.id} that runs machine '{theirs}' did not "
                                                      "answer within 4 s; is its housekeeping worker running?")
        assert took < 4 + 10, took  # the bound, not a hang (generous for a loaded box)
    finally:
        two.start_worker("housekeeping")
    # Back, it answers again.
    assert _check_on(two_hosts.shell, theirs, str(only_there / "work"), 10)[:2] == ["ok", str(only_there / "work")]
    outside = _check_on(two_hosts.shell, theirs, "/etc", 10)
    assert outside[:2] == ["WorkingDirRefused", f"On {theirs} your working directory must be inside {tmp_path}; "
                                                "/etc is not."]
    two_hosts.sql("UPDATE machines_app_machine SET workspace_roots = %s WHERE name = %s RETURNING id", roots, theirs)


def _vision_models(where) -> str:
    """SmolLM2 with the tiny projector beside it (tests/tiny_mmproj.py) in ``where``."""
    from machines_app.demo_models import packaged_model_paths

    from .tiny_mmproj import text_embedding_length, write_tiny_projector

    smol = packaged_model_paths()["smollm2"]
    directory = where / "smol"
    directory.mkdir(parents=True)
    (directory / smol.name).symlink_to(smol)
    write_tiny_projector(directory / "mmproj-smol-tiny.gguf", text_embedding_length(smol))
    return str(where)


_MAKE_VISION_MACHINE = """
from django.conf import settings
from machines_app import catalog
from machines_app.models import Machine
machine = Machine.objects.create(
    name={name!r}, transport="local", corral_host=settings.CORRAL_HOST_ID, models_dir={models!r},
    llama_server_path=Machine.objects.filter(transport="local").exclude(llama_server_path="").first().llama_server_path,
    workspace_roots="")
result = [(m.key, m.projector_key, m.has_vision) for m in catalog.refresh_models(machine)]
"""

_SEND_IMAGE = """
import io
from PIL import Image
from django.contrib.auth import get_user_model
from sessions_app import actions, images
from sessions_app.images import Upload
from sessions_app.models import AgentSession
buffer = io.BytesIO()
Image.new("RGB", (40, 30), {colour!r}).save(buffer, "PNG")
upload = Upload("picture.png", buffer.getvalue())
actions.do_send_message(AgentSession.objects.get(pk={session}), get_user_model().objects.get(username="alice"),
                        {text!r}, [upload])
result = images.missing_sentence(images.check_image(upload))
"""

_TEXT_ONLY_TOKENS = """
import httpx
from sessions_app.servers.models import ServerRecord
record = ServerRecord.objects.get(session_id={session})
server, auth = f"http://127.0.0.1:{{record.port}}", {{"Authorization": f"Bearer {{record.api_key}}"}}
prompt = httpx.post(server + "/apply-template", headers=auth, timeout=30,
                    json={{"messages": [{{"role": "user", "content": {text!r}}}]}}).json()["prompt"]
result = len(httpx.post(server + "/tokenize", headers=auth, timeout=30, json={{"content": prompt}}).json()["tokens"])
"""


def test_an_image_stored_by_one_host_is_read_by_the_other_hosts_server(two_hosts, tmp_path):
    """A vision machine on each host, a session on each, and a message with an image sent
    from the other host: the image is stored in the database by one host and read there
    by the other's turn worker, and the server counts its tokens (4 a picture: the tiny
    projector's 2×2 patches, tests/test_images_real.py)."""
    one, two = two_hosts.one, two_hosts.two
    for host in (one, two):
        for kind in ("servers", "turns"):
            if kind not in host.workers:
                host.start_worker(kind)
    if "housekeeping" not in one.workers:
        one.start_worker("housekeeping")
    if "housekeeping" not in two.workers:
        two.start_worker("housekeeping")
    shells = {one: two_hosts.shell, two: two.shell()}
    sessions = {}
    for host, name in ((one, "vision-one"), (two, "vision-two")):
        found = shells[host].run(_MAKE_VISION_MACHINE.format(name=name, models=_vision_models(tmp_path / name)))
        assert len(found) == 1 and found[0][1:] == ["smol/mmproj-smol-tiny.gguf", True], found
        sessions[host] = two_hosts.new_session(name, str(tmp_path), max_tokens=8, seed=7)
    assert two_hosts.sql("SELECT m.corral_host FROM sessions_app_agentsession s JOIN machines_app_machine m "
                         "ON m.id = s.machine_id WHERE s.id = %s", sessions[two])[0][0] == two.id
    for session in sessions.values():
        two_hosts.wait_idle(session)
    text = "What colour is this picture?"
    missing = {}
    for host, other, colour in ((one, two, (220, 20, 20)), (two, one, (20, 200, 20))):
        missing[host] = shells[other].run(_SEND_IMAGE.format(session=sessions[host], colour=colour, text=text))
    for host, session in sessions.items():
        end = two_hosts.turn_ended(session)
        assert end["reason"] in ("done", "length"), two_hosts.all_text(session)
        assert not two_hosts.events(session, "error"), two_hosts.all_text(session)
        notices = [n["message"] for n in two_hosts.events(session, "notice")]
        assert missing[host] not in notices and not [n for n in notices if "did not see" in n], notices
        # The server's loopback port is its own host's: the count is asked there.
        text_only = shells[host].run(_TEXT_ONLY_TOKENS.format(session=session, text=text))
        usage = two_hosts.events(session, "usage")
        assert usage and usage[0]["prompt_tokens"] == text_only + 4, (usage, text_only)
