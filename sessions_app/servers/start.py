"""Starting a session's llama-server (docs/behaviour.md §5, §10): one start at a time per
session (:class:`StartClaim`), a live recorded server adopted (:mod:`.adopt`) rather
than a second one spawned, room on the machine first (:mod:`sessions_app.room`), then
the spawn in named steps — spec, files checked, launch in the sandbox, record — and
the wait until it is ready (:mod:`.ready`). A restart is a stop and this start.

No database transaction is held across a process start, a health poll or a stop.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, connection
from django.db.models import Q
from django.utils import timezone

from machines_app import catalog
from machines_app.llama_server import ServerSpec, build_argv, new_api_key, slot_dir
from machines_app.models import Machine
from machines_app.sandbox import Sandbox
from machines_app.template_files import TemplateFileRefused, check_template_file
from machines_app.transports import ProcessId, Transport, TransportError, machine_place, transport_for

from .. import orphans, room
from ..events import record_event, set_status
from ..models import AgentSession
from ..transcript import Kind
from . import adopt
from .containment import sandbox_for
from .logs import log_path_for, prune_server_logs
from .models import ServerRecord
from .ready import wait_ready
from .records import fail, key_path_for
from .stop import sleep_server, stop_process

Status = AgentSession.Status
log = logging.getLogger(__name__)


def start_ttl() -> timedelta:
    return timedelta(seconds=settings.CORRAL_START_CLAIM_SECONDS)


def _claim_start(session_id: int, owner: str) -> bool:
    now = timezone.now()
    free = Q(start_owner="") | Q(start_expires__isnull=True) | Q(start_expires__lt=now)
    # One conditional UPDATE: of two starts racing for it, exactly one counts a row.
    rows = AgentSession.objects.filter(free, pk=session_id)
    return rows.update(start_owner=owner, start_expires=now + start_ttl()) == 1


class StartClaim:
    """Holds the claim to start the session's server for the duration of a ``with``
    block, renewed every third of its lifetime by a thread of its own; ``held`` says
    whether it was got. Two start tasks for one session (a redelivered task, a restart
    racing a start, the housekeeping rounds' recovery) therefore never spawn two servers:
    the second finds the claim held and does nothing. ``wait``: seconds to wait for a
    held claim to be let go before giving up (a restart waits for the start it replaces).
    """

    def __init__(self, session_id: int, *, wait: float = 0.0) -> None:
        self.session_id, self.wait = session_id, wait
        self.owner = uuid.uuid4().hex
        self.held = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name=f"start-{session_id}", daemon=True)

    def _renew(self) -> None:
        try:
            while not self.stopped.wait(settings.CORRAL_START_CLAIM_SECONDS / 3):
                AgentSession.objects.filter(pk=self.session_id, start_owner=self.owner).update(
                    start_expires=timezone.now() + start_ttl()
                )
        finally:
            connection.close()

    def __enter__(self) -> StartClaim:
        deadline = time.monotonic() + self.wait
        while True:
            self.held = _claim_start(self.session_id, self.owner)
            if self.held or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if self.held:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.held:
            return
        self.stopped.set()
        self.thread.join(5)
        AgentSession.objects.filter(pk=self.session_id, start_owner=self.owner).update(
            start_owner="", start_expires=None
        )


def start_server(session_id: int) -> None:
    """Start the session's llama-server and wait until it is ready (docs/behaviour.md §5).

    Only the holder of the session's start claim starts anything (:class:`StartClaim`); a
    second start task leaves at once. A live recorded server (same pid and start time) is
    adopted instead of starting a second one; one being stopped (an idle stop saving its
    slot) is waited for first. Every failure — a model the machine does not have, a server
    that exits or never answers — ends as an error event with the server's last words and
    status ``exited``. Once ready: a saved slot of the same model and parameters restored
    (docs/behaviour.md C44), catalogue read, status ``idle``, and a waiting message runs.
    """
    with StartClaim(session_id) as claim:
        if not claim.held:
            log.info("session %s: another start holds the claim; leaving it to that one", session_id)
            return
        _start(session_id)


def restart_server(session_id: int) -> None:
    """Stop the session's server (if any) and start one with the session's current model
    and server parameters (docs/behaviour.md §10 model change; a server-parameter change). The
    conversation survives because it was never in the server; its prompt cache is saved
    with the slot and restored when this model comes back.

    A start still loading the old model is cancelled (its record is marked stopping) and
    waited for; then this restart holds the start claim (:class:`StartClaim`)."""
    if stop_process(session_id):
        record_event(session_id, Kind.SERVER_STOPPED, {"reason": "restart"})
    with StartClaim(session_id, wait=settings.CORRAL_READY_TIMEOUT + settings.CORRAL_STOP_GRACE + 30) as claim:
        if not claim.held:
            fail(AgentSession.objects.get(pk=session_id), "The server could not be restarted: another start of it "
                 "did not finish. Restart again.")
            return
        if stop_process(session_id):
            record_event(session_id, Kind.SERVER_STOPPED, {"reason": "restart"})
        _start(session_id)


def _start(session_id: int) -> None:
    session = AgentSession.objects.select_related("machine").get(pk=session_id)
    transport = transport_for(session.machine)
    record = adopt.live_record(session, transport)
    if record is not None:
        if adopt.adopt(session, record):
            _wait_then(session, transport, record)
        return
    # Room on the machine first (docs/behaviour.md §5): a start that does not fit waits in
    # line or is refused before anything is spawned; one let through counts until ready.
    if not room.admit(session, transport, sleep=sleep_server, fail=fail):
        return
    try:
        _spawn(session, transport)
    finally:
        room.release(session.pk)


def _wait_then(session: AgentSession, transport: Transport, record: ServerRecord, *, restore: bool = True) -> None:
    """Wait for the server of ``record`` to be ready (:func:`.ready.wait_ready`); one
    stopped because its saved slot could not be restored is started again, cold."""
    if wait_ready(session, transport, record, restore=restore):
        _spawn(session, transport, restore=False)


def _spawn(session: AgentSession, transport: Transport, *, restore: bool = True) -> None:
    """Start a new llama-server for the session on ``transport``'s machine, record it and
    wait until it is ready (``restore``: restore the session's saved slot then). A model
    that cannot be started there, or a machine that refuses the spawn, ends as an error
    and status ``exited`` (:func:`.records.fail`) with nothing left running."""
    key_path = ""
    try:
        # A stop still pending on this machine first (docs/behaviour.md §5 "no orphans"):
        # never a new server beside one Corral meant to stop.
        orphans.settle_machine(session.machine, transport)
        _stop_lost_spawns(session, transport)
        model = catalog.model_for_session(session.machine, session.model_key)
        port = transport.free_port()
        key_path = key_path_for(session, transport, port)
        spec = _spec(session, transport, model, port, key_path)
        _check_files(session, transport, model)
        log_path = log_path_for(session, transport, port)
        proc, api_key = _launch(session, transport, model, spec, log_path)
    except (catalog.ModelUnavailable, TransportError) as exc:
        if key_path:
            transport.remove(key_path)
        fail(session, str(exc))
        return
    record = _record(session, transport, spec, proc, api_key, log_path)
    if record is None:
        return
    try:
        prune_server_logs(transport, session.pk, settings.CORRAL_SERVER_LOGS_KEPT, current=log_path)
    except TransportError as exc:  # the next start tries again; this one goes on
        log.warning("session %s: old server logs not pruned: %s", session.pk, exc)
    _wait_then(session, transport, record, restore=restore)


def _stop_lost_spawns(session: AgentSession, transport: Transport) -> None:
    """Stop the session's servers that no record names (docs/behaviour.md §5 "no orphans"):
    spawned by a start whose worker died before it recorded them, so adoption cannot find
    them. Only the holder of the start claim spawns, so none of them is another start's.
    A machine whose processes cannot be listed starts as before (admins see such servers
    as unrecorded on the machine's admin page)."""
    try:
        lost = [s for s in orphans.unrecorded_servers(session.machine) if s.session_id == session.pk]
    except TransportError as exc:
        log.warning("session %s: servers of lost starts not looked for: %s", session.pk, exc)
        return
    for server in lost:
        log.warning("session %s: stopping pid %s, started by a start that was lost", session.pk, server.proc.pid)
        transport.stop(server.proc, grace=settings.CORRAL_STOP_GRACE)
        transport.release_port(server.port)
        transport.remove(key_path_for(session, transport, server.port))


def _spec(session: AgentSession, transport: Transport, model: catalog.ResolvedModel, port: int,
          key_path: str) -> ServerSpec:
    """What the new server is started with: the session's model and server parameters,
    its port, its key file and its own slot directory on the machine."""
    return ServerSpec(
        binary=session.machine.llama_server_path,
        model_path=model.path,
        port=port,
        params=session.server_params,
        has_mtp=model.has_mtp,
        api_key_file=key_path,
        mmproj_path=model.mmproj_path,
        chat_template=model.chat_template,
        chat_template_file=model.chat_template_file,
        slot_dir=slot_dir(transport.private_dir(), session.pk),
        alias=model.display_name,  # replies name the model as the picker does, never by its path
        shared=session.purpose == AgentSession.Purpose.API,
    )


def _check_files(session: AgentSession, transport: Transport, model: catalog.ResolvedModel) -> None:
    """Every file the server reads is still on the machine, and a chat template file is
    still one a server may read (docs/security.md). Raises ModelUnavailable with the
    sentence, before anything starts."""
    machine = session.machine
    if not transport.is_file(model.path):
        # Listed once, gone since: say so in the machine's terms, before anything starts.
        raise catalog.ModelUnavailable(
            f"Machine '{machine.name}' has no file {model.path} any more; the model file has to be "
            "on that machine (refresh the model list after copying it there)."
        )
    if model.mmproj_path and not transport.is_file(model.mmproj_path):
        raise catalog.ModelUnavailable(
            f"Machine '{machine.name}' has no vision projector {model.mmproj_path} any more; refresh "
            "the model list there."
        )
    if model.chat_template_file and not transport.is_file(model.chat_template_file):
        raise catalog.ModelUnavailable(
            f"Machine '{machine.name}' has no chat template file {model.chat_template_file}, which an "
            f"admin set for {model.display_name}; copy it there or change the model file's template."
        )
    if model.chat_template_file:
        # Checked again before each start (docs/security.md): a file that became a link to
        # a secret, or went away, since an admin set it.
        try:
            check_template_file(transport, model.chat_template_file, machine.name,
                                local=machine.transport == Machine.Transport.LOCAL)
        except TemplateFileRefused as exc:
            raise catalog.ModelUnavailable(
                f"The chat template file set for {model.display_name} cannot be used: {exc} An admin can "
                "change it on the model file (admin → Model files)."
            ) from None


def _launch(session: AgentSession, transport: Transport, model: catalog.ResolvedModel, spec: ServerSpec,
            log_path: str) -> tuple[ProcessId, str]:
    """Spawn the server in its sandbox, status ``loading``: the process and the API key
    written for it. Raises TransportError (a machine that refuses, no sandbox where one is
    required: :func:`.containment.sandbox_for`)."""
    bwrap = sandbox_for(session.machine, transport)
    set_status(session.pk, Status.LOADING)
    # Corral's own, owner-only, never a link (docs/behaviour.md C43): llama-server
    # writes the saved KV caches there.
    transport.make_private_dir(posixpath.dirname(spec.slot_dir))
    transport.make_private_dir(spec.slot_dir)
    api_key = new_api_key()
    transport.write_private(spec.api_key_file, api_key + "\n")
    sandbox = Sandbox(
        # What the server needs from the hidden directories, bound back at its own path:
        # its files (read-only) and its own slot directory.
        read=(model.path, model.mmproj_path, model.chat_template_file, spec.api_key_file), write=(spec.slot_dir,),
    )
    return transport.spawn(build_argv(spec), log_path, cwd=None, bwrap=bwrap, sandbox=sandbox), api_key


def _record(session: AgentSession, transport: Transport, spec: ServerSpec, proc: ProcessId, api_key: str,
            log_path: str) -> ServerRecord | None:
    """The new server's record, or None when the session was deleted meanwhile or another
    start recorded one first: the process is stopped then (or its stop left pending)."""
    try:
        return ServerRecord.objects.create(
            session=session,
            machine=session.machine,
            model_key=session.model_key,
            server_params=session.server_params,
            pid=proc.pid,
            start_time=proc.start_time,
            port=spec.port,
            api_key=api_key,
            log_path=log_path,
        )
    except IntegrityError:
        # The session was deleted while its server was being spawned (its delete found
        # no record to hand to the stop task), or another start recorded one first: this
        # process is nobody's, so it stops here rather than run untracked.
        log.warning("session %s: gone or already served while starting; stopping pid %s", session.pk, proc.pid)
        try:
            transport.remove(spec.api_key_file)
            transport.stop(proc, grace=settings.CORRAL_STOP_GRACE)
        except TransportError as exc:
            orphans.defer_stop(machine_place(session.machine), proc.pid, proc.start_time, spec.port, session.pk, exc)
        transport.release_port(spec.port)
        return None
