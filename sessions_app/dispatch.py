"""How the lower layers hand work to Celery: by task name, never by importing the tasks.

Actions and the lifecycle must not import :mod:`sessions_app.tasks` (the tasks import
them: that would be an import circle), and an enqueue that fails — the broker is down for a
moment — must never undo or hide what the caller already stored. Work that is lost this
way is not lost for good: the beat's ``recover_turns`` picks up every open turn whose step
is not running, and ``watch_servers`` starts again a session left ``loading`` by a start that
never ran (lifecycle.recover_starts; the page's Restart works then too: docs/architecture.md).
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

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


def enqueue(task: str, *args: object) -> bool:
    """Send ``task`` (a name above) with ``args`` now; False, logged, when the broker
    cannot take it."""
    try:
        current_app.send_task(task, args=args)
    except Exception as exc:  # kombu/redis raise many kinds; none may fail the caller
        log.warning("could not enqueue %s%r: %s", task, args, exc)
        return False
    return True


def enqueue_on_commit(task: str, *args: object) -> None:
    """:func:`enqueue` once the current transaction commits (at once outside one), so a
    worker never looks for rows that are not there yet."""
    transaction.on_commit(lambda: enqueue(task, *args))
