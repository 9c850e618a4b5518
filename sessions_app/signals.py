"""What follows changes that do not all go through an action: a session deleted (from
its page, the admin, or with its owner or machine) and a browser logging out.

A deleted session's server is handed to the stop task, whichever way the row went
(docs/behaviour.md §5), and the images only it referred to are deleted (§16); both close the sockets they concern, so a page says so at once
instead of at its next reconnect (docs/live-page.md)."""

from __future__ import annotations

import logging

from django.contrib.auth.signals import user_logged_out
from django.db import DatabaseError, transaction
from django.db.models.signals import post_delete, pre_delete
from django.dispatch import receiver

from . import images
from .live import broadcast
from .models import AgentSession
from .servers import stop

log = logging.getLogger(__name__)


@receiver(pre_delete, sender=AgentSession, dispatch_uid="corral-session-server-stop")
def session_deleting(sender, instance: AgentSession, **kwargs) -> None:
    # pre_delete: Django sends it for every row a delete or cascade takes, before any row
    # goes, so the ServerRecord (deleted with the session) can still be read.
    stop.stop_when_deleted(instance.pk)
    # docs/behaviour.md §16: its images go with it unless another session's messages carry
    # the same bytes — judged once the rows are gone (the hourly sweep catches a miss).
    hashes = images.referred_hashes(instance.pk)
    if hashes:
        transaction.on_commit(lambda: _forget_images(hashes))


def _forget_images(hashes: set[str]) -> None:
    try:
        images.forget_unreferenced(hashes)
    except DatabaseError:
        log.warning("the images of a deleted session were not deleted now; the hourly sweep deletes them",
                    exc_info=True)


@receiver(post_delete, sender=AgentSession, dispatch_uid="corral-session-gone")
def session_deleted(sender, instance: AgentSession, **kwargs) -> None:
    session_id = instance.pk
    transaction.on_commit(lambda: broadcast.push_session_gone(session_id))


@receiver(user_logged_out, dispatch_uid="corral-login-ended")
def login_ended(sender, request, user, **kwargs) -> None:
    # Sent before the session is flushed, so its key is still the one the sockets joined under.
    session_key = getattr(getattr(request, "session", None), "session_key", None)
    if session_key:
        transaction.on_commit(lambda: broadcast.push_login_ended(session_key))
