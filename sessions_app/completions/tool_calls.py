"""Streamed ``tool_calls`` fragments joined into :class:`ToolCall` values
(:class:`ToolCallAssembler`; docs/behaviour.md §9, C01, C02, C04), and the one reading of a
call's arguments text (:func:`parse_arguments`). Plain data; no Django import.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import callcard
from .deltas import as_int

__all__ = ["ToolCall", "ToolCallAssembler", "arguments_problem", "parse_arguments"]

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One assembled tool call (docs/behaviour.md §9).

    ``arguments`` is the JSON text sent back to the model in the assistant message's
    ``tool_calls``: the received text byte for byte when it is a JSON object, ``"{}"``
    otherwise (empty — C04 — or malformed, e.g. truncated ``{"q"``). Malformed text is
    not sent back because llama-server parses the arguments of earlier calls for chat
    templates that take them as objects and refuses the whole request when they are not
    JSON ("Failed to parse tool call arguments as JSON"), which would break every later
    turn of the session. ``raw_arguments`` keeps the text as received when it differs from
    ``arguments`` (``None`` otherwise), for the transcript and the user.

    ``arguments_error`` is why non-empty arguments are not one JSON object (the parser's
    words, e.g. ``"Expecting ':' delimiter: line 1 column 5 (char 4)"`` or ``"duplicate key
    'command'"``), ``None`` when they are one or are empty. Such a call is never run
    (docs/behaviour.md §9, C04): the model is told the error instead.
    """

    id: str
    name: str
    arguments: str
    raw_arguments: str | None = None
    arguments_error: str | None = None

    def parsed_arguments(self) -> dict[str, Any]:
        """``arguments`` as a dict: the one parsed object the card, the exports and the tool
        all read; ``{}`` when they are empty or malformed (a malformed call is not run)."""
        decoded, _ = parse_arguments(self.arguments)
        return decoded if decoded is not None else {}


def parse_arguments(text: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """A call's arguments text → ``(object, None)``, or ``(None, why)`` when it is not one
    JSON object llama-server's parser accepts, or names a key twice (the rules are
    :func:`sessions_app.callcard.parse_arguments`'s, the one parser of arguments);
    ``({}, None)`` for empty or white-space text (C04: a call with no arguments runs with
    ``{}``)."""
    parsed = callcard.parse_arguments(text or "")
    return (None, parsed.error) if parsed.error is not None else (parsed.input, None)


def arguments_problem(raw_arguments: str | None) -> str | None:
    """Why a stored call's received arguments (``tool_start``'s ``raw_arguments``) may not
    run, or None. Transcripts recorded before calls were refused for this carry no
    ``arguments_error``; this reads theirs from the text (docs/behaviour.md §9)."""
    return parse_arguments(raw_arguments)[1]


def _new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class _PartialCall:
    index: int | None
    id: str | None = None
    name: str | None = None
    pieces: list[str] = field(default_factory=list)


class ToolCallAssembler:
    """Joins streamed ``tool_calls`` fragments into calls (docs/behaviour.md §9; docs/behaviour.md C01, C02, C04).

    Rules, per fragment ``{"index"?, "id"?, "function": {"name"?, "arguments"?}}``:

    - a non-empty ``id`` already seen names that call, whatever its ``index`` (C02: a
      repeated id is the same call, not a new one);
    - otherwise ``index`` names the call; a fragment at a known index that brings a new,
      different id starts a new call there (servers that number every call 0);
    - without ``index`` a fragment extends the newest call, unless it carries a new
      non-empty id, which starts a new call (C01); an id-less fragment with an index no
      call has yet continues the newest call when that one began without an index;
    - a fragment with no known id that names a function other than the one of the call it
      would extend starts a new call instead (docs/behaviour.md C01: two unnumbered, id-less calls
      each with its own name are two calls, never one whose arguments run together);
    - ``id`` and ``function.name`` are taken from the first fragment that has them;
      ``function.arguments`` pieces are concatenated in arrival order (a non-string value
      is serialised as JSON).

    :meth:`calls` lists calls in the order their first fragment arrived; a call whose name
    never arrived is dropped; a call with a name but no id gets ``"call_"`` + 24 random
    letters and digits, fixed for the assembler's lifetime.
    """

    def __init__(self) -> None:
        self._calls: list[_PartialCall] = []
        self._by_index: dict[int, _PartialCall] = {}
        self._by_id: dict[str, _PartialCall] = {}

    def feed(self, fragments: Iterable[Mapping[str, Any]]) -> None:
        """Take the ``tool_calls`` entries of one chunk (a :class:`ToolCallFragment`)."""
        for fragment in fragments:
            if isinstance(fragment, Mapping):
                self._feed_one(fragment)

    def _feed_one(self, fragment: Mapping[str, Any]) -> None:
        index = as_int(fragment.get("index"))
        call_id = fragment.get("id") if isinstance(fragment.get("id"), str) and fragment.get("id") else None
        function = fragment.get("function")
        function = function if isinstance(function, Mapping) else {}

        name = function.get("name")
        name = name if isinstance(name, str) and name else None
        call = self._find(index, call_id)
        if call_id is None and name is not None and call.name is not None and name != call.name:
            # Another function named where this call would go on: a call of its own.
            call = self._start(index)
        if call_id is not None and call.id is None:
            call.id = call_id
            self._by_id[call_id] = call
        if call.name is None and name is not None:
            call.name = name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            call.pieces.append(arguments)
        elif arguments is not None:
            call.pieces.append(json.dumps(arguments, ensure_ascii=False))

    def _find(self, index: int | None, call_id: str | None) -> _PartialCall:
        if call_id is not None and call_id in self._by_id:
            return self._by_id[call_id]
        if index is not None:
            known = self._by_index.get(index)
            if known is not None and (call_id is None or known.id in (None, call_id)):
                return known
            newest = self._calls[-1] if self._calls else None
            if known is None and call_id is None and newest is not None and newest.index is None:
                # C01 mixed: the call began without an index and its pieces now carry one.
                newest.index = index
                self._by_index[index] = newest
                return newest
            return self._start(index)
        # C01: no index; a new id starts a new call (an id already seen was handled above).
        if self._calls and call_id is None:
            return self._calls[-1]
        return self._start(None)

    def _start(self, index: int | None) -> _PartialCall:
        call = _PartialCall(index=index)
        self._calls.append(call)
        if index is not None:
            self._by_index[index] = call
        return call

    def calls(self) -> list[ToolCall]:
        """The assembled calls, in the order their first fragment arrived."""
        result = []
        for call in self._calls:
            if call.name is None:
                continue
            if call.id is None:
                call.id = _new_call_id()
                self._by_id[call.id] = call
            received = "".join(call.pieces)
            decoded, error = parse_arguments(received)
            arguments = received if decoded is not None and received.strip() else "{}"
            raw = received if received != arguments else None
            result.append(ToolCall(id=call.id, name=call.name, arguments=arguments, raw_arguments=raw,
                                   arguments_error=error))
        return result
