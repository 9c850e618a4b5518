"""Celery tasks of the attention app (queue: housekeeping, project/queues.py)."""

from celery import shared_task

from . import push


@shared_task(name="attention_app.tasks.push_question", ignore_result=True)
def push_question(session_id: int, call_id: str) -> None:
    """Web Push for a question just asked (attention_app.push.notify_question)."""
    push.notify_question(session_id, call_id)
