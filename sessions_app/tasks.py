"""Thin Celery tasks: ids in, actions / lifecycle / agent calls out."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from . import agent, lifecycle
from .models import AgentSession


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
def run_turn(session_id: int) -> None:
    agent.run_turn_step(session_id)


@shared_task
def recover_turns() -> None:
    """Re-enqueue the step of every active turn whose lease is free or expired: a worker
    that died mid-step, or a step message that was lost. A duplicate is harmless: the
    lease lets one copy run (case C16)."""
    stale = timezone.now() - timedelta(seconds=10)
    for session_id in AgentSession.objects.filter(
        turn_active=True, last_activity_at__lt=stale, status__in=["idle", "running"]
    ).filter(lease_expires__isnull=True).values_list("pk", flat=True):
        run_turn.delay(session_id)
    for session_id in AgentSession.objects.filter(turn_active=True, lease_expires__lt=timezone.now()).values_list(
        "pk", flat=True
    ):
        run_turn.delay(session_id)
