"""A session's llama-server: start, ready, watch, stop, adopt (docs/behaviour.md §4, §5).

Wires :mod:`machines_app.llama_server` (no Django) to the database and the transcript.
No database transaction is held across a process start, a health poll or a stop.
"""

from __future__ import annotations

import logging
import posixpath

import httpx
from django.conf import settings
from django.db import IntegrityError
from django.db.models import Q
from django.utils import timezone

from machines_app import catalog
from machines_app.llama_server import (
    Endpoint,
    ServerSpec,
    ServerStartError,
    build_argv,
    new_api_key,
    read_props,
    wait_until_ready,
)
from machines_app.models import ModelFile, ServerRecord
from machines_app.transports import ProcessId, Transport, TransportError, machine_place, transport_at, transport_for

from . import dispatch, tools, turns
from .events import record_error, record_event, set_status
from .models import AgentSession, McpServer
from .transcript import Kind, TurnEnd

Status = AgentSession.Status
log = logging.getLogger(__name__)


def log_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """The owner-only log file of one start of the session's server, on the machine that
    runs it (a remote server writes its log there, read back by the tail: docs/ssh.md).
    One file per start (the port tells starts apart), so a failed start's last words are
    its own, never an earlier run's (docs/behaviour.md C08)."""
    return posixpath.join(transport.private_dir(), f"session-{session.pk}-{port}.log")


def key_path_for(session: AgentSession, transport: Transport, port: int) -> str:
    """Where the server's API key waits for llama-server to read it at start, on the
    server's machine (mode 0600; removed once the server is ready or has failed). One file
    per start (the port tells starts apart), so a cancelled start never removes the key of
    the start that replaced it."""
    return _key_file(session.pk, transport, port)


def _key_file(session_id: int, transport: Transport, port: int) -> str:
    return posixpath.join(transport.private_dir(), f"session-{session_id}-{port}.key")


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


def _fail(session: AgentSession, message: str, log: str = "") -> None:
    """The server is gone: say so (``log``: its last words, shown folded below the
    sentence), status ``exited``, and end an open turn."""
    record_error(session.pk, message, log=log)
    set_status(session.pk, Status.EXITED)
    if AgentSession.objects.filter(pk=session.pk, turn_active=True).exists():
        turns.finish_turn(session.pk, TurnEnd.ERROR)


def start_server(session_id: int) -> None:
    """Start the session's llama-server and wait until it is ready (docs/behaviour.md §5).

    A live recorded server (same pid and start time) is adopted instead of starting a
    second one. Every failure — a model the machine does not have, a server that exits or
    never answers — ends as an error event with the server's last words and status
    ``exited``. Once ready: catalogue read, status ``idle``, and a waiting message runs.
    """
    session = AgentSession.objects.select_related("machine").get(pk=session_id)
    transport = transport_for(session.machine)
    record = ServerRecord.objects.filter(session=session).first()
    if record is not None:
        try:
            alive = transport.process_alive(_proc(record))
        except TransportError:
            alive = True  # cannot tell: never risk two servers holding one model
        if alive:
            log.info("session %s: adopting llama-server pid %s", session_id, record.pid)
            if record.ready_at is None:
                _wait(session, transport, record)
            return
        record.delete()

    key_path = ""
    try:
        model = catalog.model_for_session(session.machine, session.model_key)
        port = transport.free_port()
        key_path = key_path_for(session, transport, port)
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
        log_path = log_path_for(session, transport, port)
        set_status(session.pk, Status.LOADING)
        api_key = new_api_key()
        transport.write_private(spec.api_key_file, api_key + "\n")
        proc = transport.spawn(build_argv(spec), log_path, cwd=None)
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
        log.warning("session %s: gone or already served while starting; stopping pid %s", session_id, proc.pid)
        try:
            transport.remove(key_path)
            transport.stop(proc, grace=settings.CORRAL_STOP_GRACE)
        except TransportError as exc:
            log.warning("could not stop llama-server pid %s on machine %s: %s", proc.pid, session.machine.name, exc)
        transport.release_port(spec.port)
        return
    _wait(session, transport, record)


def _wait(session: AgentSession, transport, record: ServerRecord) -> None:
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
            _fail(session, exc.sentence, log=exc.log_tail)
        return
    # llama-server read its key at start; the file need not outlive that.
    try:
        transport.remove(key_path_for(session, transport, record.port))
    except TransportError:
        pass  # the machine went away just now: the watch will say so
    ServerRecord.objects.filter(pk=record.pk).update(ready_at=timezone.now())
    model = ModelFile.objects.filter(machine=session.machine, key=record.model_key).first()
    endpoint = _endpoint(transport, record)
    record_event(
        session.pk, Kind.SERVER_READY,
        {"model_key": record.model_key, "model": model.display_name if model else record.model_key,
         **server_facts(session.pk, model, endpoint)},
    )
    record_catalogue(session.pk, endpoint)
    set_status(session.pk, Status.IDLE, only_from=(Status.LOADING, Status.UNKNOWN))
    if AgentSession.objects.filter(pk=session.pk, turn_active=True).exists():
        dispatch.enqueue_on_commit(dispatch.RUN_TURN, session.pk)
    else:
        turns.resume_queue(session.pk)


def server_facts(session_id: int, model: ModelFile | None, server: Endpoint) -> dict:
    """What a ready server says about its chat template and sampling defaults
    (``GET /props``, docs/behaviour.md §17), for its ``server_ready`` event. The template's
    capabilities are also kept on the model file, so the picker knows them before the next
    start. A server that does not answer /props still starts; the transcript says so."""
    facts: dict = {
        "chat_template": (model.chat_template_file or model.chat_template) if model else "",
        "jinja": not (model and model.chat_template and not model.chat_template_file),
    }
    try:
        props = read_props(server.url, server.api_key)
    except (httpx.HTTPError, ValueError) as exc:
        record_error(session_id, f"llama-server did not say what its chat template can do (GET /props: {exc}).")
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


def _stop_process(session_id: int) -> bool:
    """SIGTERM, a grace period, then SIGKILL, and only then clear the record (docs/behaviour.md §5,
    docs/behaviour.md C21). False when there was no server."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is None:
        return False
    ServerRecord.objects.filter(pk=record.pk).update(stopping=True)
    transport = transport_for(record.machine)
    try:
        transport.stop(_proc(record), grace=settings.CORRAL_STOP_GRACE)
    except TransportError as exc:
        # The machine cannot be reached to stop it: say so, with what an admin needs to
        # find the process, rather than claim it stopped.
        record_error(
            session_id,
            f"Could not stop llama-server (pid {record.pid}) on machine '{record.machine.name}': {exc}. "
            "It may still be running there.",
        )
    transport.release_port(record.port)
    record.delete()
    return True


def stop_when_deleted(session_id: int) -> None:
    """Hand the server of a session about to be deleted to the stop task, on commit.

    Called for every way a session row goes (its page, the admin's delete and bulk
    delete, the cascade from its owner or its machine, ``QuerySet.delete()``: the
    ``pre_delete`` receiver in :mod:`sessions_app.signals`), while its ServerRecord is
    still there to read. The task is given the process itself and where it runs
    (:func:`machines_app.transports.machine_place`), since the record, the session and
    perhaps the machine go with this delete (docs/behaviour.md §5)."""
    record = ServerRecord.objects.filter(session_id=session_id).select_related("machine").first()
    if record is not None:
        dispatch.enqueue_on_commit(
            dispatch.STOP_PROCESS, machine_place(record.machine), record.pid, record.start_time, record.port, session_id
        )


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
        # Nobody is left to tell in a transcript: the worker's log says what to look for.
        log.warning("could not stop llama-server pid %s on machine %s: %s", pid, place.get("name"), exc)


def stop_server(session_id: int, *, reason: str = "stopped", by: dict | None = None) -> None:
    """Stop the session's server on purpose; status becomes ``stopped`` (not ``exited``,
    which says the server went away by itself: docs/behaviour.md §4). A running turn ends (its open
    questions closed as refusals); queued messages wait for a restart (docs/behaviour.md §8, §10).
    ``by`` is who asked (``actions.by``), None when Corral itself stops it.

    The status changes first, so the turn that the stop breaks off does not hand the
    queue to a server that is going away.
    """
    set_status(session_id, Status.STOPPED)
    _stop_process(session_id)
    record_event(session_id, Kind.SERVER_STOPPED, {"reason": reason, **({"by": by} if by else {})})
    turns.finish_if_unheld(session_id, TurnEnd.STOPPED)


def restart_server(session_id: int) -> None:
    """Stop the session's server (if any) and start one with the session's current model
    and server parameters (docs/behaviour.md §10 model change; a server-parameter change). The
    conversation survives because it was never in the server; the prompt cache does not."""
    if _stop_process(session_id):
        record_event(session_id, Kind.SERVER_STOPPED, {"reason": "restart"})
    start_server(session_id)


def watch_servers() -> None:
    """Check every ready server's process (docs/behaviour.md §5 "keep watching"): one that died
    without being stopped ends with "llama-server exited" and status ``exited``; one whose
    liveness cannot be told makes the session ``unknown`` until it can. A server whose
    machine was lost while it loaded (``unknown``, not ready) is checked too, so it is
    waited for again once the machine answers (docs/ssh.md)."""
    records = ServerRecord.objects.filter(
        Q(ready_at__isnull=False) | Q(session__status=Status.UNKNOWN), stopping=False
    ).select_related("machine")
    for record in records:
        check_server(record)


def _unknown_sentence(exc: TransportError) -> str:
    return f"{exc} The session's server cannot be checked; its status is unknown until the machine answers again."


def check_session_server(session_id: int) -> None:
    """Check one session's server now (a turn whose stream broke off asks this, so a dead
    server shows ``exited`` at once rather than ``idle`` until the next watch)."""
    record = ServerRecord.objects.filter(session_id=session_id, stopping=False).select_related("machine").first()
    if record is not None:
        check_server(record)


def check_server(record: ServerRecord) -> None:
    transport = transport_for(record.machine)
    try:
        alive = transport.process_alive(_proc(record))
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
    _fail(AgentSession.objects.get(pk=record.session_id), message, log=tail.strip())
