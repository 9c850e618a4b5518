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
