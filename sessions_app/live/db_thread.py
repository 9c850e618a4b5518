"""The live pages' trips to the database: one connection, kept while pages are open.

Channels runs every websocket consumer's ``database_sync_to_async`` on one thread per
daphne process (asgiref's single-thread executor: a consumer runs outside any
``ThreadSensitiveContext``), and closes stale connections before and after each call.
With Django's default ``CONN_MAX_AGE`` of 0 every call opened a new database connection
and closed it again: a fifth of daphne's time while pages streamed.

:func:`database_sync_to_async` here is Channels' own, on the same thread, but a connection
it opens is Django's persistent kind — ``CONN_MAX_AGE`` :data:`KEEP_SECONDS` and
``CONN_HEALTH_CHECKS`` on — so the next call finds it open. Django's own rules then decide
at each call, as at each request: a connection that raised an error and no longer answers,
one left outside autocommit, or one older than :data:`KEEP_SECONDS` is closed; and before a
call's first query the connection is asked ``SELECT 1``, so one that PostgreSQL cut while
it sat idle (a restart, ``pg_terminate_backend``) is replaced, not failed on.

It is kept only while this process has a page open (:func:`sessions_app.live.live_link.pages_open`):
the call that finds none open — every page's last one, as it closes — closes it, so an idle
daphne holds no connection, and neither does a test process once its sockets are closed
(PostgreSQL would refuse to drop the test database).

Only these calls get a kept connection: the HTTP views keep ``CONN_MAX_AGE`` 0, because
Django runs each request on a thread of its own (its ``ThreadSensitiveContext``), where a
kept connection would never be used again and would stay open until garbage-collected.
"""

from __future__ import annotations

from channels.db import DatabaseSyncToAsync
from django.db import connections

from . import live_link

#: Seconds a kept connection lives at most (Django's ``CONN_MAX_AGE``, for these calls only).
KEEP_SECONDS = 600


class KeptConnection(DatabaseSyncToAsync):
    """Channels' ``database_sync_to_async`` whose connection outlives the call while pages
    are open (module docstring). Same thread, same stale-connection rules."""

    def thread_handler(self, loop, *args, **kwargs):
        # Each thread has its own connection objects, so their settings can be this
        # thread's own for the call: a connection opened now takes its lifetime and health
        # checks from them (Django reads both when it connects). Other callers on the same
        # thread (Channels' login lookup) keep Django's settings and open no kept connection.
        plain = [(conn, conn.settings_dict) for conn in connections.all()]
        for conn, settings_dict in plain:
            conn.settings_dict = {**settings_dict, "CONN_MAX_AGE": KEEP_SECONDS, "CONN_HEALTH_CHECKS": True}
        try:
            return super().thread_handler(loop, *args, **kwargs)
        finally:
            for conn, settings_dict in plain:
                conn.settings_dict = settings_dict
            if not live_link.pages_open():
                for conn in connections.all(initialized_only=True):
                    if not conn.in_atomic_block:  # a caller's transaction (a test's) is its own
                        conn.close()


#: Used as Channels' is: ``await database_sync_to_async(func)(*args)``.
database_sync_to_async = KeptConnection
