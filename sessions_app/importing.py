"""Importing a JSON Lines export (:func:`sessions_app.export.to_jsonl`) as a new session of
the person importing it (docs/transcript.md, "Import").

The file is read with the export's own reader (:func:`sessions_app.export.read_export`:
every line JSON, every payload the shape of its kind), then checked event by event for
what a file made by hand could get wrong or use against Corral (:func:`check_events`):
seq numbers, the types of the values the folds and the page read, image references and
their bytes, references to earlier events. The first fault refuses the whole file,
naming its line and the reason (:class:`ImportRefused`).

What is written (:func:`import_into`), after the new session's first ``settings`` event:

- every event of the file, in order, renumbered to follow on; a ``replaces``, an
  ``allowance_revoked``'s or a ``version_chosen``'s ``seq`` renumbered with it;
- who did what kept as text only: every ``by`` (and a message's ``author``) becomes the
  plain name it held, never a user id of this deployment (another deployment's user 3 is
  not this one's);
- whatever the file left open closed as Corral: a call without a result gets one saying
  it was not run here, an open question is refused, an open turn ends ``interrupted``;
- the ``imported`` event (who imported, how many events, the file's first seq): queued
  messages and "always" allowances before it are not in force here (transcript folds).

Images the messages carry are re-attached from the file's image lines, each checked as an
upload is (:func:`sessions_app.images.check_image`) and stored under its SHA-256. A
reference whose bytes the file does not carry is left out of its message (a notice says
how many): a bare SHA-256 must never hand its importer an image of this deployment that
they never had (docs/security.md, "Who can see an image").
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints, is_typeddict

from django.db import transaction

from . import actions, images, rules, transcript
from .events import append, locked
from .export import read_export
from .models import AgentSession
from .transcript import ANSWER_REFUSE, Event, InvalidEvent, Kind, TurnEnd

__all__ = ["MAX_IMPORT_BYTES", "MAX_IMPORT_EVENTS", "ImportRefused", "check_events", "do_import", "import_into", "read_file"]

#: The largest file taken, in bytes (the images' base64 included).
MAX_IMPORT_BYTES = 64_000_000
#: The most events one file may hold.
MAX_IMPORT_EVENTS = 50_000

#: The result of a call the file left without one.
NOT_RUN_HERE = "This call was not run: the session was imported from an export before it had a result."
#: Why an open question of the file was closed.
CLOSED_ON_IMPORT = "closed when the session was imported"
#: Said when messages of the file name images whose bytes it does not carry.
IMAGES_LEFT_OUT = ("{count} image reference(s) of the file came without the image itself (its file was gone when "
                   "it was exported); they were left out of the messages.")
#: Said when a file's open turn is closed on import.
TURN_CLOSED = "The imported session's last turn had not ended; it was closed on import."

_CALL_ID = re.compile(r"[A-Za-z0-9_.-]{1,80}")


class ImportRefused(Exception):
    """The file cannot be imported; the message names the line and the reason, in words."""


def read_file(data: bytes) -> tuple[list[Event], dict[str, tuple[str, bytes]]]:
    """The events and images of an uploaded export, checked (:func:`check_events`).
    Raises :class:`ImportRefused`."""
    if len(data) > MAX_IMPORT_BYTES:
        raise ImportRefused(f"The file is {len(data):,} bytes; an export to import can be at most "
                            f"{MAX_IMPORT_BYTES:,}.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ImportRefused(f"Line {line}: the file is not UTF-8 text, so it is not a Corral export.") from None
    try:
        events, stored, lines = read_export(text)
    except InvalidEvent as exc:
        raise ImportRefused(_sentence(str(exc))) from None
    if not events:
        raise ImportRefused("The file holds no events: it is not a Corral export, or it is empty.")
    if len(events) > MAX_IMPORT_EVENTS:
        raise ImportRefused(f"The file holds {len(events):,} events; at most {MAX_IMPORT_EVENTS:,} can be imported.")
    check_events(events, lines)
    return events, stored


def _sentence(message: str) -> str:
    """``line 3: …`` from the reader as a sentence: ``Line 3: ….``"""
    message = message[:1].upper() + message[1:]
    return message if message.endswith(".") else message + "."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any, *, empty: bool = True) -> bool:
    return isinstance(value, str) and (empty or bool(value))


def _check_actor(value: Any) -> str | None:
    if value is None or _is_text(value):
        return None
    if isinstance(value, Mapping) and _is_text(value.get("username")):
        return None
    return "who did it (by) must be a name or {id, username}"


#: The deepest nesting a payload may have (``storable`` and the folds recurse into it).
MAX_DEPTH = 32
#: The largest whole number a payload may carry: exact in a double (JavaScript, jsonb
#: arithmetic) and far from overflowing a sum of them in a 64-bit column (/metrics).
MAX_INT = 2**53
#: Characters a person cannot send in a message (C0 and C1 controls but tab and new lines).
_MESSAGE_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (a scalar is 0), without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` (read from JSON) has the type ``hint`` of a payload key (the
    TypedDicts of sessions_app/transcript/payloads.py): str, int (within ±MAX_INT), float
    (finite), bool, dict, list[X], X | None, a TypedDict (an object; ``Actor``: a name or
    {id, username}), Any."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, UnionType):
        return any(_conforms(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is transcript.Actor:
        return _check_actor(value) is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and -MAX_INT <= value <= MAX_INT
    if hint is float:
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value) and abs(value) <= MAX_INT)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict or is_typeddict(hint):
        return isinstance(value, Mapping)
    if hint is list or origin is list:
        return isinstance(value, list) and (not args or all(_conforms(item, args[0]) for item in value))
    return True  # a type the payloads do not use: the key checks above still hold


def _check_shape(kind: str, payload: Mapping[str, Any]) -> str | None:
    """Every key of ``payload`` against the type its kind's payload declares."""
    if _depth(payload) > MAX_DEPTH:
        return f"{kind}'s payload nests deeper than {MAX_DEPTH} levels"
    hints = _hints(kind)
    for key, value in payload.items():
        if key in hints and not _conforms(value, hints[key]):
            return f"{kind}'s {key} is not of the type Corral writes there"
    if kind == Kind.QUESTION:
        for offer in payload.get("offers") or []:
            if not isinstance(offer.get("scope"), Mapping):
                return "question's offers must each carry a scope object"
    if kind in (Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED):
        text = payload.get("text") or ""
        if len(text) > rules.MAX_MESSAGE_CHARS:
            return f"a message of {len(text):,} characters is longer than a person may send"
        if _MESSAGE_CONTROLS.search(text):
            return "a message holds a control character a person cannot send"
    return None


@functools.cache
def _hints(kind: str) -> dict[str, Any]:
    return get_type_hints(transcript.PAYLOADS[Kind(kind)])


def _check_images(payload: Mapping[str, Any]) -> str | None:
    items = payload.get("images")
    if items is None:
        return None
    if not isinstance(items, list):
        return "images must be a list"
    for item in items:
        if not isinstance(item, Mapping) or len(transcript.image_refs({"images": [item]})) != 1:
            return "an image reference needs sha256 (64 hex digits), media_type and size"
        if item.get("media_type") not in images.EXTENSIONS:
            return f"an image's media_type must be one of {', '.join(sorted(images.EXTENSIONS))}"
    return None


#: For each kind, the keys whose values a fold, a request or the page reads, and the type
#: each must have: text (str), int, bool, list, dict, or text-or-none.
_TYPES: dict[str, dict[str, str]] = {
    Kind.MESSAGE_TAKEN: {"text": "str", "queued_id": "str?", "replaces": "int?", "edited": "bool?"},
    Kind.MESSAGE_QUEUED: {"id": "str", "text": "str"},
    Kind.MESSAGE_DROPPED: {"id": "str"},
    Kind.ASSISTANT_TEXT: {"text": "str"},
    Kind.REASONING: {"text": "str"},
    Kind.TOOL_START: {"id": "call", "tool": "str", "arguments": "str?", "raw_arguments": "str?", "input": "dict?"},
    Kind.TOOL_RUNNING: {"id": "str"},
    Kind.TOOL_END: {"id": "str", "output": "str", "ok": "bool?", "full_chars": "int?"},
    Kind.QUESTION: {"id": "str", "tool": "str?"},
    Kind.ANSWERED: {"id": "str", "tool": "str?", "answer": "str", "scope": "dict?"},
    Kind.ALLOWANCE_REVOKED: {"seq": "int", "tool": "str", "scope": "dict"},
    Kind.ERROR: {"message": "str", "log": "str?", "context_exceeded": "bool?"},
    Kind.SETTINGS: {"model_key": "str", "model": "str", "permission_mode": "str", "sampling": "dict",
                    "server_params": "dict", "system_prompt": "str", "title": "str", "takes_images": "bool",
                    "visibility": "str", "reason": "str?"},
    Kind.SERVER_READY: {"model_key": "str", "model": "str", "chat_template": "str", "jinja": "bool",
                        "chat_template_caps": "dict", "sampling_defaults": "dict", "n_ctx": "int",
                        "warm_tokens": "int", "opens_thinking": "bool"},
    Kind.USAGE: {"prompt_tokens": "int?", "completion_tokens": "int?", "cached_tokens": "int?", "prompt_n": "int?",
                 "cache_n": "int?", "predicted_n": "int?", "predicted_per_second": "num?",
                 "prompt_per_second": "num?", "prompt_ms": "num?", "predicted_ms": "num?", "seed": "int?", "finish_reason": "str?", "sampling": "dict?",
                 "sampling_from": "dict?"},
    Kind.NOTICE: {"message": "str"},
    Kind.TURN_END: {"reason": "str"},
    Kind.STATUS: {"status": "str"},
    Kind.SERVER_STOPPED: {"reason": "str"},
    Kind.CATALOGUE: {"tools": "list"},
    Kind.IMPORTED: {"events": "int", "first_seq": "int"},
    Kind.VERSION_CHOSEN: {"seq": "int"},
}

_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, Mapping),
    "call": lambda v: isinstance(v, str) and _CALL_ID.fullmatch(v) is not None,
    "num": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}
_WORDS = {"str": "text", "int": "a whole number", "num": "a number", "bool": "true or false", "list": "a list", "dict": "an object",
          "call": "a call id (letters, digits, _ . -, at most 80)"}


def check_events(events: list[Event], lines: list[int] | None = None) -> None:
    """Check the events of a file beyond their payload shapes (the export reader's checks
    come first): seq numbers one after another; each value the folds read of the type they
    read; who did what a name; image references well formed; a ``replaces`` naming an
    earlier message and an ``allowance_revoked`` an earlier ``answered``; call ids and
    question ids naming calls of the file. Raises :class:`ImportRefused` naming the line."""
    seen: dict[int, str] = {}
    calls: set[str] = set()
    for index, event in enumerate(events):
        line = lines[index] if lines and index < len(lines) else index + 1

        def refuse(reason: str, line: int = line) -> None:
            raise ImportRefused(f"Line {line}: {reason}.")

        if index and event.seq != events[index - 1].seq + 1:
            refuse(f"seq {event.seq} does not follow seq {events[index - 1].seq} (an export numbers its events "
                   "one after another)")
        if event.seq < 1:
            refuse("seq must be 1 or more")
        payload = event.payload
        for key, kind in _TYPES.get(event.kind, {}).items():
            optional = kind.endswith("?")
            kind = kind.rstrip("?")
            if key not in payload or (optional and payload[key] is None):
                continue
            if not _CHECKS[kind](payload[key]):
                refuse(f"{event.kind}'s {key} must be {_WORDS[kind]}")
        for problem in (_check_actor(payload.get("by")), _check_actor(payload.get("author")),
                        _check_images(payload) if event.kind in (Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED) else None,
                        _check_shape(event.kind, payload)):
            if problem:
                refuse(problem)
        if event.kind == Kind.MESSAGE_TAKEN and payload.get("replaces") is not None:
            if seen.get(payload["replaces"]) != Kind.MESSAGE_TAKEN:
                refuse(f"replaces names seq {payload['replaces']}, which is not an earlier message of the file")
        if event.kind == Kind.VERSION_CHOSEN and seen.get(payload["seq"]) != Kind.MESSAGE_TAKEN:
            refuse(f"the version chosen (seq {payload['seq']}) is not an earlier message of the file")
        if event.kind == Kind.ALLOWANCE_REVOKED and seen.get(payload["seq"]) != Kind.ANSWERED:
            refuse(f"the allowance revoked (seq {payload['seq']}) is not an earlier answer of the file")
        if event.kind == Kind.TOOL_START:
            calls.add(payload["id"])
        elif event.kind in (Kind.TOOL_RUNNING, Kind.TOOL_END, Kind.QUESTION, Kind.ANSWERED) and payload["id"] not in calls:
            refuse(f"{event.kind} names call {payload['id']!r}, which no earlier tool_start of the file started")
        seen[event.seq] = event.kind


def _as_text(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` with who did what kept as a plain name (never a user id of this deployment)."""
    copy = dict(payload)
    for key in ("by", "author"):
        if key in copy:
            who = transcript.actor({"by": copy[key]})
            if who is None:
                del copy[key]
            else:
                copy[key] = who["username"]
    return copy


def _closing(events: list[Event]) -> Iterable[tuple[str, dict]]:
    """The events that close what the file left open: results for calls without one,
    refusals for open questions, the end of an open turn."""
    answered = {e.payload["id"] for e in events if e.kind == Kind.ANSWERED}
    for question in transcript.open_questions(events):
        if question["id"] not in answered:
            yield Kind.ANSWERED, {"id": question["id"], "tool": question.get("tool"), "answer": ANSWER_REFUSE,
                                  "reason": CLOSED_ON_IMPORT}
    ended = {e.payload["id"] for e in events if e.kind == Kind.TOOL_END}
    for event in events:
        if event.kind == Kind.TOOL_START and event.payload["id"] not in ended:
            ended.add(event.payload["id"])
            yield Kind.TOOL_END, {"id": event.payload["id"], "output": NOT_RUN_HERE, "ok": False}
    if transcript.open_turn(events):
        yield Kind.NOTICE, {"message": TURN_CLOSED}
        yield Kind.TURN_END, {"reason": TurnEnd.INTERRUPTED}


def import_into(session: AgentSession, events: list[Event], stored: dict[str, tuple[str, bytes]],
                by: transcript.Actor) -> int:
    """Append a checked file's ``events`` to a new ``session`` locked by the caller, then
    what closes what they left open and the ``imported`` event naming ``by``; store the
    images they carry from ``stored`` (sha256 → (media type, bytes)). Returns how many
    images were attached (references the file carries no bytes for are left out). Raises :class:`ImportRefused` for an image whose bytes are not an
    image Corral takes, or are not the type its reference says."""
    attached = _store_images(events, stored)
    delta = session.last_seq + 1 - events[0].seq
    left_out = 0
    for event in events:
        payload = _as_text(event.payload)
        if event.kind in (Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED) and payload.get("images"):
            # Only images the file itself carries: a reference alone would hand its importer
            # whatever image of this deployment has that SHA-256 (docs/security.md).
            kept = [ref for ref in payload["images"] if ref["sha256"] in attached]
            left_out += len(payload["images"]) - len(kept)
            payload["images"] = kept
            if not kept:
                del payload["images"]
        if event.kind == Kind.MESSAGE_TAKEN and payload.get("replaces") is not None:
            payload["replaces"] += delta
        elif event.kind in (Kind.ALLOWANCE_REVOKED, Kind.VERSION_CHOSEN):
            payload["seq"] += delta
        append(session, event.kind, payload)
    for kind, payload in _closing(events):
        append(session, kind, payload)
    if left_out:
        append(session, Kind.NOTICE, {"message": IMAGES_LEFT_OUT.format(count=left_out)})
    append(session, Kind.IMPORTED, {"by": by, "events": len(events), "first_seq": events[0].seq})
    return len(attached)


def _store_images(events: list[Event], stored: dict[str, tuple[str, bytes]]) -> set[str]:
    wanted: dict[str, dict] = {}
    for event in events:
        if event.kind in (Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED):
            for ref in transcript.image_refs(event.payload):
                wanted.setdefault(ref["sha256"], ref)
    attached: set[str] = set()
    for sha256, ref in wanted.items():
        if sha256 not in stored:
            continue  # not in the file: the reference says the image is missing, as a deleted file does
        media_type, data = stored[sha256]
        try:
            checked = images.check_image(images.Upload(name=f"The image {sha256[:12]}", data=data))
        except images.ImageRefused as exc:
            raise ImportRefused(f"{exc} It cannot be attached again.") from None
        if checked["media_type"] != ref["media_type"] or media_type != ref["media_type"]:
            raise ImportRefused(f"The image {sha256[:12]} is {checked['media_type']}, not the {ref['media_type']} "
                                "its message says.")
        images.store(images.Upload(name=sha256, data=data), checked)
        attached.add(sha256)
    return attached


def do_import(owner, data: bytes, **create: Any) -> AgentSession:
    """Create a session for ``owner`` (``create``: the arguments of
    :func:`sessions_app.actions.do_create_session`, whose checks all apply) holding the
    export ``data``, in one transaction: its server starts only once the imported events
    are stored. Raises :class:`ImportRefused` (nothing created) or
    :class:`sessions_app.actions.SessionError`."""
    events, stored = read_file(data)
    if not create.get("title"):
        titles = [e.payload["title"] for e in events if e.kind == Kind.SETTINGS and isinstance(e.payload.get("title"), str)]
        try:
            create["title"] = rules.check_title(titles[-1]) if titles and titles[-1].strip() else ""
        except actions.SessionError:
            create["title"] = ""
    with transaction.atomic():
        session = actions.do_create_session(owner, **create)
        import_into(locked(session.pk), events, stored, actions.by(owner))
    return session
