"""Celery queues: which task runs on which queue, so one kind of work never waits behind another.

Three queues, each consumed by workers of its own (``./corral run`` starts one worker per
queue, docs/operations.md shows the production units)::

    turns         sessions_app.tasks.run_turn            (one thread per streaming turn)
    servers       start / stop / restart / sleep a llama-server, stop an orphan, remove a
                  deleted session's slot files and logs
    housekeeping  watch_servers, recover_turns, sample_machines (beat, every few seconds),
                  forget_old_slots (beat, every 10 minutes),
                  refresh_models, Web Push of a question (attention_app.tasks.push_question)

A full ``turns`` pool (every thread streaming a reply) therefore never delays a health
check, a recovery or a Stop. Pure data: imported by settings, the launcher and the tests.
"""

from __future__ import annotations

TURNS = "turns"
SERVERS = "servers"
HOUSEKEEPING = "housekeeping"
ALL = (TURNS, SERVERS, HOUSEKEEPING)

#: Celery's ``task_routes``: task name → ``{"queue": name}``. A task not listed goes to
#: HOUSEKEEPING (``task_default_queue``).
ROUTES: dict[str, dict[str, str]] = {
    "sessions_app.tasks.run_turn": {"queue": TURNS},
    "sessions_app.tasks.start_server": {"queue": SERVERS},
    "sessions_app.tasks.stop_server": {"queue": SERVERS},
    "sessions_app.tasks.restart_server": {"queue": SERVERS},
    "sessions_app.tasks.stop_process": {"queue": SERVERS},
    "sessions_app.tasks.sleep_server": {"queue": SERVERS},
    "sessions_app.tasks.remove_slot": {"queue": SERVERS},
    "sessions_app.tasks.remove_logs": {"queue": SERVERS},
    "sessions_app.tasks.watch_servers": {"queue": HOUSEKEEPING},
    "sessions_app.tasks.recover_turns": {"queue": HOUSEKEEPING},
    "sessions_app.tasks.sample_machines": {"queue": HOUSEKEEPING},
    "sessions_app.tasks.forget_old_slots": {"queue": HOUSEKEEPING},
    "machines_app.tasks.refresh_models": {"queue": HOUSEKEEPING},
    "attention_app.tasks.push_question": {"queue": HOUSEKEEPING},
}

#: Threads of the servers and housekeeping workers that ``./corral run`` starts (a start
#: waits for a model to load, up to CORRAL_READY_TIMEOUT; a model refresh over SSH may take
#: a while, so housekeeping keeps threads free for the 2-second health watch).
SERVERS_CONCURRENCY = 4
HOUSEKEEPING_CONCURRENCY = 4
