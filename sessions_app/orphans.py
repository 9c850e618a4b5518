"""No orphaned servers (docs/behaviour.md §5 "no orphans").

A stop that cannot reach its machine — Stop, a restart, an idle sleep, a session or
machine deleted — does not forget the process: it becomes a :class:`PendingStop`, the
session says "Stop pending: <machine> is unreachable", and the watch
(:func:`settle_pending_stops`, every few seconds) stops it there as soon as the machine
answers again (pid and start time checked, so a reused pid is never signalled). No
server starts on a machine while a stop is pending there (:func:`settle_machine`).

And a server Corral started but has no record of (its record lost with a database
restore, a crash between spawn and record) is still recognisable on its machine: its
command line names its key file in Corral's private directory there
(``--api-key-file <private dir>/session-<id>-<port>-<install tag>.key``), so the machine's admin page
lists it (:func:`unrecorded_servers`) with a Stop button (:func:`stop_unrecorded`).
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import re
import shlex
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from machines_app.models import Machine, PendingStop
from machines_app.transports import (
    ProcessId,
    Transport,
    TransportError,
    parse_proc_stat,
    transport_at,
    transport_for,
)

from .events import record_error, record_event
from .models import AgentSession
from .servers.models import ServerRecord
from .transcript import Kind

log = logging.getLogger(__name__)


def install_tag() -> str:
    """Ten hex digits that tell this Corral installation's servers from another's sharing
    the same user on a machine (a digest of the secret key, which it does not reveal)."""
    return hashlib.sha256(b"corral-install:" + settings.SECRET_KEY.encode()).hexdigest()[:10]


def key_file(transport: Transport, session_id: int, port: int) -> str:
    """The key file a server of ``session_id`` on ``port`` reads at start, and names on its
    command line for as long as it runs: ``<private dir>/session-<id>-<port>-<install tag>.key``."""
    return posixpath.join(transport.private_dir(), f"session-{session_id}-{port}-{install_tag()}.key")


def pending_sentence(machine_name: str, pid: int, exc: BaseException) -> str:
    return (
        f"Stop pending: {machine_name} is unreachable ({exc}). Its llama-server (pid {pid}) may still run there; "
        "Corral stops it as soon as the machine answers again, before anything new starts there."
    )


def defer_stop(place: dict, pid: int, start_time: str, port: int, session_id: int | None,
               exc: BaseException) -> PendingStop:
    """Keep a stop that could not reach its machine (``place``: a
    :func:`machines_app.transports.machine_place`), and say so in the session's
    transcript when it still has one."""
    machine = Machine.objects.filter(name=place.get("name")).first()
    pending, _ = PendingStop.objects.update_or_create(
        pid=pid, start_time=start_time, machine=machine,
        defaults={"place": place, "port": port, "session_id": session_id, "reason": str(exc),
                  "tried_at": timezone.now()},
    )
    log.warning("stop of llama-server pid %s on %s pending: %s", pid, place.get("name"), exc)
    if session_id is not None and AgentSession.objects.filter(pk=session_id).exists():
        record_error(session_id, pending_sentence(str(place.get("name")), pid, exc))
    return pending


def _settle(pending: PendingStop, transport: Transport) -> None:
    """Stop one pending process (raises TransportError while its machine is unreachable)."""
    transport.stop(ProcessId(pending.pid, pending.start_time), grace=settings.CORRAL_STOP_GRACE)
    transport.release_port(pending.port)
    if pending.session_id is not None:
        transport.remove(key_file(transport, pending.session_id, pending.port))
    if PendingStop.objects.filter(pk=pending.pk).delete()[0] and pending.session_id is not None:
        if AgentSession.objects.filter(pk=pending.session_id).exists():
            record_event(pending.session_id, Kind.NOTICE, {
                "message": f"The pending stop is done: {pending.place.get('name')} answers again and its "
                           f"llama-server (pid {pending.pid}) is stopped."
            })


def settle_machine(machine: Machine, transport: Transport) -> None:
    """Stop every pending stop on ``machine`` before a server starts there. Raises
    TransportError (naming the machine) while one of them cannot be stopped."""
    for pending in PendingStop.objects.filter(machine=machine).order_by("created_at"):
        try:
            _settle(pending, transport)
        except TransportError as exc:
            PendingStop.objects.filter(pk=pending.pk).update(reason=str(exc), tried_at=timezone.now())
            raise TransportError(
                f"{exc} A server stopped earlier (pid {pending.pid}) still has to be stopped there before another "
                "starts.", permanent=False,
            ) from None


def settle_pending_stops(host: str | None = None, *, hosts: tuple[str | None, ...] | None = None) -> int:
    """The watch's part: try every pending stop, one machine at a time (a machine still
    unreachable is tried once per round, not once per process). Returns how many are left.
    ``host`` as for servers.watch.watch_servers: None for the machines every host reaches, a
    host id for that host's own local machine (only it can stop a process there);
    ``hosts``, when given, several of those at once (one query for all)."""
    hosts = (host,) if hosts is None else hosts
    left = 0
    unreachable: set[str] = set()
    for pending in PendingStop.objects.select_related("machine").order_by("created_at"):
        place = pending.place
        owner = str(place.get("corral_host") or "") if place.get("transport") == "local" else ""
        if (owner or None) not in hosts:
            continue  # another host's own machine: its watch settles it
        name = str(pending.place.get("name"))
        if name in unreachable:
            left += 1
            continue
        try:
            transport = transport_for(pending.machine) if pending.machine is not None else transport_at(pending.place)
            _settle(pending, transport)
        except TransportError as exc:
            unreachable.add(name)
            left += 1
            PendingStop.objects.filter(pk=pending.pk).update(reason=str(exc), tried_at=timezone.now())
    return left


# --- servers Corral started and has no record of --------------------------------------------------

_KEY_NAME = re.compile(r"session-(\d+)-(\d+)-([0-9a-f]{10})\.key$")


@dataclass(frozen=True)
class FoundServer:
    """A ``llama-server`` on a machine whose command line names Corral's private directory
    there: its process, the session and port its key file names, its command line."""

    proc: ProcessId
    session_id: int
    port: int
    argv: tuple[str, ...]


def corral_servers(transport: Transport) -> list[FoundServer]:
    """Every process on the machine started as one of Corral's servers, read from its
    ``/proc`` (one command: ``grep`` finds the command lines naming the key files, then
    each one's stat and arguments). Of a server in its sandbox only the server itself is
    listed, not the bubblewrap processes around it (they carry the same arguments).
    Raises TransportError."""
    marker = posixpath.join(transport.private_dir(), "session-")
    script = (
        f"for f in $(grep -l -F -a -- {shlex.quote(marker)} /proc/[0-9]*/cmdline 2>/dev/null); do "
        'd=${f%/cmdline}; s=$(cat "$d/stat" 2>/dev/null) || continue; '
        'printf "@@ %s\\n" "$s"; tr "\\000" "\\n" < "$f"; printf "\\n"; done; true'
    )
    output = transport.run_probe(["sh", "-c", script])
    if output is None:
        raise TransportError("could not list the processes on the machine")
    found: dict[int, tuple[int, FoundServer]] = {}  # pid -> (parent pid, server)
    for block in output.split("@@ ")[1:]:
        stat_line, _, rest = block.partition("\n")
        argv = tuple(line for line in rest.split("\n") if line)
        try:
            pid = int(stat_line.split(" ", 1)[0])
            state, start_time = parse_proc_stat(stat_line)
            parent = int(stat_line[stat_line.rindex(")") + 2 :].split()[1])
        except (ValueError, IndexError):
            continue
        if state in ("Z", "X") or "--api-key-file" not in argv:
            continue
        key = argv[argv.index("--api-key-file") + 1] if argv.index("--api-key-file") + 1 < len(argv) else ""
        match = _KEY_NAME.search(key)
        if not key.startswith(marker) or match is None or match[3] != install_tag():
            continue  # another installation's server (the same user there), or not a server at all
        found[pid] = (parent, FoundServer(ProcessId(pid, start_time), int(match[1]), int(match[2]), argv))
    parents = {parent for parent, _ in found.values()}
    return sorted((server for pid, (_, server) in found.items() if pid not in parents), key=lambda s: s.proc.pid)


def unrecorded_servers(machine: Machine) -> list[FoundServer]:
    """Corral's servers on ``machine`` that no record and no pending stop names (by pid
    and start time): left behind by something that forgot them. Raises TransportError."""
    transport = transport_for(machine)
    known = {(r.pid, r.start_time) for r in ServerRecord.objects.filter(machine=machine)}
    known |= {(p.pid, p.start_time) for p in PendingStop.objects.filter(machine=machine)}
    return [s for s in corral_servers(transport) if (s.proc.pid, s.proc.start_time) not in known]


def stop_unrecorded(machine: Machine, pid: int, start_time: str) -> FoundServer | None:
    """Stop one of :func:`unrecorded_servers` (asked again now, so a server whose record
    appeared since — a start finishing — is never stopped this way). None when it is not
    (or no longer) one of them. Raises TransportError."""
    for server in unrecorded_servers(machine):
        if server.proc == ProcessId(pid, start_time):
            transport = transport_for(machine)
            transport.stop(server.proc, grace=settings.CORRAL_STOP_GRACE)
            transport.release_port(server.port)
            transport.remove(key_file(transport, server.session_id, server.port))
            return server
    return None
