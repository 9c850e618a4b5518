"""The state folds (docs/behaviour.md §6, §8, §9, §10, §17): the allowances in force, the
queue, whether a turn is open and where it stands, the calls and questions still waiting,
and the latest catalogue and ``server_ready`` a session's server recorded.

Each is a pure function of the events it is given, read in ``seq`` order. This module
must not import Django.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from .reading import (
    _ANSWERED,
    _MESSAGE_DROPPED,
    _MESSAGE_QUEUED,
    _MESSAGE_TAKEN,
    _QUESTION,
    _TOOL_END,
    _TOOL_START,
    _current_turn,
    _ordered,
    _payload,
    _text,
)
from .vocabulary import ANSWER_ALLOW_ALWAYS, Actor, EventLike, Kind, actor


class Allowance(TypedDict):
    """An "always" answer in force: the ``seq`` of its ``answered`` event, the ``tool`` it
    was given for, its ``scope`` (sessions_app/allowances.py), who granted it (``by``, or
    None) and when (``at``: the event's ``created_at`` when it has one, else None)."""

    seq: int
    tool: str
    scope: dict
    by: Actor | None
    at: Any


def allowances(events: Iterable[EventLike]) -> list[Allowance]:
    """The allowances in force, in the order granted (docs/behaviour.md §8).

    Folded from every ``answered`` event with ``answer: allow_always`` and a ``scope``
    (a dict with a ``kind``), less those an ``allowance_revoked`` names by seq. An
    ``allow_always`` with no scope (written before scopes existed: it meant "the whole
    tool") grants nothing: such a tool is asked about again. A grant equal to one in
    force (same tool and scope) is not listed twice; a grant for an MCP tool replaces an
    earlier one for the same server and remote name (its definition changed since).
    Allowances are the session's: ``cleared``, a model change and a restart keep them;
    ``imported`` ends those granted before it (granted in another session, by people who
    granted nothing here).
    """
    in_force: list[Allowance] = []
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == Kind.IMPORTED:
            in_force = []
            continue
        if event.kind == Kind.ALLOWANCE_REVOKED:
            in_force = [a for a in in_force if a["seq"] != payload.get("seq")]
            continue
        if event.kind != _ANSWERED or payload.get("answer") != ANSWER_ALLOW_ALWAYS:
            continue
        scope, tool = payload.get("scope"), payload.get("tool")
        if not isinstance(scope, Mapping) or not isinstance(scope.get("kind"), str) or not isinstance(tool, str):
            continue
        scope = dict(scope)
        if scope["kind"] == "mcp":
            in_force = [a for a in in_force if not (a["scope"]["kind"] == "mcp"
                        and a["scope"].get("server") == scope.get("server")
                        and a["scope"].get("remote_name") == scope.get("remote_name"))]
        elif any(a["tool"] == tool and a["scope"] == scope for a in in_force):
            continue  # granted again while in force (two pages answering): one is enough
        in_force.append({"seq": event.seq, "tool": tool, "scope": scope, "by": actor(payload),
                         "at": getattr(event, "created_at", None)})
    return in_force


def _still_open(events: Iterable[EventLike], opens: str, closed_by: Mapping[str, str]) -> list[dict[str, Any]]:
    """Copies of the ``opens`` payloads (the first per ``id``), in order, whose id no
    later event of a ``closed_by`` kind names (in that kind's given payload key)."""
    opened: dict[str, dict[str, Any]] = {}
    closed: set[str] = set()
    for event in _ordered(events):
        payload = _payload(event)
        if event.kind == opens:
            opened.setdefault(_text(payload.get("id")), dict(payload))
        elif event.kind in closed_by and payload.get(closed_by[event.kind]) is not None:
            closed.add(_text(payload.get(closed_by[event.kind])))
    return [item for key, item in opened.items() if key not in closed]


def pending_queue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Queued messages still waiting, oldest first (docs/behaviour.md §10).

    A ``message_queued`` payload is pending until a ``message_taken`` names its id as
    ``queued_id`` or a ``message_dropped`` names its id. Returns copies of the queued
    payloads in queue order. ``cleared`` does not empty the queue; ``imported`` does (what
    was queued in another session is not sent from this one).
    """
    return _still_open(_since_import(events), _MESSAGE_QUEUED, {_MESSAGE_TAKEN: "queued_id", _MESSAGE_DROPPED: "id"})


def _since_import(events: Iterable[EventLike]) -> list[EventLike]:
    """The events after the last ``imported`` (all of them when there is none)."""
    ordered = list(_ordered(events))
    for index in range(len(ordered) - 1, -1, -1):
        if ordered[index].kind == Kind.IMPORTED:
            return ordered[index + 1:]
    return ordered


def open_turn(events: Iterable[EventLike]) -> bool:
    """True when a turn was started and has not ended (docs/behaviour.md §6, §10).

    That is: some ``message_taken`` comes after the last ``turn_end`` (or there is a
    ``message_taken`` and no ``turn_end`` at all).
    """
    return _current_turn(_ordered(events)) is not None


_MODEL_OUTPUT = frozenset({Kind.ASSISTANT_TEXT, Kind.REASONING})
_TURN_STEPS = _MODEL_OUTPUT | {Kind.MESSAGE_TAKEN, Kind.TOOL_START, Kind.TOOL_END, Kind.ANSWERED, Kind.ERROR, Kind.USAGE}


def reply_cut_off(events: Iterable[EventLike]) -> bool:
    """True when the open turn's last step is streamed output that no completion closed.

    A completion that ends normally is followed by its ``usage``, its calls or the end of
    the turn; one that fails by an ``error``. Streamed ``assistant_text`` / ``reasoning``
    as the last step of an open turn therefore means the step streaming it died (a worker
    killed, a database or Redis outage): running the completion again would answer the
    same message twice, so the turn ends with "partial, send again" instead.
    """
    turn = _current_turn(_ordered(events))
    if turn is None:
        return False
    steps = [event.kind for event in turn if event.kind in _TURN_STEPS]
    return bool(steps) and steps[-1] in _MODEL_OUTPUT


def pending_calls(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Tool calls of the open turn that have not returned yet (docs/behaviour.md §6, §7, §9).

    Copies of the ``tool_start`` payloads of the current open turn, in start order,
    whose id has no ``tool_end`` in that turn. Empty when no turn is open. The agent
    loop folds the conversation with :func:`build_messages` only once this is empty.
    """
    turn = _current_turn(_ordered(events))
    if turn is None:
        return []
    ended = {_text(_payload(ev).get("id")) for ev in turn if ev.kind == _TOOL_END}
    return [
        dict(_payload(ev))
        for ev in turn
        if ev.kind == _TOOL_START and _text(_payload(ev).get("id")) not in ended
    ]


def open_questions(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """Permission questions still waiting for an answer (docs/behaviour.md §8).

    Copies of the ``question`` payloads, in the order asked (one per call id, the first
    asked), whose id has no ``answered`` event. Not reset by ``cleared``.
    """
    return _still_open(events, _QUESTION, {_ANSWERED: "id"})


def last_catalogue(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """The tool entries of the latest ``catalogue`` event (recorded when a server became
    ready, docs/behaviour.md §9); ``[]`` when none was recorded since the last ``imported``."""
    latest: list[dict[str, Any]] = []
    for event in _ordered(events):
        if event.kind == Kind.CATALOGUE:
            latest = list(_payload(event).get("tools", []))
        elif event.kind == Kind.IMPORTED:
            latest = []  # another deployment's tools: this session's server has not said its own yet
    return latest


def last_server_ready(events: Iterable[EventLike]) -> dict[str, Any]:
    """A copy of the latest ``server_ready`` payload (what the running server reported about
    its chat template and sampling defaults, docs/behaviour.md §17); ``{}`` when none since
    the last ``imported``."""
    latest: dict[str, Any] = {}
    for event in _ordered(events):
        if event.kind == Kind.SERVER_READY:
            latest = dict(_payload(event))
        elif event.kind == Kind.IMPORTED:
            latest = {}  # another deployment's server: this session's has not said anything yet
    return latest
