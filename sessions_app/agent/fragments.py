"""Streamed text on its way to the watchers and into the transcript, in batches
(:class:`Fragments`; docs/live-page.md, "What it costs"). Threads and clocks only; no
Django import: the step hands it its ``record`` and ``tail``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FRAGMENT_FLUSH_EVERY = 0.05  # seconds: the longest streamed text waits before watchers see it
FRAGMENT_STORE_EVERY = 0.5  # seconds: the longest streamed text waits to be stored
#: Seconds between the starts of two reads of a reply's stream: tokens gather in the socket
#: and are read, handed on and shown as one burst (completions.AbortableHTTP).
READ_EVERY = FRAGMENT_FLUSH_EVERY


class Fragments:
    """Streamed text on its way to the watchers and into the transcript (docs/live-page.md,
    "What it costs").

    Each stored event costs a transaction, a push and a websocket message; one per token
    would spend more CPU than the model does (docs/behaviour.md §13). So text is stored in
    batches of ``FRAGMENT_STORE_EVERY`` seconds, one event each, and in between the
    watchers are shown what has streamed since as a *tail* (``tail(kind, text, after)``:
    all the text not stored yet, after stored event ``after``; pushed, never stored).

    The stream is read in bursts (``READ_EVERY`` apart, completions.AbortableHTTP), and
    :meth:`at_read` runs at the end of each, before the next read: it stores a block's
    first text (so the block is on the page at once) and shows the rest as a tail. So a
    watcher sees each token within about ``READ_EVERY`` of its arrival. :meth:`add` keeps
    the batches (a change of kind stores the batch before it, keeping order; text that
    has waited a store window is stored), as does :meth:`due` for anything else that
    streams (a call's arguments, usage). :meth:`flush_due` — the step's watcher thread,
    when :meth:`seconds_to_due` says — covers a stream gone quiet and a client that reads
    without bursts: it shows text not shown for ``FRAGMENT_FLUSH_EVERY``, and stores text
    that has waited a store window. So no text waits for the next fragment, and a worker
    that dies loses at most the last ``FRAGMENT_STORE_EVERY`` of text.

    Thread-safe (the stream's thread and the watcher's). A write that fails in the
    watcher's thread (the lease lost: turns.LeaseLost) is raised in the stream's thread at
    its next :meth:`add`, :meth:`at_read` or :meth:`flush`.
    """

    def __init__(self, record: Callable[[str, dict], int], tail: Callable[[str, str, int], None]) -> None:
        self.record = record
        self.tail = tail
        self.lock = threading.Lock()
        self.kind: str | None = None
        self.parts: list[str] = []
        self.oldest = 0.0  # time.monotonic() of the first part not stored
        self.unshown: float | None = None  # … of the first part no watcher was shown
        self.stored_seq: int | None = None  # the last event stored of this block
        self.started = False  # whether the reply has begun (any text, call or usage)
        self.failed: Exception | None = None

    def add(self, kind: str, text: str) -> None:
        if not text:
            return
        with self.lock:
            self._raise_failure()
            self.started = True
            if kind != self.kind:
                self._store()
                self.kind, self.stored_seq = kind, None
            now = time.monotonic()
            if not self.parts:
                self.oldest = now
            if self.unshown is None:
                self.unshown = now
            self.parts.append(text)
            self._due(now)

    def due(self) -> None:
        """Store what is due (the stream's thread, at every delta of the reply but its text)."""
        with self.lock:
            self._raise_failure()
            self.started = True
            self._due(time.monotonic())

    def at_read(self) -> bool:
        """The end of a burst (the stream's thread, before it reads again): store a
        block's first text, show the rest. False until the reply has begun (while the
        prompt is read): the reads are paced only from then on (completions.AbortableHTTP),
        so the reply's first token is read, stored and shown the moment it comes."""
        with self.lock:
            self._raise_failure()
            now = time.monotonic()
            self._due(now)
            if self.parts:
                if self.stored_seq is None:
                    self._store()
                elif self.unshown is not None:
                    self._show()
            return self.started

    def seconds_to_due(self) -> float | None:
        """Seconds until :meth:`flush_due` has something to do; None while nothing waits
        (the watcher then sleeps until its next interrupt poll)."""
        with self.lock:
            if not self.parts or self.failed is not None:
                return None
            due = self.oldest + FRAGMENT_STORE_EVERY
            if self.stored_seq is not None and self.unshown is not None:
                due = min(due, self.unshown + FRAGMENT_FLUSH_EVERY)
            return max(0.0, due - time.monotonic())

    def flush_due(self) -> None:
        """Show text no burst end has shown for a whole ``FRAGMENT_FLUSH_EVERY``, and
        store only text that has waited a whole store window (the watcher's thread: its
        database connection is not the stream's, so it writes only when the stream has
        gone quiet)."""
        with self.lock:
            if self.failed is None:
                try:
                    now = time.monotonic()
                    self._due(now, quiet=True)
                    if (self.parts and self.stored_seq is not None and self.unshown is not None
                            and now - self.unshown >= FRAGMENT_FLUSH_EVERY):
                        self._show()
                except Exception as exc:  # raised in the stream's thread instead
                    self.failed = exc

    def flush(self) -> None:
        with self.lock:
            self._raise_failure()
            self._store()

    def _due(self, now: float, *, quiet: bool = False) -> None:
        if not self.parts:
            return
        if self.stored_seq is None and not quiet:
            if now - self.oldest >= FRAGMENT_FLUSH_EVERY:
                self._store()
        elif now - self.oldest >= FRAGMENT_STORE_EVERY:
            self._store()

    def _show(self) -> None:
        # Called only for text after a stored event of its block: both are known.
        assert self.kind is not None and self.stored_seq is not None
        self.unshown = None
        self.tail(self.kind, "".join(self.parts), self.stored_seq)

    def _raise_failure(self) -> None:
        if self.failed is not None:
            failed, self.failed = self.failed, None
            self.parts = []
            raise failed

    def _store(self) -> None:
        if self.parts and self.kind:
            text, self.parts, self.unshown = "".join(self.parts), [], None
            self.stored_seq = self.record(self.kind, {"text": text})
        self.parts = []
