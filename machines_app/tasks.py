"""Thin Celery tasks for machines: model discovery and the server watch (SPEC §3, §5)."""

from __future__ import annotations

from celery import shared_task

from . import catalog
from .models import Machine
from .transports import TransportError


@shared_task
def refresh_models(machine_id: int) -> None:
    try:
        catalog.refresh_models(Machine.objects.get(pk=machine_id))
    except TransportError:
        pass  # kept on the machine row (models_refresh_error) for the pages to show


@shared_task
def watch_servers() -> None:
    from sessions_app import lifecycle

    lifecycle.watch_servers()
