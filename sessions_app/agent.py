"""The turn loop (SPEC §6): fold the transcript, stream a completion, record what comes.

A turn step is claimed with a conditional UPDATE on the session row (a lease), so a
second copy of the same step — a redelivered task, a recovery run — finds the lease held
and leaves (case C16). Nothing here waits for a person: a step that needs an answer
records the question and ends; the answer enqueues the next step (SPEC §8).

The completion client is a parameter, so tests can script the server side of a stream
(a malformed stream, a context overflow) while the rest stays real.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from . import actions, lifecycle, transcript
from .completions import (
    CompletionClient,
    CompletionError,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallAssembler,
    ToolCallFragment,
    Usage,
)
from .models import AgentSession

Status = AgentSession.Status
log = logging.getLogger(__name__)

LEASE_TTL = timedelta(seconds=90)
LEASE_RENEW_EVERY = 20.0  # seconds
INTERRUPT_POLL_EVERY = 0.2  # seconds: an interrupt stops the stream within about a second
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed")

ClientFactory = Callable[[str], CompletionClient]


def claim_step(session_id: int, owner: str) -> bool:
    """Take the session's turn lease if nobody holds a live one; True when taken."""
    now = timezone.now()
    return (
        AgentSession.objects.filter(pk=session_id, turn_active=True)
        .filter(Q(lease_expires__isnull=True) | Q(lease_expires__lt=now))
        .update(lease_owner=owner, lease_expires=now + LEASE_TTL)
        == 1
    )


def renew_lease(session_id: int, owner: str) -> bool:
    return (
        AgentSession.objects.filter(pk=session_id, lease_owner=owner).update(
            lease_expires=timezone.now() + LEASE_TTL
        )
        == 1
    )


def release_lease(session_id: int, owner: str) -> None:
    AgentSession.objects.filter(pk=session_id, lease_owner=owner).update(lease_owner="", lease_expires=None)


def request_sampling(sampling: dict) -> tuple[dict, int]:
    """The sampling parameters for one request and the seed it uses (SPEC §14: a session
    without a fixed seed draws one per request, recorded with the usage)."""
    params = {k: sampling[k] for k in SAMPLING_KEYS if sampling.get(k) not in (None, "")}
    if "seed" not in params:
        params["seed"] = secrets.randbelow(2**31)
    return params, int(params["seed"])


def run_turn_step(session_id: int, *, client_factory: ClientFactory = CompletionClient) -> None:
    """Advance the session's open turn by one completion (SPEC §6).

    Returns without doing anything when another step holds the lease, when no turn is
    open, or while the model is still loading (the server's readiness re-enqueues the
    step). Every failure ends the turn with an error event in the user's terms.
    """
    owner = uuid.uuid4().hex
    if not claim_step(session_id, owner):
        return
    try:
        _step(session_id, owner, client_factory)
    except Exception as exc:  # the turn must end, whatever broke
        log.exception("turn step failed for session %s", session_id)
        actions.record_error(session_id, f"The turn failed: {exc}")
        actions.finish_turn(session_id, "error")
    finally:
        release_lease(session_id, owner)


def _step(session_id: int, owner: str, client_factory: ClientFactory) -> None:
    session = AgentSession.objects.select_related("machine").get(pk=session_id)
    if session.status == Status.LOADING:
        return  # SPEC §4: the message waits; start_server enqueues the step once ready
    events = actions.load_events(session_id)
    if not transcript.open_turn(events) or session.interrupt_requested:
        actions.finish_turn(session_id, "interrupted" if session.interrupt_requested else "done")
        return
    base_url = lifecycle.server_base_url(session) if session.status != Status.EXITED else None
    if base_url is None or session.status == Status.UNKNOWN:
        actions.record_error(session_id, "llama-server is not running for this session; restart it and send again.")
        actions.finish_turn(session_id, "error")
        return

    actions.set_status(session_id, Status.RUNNING)
    messages = transcript.build_messages(events)
    sampling, seed = request_sampling(session.sampling)
    assembler = ToolCallAssembler()
    usage: Usage | None = None
    finish_reason = None
    stream = client_factory(base_url).stream(messages, tools=None, sampling=sampling)
    last_poll = last_renew = time.monotonic()
    interrupted = False
    try:
        for delta in stream:
            if isinstance(delta, TextDelta):
                if delta.text:
                    actions.record_event(session_id, "assistant_text", {"text": delta.text})
            elif isinstance(delta, ReasoningDelta):
                if delta.text:
                    actions.record_event(session_id, "reasoning", {"text": delta.text})
            elif isinstance(delta, ToolCallFragment):
                assembler.feed(delta.fragments)
            elif isinstance(delta, Usage):
                usage = delta
            elif isinstance(delta, Finish):
                finish_reason = delta.reason or finish_reason
            now = time.monotonic()
            if now - last_poll >= INTERRUPT_POLL_EVERY:
                last_poll = now
                if AgentSession.objects.filter(pk=session_id, interrupt_requested=True).exists():
                    interrupted = True
                    break
            if now - last_renew >= LEASE_RENEW_EVERY:
                last_renew = now
                renew_lease(session_id, owner)
    except CompletionError as exc:
        actions.record_error(session_id, str(exc))
        actions.finish_turn(session_id, "error")
        return
    finally:
        stream.close()  # closes the HTTP response: llama-server stops generating

    if usage is not None or finish_reason is not None:
        payload = usage.as_payload() if usage is not None else {}
        payload.update({"seed": seed, "finish_reason": finish_reason})
        actions.record_event(session_id, "usage", payload)
    if interrupted:
        actions.finish_turn(session_id, "interrupted")
        return
    # Tool calls are assembled here; running them (SPEC §6.5, §8, §9) plugs in at this point.
    actions.finish_turn(session_id, "done")
