"""Thin Celery tasks for machines: model discovery (docs/behaviour.md §3), and the answer to
a page's read-only question about this host's own local machine (machines_app/transports/relay.py)."""

from __future__ import annotations

import logging

from celery import shared_task
from django.utils import timezone

from . import catalog
from .models import Machine
from .transports import TransportError, relay

log = logging.getLogger(__name__)


@shared_task
def refresh_models(machine_id: int) -> None:
    try:
        catalog.refresh_models(Machine.objects.get(pk=machine_id))
    except TransportError:
        pass  # kept on the machine row (models_refresh_error) for the pages to show
    except Exception as exc:
        # Whatever broke, the page waiting for this refresh must hear that it ended.
        log.exception("model refresh failed on machine %s", machine_id)
        Machine.objects.filter(pk=machine_id).update(
            models_refresh_error=f"Reading the model files failed ({type(exc).__name__}): {exc}"[:2000],
            models_refreshed_at=timezone.now(),
        )


@shared_task(ignore_result=True)
def machine_call(place: dict, method: str, args: list, reply_to: str) -> None:
    """Answer a page on another host: ``method`` (one of relay.READ_ONLY) with ``args`` on
    the machine at ``place``, pushed as JSON to the Redis list ``reply_to`` (relay.answer's
    shapes). Runs on the owner host's housekeeping queue; anywhere else the answer is
    ElsewhereError's sentence."""
    relay.reply(reply_to, relay.answer(place, method, args))
