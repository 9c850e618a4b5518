"""A session's llama-server: start, ready, watch, stop, adopt (docs/behaviour.md §4, §5).

Wires :mod:`machines_app.llama_server` (no Django) to the database and the transcript.
No database transaction is held across a process start, a health poll or a stop.
"""

from __future__ import annotations

import logging
import posixpath
import re
import threading
import time
import uuid
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from machines_app import actions as machine_actions
from machines_app import catalog
from machines_app.llama_server import (
    SLOT_IO_TIMEOUT,
    Endpoint,
    ServerProps,
    ServerSpec,
    ServerStartError,
    SlotError,
    build_argv,
    does_not_answer,
    explain_start_failure,
    new_api_key,
    prompt_opens_thinking,
    read_props,
    restore_slot,
    save_slot,
    slot_dir,
    slot_file_name,
    slot_fingerprint,
    wait_until_ready,
)
from machines_app.models import Machine, ModelFile, ServerRecord, SlotSave, reached_by
from machines_app.sandbox import Sandbox
from machines_app.template_files import (
    MAX_TEMPLATE_BYTES,
    TemplateFileRefused,
    check_template_file,
    without_template_lines,
)
from machines_app.transports import (
    ElsewhereError,
    ProcessId,
    ToolView,
    Transport,
    TransportError,
    machine_place,
    transport_at,
    transport_for,
)

from . import dispatch, orphans, room, tools, turns
from .events import append, change_status, locked, record_error, record_event, set_status
from .live.header import model_facts
from .models import AgentSession, McpServer
from .server_state import idle_sessions
from .transcript import Kind, TurnEnd

Status = AgentSession.Status
log = logging.getLogger(__name__)


def log_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """The owner-only log file of one start of the session's server, on the machine that
    runs it (a remote server writes its log there, read back by the tail: docs/ssh.md).
    One file per start (the port tells starts apart), so a failed start's last words are
    its own, never an earlier run's (docs/behaviour.md C08)."""
    return posixpath.join(transport.private_dir(), f"session-{session.pk}-{port}.log")


#: A server log's file name: ``session-<session id>-<port>.log`` (:func:`log_path_for`).
SERVER_LOG = re.compile(r"session-(\d+)-(\d+)\.log")


def prune_server_logs(transport: Transport, session_id: int, keep: int, *, current: str = "") -> int:
    """Delete the session's server logs on the machine of ``transport`` but the newest
    ``keep`` (by modification time), ``current`` — the log of the start under way — always
    among those kept; ``keep=0`` with no ``current`` deletes them all (the session is
    deleted). How many were deleted. Raises TransportError when the machine cannot be
    asked (``CORRAL_SERVER_LOGS_KEPT``, docs/operations.md "Disk")."""
    directory = transport.private_dir()
    logs = sorted(
        ((mtime, name) for name, mtime in transport.list_files(directory)
         if (m := SERVER_LOG.fullmatch(name)) and int(m.group(1)) == session_id
         and posixpath.join(directory, name) != current),
        reverse=True,
    )
    room = max(keep - (1 if current else 0), 0)
    for _, name in logs[room:]:
        transport.remove(posixpath.join(directory, name))
    return len(logs[room:])


def remove_server_logs(place: dict, session_id: int) -> None:
    """Delete every server log of a deleted session from its machine (``place``: a
    :func:`machines_app.transports.machine_place`, since the machine may be gone too)."""
    try:
        prune_server_logs(transport_at(place), session_id, 0)
    except TransportError as exc:
        log.warning("could not remove the server logs of session %s on %s: %s", session_id, place.get("name"), exc)


def key_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """Where the server's API key waits for llama-server to read it at start, on the
    server's machine (mode 0600; removed once the server is ready or has failed). One file
    per start (the port tells starts apart), so a cancelled start never removes the key of
    the start that replaced it."""
    return _key_file(session.pk, transport, port)


def _key_file(session_id: int, transport: Transport, port: int) -> str:
    # Its name also tells Corral's servers apart on the machine (orphans.key_file).
    return orphans.key_file(transport, session_id, port)


def _proc(record: ServerRecord) -> ProcessId:
    return ProcessId(record.pid, record.start_time)


def _endpoint(transport, record: ServerRecord) -> Endpoint:
    return Endpoint(transport.base_url(record.port), record.api_key)


def server_endpoint(session: AgentSession) -> Endpoint | None:
    """How this backend reaches the session's server (URL and key), or None when it has none."""
    record = ServerRecord.objects.filter(session=session).select_related("machine").first()
    if record is None:
        return None
    return _endpoint(transport_for(record.machine), record)


def template_safe(session: AgentSession, transport: Transport, log_tail: str) -> str:
    """A server's last log lines as every watcher of ``session`` may read them (and its
    export keeps them): without the lines that quote its model file's chat template file
    (docs/security.md), read back from the machine to know them. Unchanged for a model
    whose template is not a file."""
    model = ModelFile.objects.filter(machine_id=session.machine_id, key=session.model_key).first()
    if model is None or not model.chat_template_file or not log_tail.strip():
        return log_tail
    try:
        path = transport.real_path(model.chat_template_file)
        text = transport.read_head(path, MAX_TEMPLATE_BYTES).decode("utf-8", "replace")
    except (TransportError, OSError):
        text = None
    return without_template_lines(log_tail, text)


def _fail(session: AgentSession, message: str, log: str = "") -> None:
    """The server is gone: say so (``log``: its last words, shown folded below the
    sentence), status ``exited``, and end an open turn."""
    record_error(session.pk, message, log=log)
    set_status(session.pk, Status.EXITED)
    if AgentSession.objects.filter(pk=session.pk, turn_active=True).exists():
        turns.finish_turn(session.pk, TurnEnd.ERROR)


# --- one start at a time (docs/behaviour.md §5) ------------------------------------------------


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
    racing a start, the housekeeping beat's recovery) therefore never spawn two servers:
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


def _start(session_id: int) -> None:
    session = AgentSession.objects.select_related("machine").get(pk=session_id)
    transport = transport_for(session.machine)
    record = ServerRecord.objects.filter(session=session).first()
    if record is not None and record.stopping:
        record = _wait_for_stop(record, transport)
    if record is not None:
        try:
            alive = transport.process_alive(_proc(record))
        except TransportError:
            alive = True  # cannot tell: never risk two servers holding one model
        if alive:
            log.info("session %s: adopting llama-server pid %s", session_id, record.pid)
            if record.ready_at is None:
                _wait(session, transport, record)
            elif set_status(session.pk, Status.IDLE, only_from=(Status.LOADING,)):
                # Ready before, its start lost on the way to saying so (docs/behaviour.md §5).
                _go_on(session.pk)
            return
        record.delete()
    # Room on the machine first (docs/behaviour.md §5): a start that does not fit waits in
    # line or is refused before anything is spawned; one let through counts until ready.
    if not room.admit(session, transport, sleep=sleep_server, fail=_fail):
        return
    try:
        _spawn(session, transport)
    finally:
        room.release(session.pk)


def _wait_for_stop(record: ServerRecord, transport: Transport) -> ServerRecord | None:
    """Wait for a stop under way (an idle stop saving the slot, then SIGTERM and grace) to
    remove the record; a stop that never ends (its worker died) is finished here. None
    once the record is gone."""
    deadline = time.monotonic() + SLOT_IO_TIMEOUT + settings.CORRAL_STOP_GRACE + 15
    while time.monotonic() < deadline:
        if not ServerRecord.objects.filter(pk=record.pk).exists():
            return None
        time.sleep(0.2)
    log.warning("session %s: the stop of pid %s never finished; finishing it", record.session_id, record.pid)
    try:
        transport.stop(_proc(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError:
        return record  # cannot tell: adopt-or-wait below decides as for any record
    transport.release_port(record.port)
    ServerRecord.objects.filter(pk=record.pk).delete()
    return None


def _spawn(session: AgentSession, transport: Transport, *, restore: bool = True) -> None:
    key_path = ""
    try:
        # A stop still pending on this machine first (docs/behaviour.md §5 "no orphans"):
        # never a new server beside one Corral meant to stop.
        orphans.settle_machine(session.machine, transport)
        model = catalog.model_for_session(session.machine, session.model_key)
        port = transport.free_port()
        key_path = key_path_for(session, transport, port)
        slots = slot_dir(transport.private_dir(), session.pk)
        spec = ServerSpec(
            binary=session.machine.llama_server_path,
            model_path=model.path,
            port=port,
            params=session.server_params,
            has_mtp=model.has_mtp,
            api_key_file=key_path,
            mmproj_path=model.mmproj_path,
            chat_template=model.chat_template,
            chat_template_file=model.chat_template_file,
            slot_dir=slots,
        )
        if not transport.is_file(model.path):
            # Listed once, gone since: say so in the machine's terms, before anything starts.
            raise catalog.ModelUnavailable(
                f"Machine '{session.machine.name}' has no file {model.path} any more; the model file has to be "
                "on that machine (refresh the model list after copying it there)."
            )
        if model.mmproj_path and not transport.is_file(model.mmproj_path):
            raise catalog.ModelUnavailable(
                f"Machine '{session.machine.name}' has no vision projector {model.mmproj_path} any more; refresh "
                "the model list there."
            )
        if model.chat_template_file and not transport.is_file(model.chat_template_file):
            raise catalog.ModelUnavailable(
                f"Machine '{session.machine.name}' has no chat template file {model.chat_template_file}, which an "
                f"admin set for {model.display_name}; copy it there or change the model file's template."
            )
        if model.chat_template_file:
            # Checked again before each start (docs/security.md): a file that became a link to
            # a secret, or went away, since an admin set it.
            try:
                check_template_file(transport, model.chat_template_file, session.machine.name,
                                    local=session.machine.transport == Machine.Transport.LOCAL)
            except TemplateFileRefused as exc:
                raise catalog.ModelUnavailable(
                    f"The chat template file set for {model.display_name} cannot be used: {exc} An admin can "
                    "change it on the model file (admin → Model files)."
                ) from None
        log_path = log_path_for(session, transport, port)
        bwrap = _sandbox_for(session.machine, transport)
        set_status(session.pk, Status.LOADING)
        # Corral's own, owner-only, never a link (docs/behaviour.md C43): llama-server
        # writes the saved KV caches there.
        transport.make_private_dir(posixpath.dirname(slots))
        transport.make_private_dir(slots)
        api_key = new_api_key()
        transport.write_private(spec.api_key_file, api_key + "\n")
        sandbox = Sandbox(
            # What the server needs from the hidden directories, bound back at its own path:
            # its files (read-only) and its own slot directory.
            read=(model.path, model.mmproj_path, model.chat_template_file, key_path), write=(slots,),
        )
        proc = transport.spawn(build_argv(spec), log_path, cwd=None, bwrap=bwrap, sandbox=sandbox)
    except (catalog.ModelUnavailable, TransportError) as exc:
        if key_path:
            transport.remove(key_path)
        _fail(session, str(exc))
        return
    try:
        record = ServerRecord.objects.create(
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
            transport.remove(key_path)
            transport.stop(proc, grace=settings.CORRAL_STOP_GRACE)
        except TransportError as exc:
            orphans.defer_stop(machine_place(session.machine), proc.pid, proc.start_time, spec.port, session.pk, exc)
        transport.release_port(spec.port)
        return
    try:
        prune_server_logs(transport, session.pk, settings.CORRAL_SERVER_LOGS_KEPT, current=log_path)
    except TransportError as exc:  # the next start tries again; this one goes on
        log.warning("session %s: old server logs not pruned: %s", session.pk, exc)
    _wait(session, transport, record, restore=restore)


#: Why a server on the backend's own machine is not started without its sandbox.
UNCONTAINED_REFUSED = (
    "llama-server was not started: its tools would run next to Corral's own files on this machine (database, "
    "secret key, SSH keys). {reason}. An admin who accepts that can empty the machine's 'bubblewrap' field."
)


def _sandbox_for(machine: Machine, transport: Transport) -> str:
    """bubblewrap's absolute path on the machine, for the server about to start there, or
    '' to start it without a sandbox; what was found is noted on the machine (the admin
    shows it). On the backend's own machine a missing or broken bubblewrap refuses the
    start (TransportError with the sentence): the tools would sit next to every secret
    Corral holds. On an SSH machine the server starts anyway, and its admin page says that
    tools there can read Corral's files (docs/security.md)."""
    bwrap = machine_actions.check_containment(machine, transport)
    if not bwrap and machine.bwrap_path.strip() and machine.transport == Machine.Transport.LOCAL:
        raise TransportError(UNCONTAINED_REFUSED.format(reason=machine.containment_reason))
    return bwrap


def tool_view(machine: Machine, transport: Transport | None = None) -> ToolView:
    """The machine as a tool call sees it (machines_app.transports.ToolView): commands in its
    tool sandbox, Corral's own files there invisible. Raises TransportError when the
    machine cannot be reached, or, on the backend's own machine, when there is no sandbox
    to run a tool in (as :func:`_sandbox_for` refuses a server then)."""
    transport = transport or transport_for(machine)
    return ToolView(transport, _sandbox_for(machine, transport))


def _wait(session: AgentSession, transport, record: ServerRecord, *, restore: bool = True) -> None:
    try:
        wait_until_ready(
            transport,
            _proc(record),
            transport.base_url(record.port),
            record.log_path,
            timeout=settings.CORRAL_READY_TIMEOUT,
            api_key=record.api_key,
            should_stop=lambda: ServerRecord.objects.filter(pk=record.pk, stopping=False).count() == 0,
        )
    except TransportError as exc:
        # The machine stopped answering while the model loads. Its server may well still
        # run there: keep the record (never orphan a process holding a model) and say
        # unknown; the watch takes it up again when the machine answers.
        transport.release_port(record.port)
        if set_status(session.pk, Status.UNKNOWN, only_from=(Status.LOADING,)):
            record_error(session.pk, _unknown_sentence(exc))
        return
    except ServerStartError as exc:
        try:
            transport.remove(key_path_for(session, transport, record.port))
            transport.stop(_proc(record), grace=settings.CORRAL_STOP_GRACE)
        except TransportError:
            pass
        transport.release_port(record.port)
        # Stopped on purpose (a stop, a restart or a model change took the record): say nothing.
        stopped_on_purpose = not ServerRecord.objects.filter(pk=record.pk, stopping=False).exists()
        ServerRecord.objects.filter(pk=record.pk).delete()
        if not stopped_on_purpose:
            tail = template_safe(session, transport, exc.log_tail)
            _fail(session, explain_start_failure(exc.headline, tail), log=tail)
        return
    # llama-server read its key at start; the file need not outlive that.
    try:
        transport.remove(key_path_for(session, transport, record.port))
    except TransportError:
        pass  # the machine went away just now: the watch will say so
    endpoint = _endpoint(transport, record)
    props = _read_props(session.pk, endpoint)
    try:
        warm = _restore(session, transport, record, props) if restore else None
    except RestoreRefused as refused:
        if not ServerRecord.objects.filter(pk=record.pk, stopping=False).exists():
            # Stopped on purpose while restoring (a Stop, a restart): the file is not to
            # blame; keep it, and say nothing, as for a start that was cancelled.
            _stop_quietly(record, transport)
            return
        # docs/behaviour.md C44: llama-server refused the file (or died reading it) and may
        # have left its KV cache half written: the file goes, and the server is started
        # afresh before it answers anything.
        _forget(refused.saved, transport)
        record_event(session.pk, Kind.NOTICE, {"message": RESTORE_FAILED.format(reason=refused.reason)})
        _stop_quietly(record, transport)
        _spawn(session, transport, restore=False)
        return
    ServerRecord.objects.filter(pk=record.pk).update(ready_at=timezone.now())
    model = ModelFile.objects.filter(machine=session.machine, key=record.model_key).first()
    ready = {"model_key": record.model_key, "model": model.display_name if model else record.model_key,
             **server_facts(model, props)}
    if _opens_thinking(endpoint):
        ready["opens_thinking"] = True
    if warm:
        ready["warm_tokens"] = warm
    record_event(session.pk, Kind.SERVER_READY, ready)
    if session.purpose != AgentSession.Purpose.API:  # the API runs no tools (docs/api.md)
        record_catalogue(session.pk, endpoint)
    set_status(session.pk, Status.IDLE, only_from=(Status.LOADING, Status.UNKNOWN))
    _go_on(session.pk)


def _go_on(session_id: int) -> None:
    """A ready server: the open turn's step runs, or the next queued message is taken."""
    if AgentSession.objects.filter(pk=session_id, turn_active=True).exists():
        dispatch.enqueue_on_commit(dispatch.RUN_TURN, session_id)
    else:
        turns.resume_queue(session_id)


def _stop_quietly(record: ServerRecord, transport: Transport) -> None:
    ServerRecord.objects.filter(pk=record.pk).update(stopping=True)
    try:
        transport.stop(_proc(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError as exc:
        orphans.defer_stop(machine_place(record.machine), record.pid, record.start_time, record.port,
                           record.session_id, exc)
    transport.release_port(record.port)
    ServerRecord.objects.filter(pk=record.pk).delete()


# --- warm prompts: slot save and restore (docs/behaviour.md §5, C43, C44) ----------------------

RESTORE_FAILED = (
    "The saved prompt cache could not be restored ({reason}); it was deleted and llama-server was started "
    "again without it. The conversation is unchanged; its first prompt is read in full."
)


class RestoreRefused(Exception):
    """llama-server did not restore a saved slot: ``saved`` is the SlotSave, ``reason`` its words."""

    def __init__(self, saved: SlotSave, reason: str) -> None:
        super().__init__(reason)
        self.saved, self.reason = saved, reason


def _slot_path(transport: Transport, session_id: int, save_id: int) -> str:
    return posixpath.join(slot_dir(transport.private_dir(), session_id), slot_file_name(session_id, save_id))


def _forget(saved: SlotSave, transport: Transport) -> None:
    """Delete a saved slot: its file (a link there is removed, not followed) and its row."""
    try:
        transport.remove(_slot_path(transport, saved.session_id, saved.pk))
    except TransportError:
        pass
    SlotSave.objects.filter(pk=saved.pk).delete()


def _fingerprint(session: AgentSession, record: ServerRecord, props: ServerProps | None) -> str:
    """The ready server's slot key (llama_server.slot_fingerprint) from its ``GET /props``
    (``props``, None when it did not answer), '' when it cannot be made."""
    if props is None:
        return ""  # the transcript already says the server did not answer /props
    try:
        model = catalog.model_for_session(session.machine, record.model_key)
    except catalog.ModelUnavailable as exc:
        log.warning("session %s: no slot key for pid %s: %s", session.pk, record.pid, exc)
        return ""
    size = ModelFile.objects.filter(machine=session.machine, key=record.model_key).values_list("file_size", flat=True)
    # '' for a server that does not report n_ctx and its build (slot_fingerprint).
    return slot_fingerprint(
        binary=session.machine.llama_server_path,
        model_path=model.path, model_size=size.first() or 0, params=record.server_params, props=props,
        mmproj_path=model.mmproj_path,
    )


def _restore(
    session: AgentSession, transport: Transport, record: ServerRecord, props: ServerProps | None
) -> int | None:
    """Restore the session's saved slot of this model into the ready server (``props``:
    its ``GET /props``, None when it did not answer); the tokens restored, or None when
    there is nothing (fit) to restore. A saved slot whose
    fingerprint differs (another build, context size, parameters, a changed file) or whose
    path holds anything but a plain file is deleted unread. Raises RestoreRefused when
    llama-server does not restore the file (the caller decides what becomes of it)."""
    key = _fingerprint(session, record, props)
    ServerRecord.objects.filter(pk=record.pk).update(slot_key=key)
    record.slot_key = key
    saved = SlotSave.objects.filter(session=session, machine=session.machine, model_key=record.model_key).first()
    if saved is None or not key:
        return None
    path = _slot_path(transport, session.pk, saved.pk)
    if saved.fingerprint != key or not transport.is_own_file(path):
        _forget(saved, transport)
        return None
    try:
        return restore_slot(_endpoint(transport, record), slot_file_name(session.pk, saved.pk))
    except SlotError as exc:
        raise RestoreRefused(saved, str(exc)) from None


def _save(record: ServerRecord, transport: Transport) -> None:
    """Save the server's slot before it stops, keyed by its model and fingerprint (see
    SlotSave). Nothing when the server never became ready or has no slot key; a failed
    save deletes what it may have left."""
    if record.ready_at is None or not record.slot_key:
        return
    saved, _ = SlotSave.objects.get_or_create(
        session_id=record.session_id, machine=record.machine, model_key=record.model_key,
        defaults={"fingerprint": record.slot_key},
    )
    try:
        # Whatever is at the path goes first: llama-server opens the name for writing, and
        # a link planted there must not be written through (docs/behaviour.md C43).
        transport.remove(_slot_path(transport, record.session_id, saved.pk))
        n_saved = save_slot(_endpoint(transport, record), slot_file_name(record.session_id, saved.pk))
    except (SlotError, TransportError) as exc:
        log.warning("session %s: slot not saved: %s", record.session_id, exc)
        _forget(saved, transport)
        return
    if n_saved <= 0:
        _forget(saved, transport)
        return
    SlotSave.objects.filter(pk=saved.pk).update(fingerprint=record.slot_key, n_tokens=n_saved, saved_at=timezone.now())


def _read_props(session_id: int, server: Endpoint) -> ServerProps | None:
    """The ready server's ``GET /props`` (read once per start: it feeds the slot key and the
    ``server_ready`` facts), None when it does not answer. A server that does not answer
    /props still starts; the transcript says so."""
    try:
        return read_props(server)
    except (httpx.HTTPError, ValueError) as exc:
        record_error(session_id, f"llama-server did not say what its chat template can do (GET /props: {exc}).")
        return None


def _opens_thinking(server: Endpoint) -> bool:
    """Whether the ready server's prompt opens a thinking block (rendered once per start:
    :func:`machines_app.llama_server.prompt_opens_thinking`); False when it cannot say
    (an older build without ``/apply-template``): replies are then read as they come."""
    try:
        return prompt_opens_thinking(server)
    except (httpx.HTTPError, ValueError) as exc:
        log.info("could not render the chat template of %s: %s", server.url, exc)
        return False


def server_facts(model: ModelFile | None, props: ServerProps | None) -> dict:
    """What a ready server says about its chat template and sampling defaults
    (``props``: its ``GET /props``, docs/behaviour.md §17; None when it did not answer),
    for its ``server_ready`` event. The template's capabilities are also kept on the model
    file, so the picker knows them before the next start."""
    facts: dict = {
        "chat_template": (model.chat_template_file or model.chat_template) if model else "",
        "jinja": not (model and model.chat_template and not model.chat_template_file),
        # What the header's model details say of the file (size, quantisation, images).
        "model_facts": model_facts(model),
    }
    if props is None:
        return facts
    facts["chat_template_caps"] = props.chat_template_caps
    facts["sampling_defaults"] = props.sampling_defaults
    if props.n_ctx:
        facts["n_ctx"] = props.n_ctx  # the page's context gauge
    if model is not None and props.chat_template_caps:
        ModelFile.objects.filter(pk=model.pk).update(chat_template_caps=props.chat_template_caps)
    return facts


def record_catalogue(session_id: int, server: Endpoint) -> None:
    """Read the tool catalogue — llama-server's ``GET /tools`` plus every enabled MCP
    server, reached from the backend — and record it (docs/behaviour.md §9). An MCP server that does
    not answer is left out and the transcript says so; the session still starts."""
    mcp_servers = list(McpServer.objects.configs().values())
    catalogue, warnings = tools.load_catalogue(server.url, mcp_servers, api_key=server.api_key)
    for warning in warnings:
        record_error(session_id, warning)
    record_event(session_id, Kind.CATALOGUE, {"tools": catalogue.as_payload()})


def _stop_process(session_id: int, *, stopped: dict | None = None, claimed: bool = False,
                  status: str | None = None) -> bool:
    """Save the slot (a ready server's prompt cache, docs/behaviour.md §5), then SIGTERM, a
    grace period, then SIGKILL, and only then clear the record (docs/behaviour.md C21).
    ``stopped``: a ``server_stopped`` payload to record before the record goes (so a start
    waiting for this stop follows it in the transcript), with ``status`` the session's
    status from then on (in the same transaction).

    One stop at a time: the record's ``stopping`` flag is claimed with a conditional
    UPDATE (``claimed``: the caller already did, as an idle stop does); a stop that finds
    another under way (a Restart clicked while Stop still saves) waits for it to finish
    instead of saving or signalling a second time. False when there was no server to stop
    here (none, or another stop stopped it)."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return False
    transport = transport_for(record.machine)
    if not claimed and not ServerRecord.objects.filter(pk=record.pk, stopping=False).update(stopping=True):
        _wait_for_stop(record, transport)
        return False
    try:
        _save(record, transport)
        transport.stop(_proc(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError as exc:
        # The machine cannot be reached to stop it: the stop stays pending and the watch
        # finishes it when the machine answers (docs/behaviour.md §5 "no orphans").
        orphans.defer_stop(machine_place(record.machine), record.pid, record.start_time, record.port, session_id, exc)
    transport.release_port(record.port)
    with transaction.atomic():
        session = locked(session_id)
        if stopped is not None:
            append(session, Kind.SERVER_STOPPED, stopped)
        if status is not None:
            change_status(session, status)
        record.delete()
    return True


def stop_when_deleted(session_id: int) -> None:
    """Hand the server of a session about to be deleted to the stop task, on commit.

    Called for every way a session row goes (its page, the admin's delete and bulk
    delete, the cascade from its owner or its machine, ``QuerySet.delete()``: the
    ``pre_delete`` receiver in :mod:`sessions_app.signals`), while its ServerRecord is
    still there to read. The task is given the process itself and where it runs
    (:func:`machines_app.transports.machine_place`), since the record, the session and
    perhaps the machine go with this delete (docs/behaviour.md §5). So is the removal of
    each of its saved slot files."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is not None:
        dispatch.enqueue_on_commit(
            dispatch.STOP_PROCESS, machine_place(record.machine), record.pid, record.start_time, record.port, session_id
        )
    # Its saved slots (docs/behaviour.md §5 warm prompts) go too, from the machines' disks.
    for save in SlotSave.objects.filter(session_id=session_id).select_related("machine"):
        dispatch.enqueue_on_commit(dispatch.REMOVE_SLOT, machine_place(save.machine), session_id, save.pk)
    # And its llama-server logs (one per start, the newest CORRAL_SERVER_LOGS_KEPT).
    session = AgentSession.objects.filter(pk=session_id).select_related("machine").first()
    if session is not None:
        dispatch.enqueue_on_commit(dispatch.REMOVE_LOGS, machine_place(session.machine), session_id)


def stop_orphan(place: dict, pid: int, start_time: str, port: int, session_id: int) -> None:
    """Stop the server of a deleted session (SIGTERM, grace, SIGKILL), let go of its
    port and remove its key file if a start left one. ``place`` is a
    :func:`machines_app.transports.machine_place`; no row is read."""
    try:
        transport = transport_at(place)
        transport.stop(ProcessId(pid, start_time), grace=settings.CORRAL_STOP_GRACE)
        transport.release_port(port)
        transport.remove(_key_file(session_id, transport, port))
    except TransportError as exc:
        # Nobody is left to tell in a transcript; the stop stays pending for the watch.
        orphans.defer_stop(place, pid, start_time, port, session_id, exc)


def remove_slot_file(place: dict, session_id: int, save_id: int) -> None:
    """Delete one saved slot file of a session that is gone (its row went with it).
    ``place`` is a :func:`machines_app.transports.machine_place`; no row is read."""
    try:
        transport = transport_at(place)
        transport.remove(_slot_path(transport, session_id, save_id))
    except TransportError as exc:
        log.warning("could not remove the saved slot %s of session %s on %s: %s", save_id, session_id,
                    place.get("name"), exc)


#: The notice when housekeeping deletes a saved slot (docs/operations.md "Disk").
SLOT_EXPIRED = (
    "The saved prompt cache of this conversation was deleted after {hours} without a running llama-server, to "
    "free the machine's disk. The next start is cold: the conversation is unchanged, and its prompt is read in "
    "full once."
)


def _hours(hours: float) -> str:
    return f"{hours:g} hour" + ("" if hours == 1 else "s")


def forget_old_slots(now: datetime | None = None) -> list[int]:
    """Housekeeping (every few minutes): delete each saved slot older than
    ``CORRAL_SLOT_KEEP_HOURS`` of a session whose server is not running or starting
    (asleep, stopped, exited), its file from its machine and its row, with a notice in the
    session's transcript (:data:`SLOT_EXPIRED`). A machine that cannot be reached keeps
    its file and row until a later round. The ids of the sessions concerned."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.CORRAL_SLOT_KEEP_HOURS)
    old = (SlotSave.objects.filter(saved_at__lt=cutoff, session__server__isnull=True)
           .exclude(session__status=Status.LOADING).select_related("machine"))
    done = []
    for saved in old:
        try:
            transport = transport_for(saved.machine)
            transport.remove(_slot_path(transport, saved.session_id, saved.pk))
            if transport.is_own_file(_slot_path(transport, saved.session_id, saved.pk)):
                raise TransportError("the file is still there")
        except TransportError as exc:
            log.warning("session %s: old saved slot %s not deleted yet: %s", saved.session_id, saved.pk, exc)
            continue
        with transaction.atomic():
            session = locked(saved.session_id)
            if ServerRecord.objects.filter(session_id=session.pk).exists() or session.status == Status.LOADING:
                continue  # woken meanwhile: its start reads no file and starts cold by itself
            if SlotSave.objects.filter(pk=saved.pk, saved_at__lt=cutoff).delete()[0]:
                append(session, Kind.NOTICE, {"message": SLOT_EXPIRED.format(hours=_hours(settings.CORRAL_SLOT_KEEP_HOURS))})
                done.append(session.pk)
    return done


def stop_server(session_id: int, *, reason: str = "stopped", by: dict | None = None) -> None:
    """Stop the session's server on purpose; status becomes ``stopped`` (not ``exited``,
    which says the server went away by itself: docs/behaviour.md §4). A running turn ends (its open
    questions closed as refusals); queued messages wait for a restart (docs/behaviour.md §8, §10).
    ``by`` is who asked (``actions.by``), None when Corral itself stops it.

    The status changes, with the ``server_stopped`` event, only once the process is gone:
    a Restart asked meanwhile follows the stop in the transcript, never precedes it
    (``actions.do_restart`` refuses while a stop is under way). The turn the stop breaks
    off hands nothing on meanwhile (``turns.finish_turn`` with ``stopped``).
    """
    stopped = {"reason": reason, **({"by": by} if by else {})}
    if not _stop_process(session_id, stopped=stopped, status=Status.STOPPED):
        # No server here (it exited) or another stop stopped it: still stopped on purpose,
        # unless a restart took over meanwhile (loading).
        with transaction.atomic():
            session = locked(session_id)
            if session.status != Status.LOADING and session.status != Status.STOPPED:
                append(session, Kind.SERVER_STOPPED, stopped)
                change_status(session, Status.STOPPED)
    turns.finish_if_unheld(session_id, TurnEnd.STOPPED)


def restart_server(session_id: int) -> None:
    """Stop the session's server (if any) and start one with the session's current model
    and server parameters (docs/behaviour.md §10 model change; a server-parameter change). The
    conversation survives because it was never in the server; its prompt cache is saved
    with the slot and restored when this model comes back.

    A start still loading the old model is cancelled (its record is marked stopping) and
    waited for; then this restart holds the start claim (:class:`StartClaim`)."""
    if _stop_process(session_id):
        record_event(session_id, Kind.SERVER_STOPPED, {"reason": "restart"})
    with StartClaim(session_id, wait=settings.CORRAL_READY_TIMEOUT + settings.CORRAL_STOP_GRACE + 30) as claim:
        if not claim.held:
            _fail(AgentSession.objects.get(pk=session_id), "The server could not be restarted: another start of it "
                  "did not finish. Restart again.")
            return
        if _stop_process(session_id):
            record_event(session_id, Kind.SERVER_STOPPED, {"reason": "restart"})
        _start(session_id)


def sleep_server(session_id: int, *, idle_for: timedelta | None = None, by: dict | None = None) -> bool:
    """Stop an idle session's server to free its memory (docs/behaviour.md §5 "sleep"): its
    slot is saved, status ``sleeping``, and the next message starts it again
    (``actions.do_send_message``). Only a session that is ``idle`` with no open turn and a
    ready server is put to sleep, and with ``idle_for`` only one quiet for that long; the
    check and the status change are one transaction under the session's lock, so a
    message arriving meanwhile either comes first (nothing sleeps) or finds it
    ``sleeping`` and waits for this stop. True when it was put to sleep."""
    with transaction.atomic():
        session = locked(session_id)
        if session.turn_active or session.status != Status.IDLE:
            return False
        if session.api_busy_until is not None and session.api_busy_until > timezone.now():
            return False  # an API server serving a request (api_app.serving)
        if idle_for is not None and session.last_activity_at > timezone.now() - idle_for:
            return False
        if not ServerRecord.objects.filter(session_id=session_id, ready_at__isnull=False, stopping=False).update(
            stopping=True
        ):
            return False
        change_status(session, Status.SLEEPING, by=by)
    _stop_process(session_id, stopped={"reason": "idle", **({"by": by} if by else {})}, claimed=True)
    return True




def sleep_idle_servers() -> list[int]:
    """The housekeeping beat's part: hand every server idle past its machine's idle time to
    the servers queue to be put to sleep (the sleep checks again under the lock)."""
    found = idle_sessions()
    for session_id in found:
        dispatch.enqueue(dispatch.SLEEP_SERVER, session_id, True)
    return found


def idle_seconds(session_id: int) -> timedelta | None:
    """The idle time of the session's machine, None when it has none."""
    seconds = (
        AgentSession.objects.filter(pk=session_id).values_list("machine__idle_stop_seconds", flat=True).first()
    )
    return timedelta(seconds=seconds) if seconds else None


LOST_START = "The server's start was lost (a worker or the broker went away); starting it again."


def recover_starts() -> list[int]:
    """Sessions left ``loading`` by a start that was lost — its task never ran (the broker
    was down) or its worker died — are started again: no live start claim, and nothing
    recorded for a claim's lifetime. The notice it records keeps it from being re-queued
    more often than that (docs/behaviour.md §5)."""
    now = timezone.now()
    stale = now - start_ttl()
    lost = AgentSession.objects.filter(
        Q(start_owner="") | Q(start_expires__isnull=True) | Q(start_expires__lt=now),
        status=Status.LOADING, last_activity_at__lt=stale,
    ).exclude(memory_claim__granted=False).values_list("pk", flat=True)  # waiting for memory: room.admit_waiting
    found = list(lost)
    for session_id in found:
        record_event(session_id, Kind.NOTICE, {"message": LOST_START})
        dispatch.enqueue(dispatch.START_SERVER, session_id)
    return found


def watch_servers(host: str | None = None) -> None:
    """Check every ready server's process (docs/behaviour.md §5 "keep watching"): one that died
    without being stopped ends with "llama-server exited" and status ``exited``; one whose
    liveness cannot be told makes the session ``unknown`` until it can. A server whose
    machine was lost while it loaded (``unknown``, not ready) is checked too, so it is
    waited for again once the machine answers (docs/ssh.md). First, every stop left pending
    on a machine that could not be reached is tried again (docs/behaviour.md §5 "no orphans").

    ``host`` None: the servers any host reaches (SSH machines); a host id: that host's own
    local machine's, which only it may judge — on another host its loopback port refuses
    and its pid is not there (machines_app.models.reached_by)."""
    orphans.settle_pending_stops(host)
    records = ServerRecord.objects.filter(
        Q(ready_at__isnull=False) | Q(session__status=Status.UNKNOWN), reached_by(host, "machine__"), stopping=False
    ).select_related("machine", "session")
    for record in records:
        check_server(record)


#: Seconds between two ``/health`` questions to one ready server from the watch (a session
#: already ``unknown`` is asked at every watch, so it is back as soon as it answers).
HEALTH_EVERY = 10.0
_asked_at: dict[int, float] = {}


def _health_due(record: ServerRecord) -> bool:
    """Whether the watch asks this server ``/health`` now. Kept per worker process (a
    pacing, not a state: a new worker asks at once)."""
    now = time.monotonic()
    if record.session.status != Status.UNKNOWN and now - _asked_at.get(record.pk, -HEALTH_EVERY) < HEALTH_EVERY:
        return False
    _asked_at[record.pk] = now
    return True


#: What a session says when its server's process runs but does not answer.
FROZEN = ("llama-server does not answer (nothing within {seconds}): its process is still there, but it may "
          "be frozen or overloaded. The status is unknown until it answers again; Stop server and Restart "
          "if it does not.")


def _unknown_sentence(exc: TransportError) -> str:
    return f"{exc} The session's server cannot be checked; its status is unknown until the machine answers again."


def check_session_server(session_id: int) -> None:
    """Check one session's server now (a turn whose stream broke off asks this, so a dead
    server shows ``exited`` at once rather than ``idle`` until the next watch)."""
    record = (ServerRecord.objects.filter(session_id=session_id, stopping=False)
              .select_related("machine", "session").first())
    if record is not None:
        check_server(record)


def stop_under_way(session_id: int) -> bool:
    """Whether the session's server is being stopped on purpose (its record claimed
    ``stopping``) or was (status ``stopped``): a reply it breaks off was stopped, not failed."""
    return (ServerRecord.objects.filter(session_id=session_id, stopping=True).exists()
            or AgentSession.objects.filter(pk=session_id, status=Status.STOPPED).exists())


def link_broken(session_id: int) -> str | None:
    """Why the way to the session's machine is broken, in words, when a reply's connection
    just broke off because of it (an SSH link gone: docs/ssh.md), else None. Asks the
    machine whether the server's process runs; a machine that cannot be asked makes the
    session ``unknown`` (the watch brings it back once the machine answers)."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return None
    try:
        transport_for(record.machine).process_alive(_proc(record))
    except ElsewhereError:
        return None  # another host's own server: nothing can be told from here
    except TransportError as exc:
        set_status(session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING))
        return f"The link to machine '{record.machine.name}' broke while llama-server was replying. {_unknown_sentence(exc)}"
    return None


def server_gone(session_id: int) -> bool:
    """Whether the session's recorded server process is known to be gone (no record left,
    or its pid and start time no longer run); False while it runs or cannot be told. Reads
    only: :func:`check_session_server` is what records the death."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return True
    try:
        return not transport_for(record.machine).process_alive(_proc(record))
    except TransportError:
        return False


def check_server(record: ServerRecord) -> None:
    try:
        transport = transport_for(record.machine)
        alive = transport.process_alive(_proc(record))
    except ElsewhereError:
        return  # another host's own server: only that host can tell whether it runs
    except TransportError as exc:
        if set_status(record.session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING)):
            record_error(record.session_id, _unknown_sentence(exc))
        return
    if alive:
        if record.ready_at is None:
            # Lost while loading, back now: wait for it again (start_server adopts it).
            if set_status(record.session_id, Status.LOADING, only_from=(Status.UNKNOWN,)):
                dispatch.enqueue(dispatch.START_SERVER, record.session_id)
            return
        # A frozen process keeps its pid: ask it, within a bound (docs/behaviour.md §5) —
        # every HEALTH_EVERY seconds, not every watch (an idle stack should cost nothing).
        if _health_due(record) and does_not_answer(_endpoint(transport, record), settings.CORRAL_HEALTH_TIMEOUT):
            if set_status(record.session_id, Status.UNKNOWN, only_from=(Status.IDLE, Status.RUNNING)):
                record_error(record.session_id, FROZEN.format(seconds=f"{settings.CORRAL_HEALTH_TIMEOUT:g} seconds"))
            return
        # Only an unknown session has anything to change (the lock checks again): a live
        # server's every-two-seconds check costs no transaction.
        if record.session.status == Status.UNKNOWN:
            set_status(record.session_id, Status.IDLE, only_from=(Status.UNKNOWN,))
        return
    # Delete first, conditionally, so two watchers never both report the death.
    if ServerRecord.objects.filter(pk=record.pk, stopping=False).delete()[0] == 0:
        return
    transport.release_port(record.port)
    try:
        tail = transport.log_tail(record.log_path)
    except TransportError:
        tail = ""
    message = "llama-server exited by itself (nobody stopped it). Restart it to go on."
    session = AgentSession.objects.select_related("machine").get(pk=record.session_id)
    _fail(session, message, log=template_safe(session, transport, tail.strip()))
