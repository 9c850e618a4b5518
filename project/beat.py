"""Celery beat's scheduler for Corral: Celery's own (``PersistentScheduler``) without its
busy wait before each entry falls due.

Beat sleeps until the next entry is due, minus a 10 ms drift (``Scheduler.adjust``). When
the wait left is under 10 ms, the drift makes it negative; beat then does not sleep at all
and ticks again at once, over and over, until the entry is due: about a hundred ticks for
each run of the health watch (every 2 s) and the turn recovery (every 5 s), 6 ms of CPU a
second for a beat with nothing else to do — the largest part of an idle stack's CPU
(docs/live-page.md, "What it costs"). Here a wait shorter than twice the drift is slept
whole: beat wakes at the due time, not 10 ms before it.
"""

from __future__ import annotations

from celery.beat import PersistentScheduler


class Scheduler(PersistentScheduler):
    def adjust(self, n, drift=-0.010):
        """``n`` seconds to wait, less ``-drift`` when that leaves at least as much again;
        else ``n`` itself (never 0 or less while ``n`` is above 0)."""
        if n and n > 2 * -drift:
            return n + drift
        return n
