"""``manage.py corral_servers_left``: what ``./corral run`` prints when it stops — the
llama-servers of this host's local machine that keep running.

Each server is a process of its own and outlives Corral on purpose: the next start takes
it over (same pid and start time) instead of loading its model again (README, "Run it").
Someone stopping Corral for the day should know that their RAM or VRAM is still held, and
by which sessions. SSH machines' servers are not listed: they run on other computers,
whose memory this host's operator is not freeing by stopping Corral.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand
from django.db.models import Prefetch

from machines_app.models import reached_by, this_host
from machines_app.transports import LocalTransport, ProcessId

from ...models import AgentSession
from ...servers.models import ServerRecord


def servers_left() -> list[ServerRecord]:
    """This host's recorded servers whose process still runs (pid and start time checked),
    oldest first."""
    local = LocalTransport()
    sessions = AgentSession.objects.with_model_name()
    records = ServerRecord.objects.filter(reached_by(this_host(), "machine__")).prefetch_related(
        Prefetch("session", queryset=sessions))
    return [record for record in records.order_by("started_at")
            if local.process_alive(ProcessId(record.pid, record.start_time))]


def describe(records: list[ServerRecord]) -> str:
    """The lines printed for ``records`` ("" when there are none)."""
    if not records:
        return ""
    one = len(records) == 1
    lines = [f"{len(records)} llama-server{'' if one else 's'} keep{'s' if one else ''} running, holding memory; "
             f"the next ./corral run takes {'it' if one else 'them'} over:"]
    lines += [f"  {record.session.display_title} ({getattr(record.session, "model_name", None) or record.model_key}, pid {record.pid})"
              for record in records]
    lines.append("Stop one now with kill <pid> (its session says the server exited, and offers Restart server), "
                 "or, with Corral running, its session's Menu → \"Stop server…\".")
    return "\n".join(lines)


class Command(BaseCommand):
    help = "List this host's llama-servers that keep running after Corral stops."

    def handle(self, *args, **options) -> None:
        text = describe(servers_left())
        if text:
            self.stdout.write(text)
