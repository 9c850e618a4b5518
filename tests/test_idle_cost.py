"""What an idle stack does, counted (docs/live-page.md, "What it costs"): the broker polls
of an idle worker, the queries of a quiet health watch, the database connections a worker
opens for its tasks. Counts, not times: the times are bench/run.py's."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest
import redis
from celery.fixups.django import DjangoWorkerFixup
from celery.signals import task_postrun
from django.conf import settings
from django.db import connection
from django.db.backends.signals import connection_created
from kombu import Consumer, Queue

from project import celery as corral_celery
from project.celery import app
from sessions_app import rounds, tasks
from sessions_app.models import AgentSession


def test_an_idle_worker_waits_in_one_brpop_for_seconds_not_a_new_one_every_second():
    """A consumer with nothing to do sends one BRPOP and waits in it for BRPOP_SECONDS
    (kombu's own: 1 s). Read from Redis: 4 s after it went idle, its connection is still
    in the BRPOP it sent first (Redis's ``idle``: seconds since its last command). A task
    sent meanwhile still ends it at once: tests/test_broker_wakeup.py."""
    name = f"corral-test-idle-{uuid.uuid4().hex[:12]}"
    queue = Queue(name, auto_delete=True)
    stop = threading.Event()
    ready = threading.Event()
    options = {**app.conf.broker_transport_options, "client_name": name}

    def worker_loop() -> None:
        with (app.connection_for_read(transport_options=options) as conn,
              Consumer(conn, [queue], callbacks=[], accept=["json"])):
            ready.set()
            while not stop.is_set():
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass

    thread = threading.Thread(target=worker_loop, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        time.sleep(4.5)
        clients = [c for c in redis.Redis.from_url(settings.REDIS_URL).client_list() if c.get("name") == name]
        waiting = [c for c in clients if c.get("cmd") == "brpop"]
        assert waiting, clients
        assert max(int(c["idle"]) for c in waiting) >= 3, waiting
        assert corral_celery.BRPOP_SECONDS >= 5
    finally:
        stop.set()
        thread.join(15)


@pytest.mark.django_db
def test_a_quiet_health_watch_asks_the_database_five_times(django_assert_max_num_queries):
    """The watch round runs every 2 s: with nothing waiting for memory, no server, no start
    and no pending stop it makes five queries (it made nine: the memory line alone took
    five), and three in the rounds that do not look for lost starts and idle servers."""
    with django_assert_max_num_queries(5):
        tasks.watch_servers()
    # The next rounds, until lost starts and idle servers are looked for again: the pending
    # stops and the servers (this host's and the shared ones in one pass) and the memory line.
    with django_assert_max_num_queries(3):
        tasks.watch_servers()


@pytest.mark.django_db(transaction=True)
def test_a_worker_thread_keeps_its_database_connection_from_task_to_task(monkeypatch, request):
    """Three tasks run one after the other on one worker thread, with Celery's own Django
    fixup around each as in a worker: one connection opened, not three (project/celery.py);
    one that failed is closed after its task, and the next task opens a new one."""
    for key in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS"):
        monkeypatch.setitem(settings.DATABASES["default"], key, settings.DATABASES["default"].get(key))
    corral_celery.keep_database_connections()
    # What worker_init connected in this test process goes with the test: a task run in
    # place later (``.apply()`` inside a test's transaction) must keep its connection.
    request.addfinalizer(lambda: task_postrun.disconnect(dispatch_uid="corral-close-finished-connections"))
    fixup = DjangoWorkerFixup(app)
    opened: list[int] = []

    def count(sender, connection, **_kwargs):
        opened.append(threading.get_ident())

    class Task:
        class request:
            is_eager = False

    def run_tasks(n: int, age_first: bool = False) -> None:
        try:
            for i in range(n):
                fixup.on_task_prerun(sender=Task)
                AgentSession.objects.count()
                if age_first and i == 0:
                    connection.close_at = time.monotonic() - 1  # as if WORKER_CONNECTION_SECONDS had passed
                fixup.on_task_postrun(sender=Task)
                corral_celery.close_finished_connections()
        finally:
            connection.close()

    connection_created.connect(count)
    try:
        thread = threading.Thread(target=run_tasks, args=(3,))
        thread.start()
        thread.join(30)
        assert len(opened) == 1
        opened.clear()
        thread = threading.Thread(target=run_tasks, args=(3, True))
        thread.start()
        thread.join(30)
        assert len(opened) == 2
    finally:
        connection_created.disconnect(count)


def test_a_watch_round_watches_this_hosts_share_in_the_shared_pass_and_hands_nothing_out(monkeypatch):
    """A watch round (every 2 s) was a task sent by beat, which handed each other live
    host its own share through that host's queue, the host keys read for it every round.
    Now every host's housekeeping worker runs its own round (sessions_app/rounds.py): the
    worker that took the shared part watches this host's servers in the same pass (one
    query for both), every other only its own host's; no host key is read and nothing is
    sent (docs/operations.md, "More hosts")."""
    watched: list[tuple] = []
    monkeypatch.setattr(rounds.watch, "watch_servers", lambda host=None, hosts=None: watched.append(hosts))
    monkeypatch.setattr(rounds.liveness, "live_hosts", lambda: pytest.fail("read the host keys"))
    monkeypatch.setattr(rounds.dispatch, "enqueue", lambda *a: pytest.fail(f"sent {a}"))
    monkeypatch.setattr(rounds, "_slow_looks_due", lambda: False)
    monkeypatch.setattr(rounds.room, "admit_waiting", lambda: watched.append("memory"))
    here = settings.CORRAL_HOST_ID
    rounds.watch_servers(rounds.Share(shared=True, host=here, worker="housekeeping@a"))
    assert watched == [(None, here), "memory"]  # one pass for both
    watched.clear()
    rounds.watch_servers(rounds.Share(shared=False, host=here, worker="housekeeping@a"))
    assert watched == [(here,)]  # another worker took the shared part: this host's only
    watched.clear()
    rounds.watch_servers(rounds.Share(shared=True, host="", worker="housekeeping@a"))
    assert watched == [(None,), "memory"]  # a worker that does not read this host's queue


def test_a_sampling_round_reads_this_hosts_machine_in_its_own_share(monkeypatch):
    """The same for the memory sampling (every 30 s): SSH machines in the shared part,
    this host's local machine in its own share, nothing handed to another host."""
    sampled: list[str | None] = []
    here = settings.CORRAL_HOST_ID
    monkeypatch.setattr(rounds.room, "sample_machines", lambda host=None: sampled.append(host))
    rounds.sample_machines(rounds.Share(shared=True, host=here, worker="w"))
    assert sampled == [None, here]
    sampled.clear()
    rounds.sample_machines(rounds.Share(shared=False, host=here, worker="w"))
    assert sampled == [here]


def test_reading_the_liveness_keys_again_opens_no_new_redis_connection(monkeypatch):
    """Each read of the liveness keys (the watch reads the host keys every 2 s) opened a
    client of its own: a connect, AUTH and HELLO each time. The process keeps one client;
    five reads open at most one connection (none once it is open). Real Redis."""
    from redis.connection import AbstractConnection

    connects: list[int] = []
    on_connect = AbstractConnection.on_connect_check_health

    def counting(self, *args, **kwargs):
        connects.append(1)
        return on_connect(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "on_connect_check_health", counting)
    for _ in range(5):
        assert rounds.liveness.live_hosts() is not None
    assert rounds.liveness.live_workers() is not None
    assert len(connects) <= 1


def test_an_idle_daphnes_channel_layer_reads_redis_once_in_seconds_not_ten_times_a_second(monkeypatch):
    """channels_redis's pub/sub receiver read its subscription in reads of 0.1 s: ten
    wake-ups a second in a daphne with nothing to deliver (project/pubsub_layer.py). The
    layer of the settings, on the real Redis: over 2 s with a page subscribed and nothing
    sent it reads at most once; a message sent then still ends the read and is received
    (well before the read's own end), and so is one sent after the last page left and a
    new one came (the receiver woken by the subscription, not by its next look)."""
    import asyncio

    from django.utils.module_loading import import_string
    from redis.asyncio.client import PubSub

    from project import pubsub_layer

    reads: list[int] = []
    get_message = PubSub.get_message

    async def counting(self, *args, **kwargs):
        reads.append(1)
        return await get_message(self, *args, **kwargs)

    monkeypatch.setattr(PubSub, "get_message", counting)
    config = settings.CHANNEL_LAYERS["default"]
    layer = import_string(config["BACKEND"])(**config["CONFIG"])
    group = f"idle-test-{uuid.uuid4().hex[:12]}"
    soon = pubsub_layer.RECEIVE_WAIT * 0.8

    async def run() -> tuple[int, list[dict]]:
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        await asyncio.sleep(0.5)  # the subscription's confirmation read
        reads.clear()
        await asyncio.sleep(2.0)
        idle_reads = len(reads)
        await layer.group_send(group, {"type": "first"})
        received = [await asyncio.wait_for(layer.receive(channel), soon)]
        await layer.group_discard(group, channel)
        await asyncio.sleep(1.0)  # nothing subscribed: the receiver waits for a subscription
        await layer.group_add(group, channel)
        await asyncio.sleep(0.2)
        await layer.group_send(group, {"type": "second"})
        received.append(await asyncio.wait_for(layer.receive(channel), soon))
        await layer.flush()
        return idle_reads, received

    idle_reads, received = asyncio.run(run())
    assert received == [{"type": "first"}, {"type": "second"}]
    assert idle_reads <= 1


@pytest.mark.django_db
def test_watch_rounds_look_for_lost_starts_and_idle_servers_every_ten_seconds_not_every_round(monkeypatch):
    """Rounds come every 2 s; lost starts (a claim lapses after 30 s) and servers idle past
    their time (minutes) are looked for every SLOW_LOOKS_EVERY seconds, each round still
    trying the starts waiting for memory. Counted over rounds run back to back, the clock
    moved by hand."""
    looks: list[str] = []
    now = [1000.0]
    monkeypatch.setattr(rounds.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(rounds, "_slow_looks_at", [])
    monkeypatch.setattr(rounds.watch, "watch_servers", lambda host=None, hosts=None: None)
    monkeypatch.setattr(rounds.watch, "recover_starts", lambda alive=None: looks.append("starts"))
    monkeypatch.setattr(rounds.stop, "sleep_idle_servers", lambda: looks.append("idle"))
    monkeypatch.setattr(rounds.room, "admit_waiting", lambda: looks.append("memory"))
    for _ in range(5):  # 10 s of rounds
        tasks.watch_servers()
        now[0] += 2.0
    assert looks.count("memory") == 5
    assert looks.count("starts") == looks.count("idle") == 1
    tasks.watch_servers()  # 10 s after the first look
    assert looks.count("starts") == looks.count("idle") == 2
    assert rounds.SLOW_LOOKS_EVERY <= 10


def test_the_embedded_redis_runs_its_background_round_once_a_second_and_keys_still_lapse(tmp_path, monkeypatch):
    """The embedded Redis ran its background round ten times a second (Redis's ``hz``),
    most of an idle Redis's CPU (project/embedded_redis.py). Started as ``./corral run``
    starts it: ``hz`` is 1, and a key written with a time to live, as the liveness keys
    are, is gone for reads (GET, SCAN) once it expired."""
    from project import launcher

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("CORRAL_DATA_DIR", str(tmp_path / "redis-data"))
    proc = launcher.ensure_redis()
    try:
        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        assert client.config_get("hz") == {"hz": "1"}
        client.set("corral-test:worker:gone", 1, px=200)
        assert client.get("corral-test:worker:gone") == b"1"
        time.sleep(0.4)
        assert client.get("corral-test:worker:gone") is None
        client.set("corral-test:worker:gone", 1, px=200)
        time.sleep(0.4)
        assert list(client.scan_iter(match="corral-test:worker:*")) == []
    finally:
        proc.stop()


@pytest.mark.django_db
def test_the_rounds_sample_memory_as_often_as_a_machine_is_sampled_and_a_round_a_little_early_still_samples():
    """The sampling round came every 10 s for a sample every 30 s: two rounds in three found
    the last sample too recent (a task and four queries for nothing). It comes every
    SAMPLE_SECONDS now; a round a little early (a late claim before) still takes its sample,
    one far too early does not. A real reading of this host's local machine."""
    from datetime import timedelta

    from django.utils import timezone

    from machines_app.models import Machine, MachineSample
    from sessions_app import room

    assert {r.name: r.period for r in rounds.ROUNDS}["sample-machines"] == room.SAMPLE_SECONDS
    machine = Machine.objects.create(name="here")
    host = machine.corral_host or None

    def last_sample_age(seconds: float) -> None:
        MachineSample.objects.filter(machine=machine).delete()
        MachineSample.objects.create(machine=machine, taken_at=timezone.now() - timedelta(seconds=seconds))

    last_sample_age(room.SAMPLE_SECONDS - 2)  # the round came 2 s early
    assert room.sample_machines(host=host) == [machine.pk]
    last_sample_age(room.SAMPLE_SECONDS / 2)
    assert room.sample_machines(host=host) == []


@pytest.mark.django_db
def test_a_turn_recovery_round_with_no_open_turn_asks_the_database_once(django_assert_num_queries):
    """Turn recovery runs every 5 s: with no open turn anywhere it asks once whether there
    is one, and stops (it asked three times: the held leases, the free and the lapsed ones)."""
    with django_assert_num_queries(1):
        tasks.recover_turns.apply()


def test_an_idle_workers_event_loop_has_no_timer_sooner_than_its_broker_health_checks():
    """kombu's Redis transport woke a worker's event loop every second to look at binding
    tables Corral never declares, and every 10 s to restore unacknowledged messages (a
    scan every tenth time) and for a credential provider Corral has none of
    (project/celery.py, project/settings.py). Registered as a worker registers it: the
    binding look is planned BINDING_LOOK_SECONDS on, and no timer of the transport's
    sooner than its health checks (25 s)."""
    from kombu.asynchronous import Hub

    hub = Hub()
    try:
        with app.connection_for_read() as conn:
            conn.default_channel  # noqa: B018 (a channel, as a consuming worker has)
            conn.transport.register_with_event_loop(conn.connection, hub)
            now = time.monotonic()
            planned = {item.entry: item.eta - now for item in hub.timer.queue if not item.entry.canceled}
            cycle = conn.transport.cycle
            assert planned[cycle._binding_expiry_tref] > 30
            assert planned[cycle._restore_messages_tref] > 60
            assert planned[cycle._reauth_tref] > 60
            assert min(planned.values()) > 20, planned
            assert corral_celery.BINDING_LOOK_SECONDS * 1000 <= 20 * 60 * 1000  # kombu's refresh: a third of an hour
    finally:
        hub.close()


class _Planned:
    """A twisted DelayedCall as the fake reactor below plans it."""

    def __init__(self, reactor, at: float, fn, args) -> None:
        self.reactor, self.at, self.fn, self.args, self.cancelled = reactor, at, fn, args, False

    def active(self) -> bool:
        return not self.cancelled and self in self.reactor.planned

    def cancel(self) -> None:
        self.cancelled = True
        self.reactor.planned.remove(self)

    def getTime(self) -> float:  # noqa: N802 (twisted's name)
        return self.at


class _Reactor:
    """Twisted's reactor as project.daphne_server uses it: plans calls, runs them when told."""

    def __init__(self, now: float) -> None:
        self.now = now  # the same clock as time.time() here
        self.planned: list[_Planned] = []

    def seconds(self) -> float:
        return self.now

    def callLater(self, delay: float, fn, *args) -> _Planned:  # noqa: N802 (twisted's name)
        call = _Planned(self, self.now + delay, fn, args)
        self.planned.append(call)
        return call

    def run_due(self) -> None:
        while due := sorted((c for c in self.planned if c.at <= self.now), key=lambda c: c.at):
            self.planned.remove(due[0])
            due[0].fn(*due[0].args)


def _open_websocket(server, opened: float, checks: list, clock: list):
    """An open websocket of ``server`` whose timeout check is daphne's ping rule alone."""
    from daphne.ws_protocol import WebSocketProtocol

    protocol = WebSocketProtocol.__new__(WebSocketProtocol)
    protocol.state, protocol.socket_opened, protocol.last_ping = WebSocketProtocol.STATE_OPEN, opened, opened
    protocol.client_addr, protocol.path = ["127.0.0.1", 50000], "/ws/attention/"  # its repr, in daphne's log

    def check_timeouts() -> None:
        checks.append(protocol)
        if clock[0] - protocol.last_ping > server.ping_interval:  # a ping sent
            protocol.last_ping = clock[0]

    protocol.check_timeouts = check_timeouts
    server.connections[protocol] = {"connected": opened}
    return protocol


def test_daphne_plans_its_looks_when_something_falls_due_not_on_a_clock(monkeypatch):
    """daphne looked at every connection every second (ended applications) and every two
    seconds (timeouts and pings) for as long as it ran (project/daphne_server.py). With
    pages open and nothing happening, the next timeout look is planned for the pings
    (one look for the pages that fall due within two seconds of each other), none for a
    daphne without connections, and no application look at all; an application that
    ends is looked at once, the next time round the loop, and forgotten with its closed
    connection. Daphne's rules themselves are its own (the protocols' checks); a fake
    reactor and clock stand in for twisted's."""
    from project import daphne_server

    reactor = _Reactor(1000.0)
    clock = [1000.0]
    monkeypatch.setattr(daphne_server, "reactor", reactor)
    monkeypatch.setattr(daphne_server.time, "time", lambda: clock[0])
    server = daphne_server.QuietServer(application=None, endpoints=["tcp:port=0"], ping_interval=20)
    server.connections = {}
    server.timeout_checker()
    assert reactor.planned == []  # nothing open: nothing to look at, ever
    checks: list = []
    first = _open_websocket(server, 1000.0, checks, clock)
    second = _open_websocket(server, 1001.0, checks, clock)
    server.application_checker()
    server.timeout_checker()
    assert len(checks) == 2
    [look] = reactor.planned
    assert look.fn == server.timeout_checker
    assert look.at == pytest.approx(1001.0 + 20 + daphne_server.SLACK)  # both pings' look, the later one's due
    # A message from the first page moved its ping later (daphne's last_ping): the look
    # pings the second only, and plans the next for the first's new due time.
    reactor.now = clock[0] = look.at
    first.last_ping = 1015.0
    reactor.run_due()
    assert second.last_ping == clock[0] and first.last_ping == 1015.0
    assert [call.at for call in reactor.planned] == [pytest.approx(1015.0 + 20 + daphne_server.SLACK)]

    # An application that ends is looked at in a call of its own, once for all noticed.
    loop = asyncio.new_event_loop()
    try:
        ended = loop.create_future()
        ended.set_result(None)
        server.connections[first]["application_instance"] = ended
        server.connections[first]["disconnected"] = clock[0]
        server._look_at(first)
        server._look_at(first)
        assert [call.fn for call in reactor.planned].count(server._reap_noticed) == 1
        reactor.run_due()
        assert first not in server.connections
    finally:
        loop.close()


def test_an_application_that_outlives_its_closed_connection_is_cancelled_as_daphne_does(monkeypatch):
    """daphne cancels an application still running ``application_close_timeout`` seconds
    after its connection closed (it looked every second). Here the close plans one look
    just after that time: it cancels the application, and its end forgets the connection."""
    from project import daphne_server

    reactor = _Reactor(1000.0)
    clock = [1000.0]
    monkeypatch.setattr(daphne_server, "reactor", reactor)
    monkeypatch.setattr(daphne_server.time, "time", lambda: clock[0])
    server = daphne_server.QuietServer(application=None, endpoints=["tcp:port=0"], application_close_timeout=10)
    server.connections = {}
    protocol = _open_websocket(server, 1000.0, [], clock)
    loop = asyncio.new_event_loop()
    try:
        running = loop.create_future()
        server.connections[protocol]["application_instance"] = running
        server.protocol_disconnected(protocol)
        reactor.run_due()
        assert protocol in server.connections and not running.cancelled()  # still has time
        reactor.now = clock[0] = 1000.0 + 10 + daphne_server.SLACK
        reactor.run_due()
        assert running.cancelled()
        server._reap(protocol)  # what its done callback asks for
        assert protocol not in server.connections
    finally:
        loop.close()


def test_daphnes_command_line_runs_the_quiet_server_for_corrals_application():
    """Every way of starting daphne on Corral's application (``./corral run``, a systemd
    unit, the tests' stack) gets project.daphne_server's server, without an argument:
    loading the application as daphne's command line does installs it."""
    import subprocess
    import sys

    from .conftest import ROOT

    code = ("import daphne.cli, daphne.server, django.utils.module_loading as m; "
            "m.import_string('project.asgi.application'); "
            "from project.daphne_server import QuietHTTPFactory, QuietServer; "
            "assert daphne.cli.CommandLineInterface.server_class is QuietServer; "
            "assert daphne.server.HTTPFactory is QuietHTTPFactory")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings",
                               "SECRET_KEY": settings.SECRET_KEY, "REDIS_URL": settings.REDIS_URL})
    assert done.returncode == 0, done.stderr[-2000:]


def test_daphnes_http_factory_formats_its_log_date_per_line_not_every_second():
    """twisted's HTTP factory formatted its access log's date every second, on a timer
    (project/daphne_server.py): started, this one plans nothing, and a line logged still
    carries the date of its moment."""
    from project import daphne_server

    factory = daphne_server.QuietHTTPFactory(server=None)
    factory.startFactory()
    try:
        assert factory._logDateTimeCall is None
        lines: list[str] = []

        class Log:
            def write(self, line: str) -> None:
                lines.append(line)

            def close(self) -> None:
                pass

        factory._logFile = Log()
        factory._logDateTime = "stale"
        factory._logFormatter = lambda date, request: date
        factory.log(object())
        assert lines and "stale" not in lines[0] and str(time.gmtime().tm_year) in lines[0]
    finally:
        factory.stopFactory()


def test_a_liveness_write_waits_for_no_reply_and_a_reply_missing_a_beat_is_a_failure():
    """A worker's liveness thread wrote its key and then waited for Redis's reply: a second
    wake-up a beat (sessions_app/liveness.py). Its writes' replies are read at the next
    beat, when they have come; one still missing then is a failure (Redis gone silent)."""
    from sessions_app import liveness

    class Connection:
        def __init__(self, replies: int) -> None:
            self.replies = replies

        def can_read(self, timeout: float) -> bool:
            assert timeout == 0  # never a wait
            return self.replies > 0

        def read_response(self) -> bytes:
            self.replies -= 1
            return b"OK"

    both = Connection(2)
    liveness._read_replies(both, 2)
    assert both.replies == 0
    with pytest.raises(redis.TimeoutError):
        liveness._read_replies(Connection(1), 2)


def test_a_heartbeat_keeps_both_keys_alive_from_one_write_a_beat():
    """The worker's key and its host's, written together at each beat, both renewed."""
    from sessions_app import liveness

    name = f"beat-test-{uuid.uuid4().hex[:8]}@test"
    host = uuid.uuid4().hex[:8]
    beat = liveness.Heartbeat(name, host=host).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (name in (liveness.live_workers() or set())
                                                    and host in (liveness.live_hosts() or set())):
            time.sleep(0.1)
        assert name in liveness.live_workers()
        assert host in liveness.live_hosts()
        assert liveness.worker_pid(name) == os.getpid()
        assert liveness.name_in_use(name) == os.getpid()  # renewed: its time to live went up
    finally:
        beat.stop()


def test_the_live_link_waits_in_redis_and_a_short_socket_timeout_does_not_cut_it(monkeypatch, settings):
    """Each daphne with pages open kept asking Redis PING every 2 s: two wake-ups each, its
    clock's and the answer's (sessions_app/live/live_link.py). It keeps one question
    waiting in Redis instead (a BLPOP of a list nobody writes, answered by Redis's own
    clock). With a page open for longer than two answers the page is not closed, even on
    a Redis URL whose socket timeout (1 s) is shorter than the wait; and Redis shows the
    link's connection blocked in that BLPOP. A Redis that cannot be reached closes the page
    as lost (4503) after FAILURES_BEFORE_LOST questions."""
    from sessions_app.live import live_link

    class Page:
        closed: int | None = None

        async def close(self, code: int) -> None:
            self.closed = code

    base = settings.REDIS_URL
    settings.REDIS_URL = base + ("&" if "?" in base else "?") + "socket_timeout=1"

    async def hold(seconds: float) -> tuple[Page, list]:
        page = Page()
        monkeypatch.setattr(live_link, "_open", {page})
        monkeypatch.setattr(live_link, "_task", None)
        live_link.watch(page)
        await asyncio.sleep(seconds / 2)
        blocked = [c for c in await asyncio.to_thread(lambda: redis.Redis.from_url(base).client_list())
                   if c.get("cmd") == "blpop"]
        await asyncio.sleep(seconds / 2)
        live_link.forget(page)
        assert live_link._task is not None
        await asyncio.wait_for(live_link._task, 4 * live_link.PING_EVERY)
        return page, blocked

    page, blocked = asyncio.run(hold(2.5 * live_link.PING_EVERY))
    assert page.closed is None
    assert blocked, "no connection waits in Redis"

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there

    async def lost() -> Page:
        page = Page()
        monkeypatch.setattr(live_link, "_open", {page})
        monkeypatch.setattr(live_link, "_task", None)
        live_link.watch(page)
        assert live_link._task is not None
        await asyncio.wait_for(live_link._task, 10 * live_link.PING_EVERY)
        return page

    assert asyncio.run(lost()).closed == live_link.LINK_LOST


def test_a_daphnes_sockets_share_their_heartbeats_after_the_first(settings):
    """Each socket's heartbeat (presence, rights, a lost push: every CORRAL_PRESENCE_SECONDS)
    came at its own moment: a daphne with N pages open woke N times a beat. After its
    first, a socket beats on the multiples of the heartbeat on the process's clock: sockets
    whose last beats were apart beat next together, and never later than a beat on."""
    from sessions_app.live import presence

    settings.CORRAL_PRESENCE_SECONDS = 20
    last_beats = [1000.0, 1003.5, 1013.0, 1019.99]
    next_beats = [at + presence.until_next_beat(at) for at in last_beats]
    assert next_beats == [pytest.approx(1020.0)] * 4
    assert all(0 < presence.until_next_beat(at) <= 20 for at in [*last_beats, 1020.0, 0.0])
