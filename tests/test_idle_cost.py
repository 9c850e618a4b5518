"""What an idle stack does, counted (docs/live-page.md, "What it costs"): the broker polls
of an idle worker, the queries of a quiet health watch, the database connections a worker
opens for its tasks. Counts, not times: the times are bench/run.py's."""

from __future__ import annotations

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
from sessions_app import tasks
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
    """The watch beat runs every 2 s: with nothing waiting for memory, no server, no start
    and no pending stop it makes five queries (it made nine: the memory line alone took
    five)."""
    with django_assert_max_num_queries(5):
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
