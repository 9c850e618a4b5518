"""The Celery app: spawn, health and turn loops run here (docs/behaviour.md §5, §6)."""

import os

from celery import Celery
from celery.signals import task_postrun, worker_init
from django.conf import settings
from django.db import close_old_connections
from kombu.transport import redis as kombu_redis

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

#: Seconds an idle worker's BRPOP waits in Redis before it is sent again (kombu's is 1 s).
#: A task sent meanwhile ends the BRPOP at once, so this delays no task; it is how often an
#: idle worker wakes to ask again (docs/live-page.md, "What it costs"). Set as kombu's own
#: attribute, not as ``polling_interval``, which is also a sleep after every empty poll of
#: a worker without the event loop (project/settings.py, tests/test_broker_wakeup.py).
BRPOP_SECONDS = 10
kombu_redis.Transport.brpop_timeout = BRPOP_SECONDS

#: Seconds between two looks of an idle worker's event loop at the broker's binding tables
#: (kombu's own: every second). kombu keeps alive the tables of queues declared with
#: ``x-expires`` and sweeps stale ones; Corral declares no such queue, so each look found
#: nothing to do, and it was most of an idle worker's wake-ups (docs/live-page.md, "What
#: it costs"). kombu refreshes a table at most every twenty minutes and sweeps at most
#: every 60 s (``MIN_BINDING_TTL / 3``, ``BINDING_SWEEP_INTERVAL``), so a look every 60 s
#: does all it did.
BINDING_LOOK_SECONDS = 60.0
_register_with_event_loop = kombu_redis.Transport.register_with_event_loop


def _register_quietly(self, connection, loop) -> None:
    """kombu's ``Transport.register_with_event_loop``, its binding look every
    :data:`BINDING_LOOK_SECONDS` instead of every second."""
    _register_with_event_loop(self, connection, loop)
    cycle = self.cycle
    every_second = getattr(cycle, "_binding_expiry_tref", None)
    if every_second is not None:
        every_second.cancel()
        cycle._binding_expiry_tref = loop.call_repeatedly(BINDING_LOOK_SECONDS, cycle.maybe_refresh_binding_expiry)


setattr(kombu_redis.Transport, "register_with_event_loop", _register_quietly)  # noqa: B010 (mypy: a method)

#: Seconds a worker thread keeps its database connection between tasks (Django's
#: ``CONN_MAX_AGE``, set in worker processes only: daphne keeps Django's default).
WORKER_CONNECTION_SECONDS = 600

app = Celery("corral")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def keep_database_connections(**_kwargs) -> None:
    """A worker thread keeps its database connection from one task to the next.

    Celery's Django fixup closes every connection before and after each task unless
    ``CELERY_DB_REUSE_MAX`` is set (it is: project/settings.py): a new connection for each
    health watch (every 2 s) and each turn step cost the housekeeping worker a third of
    its idle CPU and each step's first query a connect (docs/live-page.md, "What it
    costs"). Instead, after each task, Django's own rule closes a connection that failed
    or is older than WORKER_CONNECTION_SECONDS (:func:`close_finished_connections`), and
    CONN_HEALTH_CHECKS has one that broke while idle (a restarted database) replaced
    before its next query."""
    for database in settings.DATABASES.values():
        database["CONN_MAX_AGE"] = WORKER_CONNECTION_SECONDS
        database["CONN_HEALTH_CHECKS"] = True
    # Only in a worker: a task run in place (``.apply()``, a test inside its transaction)
    # must not have its caller's connection closed under it.
    task_postrun.connect(close_finished_connections, weak=False, dispatch_uid="corral-close-finished-connections")


def close_finished_connections(**_kwargs) -> None:
    """After each task: close this thread's connections that errored or outlived
    ``CONN_MAX_AGE`` (what Django does at the end of each request)."""
    close_old_connections()
