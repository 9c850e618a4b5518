"""The turn loop (docs/behaviour.md §6): fold the transcript, stream a completion, run the calls.

A turn is driven by *steps*. A step claims the session's lease with a conditional
UPDATE (docs/behaviour.md C16: a second copy of the same step — a redelivered task, a recovery run —
finds the lease held and leaves), folds the transcript to learn where the turn stands,
and goes on from there: run the calls that are allowed, ask about the first one that is
not (then end: no worker waits for a person, docs/behaviour.md §8), or ask the model again. Where a
turn stands is never kept in memory, so a restarted worker picks it up from the
transcript.

The completion client, the catalogue loader and the tool runner are parameters, so tests
can script the server side of a stream while everything else stays real.

One module per part:

- :mod:`.step`: :func:`run_turn_step` and :class:`Step`, the loop of completions and calls;
- :mod:`.lease`: :class:`LeasedStep`, a step's writes and looks through its lease;
- :mod:`.request`: what one completion sends (:class:`Request`, :func:`request_for`, the
  sampling in force);
- :mod:`.completion`: one streamed completion in its phases (:class:`Completion`);
- :mod:`.fragments`: streamed text on its way to the watchers and the transcript;
- :mod:`.calls`: recording a reply's calls, the gate, running a call;
- :mod:`.folds`: the tool catalogue and the rounds of the open turn, read from the transcript.

The names below are re-exported so ``agent.X`` keeps working; new code imports from the
module that defines the name.
"""

from __future__ import annotations

from .calls import (
    CALL_ID,
    CUT_CALL_NOTICE,
    CUT_CALL_RESULT,
    CUT_CALL_WHY,
    MALFORMED_RESULT,
    REFUSED_RESULT,
    SERVER_LOST_RESULT,
    TOOL_INTERRUPT_POLL_EVERY,
    WORKER_LOST_RESULT,
    question_details,
)
from .completion import EMPTY_REPLY, INTERRUPT_POLL_EVERY, LENGTH_LIMIT, LINK_BROKEN_REPLY, PROGRESS_EVERY
from .folds import catalogue_of, rounds_in_turn
from .fragments import FRAGMENT_FLUSH_EVERY, FRAGMENT_STORE_EVERY, READ_EVERY, Fragments
from .lease import STOPPED_REPLY, ClientFactory
from .request import REPORTED_SAMPLING, SAMPLING_KEYS, Request, request_for, request_sampling, sampling_in_force
from .step import DATABASE_LOST, MAX_ROUNDS, ROUND_LIMIT_MESSAGE, WORKER_LOST_REPLY, Step, run_turn_step

__all__ = [
    "CALL_ID", "CUT_CALL_NOTICE", "CUT_CALL_RESULT", "CUT_CALL_WHY", "DATABASE_LOST", "EMPTY_REPLY",
    "FRAGMENT_FLUSH_EVERY", "FRAGMENT_STORE_EVERY", "INTERRUPT_POLL_EVERY", "LENGTH_LIMIT", "LINK_BROKEN_REPLY",
    "MALFORMED_RESULT", "MAX_ROUNDS", "PROGRESS_EVERY", "READ_EVERY", "REFUSED_RESULT", "REPORTED_SAMPLING",
    "ROUND_LIMIT_MESSAGE", "SAMPLING_KEYS", "SERVER_LOST_RESULT", "STOPPED_REPLY", "TOOL_INTERRUPT_POLL_EVERY",
    "WORKER_LOST_REPLY", "WORKER_LOST_RESULT", "ClientFactory", "Fragments", "Request", "Step", "catalogue_of",
    "question_details", "request_for", "request_sampling", "rounds_in_turn", "run_turn_step", "sampling_in_force",
]
