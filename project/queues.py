"""Celery queues: which task runs on which queue, so one kind of work never waits behind another.

Three queues, each consumed by workers of its own (``./corral run`` starts one worker per
queue, docs/operations.md shows the production units)::

    turns         sessions_app.tasks.run_turn            (one thread per streaming turn)
    servers       start / stop / restart / sleep a llama-server, stop an orphan, remove a
                  deleted session's slot files and logs
    housekeeping  refresh_models, machine_call (a page's read-only question about a
                  host's own local machine, always sent to that host's own queue:
                  machines_app/transports/relay.py),
                  Web Push of a question (attention_app.tasks.push_question); its
                  workers also run the periodic rounds, each in a thread of its own
                  (the health watch, turn recovery, memory sampling, clean-ups:
                  sessions_app/rounds.py), and the tasks that run one of those rounds
                  by hand (watch_servers, recover_turns, sample_machines,
                  forget_old_slots, forget_images)

A full ``turns`` pool (every thread streaming a reply) therefore never delays a health
check, a recovery or a Stop.

**Hosts.** Every Corral host has queues of its own besides: ``turns.<host id>``,
``servers.<host id>`` and ``housekeeping.<host id>`` (:func:`on_host`), which its workers
consume with the shared one of their kind. Work that must touch a server on a host's own
local machine — its process, its loopback port, its files — goes there
(sessions_app/dispatch.py), since no other host can reach it; work on an SSH machine
stays on the shared queues, any host's worker takes it (docs/operations.md, "More
hosts"). Pure data: imported by settings, the launcher and the tests.
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
    "machines_app.tasks.machine_call": {"queue": HOUSEKEEPING},
    "attention_app.tasks.push_question": {"queue": HOUSEKEEPING},
}

#: Tasks that touch one machine's server or files: sent to the owner host's queue of their
#: kind when that machine is a host's local machine (sessions_app/dispatch.py).
MACHINE_BOUND = frozenset({
    "sessions_app.tasks.run_turn", "sessions_app.tasks.start_server", "sessions_app.tasks.stop_server",
    "sessions_app.tasks.restart_server", "sessions_app.tasks.stop_process", "sessions_app.tasks.sleep_server",
    "sessions_app.tasks.remove_slot", "sessions_app.tasks.remove_logs", "machines_app.tasks.refresh_models",
})


def on_host(queue: str, host_id: str) -> str:
    """The queue of kind ``queue`` (TURNS, SERVERS, HOUSEKEEPING) that only the workers of
    the host ``host_id`` consume: ``"<queue>.<host id>"``."""
    return f"{queue}.{host_id}"


def consumed_by(queue: str, host_id: str) -> list[str]:
    """What a worker of kind ``queue`` on the host ``host_id`` consumes: the shared queue
    and the host's own of that kind (only the shared one while the host has no id)."""
    return [queue, on_host(queue, host_id)] if host_id else [queue]


def worker_name(queue: str, host_id: str) -> str:
    """The Celery node name of the host's worker of kind ``queue``: ``"<queue>@<host id>"``,
    unique as the host id is (a host name is not: cloned machines share theirs)."""
    return f"{queue}@{host_id}"


#: Threads of the servers and housekeeping workers that ``./corral run`` starts (a start
#: waits for a model to load, up to CORRAL_READY_TIMEOUT; a model refresh over SSH may take
#: a while, so housekeeping keeps threads free for the others; its periodic rounds run in
#: threads of their own besides, sessions_app/rounds.py).
SERVERS_CONCURRENCY = 4
HOUSEKEEPING_CONCURRENCY = 4
