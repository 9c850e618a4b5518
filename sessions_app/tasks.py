"""Thin Celery tasks: ids in, actions / lifecycle / agent calls out."""

from __future__ import annotations

from celery import shared_task

from . import agent, lifecycle, turns


@shared_task
def start_server(session_id: int) -> None:
    lifecycle.start_server(session_id)


@shared_task
def stop_server(session_id: int, by: dict | None = None) -> None:
    lifecycle.stop_server(session_id, by=by)


@shared_task
def restart_server(session_id: int) -> None:
    lifecycle.restart_server(session_id)


@shared_task
def stop_process(machine_id: int, pid: int, start_time: str) -> None:
    """Stop a server whose session is gone (deleted): SIGTERM, grace, SIGKILL."""
    lifecycle.stop_orphan(machine_id, pid, start_time)


@shared_task
def watch_servers() -> None:
    lifecycle.watch_servers()


@shared_task
def run_turn(session_id: int) -> None:
    agent.run_turn_step(session_id)


@shared_task
def recover_turns() -> None:
    """Re-enqueue the step of every open turn whose step is not running (a worker that
    died mid-step, or a step message that was lost); see turns.recoverable."""
    for session_id in turns.recoverable():
        run_turn.delay(session_id)
