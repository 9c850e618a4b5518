"""What a long-running process (daphne, a Celery worker) does once it has started: set
aside the objects it built while starting, so Python's garbage collector stops walking
them (docs/live-page.md, "What it costs").

CPython's full collection (generation 2) walks every object that has survived two
collections: in a worker or daphne that is everything Django, Celery, Channels and their
imports built at start, some 300,000 objects, and one full collection took 50–140 ms of
CPU here. One came in the middle of most first replies after a start, and then every time
enough new objects had lived long enough. ``gc.freeze()`` moves the objects alive now to a
permanent generation that collections skip; what is built later is collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then freeze every object still alive (never
    collected from now on: they live as long as the process anyway). Returns how many
    objects were frozen. Call it once, after the process has built what it keeps."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
