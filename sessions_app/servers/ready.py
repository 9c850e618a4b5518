"""A started server until it answers (docs/behaviour.md §5, §17): waited for within
``CORRAL_READY_TIMEOUT``, its saved slot restored, what it says of its chat template and
sampling defaults recorded with its tool catalogue, status ``idle``, and the session's
waiting work handed on.
"""

from __future__ import annotations

import logging

import httpx
from django.conf import settings
from django.utils import timezone

from machines_app.llama_server import (
    Endpoint,
    ServerProps,
    ServerStartError,
    explain_start_failure,
    prompt_opens_thinking,
    read_props,
    wait_until_ready,
)
from machines_app.models import ModelFile
from machines_app.transports import Transport, TransportError

from .. import dispatch, tools, turns
from ..events import record_error, record_event, set_status
from ..live.header import model_facts
from ..models import AgentSession, McpServer
from ..transcript import Kind
from .models import ServerRecord
from .records import endpoint_of, fail, key_path_for, proc_of, template_safe, unknown_sentence
from .slots import RESTORE_FAILED, RestoreRefused, forget_slot, restore_saved
from .stop import stop_quietly

Status = AgentSession.Status
log = logging.getLogger(__name__)


def wait_ready(session: AgentSession, transport: Transport, record: ServerRecord, *, restore: bool = True) -> bool:
    """Wait until the server of ``record`` answers (docs/behaviour.md §5), then: its key file
    removed, its saved slot restored (``restore``), its facts and tool catalogue recorded,
    status ``idle``, and the session's work goes on (:func:`go_on`). A server that exits
    or never answers ends as an error with its last words; a machine lost meanwhile makes
    the session ``unknown`` and keeps the record (the watch takes it up again).

    True when llama-server refused the saved slot: the file is deleted and the server
    stopped, and the caller starts it again without restoring (docs/behaviour.md C44)."""
    try:
        wait_until_ready(
            transport,
            proc_of(record),
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
            record_error(session.pk, unknown_sentence(exc))
        return False
    except ServerStartError as exc:
        try:
            transport.remove(key_path_for(session, transport, record.port))
            transport.stop(proc_of(record), grace=settings.CORRAL_STOP_GRACE)
        except TransportError:
            pass
        transport.release_port(record.port)
        # Stopped on purpose (a stop, a restart or a model change took the record): say nothing.
        stopped_on_purpose = not ServerRecord.objects.filter(pk=record.pk, stopping=False).exists()
        ServerRecord.objects.filter(pk=record.pk).delete()
        if not stopped_on_purpose:
            tail = template_safe(session, transport, exc.log_tail)
            fail(session, explain_start_failure(exc.headline, tail), log=tail)
        return False
    # llama-server read its key at start; the file need not outlive that.
    try:
        transport.remove(key_path_for(session, transport, record.port))
    except TransportError:
        pass  # the machine went away just now: the watch will say so
    endpoint = endpoint_of(transport, record)
    props = _read_props(session.pk, endpoint)
    try:
        warm = restore_saved(session, transport, record, props) if restore else None
    except RestoreRefused as refused:
        if not ServerRecord.objects.filter(pk=record.pk, stopping=False).exists():
            # Stopped on purpose while restoring (a Stop, a restart): the file is not to
            # blame; keep it, and say nothing, as for a start that was cancelled.
            stop_quietly(record, transport)
            return False
        # docs/behaviour.md C44: llama-server refused the file (or died reading it) and may
        # have left its KV cache half written: the file goes, and the server is started
        # afresh before it answers anything.
        forget_slot(refused.saved, transport)
        record_event(session.pk, Kind.NOTICE, {"message": RESTORE_FAILED.format(reason=refused.reason)})
        stop_quietly(record, transport)
        return True
    _announce_ready(session, record, endpoint, props, warm)
    return False


def _announce_ready(session: AgentSession, record: ServerRecord, endpoint: Endpoint, props: ServerProps | None,
                    warm: int | None) -> None:
    """The server answers: ``ready_at`` set, its ``server_ready`` event (model, template,
    sampling defaults, ``warm``: tokens restored from a saved slot), its tool catalogue,
    status ``idle``, and the session's work goes on."""
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
    go_on(session.pk)


def go_on(session_id: int) -> None:
    """A ready server: the open turn's step runs, or the next queued message is taken."""
    if AgentSession.objects.filter(pk=session_id, turn_active=True).exists():
        dispatch.enqueue_on_commit(dispatch.RUN_TURN, session_id)
    else:
        turns.resume_queue(session_id)


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
