"""An idle worker takes a task the moment it is sent (project/settings.py's broker options).

kombu's virtual transport sleeps ``polling_interval`` after every poll that came back empty
in its blocking consumer loop (``drain_events(timeout=…)`` again and again: Celery's
``synloop``, the loop of a worker that does not run the event loop), and an empty BRPOP
reply (its timeout, with nothing queued) is such a poll: told ``polling_interval=5`` (meant
as the BRPOP timeout), a consumer slept up to 2 s with no BRPOP pending, and a task sent
meanwhile waited in Redis for the sleep to end. This test runs that loop with the
project's broker settings against the real Redis.
"""

from __future__ import annotations

import threading
import time
import uuid

from kombu import Consumer, Queue

from project.celery import app

#: Seconds a task may wait for an idle worker (it is at once; this is generous for CI).
AT_ONCE = 0.5


def test_an_idle_worker_takes_a_task_sent_at_any_moment_at_once():
    queue = Queue(f"corral-test-wakeup-{uuid.uuid4().hex}", auto_delete=True)
    taken: dict[str, float] = {}
    stop = threading.Event()

    def worker_loop(ready: threading.Event) -> None:
        with app.connection_for_read() as connection:
            def on_message(body, message):
                taken[body["id"]] = time.monotonic()
                message.ack()

            with Consumer(connection, [queue], callbacks=[on_message], accept=["json"]):
                ready.set()
                while not stop.is_set():  # what synloop does between tasks
                    try:
                        connection.drain_events(timeout=2.0)
                    except TimeoutError:
                        pass

    ready = threading.Event()
    thread = threading.Thread(target=worker_loop, args=(ready,), daemon=True)
    thread.start()
    assert ready.wait(10)
    sent: dict[str, float] = {}
    try:
        with app.connection_for_write() as connection, connection.Producer() as producer:
            # One task, then none for over 5 s (every task taken starts a new BRPOP, so only
            # a quiet spell lets one time out), then tasks just after its empty reply.
            start = time.monotonic()
            for at in (0.5, 5.8, 6.3, 6.8, 7.3):
                time.sleep(max(0.0, start + at - time.monotonic()))
                key = uuid.uuid4().hex
                sent[key] = time.monotonic()
                producer.publish({"id": key}, routing_key=queue.name, declare=[queue], serializer="json")
            deadline = time.monotonic() + 10
            while len(taken) < len(sent) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    waits = sorted(round(taken[key] - sent[key], 3) for key in sent if key in taken)
    assert len(waits) == len(sent), f"some tasks were never taken: {waits}"
    assert waits[-1] < AT_ONCE, f"an idle worker left a task waiting: {waits}"
