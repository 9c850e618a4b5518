"""A reply's text reaches the watchers within agent.FRAGMENT_FLUSH_EVERY and the transcript
within agent.FRAGMENT_STORE_EVERY (docs/live-page.md, "What it costs"): few stored events
per reply, tails in between carrying all the text not stored yet after the last stored
event, in order, and a write that fails in the watcher's thread stops the stream's thread.

The real-stack proofs are in tests/test_agent_durable.py (a worker killed while the stream
is quiet has lost nothing older than a store window) and tests/test_live_updates.py (tails
on the socket; a reconnecting page gets the text exactly once).
"""

from __future__ import annotations

import pytest

from sessions_app import agent, turns
from sessions_app.agent import fragments

SHOW = agent.FRAGMENT_FLUSH_EVERY
STORE = agent.FRAGMENT_STORE_EVERY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(fragments.time, "monotonic", clock)
    return clock


class Sink:
    """What a step would store (seq handed out from 10) and show."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, str]] = []
        self.tails: list[tuple[str, str, int]] = []

    def record(self, kind: str, payload: dict) -> int:
        self.stored.append((kind, payload["text"]))
        return 9 + len(self.stored)

    def tail(self, kind: str, text: str, after: int) -> None:
        self.tails.append((kind, text, after))


@pytest.fixture
def sink():
    return Sink()


def test_a_blocks_first_text_is_stored_at_the_first_burst_end_then_shown_as_tails_and_stored_in_batches(clock, sink):
    batch = agent.Fragments(sink.record, sink.tail)
    batch.add("assistant_text", "a")
    batch.add("assistant_text", "b")
    assert sink.stored == [] and sink.tails == []  # a burst is handed on before anything is written
    batch.at_read()  # the end of the first burst: the block goes on the page at once
    assert sink.stored == [("assistant_text", "ab")] and sink.tails == []
    for word in ["c", "d"]:
        clock.now += agent.READ_EVERY
        batch.add("assistant_text", word)
        batch.at_read()
    # Shown, not stored: each tail is all the text after stored event 10.
    assert sink.tails == [("assistant_text", "c", 10), ("assistant_text", "cd", 10)]
    batch.at_read()
    assert len(sink.tails) == 2  # nothing new to show: no tail
    batch.add("assistant_text", "e")
    clock.now += STORE
    batch.add("assistant_text", "f")  # the oldest part not stored has waited a store window
    assert sink.stored == [("assistant_text", "ab"), ("assistant_text", "cdef")]
    assert "".join(text for _, text in sink.stored) == "abcdef"


def test_the_watcher_wakes_only_when_something_is_due(clock, sink):
    batch = agent.Fragments(sink.record, sink.tail)
    assert batch.seconds_to_due() is None  # nothing waits: sleep until the interrupt poll
    batch.add("assistant_text", "a")
    assert batch.seconds_to_due() == pytest.approx(STORE)  # the first text's store window
    batch.at_read()
    assert batch.seconds_to_due() is None
    clock.now += 0.1
    batch.add("assistant_text", "b")  # not shown yet (no burst end: a client without bursts)
    assert batch.seconds_to_due() == pytest.approx(SHOW)
    clock.now += SHOW * 1.01
    assert batch.seconds_to_due() == 0
    batch.flush_due()
    assert sink.tails == [("assistant_text", "b", 10)]
    assert batch.seconds_to_due() == pytest.approx(STORE - SHOW * 1.01)


def test_a_stream_with_no_burst_ends_still_stores_its_first_text_within_a_show_window(clock, sink):
    # A client that reads without pacing (a test's scripted stream) never calls at_read.
    batch = agent.Fragments(sink.record, sink.tail)
    batch.add("assistant_text", "a")
    clock.now += SHOW * 1.01
    batch.add("assistant_text", "b")
    assert sink.stored == [("assistant_text", "ab")]


def test_a_failure_at_a_burst_end_is_raised_in_the_streams_thread(clock):
    def record(kind, payload):
        raise turns.LeaseLost("taken over")

    batch = agent.Fragments(record, lambda *args: None)
    batch.add("assistant_text", "x")
    with pytest.raises(turns.LeaseLost):
        batch.at_read()


def test_a_quiet_stream_is_shown_then_stored_by_the_watcher_without_a_next_fragment(clock, sink):
    batch = agent.Fragments(sink.record, sink.tail)
    batch.add("assistant_text", "alpha")
    batch.flush_due()
    assert sink.stored == []  # not a window old yet
    clock.now += SHOW * 1.01
    batch.due()  # something else streamed (a call's arguments): the block's first text is stored
    assert sink.stored == [("assistant_text", "alpha")]
    batch.add("assistant_text", " beta")
    clock.now += SHOW * 1.01
    batch.flush_due()  # the watcher: shown at once …
    assert sink.tails == [("assistant_text", " beta", 10)] and len(sink.stored) == 1
    batch.flush_due()
    assert len(sink.tails) == 1  # nothing new to show: no tail
    clock.now += STORE
    batch.flush_due()  # … and stored once it has waited a store window
    assert sink.stored == [("assistant_text", "alpha"), ("assistant_text", " beta")]
    batch.flush_due()
    assert len(sink.stored) == 2  # nothing twice


def test_the_watcher_stores_a_blocks_first_text_only_after_a_store_window(clock, sink):
    batch = agent.Fragments(sink.record, sink.tail)
    batch.add("reasoning", "hm")
    clock.now += SHOW * 1.01
    batch.flush_due()
    assert sink.stored == [] and sink.tails == []  # no block on the page yet to show a tail in
    clock.now += STORE
    batch.flush_due()
    assert sink.stored == [("reasoning", "hm")]


def test_a_change_of_kind_stores_the_batch_before_it_in_order(clock, sink):
    batch = agent.Fragments(sink.record, sink.tail)
    batch.add("reasoning", "hm")
    batch.add("assistant_text", "Hi")
    batch.add("assistant_text", "")
    batch.flush()
    assert sink.stored == [("reasoning", "hm"), ("assistant_text", "Hi")]


def test_a_lost_lease_in_the_watchers_thread_is_raised_in_the_streams_thread(clock):
    def record(kind, payload):
        raise turns.LeaseLost("taken over")

    batch = agent.Fragments(record, lambda *args: None)
    batch.add("assistant_text", "x")
    clock.now += STORE * 1.01
    batch.flush_due()  # the watcher's thread: nothing raised there
    with pytest.raises(turns.LeaseLost):
        batch.add("assistant_text", "y")


def test_the_reads_are_paced_only_once_the_reply_has_begun(clock, sink):
    """at_read says False while the prompt is read (nothing streamed yet: the next read
    starts at once, so the first token is shown the moment it comes), True from the end of
    the burst that brought the reply's first text — or a tool call's first fragment."""
    batch = agent.Fragments(sink.record, sink.tail)
    assert batch.at_read() is False
    assert batch.at_read() is False  # still reading the prompt: progress chunks only
    batch.add("assistant_text", "Hi")
    assert batch.at_read() is True
    assert sink.stored == [("assistant_text", "Hi")]  # stored at that burst's end
    calls = agent.Fragments(sink.record, sink.tail)
    assert calls.at_read() is False
    calls.due()  # a tool call's fragment, or the usage, streamed
    assert calls.at_read() is True
