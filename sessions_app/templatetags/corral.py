"""Template filters of the session pages."""

from __future__ import annotations

from django import template

from sessions_app.models import AgentSession

register = template.Library()


@register.filter
def status_word(status: str) -> str:
    """The word a page shows for a session status: ``AgentSession.Status``'s labels are the
    one map of them (``"stopped"`` for a server a person stopped, ``"exited"`` for one that
    went away by itself: docs/behaviour.md §4)."""
    return AgentSession.Status.word(status)


@register.filter
def ago(moment) -> str:
    """How long ago ``moment`` was, as a person says it: "just now" under a minute (Django's
    ``timesince`` says "0 minutes"), else "3 minutes ago", "2 days, 4 hours ago"."""
    from django.utils import timezone
    from django.utils.timesince import timesince

    if moment is None:
        return ""
    if (timezone.now() - moment).total_seconds() < 60:
        return "just now"
    return f"{timesince(moment)} ago"
