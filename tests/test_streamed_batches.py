"""Streamed text is stored in batches of at most one window (docs/live-page.md, "What it
costs"): few events per reply, none waiting longer than agent.FRAGMENT_FLUSH_EVERY, in
order, and a write that fails in the watcher's thread stops the stream's thread.

The real-stack proof (a worker killed while the stream is quiet has lost nothing older
than a window) is in tests/test_agent_durable.py.
"""

from __future__ import annotations

import pytest

from sessions_app import agent, turns

WINDOW = agent.FRAGMENT_FLUSH_EVERY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(agent.time, "monotonic", clock)
    return clock


def test_fragments_within_a_window_make_one_event_and_a_later_one_closes_it(clock):
    stored = []
    batch = agent.Fragments(lambda kind, payload: stored.append((kind, payload["text"])))
    for word in ["a", "b", "c"]:
        batch.add("assistant_text", word)
        clock.now += WINDOW / 4
    assert stored == []
    clock.now += WINDOW / 2
    batch.add("assistant_text", "d")  # the oldest part has waited a window: stored with it
    assert stored == [("assistant_text", "abcd")]


def test_a_batch_whose_stream_went_quiet_is_stored_by_the_watcher_without_a_next_fragment(clock):
    stored = []
    batch = agent.Fragments(lambda kind, payload: stored.append((kind, payload["text"])))
    batch.add("assistant_text", "alpha")
    batch.add("assistant_text", " beta")
    batch.flush_due()
    assert stored == []  # not a window old yet
    clock.now += WINDOW * 1.01
    batch.flush_due()
    assert stored == [("assistant_text", "alpha beta")]
    batch.flush_due()
    assert stored == [("assistant_text", "alpha beta")]  # nothing twice


def test_a_change_of_kind_stores_the_batch_before_it_in_order(clock):
    stored = []
    batch = agent.Fragments(lambda kind, payload: stored.append((kind, payload["text"])))
    batch.add("reasoning", "hm")
    batch.add("assistant_text", "Hi")
    batch.add("assistant_text", "")
    batch.flush()
    assert stored == [("reasoning", "hm"), ("assistant_text", "Hi")]


def test_a_lost_lease_in_the_watchers_thread_is_raised_in_the_streams_thread(clock):
    def record(kind, payload):
        raise turns.LeaseLost("taken over")

    batch = agent.Fragments(record)
    batch.add("assistant_text", "x")
    clock.now += WINDOW * 1.01
    batch.flush_due()  # the watcher's thread: nothing raised there
    with pytest.raises(turns.LeaseLost):
        batch.add("assistant_text", "y")
