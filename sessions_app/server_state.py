"""Read-only questions about sessions' servers that both sessions_app.servers (start, stop,
sleep) and the room on a machine (sessions_app/room.py) ask: whether a start is under way,
and which servers are idle. Kept apart so that room.py never imports the servers package that
calls it (tests/test_layers.py: no import circle)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from machines_app.models import Machine

from .models import AgentSession
from .servers.models import ServerRecord

Status = AgentSession.Status


def start_live(session: AgentSession) -> bool:
    """Whether a start (or restart) of the session's server is under way, as read from
    ``session``: its claim is held and was renewed lately. A start lost with its worker
    or with the broker holds none, and the session may be restarted."""
    return bool(session.start_owner) and session.start_expires is not None and session.start_expires > timezone.now()

def idle_sessions(machine: Machine | None = None) -> list[int]:
    """Sessions whose server has been idle longer than their machine's idle time (or, with
    ``machine``, every idle one of that machine, for its "stop all idle"), oldest first."""
    rows = ServerRecord.objects.filter(
        ready_at__isnull=False, stopping=False, session__status=Status.IDLE, session__turn_active=False
    ).exclude(session__api_busy_until__gt=timezone.now())  # an API server serving a request (api_app)
    if machine is not None:
        rows = rows.filter(machine=machine)
    else:
        now = timezone.now()
        # Three columns, not two whole rows joined in: the health watch asks this every 2 s.
        rows = rows.filter(machine__idle_stop_seconds__isnull=False).order_by("session__last_activity_at")
        return [
            session_id for session_id, active_at, idle_seconds in rows.values_list(
                "session_id", "session__last_activity_at", "machine__idle_stop_seconds")
            if active_at <= now - timedelta(seconds=idle_seconds)
        ]
    return list(rows.order_by("session__last_activity_at").values_list("session_id", flat=True))
