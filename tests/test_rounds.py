"""The housekeeping rounds (sessions_app/rounds.py): periodic checks run by threads of every
housekeeping worker instead of Celery beat. Real Redis (the claims); rounds of this test's
own, with short periods, so the suite's running stack and its rounds are left alone."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import redis
from django.conf import settings

from sessions_app import rounds, tasks

from .conftest import wait_for

PERIOD = 0.4


def _round(run, period: float = PERIOD) -> rounds.Round:
    return rounds.Round(f"test-{uuid.uuid4().hex[:12]}", period, run)


def test_two_workers_run_the_shared_part_once_a_period_between_them_and_each_its_own_hosts_share():
    """Two workers' rounds threads (two hosts), started together, for 4 s: the shared part
    ran once a period in all — never twice within a period, whichever worker took it — and
    each worker ran its own host's share every period, for its own host only."""
    runs: list[tuple[float, str, bool, str]] = []
    lock = threading.Lock()

    def record(share: rounds.Share) -> None:
        with lock:
            runs.append((time.monotonic(), share.worker, share.shared, share.host))

    round_ = _round(record)
    one = rounds.Rounds("housekeeping@one", host="host-one", rounds=(round_,))
    two = rounds.Rounds("housekeeping@two", host="host-two", rounds=(round_,))
    seconds = 4.0
    one.start()
    two.start()
    time.sleep(seconds)
    one.stop()
    two.stop()
    assert not any(t.is_alive() for t in one.threads + two.threads)

    periods = seconds / PERIOD
    shared = sorted(at for at, _worker, is_shared, _host in runs if is_shared)
    assert periods - 2 <= len(shared) <= periods + 1, runs
    gaps = [b - a for a, b in zip(shared, shared[1:], strict=False)]
    assert min(gaps) > PERIOD / 2, gaps  # never two in one period
    for worker, host in (("housekeeping@one", "host-one"), ("housekeeping@two", "host-two")):
        own = [r for r in runs if r[1] == worker]
        assert periods - 2 <= len(own) <= periods + 1, runs  # its own share, every period
        assert {r[3] for r in own} == {host}
    key = rounds.claim_key(round_.name)
    assert redis.Redis.from_url(settings.REDIS_URL).get(key) in (b"housekeeping@one", b"housekeeping@two", None)


def test_one_worker_alone_runs_every_shared_part_and_never_takes_another_workers_claim():
    """One worker alone takes the shared part every period: its claim of the last period
    lapses just before its next run, or is renewed by it when that run's claim reaches
    Redis first (a claim that lived the whole period was found still there now and then).
    A claim another worker holds is left alone."""
    assert rounds.claim_ms(2.0) == 1800 and rounds.claim_ms(3600.0) == 3_599_800
    assert rounds.claim_ms(0.4) == 360
    shared: list[bool] = []
    round_ = _round(lambda share: shared.append(share.shared))
    alone = rounds.Rounds("housekeeping@alone", rounds=(round_,)).start()
    time.sleep(PERIOD * 6 + PERIOD / 2)
    alone.stop()
    assert len(shared) >= 6 and all(shared), shared
    assert alone.claim(round_)  # its own claim, still there: renewed
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.set(rounds.claim_key(round_.name), "housekeeping@other", px=10_000)
    assert not alone.claim(round_)
    assert client.get(rounds.claim_key(round_.name)) == b"housekeeping@other"
    client.delete(rounds.claim_key(round_.name))


def test_a_round_that_raises_is_logged_and_its_thread_goes_on(caplog):
    calls: list[int] = []

    def fails_first(share: rounds.Share) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the database went away")

    worker = rounds.Rounds("housekeeping@raises", rounds=(_round(fails_first, 0.1),))
    with caplog.at_level(logging.ERROR, logger="sessions_app.rounds"):
        worker.start()
        wait_for(lambda: len(calls) >= 3, 10, what="the runs after the failure")
        worker.stop()
    assert "the database went away" in caplog.text
    assert "failed" in caplog.text


def test_without_redis_this_hosts_share_still_runs_and_the_shared_part_waits(monkeypatch, caplog):
    """Redis cannot be reached: nobody can take a claim, so the shared part waits for it
    (logged once, not every run); this host's own share needs no claim and goes on."""
    shares: list[rounds.Share] = []
    monkeypatch.setattr(settings, "REDIS_URL", "redis://127.0.0.1:1/0")
    worker = rounds.Rounds("housekeeping@cut-off", host="host-one", rounds=(_round(shares.append, 0.1),))
    with caplog.at_level(logging.WARNING, logger="sessions_app.rounds"):
        worker.start()
        wait_for(lambda: len(shares) >= 3, 10, what="three runs")
        worker.stop()
    assert {(s.shared, s.host) for s in shares} == {(False, "host-one")}
    assert caplog.text.count("cannot reach Redis") == 1


def test_the_rounds_stop_with_their_worker():
    """Celery's worker_shutdown stops the worker's rounds (tasks.stop_rounds), after the
    run in progress."""
    runs: list[int] = []
    started = rounds.Rounds("housekeeping@stopping", rounds=(_round(lambda share: runs.append(1), 0.1),)).start()
    tasks._rounds.append(started)
    wait_for(lambda: runs, 10, what="a first run")
    tasks.stop_rounds()
    assert tasks._rounds == []
    assert not any(t.is_alive() for t in started.threads)
    count = len(runs)
    time.sleep(0.3)
    assert len(runs) == count


@pytest.mark.parametrize("name", [r.name for r in rounds.ROUNDS])
def test_the_rounds_keep_the_periods_beat_had(name):
    periods = {"watch-servers": 2.0, "recover-turns": 5.0, "sample-machines": 30.0, "forget-old-slots": 600.0,
               "forget-images": 3600.0}
    assert {r.name: r.period for r in rounds.ROUNDS}[name] == periods[name]
