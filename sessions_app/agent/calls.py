"""The calls of a reply and the gate (docs/behaviour.md §8, §9): recording a reply's calls
(:func:`record_calls`), running the pending ones in order and asking about the first one
nothing allows (:func:`run_calls`), and running one call (:func:`execute`).

Each takes the claimed step (:class:`~sessions_app.agent.lease.LeasedStep`) whose lease
its writes go through.
"""

from __future__ import annotations

import re
import secrets
import threading

from django.conf import settings
from django.db import connection

from machines_app.llama_server import Endpoint
from machines_app.transports import TransportError

from .. import actions, allowances, callcard, db_link, machine_use, tool_results, tools, transcript, turns
from ..completions.tool_calls import ToolCall, arguments_problem
from ..models import AgentSession, McpServer
from ..servers import containment, watch
from ..transcript import Kind, TurnEnd
from .folds import catalogue_of
from .lease import LeasedStep
from .request import Request

Status = AgentSession.Status

REFUSED_RESULT = "The user refused this call of {tool}; it was not run."
WORKER_LOST_RESULT = (
    "The result of this call is unknown: the worker running it stopped while it ran, and it was not run again."
)
SERVER_LOST_RESULT = (
    "The result of this call is unknown: llama-server stopped while it ran, and it was not run again."
)
#: The result of a call whose arguments were not one JSON object (docs/behaviour.md §9, C04):
#: the model is told why, so it can call again; the call is neither run nor asked about.
MALFORMED_RESULT = (
    "This call of {tool} was not run: its arguments were not valid JSON ({error}). "
    "Call {tool} again with its arguments as one JSON object."
)
#: The result of a call in a reply that stopped before it was finished (docs/behaviour.md §9).
CUT_CALL_RESULT = (
    "This call of {tool} was not run: the reply stopped before it was finished ({why}), "
    "so its arguments may be incomplete."
)
CUT_CALL_WHY = {"length": "the length limit, max_tokens", None: "the server did not say it had finished"}
#: The notice after a reply that stopped in the middle of a tool call.
CUT_CALL_NOTICE = {
    "length": ("The reply stopped in the middle of a tool call at its length limit (max_tokens {max_tokens}); "
               "the call was not run. Send \"go on\" to let the model try again, or raise max_tokens in Settings."),
    None: ("The reply ended in the middle of a tool call (the server did not say it had finished); the call "
           "was not run. Send another message to carry on."),
}
#: Seconds between two looks for an interrupt while a tool runs: Stop reply ends it within
#: about half a second (the tool's own poll adds a few hundredths).
TOOL_INTERRUPT_POLL_EVERY = 0.25
CALL_ID = re.compile(r"[A-Za-z0-9_.-]{1,80}")


def question_details(call: dict, entry: dict, working_dir: str, in_force: list) -> dict:
    """What a question about ``call`` says besides its id and tool (the ``question`` payload,
    docs/transcript.md): the scopes "always" may cover (``offers``); for an MCP tool, what
    its server claims (``claims``: readOnlyHint, shown, never trusted) and, when an
    allowance for it no longer matches, what changed in its definition (``changed``)."""
    details: dict = {"offers": [{"scope": scope} for scope in allowances.offers(call, entry, working_dir)]}
    if entry.get("origin") == tools.ORIGIN_MCP:
        hint = (entry.get("annotations") or {}).get("readOnlyHint")
        details["claims"] = ("its server says it only reads (readOnlyHint)" if hint is True
                             else "its server does not say it only reads")
        for allowance in in_force:
            scope = allowance["scope"]
            if (scope.get("kind") == "mcp" and scope.get("server") == entry.get("server")
                    and scope.get("remote_name") == entry.get("remote_name")):
                details["changed"] = allowances.changes(scope.get("definition") or {}, entry) or ["its definition"]
    return details


def record_calls(step: LeasedStep, session: AgentSession, events, request: Request, calls: list[ToolCall],
                 finish_reason: str | None) -> TurnEnd | None:
    """Record the ``calls`` a reply asked for (``finish_reason``: how it ended), one
    ``tool_start`` each, before any runs. None when they are to run next; ``TurnEnd.DONE``
    when the reply stopped inside its last call, so none of them runs (each ends with
    :data:`CUT_CALL_RESULT`, and a notice says why)."""
    # docs/behaviour.md §9: only whole calls run. A reply that stopped at its length limit,
    # or without saying it had finished, stopped inside its last call: what its arguments
    # were meant to be is unknown, so none of its calls is run or asked about.
    cut = finish_reason in CUT_CALL_WHY
    # docs/behaviour.md §9: every call of the reply is recorded, in order, before any runs, so the
    # fold knows they belong to one assistant message. Results are paired by call id,
    # so an id the transcript has seen before (some servers number calls call_0,
    # call_1 in every reply) is replaced by a fresh one.
    used = {e.payload.get("id") for e in events if e.kind == Kind.TOOL_START}
    call_ids: list[tuple[str, str]] = []
    # Each call's arguments parsed, and a file a write or edit would change read from the
    # machine (docs/behaviour.md §8), before any call is recorded: a slow or failing
    # machine delays or fails no half-recorded batch.
    parsed = [
        callcard.recorded(call.name, call.arguments if call.raw_arguments is None else call.raw_arguments,
                          working_dir=session.working_dir, transport=lambda: containment.tool_view(session.machine))
        for call in calls
    ]
    for index, call in enumerate(calls):
        # Ids go into URLs and DOM ids: anything but a plain token is replaced too.
        fresh = call.id not in used and CALL_ID.fullmatch(call.id or "")
        call_id = call.id if fresh else f"call_{secrets.token_hex(12)}"
        used.add(call_id)
        entry = request.catalogue.get(call.name)
        step.record(
            Kind.TOOL_START,
            {
                "id": call_id,
                "tool": call.name,
                "arguments": call.arguments,
                "raw_arguments": call.raw_arguments,
                # Parsed once (above): what the card shows is what the tool receives.
                **parsed[index],
                "origin": entry.origin if entry else None,
                "server": entry.server if entry else None,
                "writes": entry.writes if entry else None,
                "display_name": entry.display_name if entry else call.name,
            },
        )
        call_ids.append((call_id, call.name))
    if cut:
        why = CUT_CALL_WHY[finish_reason]
        for call_id, name in call_ids:
            step.record(Kind.TOOL_END, {"id": call_id, "output": CUT_CALL_RESULT.format(tool=name, why=why),
                                        "ok": False})
        step.record(Kind.NOTICE, {"message": CUT_CALL_NOTICE[finish_reason].format(
            max_tokens=request.sampling.get("max_tokens"))})
        return TurnEnd.DONE
    return None


def run_calls(step: LeasedStep, session: AgentSession, events, server: Endpoint) -> bool:
    """Run the pending calls in order. False when the step must end here: a question
    was asked (status awaiting_input) or the turn was interrupted."""
    catalogue = catalogue_of(events)
    answers = {e.payload.get("id"): e.payload for e in events if e.kind == Kind.ANSWERED}
    asked = {e.payload.get("id") for e in events if e.kind == Kind.QUESTION}
    running = {e.payload.get("id") for e in events if e.kind == Kind.TOOL_RUNNING}
    # Only what a person who may still give it granted (docs/access.md).
    in_force = machine_use.standing(session, transcript.allowances(events))
    for call in transcript.pending_calls(events):
        call_id, name = call["id"], call["tool"]
        if step.interrupted():
            step.finish(step.stop_reason())
            return False
        if call_id in running:
            # Started by a worker that died: a command may have run; never re-run it silently.
            step.record(Kind.TOOL_END, {"id": call_id, "output": WORKER_LOST_RESULT, "ok": False})
            continue
        entry = catalogue.get(name)
        if entry is None:
            output = tools.UNKNOWN_TOOL_RESULT.format(name=name)
            step.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
            continue
        problem = call.get("arguments_error") or arguments_problem(call.get("raw_arguments"))
        if problem:
            # Never run as {} (C04): the model is told why, and nobody is asked.
            output = MALFORMED_RESULT.format(tool=name, error=problem)
            step.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
            continue
        answer = answers.get(call_id, {}).get("answer")
        if answer == transcript.ANSWER_REFUSE:
            output = REFUSED_RESULT.format(tool=name)
            step.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
            continue
        # The mode is read for each call that would be asked about: a bypass whose owner lost
        # the right to it ends here, before this call (actions.gate_mode).
        described = entry.as_payload()
        if (
            answer is None
            and not any(allowances.matches(a, call, described, session.working_dir) for a in in_force)
            and actions.gate_mode(step.session_id) != AgentSession.PermissionMode.BYPASS
        ):
            if call_id not in asked:
                turns.ask_question(step.session_id, call_id, name, owner=step.owner,
                                   **question_details(call, described, session.working_dir, in_force))
            return False
        if not execute(step, session, entry, call, server):
            return False  # the server died under the call: its turn was ended with the session
        if step.interrupted():
            step.finish(step.stop_reason())
            return False
    return True

def execute(step: LeasedStep, session: AgentSession, entry: tools.ToolEntry, call: dict, server: Endpoint) -> bool:
    """Run one call and record its result, cut to ``CORRAL_TOOL_RESULT_MAX_CHARS``
    (tool_results.cap; ``full_chars`` then says how long it was). While it runs, a thread
    looks for an interrupt and cancels it (docs/behaviour.md §9: Stop reply ends a running
    tool within a second). False when the server died under a call it ran: the call's
    result says so and the turn has ended with the session's ``exited``."""
    machine_use.check_call(step, session, call)  # not run for someone cut off from the machine
    turns.step_status(step.session_id, step.owner, Status.RUNNING)
    step.record(Kind.TOOL_RUNNING, {"id": call["id"]})
    cancel, done = threading.Event(), threading.Event()

    def watch_interrupt() -> None:
        # Only a row seen asking to stop cancels: this thread's connection cannot see
        # rows its caller has not committed (a test's transaction), and a deleted
        # session's tool ends at its own timeout anyway.
        try:
            while not done.wait(TOOL_INTERRUPT_POLL_EVERY):
                try:
                    row = AgentSession.objects.filter(pk=step.session_id).values_list(
                        "interrupt_requested", "lease_owner").first()
                except db_link.LOST:
                    db_link.reconnect()  # a new connection at the next look
                    continue
                if row is not None and (row[0] or row[1] != step.owner):
                    cancel.set()
                    return
        finally:
            connection.close()

    try:
        # What Corral runs or reads for the call reaches no more than a tool in the
        # machine's sandbox (docs/security.md "What a tool can reach").
        transport = containment.tool_view(session.machine)
    except TransportError:
        transport = None  # the built-ins then go to llama-server, which says what is wrong
    watcher = threading.Thread(target=watch_interrupt, name=f"tool-interrupt-{step.session_id}", daemon=True)
    watcher.start()
    try:
        result = step.run_tool(
            entry,
            call.get("input") or {},
            base_url=server.url,
            api_key=server.api_key,
            cwd=session.working_dir,
            mcp_servers=McpServer.objects.configs(),
            transport=transport,
            cancel=cancel,
        )
    finally:
        done.set()
        watcher.join(2)
    output, total = tool_results.cap(result.output, settings.CORRAL_TOOL_RESULT_MAX_CHARS)
    server_lost = (entry.origin == tools.ORIGIN_MACHINE and not result.ok
                   and watch.server_gone(step.session_id))
    if server_lost:
        output, total = SERVER_LOST_RESULT, None
    payload = {"id": call["id"], "output": output, "ok": result.ok and not server_lost}
    if total is not None:
        payload["full_chars"] = total
    step.record(Kind.TOOL_END, payload)
    if server_lost:
        watch.check_session_server(step.session_id)  # says so, status exited, ends the turn
        if AgentSession.objects.filter(pk=step.session_id, turn_active=True, lease_owner=step.owner).exists():
            step.error("llama-server is not running for this session; restart it and send again.")
            step.finish(TurnEnd.ERROR)
        return False
    return True
