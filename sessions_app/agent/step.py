"""A step of a turn (docs/behaviour.md §6): claim the lease, fold the transcript, and go on
from where the turn stands — run the calls, or ask the model again — until a person is
needed or the turn ends (:func:`run_turn_step`, :class:`Step`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx

from machines_app.llama_server import Endpoint

from .. import db_link, machine_use, tools, transcript, turns
from ..completions.client import CompletionClient
from ..completions.errors import CompletionError
from ..events import load_events
from ..models import AgentSession
from ..servers import records
from ..transcript import TurnEnd
from .calls import record_calls, run_calls
from .completion import Completion
from .folds import rounds_in_turn
from .lease import ClientFactory, LeasedStep
from .request import request_for

Status = AgentSession.Status
log = logging.getLogger(__name__)

MAX_ROUNDS = 32  # docs/behaviour.md §6.5
ROUND_LIMIT_MESSAGE = (
    f"Stopped after {MAX_ROUNDS} tool calls in one turn; send another message to carry on, "
    "or ask for something narrower."
)
WORKER_LOST_REPLY = (
    "The worker running this turn stopped while the model was replying; the reply above is partial. "
    "Send another message to carry on."
)
#: The error of a turn whose step lost its database connection (sessions_app/db_link.py).
DATABASE_LOST = (
    "The turn stopped: Corral lost its connection to the database while working on it. What is shown "
    "above was kept; send another message to carry on."
)


class Step(LeasedStep):
    """One claimed step of one session's turn (see :class:`LeasedStep`): the loop of
    completions and calls (:meth:`run`)."""

    def run(self, resumed_after_loss: bool) -> None:
        session = AgentSession.objects.select_related("machine").get(pk=self.session_id)
        if session.status == Status.LOADING:
            return  # docs/behaviour.md §4: the message waits; start_server enqueues the step once ready
        events = load_events(self.session_id)
        if not transcript.open_turn(events) or session.interrupt_requested:
            self.finish(self.stop_reason() if session.interrupt_requested else TurnEnd.DONE)
            return
        if (resumed_after_loss or transcript.reply_cut_off(events)) and not transcript.pending_calls(events):
            # A step died mid-reply (its worker killed, or Redis or the database failing
            # under it): never answer the same message twice from half a stream.
            self.error(WORKER_LOST_REPLY)
            self.finish(TurnEnd.INTERRUPTED)
            return
        machine_use.check_turn(self, session)  # its author may no longer use the machine: ends here
        server = records.server_endpoint(session) if session.status not in Status.server_down() else None
        if server is None or session.status == Status.UNKNOWN:
            self.error(
                "llama-server is not running for this session; restart it and send again."
            )
            self.finish(TurnEnd.ERROR)
            return
        read = events  # the first round folds the transcript read above: nothing was written since
        while True:
            events = read if read is not None else load_events(self.session_id)  # later rounds read it again
            read = None
            if transcript.pending_calls(events):
                if not run_calls(self, session, events, server):
                    return  # waiting for a person, or interrupted
                continue
            if rounds_in_turn(events) >= MAX_ROUNDS:
                self.error(ROUND_LIMIT_MESSAGE)
                self.finish(TurnEnd.LIMIT)
                return
            outcome = self.complete(session, events, server)
            if outcome is not None:
                self.finish(outcome)
                return

    def complete(self, session: AgentSession, events, server: Endpoint) -> TurnEnd | None:
        """Stream one completion into the transcript. Returns None when the reply asked
        for tools (their tool_start events are recorded), else why the turn ends:
        ``TurnEnd.DONE``, ``ERROR`` or ``INTERRUPTED``."""
        turns.step_status(self.session_id, self.owner, Status.RUNNING)
        request = request_for(session, events)
        self.say_missing_images(events, request.missing)
        reply = Completion(self, request)
        reply.send(server)
        try:
            reply.read()
        except CompletionError as exc:
            reply.pending.flush()  # what was seen stays (docs/behaviour.md §6: an interrupted reply is kept)
            if not reply.interrupted.is_set():
                return reply.failed(exc)
        except (httpx.HTTPError, RuntimeError):
            if not reply.interrupted.is_set():
                raise
        finally:
            reply.close()
        reply.record_usage()
        if reply.interrupted.is_set():
            return self.cut_by_stop(reply.produced) if self.server_stop_asked() else TurnEnd.INTERRUPTED
        calls = reply.assembler.calls()
        reply.say_how_it_ended(calls)
        if not calls:
            return TurnEnd.DONE
        return record_calls(self, session, events, request, calls, reply.finish_reason)


def run_turn_step(
    session_id: int,
    *,
    client_factory: ClientFactory = CompletionClient,
    run_tool: Callable[..., tools.ToolResult] | None = None,
    worker: str | None = None,
) -> None:
    """Advance the session's open turn as far as it can go without a person (docs/behaviour.md §6, §8).

    ``worker``: the nodename of the Celery worker running the step, recorded in the lease
    so a step whose worker died is taken over without waiting for the lease to lapse.

    Returns without doing anything when another step holds the lease, when no turn is
    open, or while the model is still loading (the server's readiness re-enqueues the
    step). Every failure ends the turn with an error event in the user's terms.
    """
    owner = turns.step_owner(worker)
    previous = turns.claim_step(session_id, owner)
    if previous is None:
        return
    step = Step(session_id, owner, client_factory, run_tool or tools.run_tool)
    try:
        with turns.LeaseKeeper(session_id, owner):
            step.run(resumed_after_loss=bool(previous))
    except machine_use.TurnCutOff:
        pass  # recorded and finished by machine_use (docs/access.md)
    except turns.LeaseLost:
        # Taken over (see turns.LeaseLost): the step that holds the lease now owns the turn.
        log.warning("session %s: this step lost its lease and stopped", session_id)
    except Exception as exc:  # the turn must end, whatever broke
        if db_link.lost(exc):
            # The connection died under the step (sessions_app/db_link.py): what follows
            # needs a new one, or it fails the same way and the page stays ``running``.
            log.warning("session %s: the database connection was lost during the step: %s", session_id, exc)
            db_link.reconnect()
            message = DATABASE_LOST
        else:
            log.exception("turn step failed for session %s", session_id)
            message = f"The turn stopped because of an internal error ({type(exc).__name__}); the log has details."

        def end() -> None:
            if not AgentSession.objects.filter(pk=session_id).exists():
                log.info("session %s was deleted while its turn ran", session_id)
                return
            step.error(message)
            step.finish(TurnEnd.ERROR)

        try:
            db_link.retrying(end)
        except turns.LeaseLost:
            pass
        except db_link.LOST as again:
            log.warning("session %s: the turn could not be ended (database unreachable: %s); recovery will", session_id,
                        again)
    finally:
        try:
            db_link.retrying(lambda: turns.release_lease(session_id, owner))
        except db_link.LOST as exc:
            log.warning("session %s: the lease could not be released (%s); it lapses", session_id, exc)
