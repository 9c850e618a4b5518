"""How the lower layers hand work to Celery: by task name, never by importing the tasks.

Actions and the servers package must not import :mod:`sessions_app.tasks` (the tasks import
them: that would be an import circle), and an enqueue that fails — the broker is down for a
moment — must never undo or hide what the caller already stored. Work that is lost this
way is not lost for good: the housekeeping rounds' turn recovery picks up every open turn
whose step is not running, and their health watch starts again a session left ``loading``
by a start that never ran (sessions_app/rounds.py, servers.watch.recover_starts; the
page's Restart works then too: docs/architecture.md).

Work on a server of a host's own local machine goes to that host's queue of its kind
(``turns.<host id>``…, project/queues.py): only that host can reach the process, its
loopback port and its files. Work on an SSH machine goes to the shared queue, which every
host's workers consume (docs/operations.md, "More hosts").
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

from machines_app.models import Machine
from project import queues

from .models import AgentSession

log = logging.getLogger(__name__)

RUN_TURN = "sessions_app.tasks.run_turn"
START_SERVER = "sessions_app.tasks.start_server"
STOP_SERVER = "sessions_app.tasks.stop_server"
RESTART_SERVER = "sessions_app.tasks.restart_server"
STOP_PROCESS = "sessions_app.tasks.stop_process"
SLEEP_SERVER = "sessions_app.tasks.sleep_server"
REMOVE_SLOT = "sessions_app.tasks.remove_slot"
REMOVE_LOGS = "sessions_app.tasks.remove_logs"
PUSH_QUESTION = "attention_app.tasks.push_question"
REFRESH_MODELS = "machines_app.tasks.refresh_models"


def owner_host(task: str, args: tuple) -> str:
    """The host whose own queue ``task`` must go to, "" for the shared queue. Tasks of
    queues.MACHINE_BOUND name their machine by their first argument: a session id (its
    machine), a machine id (REFRESH_MODELS) or a ``machine_place`` dict."""
    if task not in queues.MACHINE_BOUND or not args:
        return ""
    first = args[0]
    if isinstance(first, dict):
        return str(first.get("corral_host") or "") if first.get("transport") == Machine.Transport.LOCAL else ""
    if task == REFRESH_MODELS:
        row = Machine.objects.filter(pk=first).values_list("transport", "corral_host").first()
    else:
        row = AgentSession.objects.filter(pk=first).values_list("machine__transport", "machine__corral_host").first()
    if row is None or row[0] != Machine.Transport.LOCAL:
        return ""
    return row[1] or ""


def enqueue(task: str, *args: object) -> bool:
    """Send ``task`` (a name above) with ``args`` now, to the owner host's queue when it
    touches a host's local machine (:func:`owner_host`); False, logged, when the broker
    cannot take it."""
    try:
        host = owner_host(task, args)
        if host:
            kind = queues.ROUTES[task]["queue"]
            current_app.send_task(task, args=args, queue=queues.on_host(kind, host))
        else:
            current_app.send_task(task, args=args)
    except Exception as exc:  # kombu/redis raise many kinds; none may fail the caller
        log.warning("could not enqueue %s%r: %s", task, args, exc)
        return False
    return True


def enqueue_on_commit(task: str, *args: object) -> None:
    """:func:`enqueue` once the current transaction commits (at once outside one), so a
    worker never looks for rows that are not there yet."""
    transaction.on_commit(lambda: enqueue(task, *args))
