"""What the turn loop reads from a session's transcript besides the messages: the tool
catalogue in force and how many rounds of calls the open turn has had (docs/behaviour.md
§6.5, §9).
"""

from __future__ import annotations

from .. import tools, transcript
from ..transcript import Kind


def catalogue_of(events) -> tools.Catalogue:
    """The tool catalogue recorded when the server became ready (the last one wins)."""
    return tools.Catalogue.from_payload(transcript.last_catalogue(events))


def rounds_in_turn(events) -> int:
    """How many times the model asked for tools in the open turn (batches of tool_start)."""
    rounds, in_batch, counting = 0, False, False
    for event in events:
        if event.kind == Kind.TURN_END:
            rounds, counting = 0, False
        elif event.kind == Kind.MESSAGE_TAKEN and not counting:
            rounds, counting = 0, True
        if event.kind == Kind.TOOL_START:
            if not in_batch:
                rounds += 1
            in_batch = True
        elif event.kind in (Kind.TOOL_END, Kind.ASSISTANT_TEXT, Kind.MESSAGE_TAKEN, Kind.TURN_END):
            in_batch = False
    return rounds
