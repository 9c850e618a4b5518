"""A database connection that dies under a step: tell it apart, reconnect, try again.

A PostgreSQL backend can be cut at any moment (``pg_terminate_backend``, a restart, a
network cut between a worker's host and the database). Django keeps one connection per
thread and does not reconnect by itself inside a task: every later query on that thread
raises ``OperationalError`` or ``InterfaceError`` ("connection already closed") until the
connection is closed, after which the next query opens a fresh one. A turn step that met
this used to fail its own error handling and its lease release on the same dead
connection, so its page stayed ``running`` until the lease lapsed a minute later and the
recovery blamed a worker that never stopped (docs/operations.md, "When the database
connection is cut").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connection

log = logging.getLogger(__name__)

#: What Django raises on a query over a connection that is gone (psycopg's and sqlite3's
#: errors are wrapped into these two).
LOST = (OperationalError, InterfaceError)

#: Tries of :func:`retrying` and the pause between two, in seconds: a database restarting
#: takes a few seconds; one that stays away is left to the lease's lapse and the recovery.
TRIES = 5
PAUSE = 1.0


#: PostgreSQL's SQLSTATEs of a connection that is gone: class 08 (connection exception) and
#: the server shutting the backend down (57P01 ``pg_terminate_backend`` or a fast shutdown,
#: 57P02 crash shutdown, 57P03 cannot connect now).
GONE_STATES = ("08", "57P01", "57P02", "57P03")


def lost(exc: BaseException) -> bool:
    """Whether ``exc`` says this thread's database connection is gone: an
    ``InterfaceError`` ("connection already closed"), or an ``OperationalError`` from the
    server or client library saying so (PostgreSQL: no SQLSTATE — the client lost the
    socket — or one of :data:`GONE_STATES`). A statement timeout or SQLite's "database is
    locked" is an ``OperationalError`` on a live connection: not lost."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError) or connection.vendor == "sqlite":
        return False
    state = getattr(exc.__cause__, "sqlstate", None) or ""
    return not state or state.startswith(GONE_STATES)


def reconnect() -> None:
    """Drop this thread's database connection; the next query opens a new one. Never
    raises (closing a dead connection may itself fail)."""
    try:
        connection.close()
    except Exception:  # the socket is gone already: nothing left to close cleanly
        log.debug("closing a dead database connection failed", exc_info=True)


def retrying[T](work: Callable[[], T], *, tries: int = TRIES, pause: float = PAUSE) -> T:
    """``work()``; when it fails for a lost connection (:data:`LOST`), reconnect and try
    again, up to ``tries`` times ``pause`` seconds apart. Returns what ``work`` returns;
    raises the last error when every try failed, and any other error at once."""
    for attempt in range(1, tries + 1):
        try:
            return work()
        except LOST:
            reconnect()
            if attempt == tries:
                raise
            time.sleep(pause)
    raise AssertionError("unreachable")
