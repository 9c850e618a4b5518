"""A session's transcript as a file to download (docs/behaviour.md §18).

Two shapes, both pure functions of the stored events (no ORM here):

- :func:`to_jsonl` — JSON Lines, one stored event a line, in the event vocabulary of
  docs/transcript.md: ``{"seq": int, "kind": str, "payload": {...}, "created_at": ISO 8601
  or null}``. :func:`read_jsonl` reads such a file back into :class:`~.transcript.Event`
  objects, checking every payload against its kind, so an export is a faithful copy that
  the folds can read again.
- :func:`to_markdown` — what a person reads: who said what, the model's replies, its
  reasoning folded away in a ``<details>``, each tool call as its card (:mod:`.callcard`:
  the same flags and sections as the page, nothing folded) and its output,
  errors and notices; status and usage bookkeeping is left out but for each reply's usage
  line. Images in a user message are linked, never inlined.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from markdown_it import MarkdownIt

from . import callcard
from .allowances import label as allowance_label
from .transcript import Event, EventLike, ImageRef, InvalidEvent, Kind, actor, check_payload, image_refs

__all__ = ["read_export", "read_jsonl", "to_jsonl", "to_markdown"]


def _created_at(event: EventLike) -> str | None:
    when = getattr(event, "created_at", None)
    return when.isoformat() if isinstance(when, datetime) else None


#: Characters JSON leaves raw but that many line readers (Python's ``str.splitlines``,
#: editors) take for a line break: written as ``\\u`` escapes, so one event stays one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


#: ``image_data(ref)`` → the stored bytes of an image reference, or None when they are gone.
ImageData = Callable[[ImageRef], "bytes | None"]


def to_jsonl(events: Iterable[EventLike], *, image_data: ImageData | None = None) -> Iterator[str]:
    """One line per event (with its ``\\n``), in the order given (callers pass seq order).
    Non-ASCII text is written as is (UTF-8) but for the Unicode line breaks U+0085, U+2028
    and U+2029, which are escaped; keys keep the stored payload's order.

    With ``image_data``, the bytes of every image the messages carry follow the events,
    one line each: ``{"image": {"sha256", "media_type", "size", "data": base64}}`` (an
    image whose file is gone is left out), so an import can attach them again
    (:func:`read_export`)."""
    refs: dict[str, ImageRef] = {}
    for event in events:
        line = {"seq": event.seq, "kind": event.kind, "payload": event.payload, "created_at": _created_at(event)}
        yield json.dumps(line, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"
        if image_data is not None and event.kind in (Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED):
            for ref in image_refs(event.payload):
                refs.setdefault(ref["sha256"], ref)
    for ref in refs.values():
        data = image_data(ref) if image_data is not None else None
        if data is not None:
            image = {"sha256": ref["sha256"], "media_type": ref["media_type"], "size": len(data),
                     "data": base64.b64encode(data).decode("ascii")}
            yield json.dumps({"image": image}) + "\n"


def read_jsonl(text: str) -> list[Event]:
    """The events of a :func:`to_jsonl` file (its image lines are skipped: see
    :func:`read_export`). Raises :class:`InvalidEvent` naming the line for a line that is
    not JSON, lacks ``seq``/``kind``/``payload``, or whose payload does not fit its kind."""
    return read_export(text)[0]


#: The sha256 of an image, as its file is named: 64 lowercase hex digits.
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _no_constant(name: str) -> None:
    """``NaN``, ``Infinity``: Python's JSON reader takes them, JSON does not (nor
    PostgreSQL's jsonb)."""
    raise ValueError(f"{name} is not a JSON value")


def read_export(text: str) -> tuple[list[Event], dict[str, tuple[str, bytes]], list[int]]:
    """The events and the image bytes of a :func:`to_jsonl` file: ``(events, {sha256:
    (media_type, bytes)}, lines)``, ``lines`` the line number of each event. Raises :class:`InvalidEvent` naming the line for a line that
    is neither an exported event (see :func:`read_jsonl`) nor an image line whose data is
    base64 whose SHA-256 is the one it names."""
    events = []
    lines = []
    images: dict[str, tuple[str, bytes]] = {}
    # JSON Lines ends a line with "\n" (or "\r\n") only: a U+2028 inside a string is text.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line, parse_constant=_no_constant)
            if isinstance(entry, dict) and "image" in entry and "kind" not in entry:
                sha256, media_type, data = _image_line(entry["image"])
                images[sha256] = (media_type, data)
                continue
            seq, kind, payload = entry["seq"], entry["kind"], entry["payload"]
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidEvent(f"line {number}: not an exported event ({exc})") from None
        except RecursionError:
            raise InvalidEvent(f"line {number}: nested too deeply to be an exported event") from None
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(payload, dict):
            raise InvalidEvent(f"line {number}: seq must be a number and payload an object")
        try:
            check_payload(kind, payload)
        except InvalidEvent as exc:
            raise InvalidEvent(f"line {number}: {exc}") from None
        events.append(Event(seq=seq, kind=kind, payload=payload))
        lines.append(number)
    return events, images, lines


def _image_line(image: Any) -> tuple[str, str, bytes]:
    """``(sha256, media_type, bytes)`` of an image line's object; ValueError when it is
    not one, or its bytes do not hash to the name it gives them."""
    if not isinstance(image, dict) or not isinstance(image.get("data"), str):
        raise ValueError("an image line needs sha256, media_type and data")
    sha256, media_type = image.get("sha256"), image.get("media_type")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256) or not isinstance(media_type, str):
        raise ValueError("an image line needs sha256 (64 hex digits) and media_type")
    data = base64.b64decode(image["data"], validate=True)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"the image data does not hash to {sha256}")
    return sha256, media_type, data


def _fence(text: str, info: str = "") -> str:
    """``text`` in a code fence longer than any run of backticks inside it (CommonMark),
    so a tool's output can never close its own block."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


#: Characters that start or shape Markdown inside a line (CommonMark, plus GFM's tables
#: and strike-through, since the file is most often read on a forge): escaped in plain text.
_INLINE = re.compile(r"([\\`*_\[\]<>&|~])")
#: What makes a line a heading, a quote, a list item or a setext underline at its start.
_LINE_START = re.compile(r"^(\s*)([#>+\-=]|\d+(?=[.)]))")


def _plain_line(text: str) -> str:
    """One line of plain text that renders as itself: every construct escaped."""
    text = _INLINE.sub(r"\\\1", text)
    match = _LINE_START.match(text)
    if match and match.group(2)[0].isdigit():  # "1." / "1)": escape the delimiter after the digits
        end = match.end()
        return f"{text[:end]}\\{text[end:]}"
    return _LINE_START.sub(r"\1\\\2", text, count=1)


def _plain(text: Any) -> str:
    """``text`` (a title, a name, a model's ``general.name``) as plain text on one line:
    line breaks become spaces, so it can never end the paragraph or heading it sits in,
    and Markdown in it is shown, not followed."""
    return _plain_line(re.sub(r"\s*[\r\n]+\s*", " ", str(text)).strip())


def _quoted(label: str, text: Any) -> str:
    """A ``> **label:** text`` block quote for an error or a notice; each line of ``text``
    stays inside the quote (a blank line or a ``#`` cannot end it) and is plain text."""
    lines = [_plain_line(line.rstrip()) for line in str(text).splitlines()] or [""]
    body = "  \n> ".join(line if line else "\u00a0" for line in lines)  # hard breaks, one paragraph
    return f"> **{label}:** {body}"


def _code(text: Any) -> str:
    """``text`` as an inline code span on one line, delimited by a backtick run longer than
    any inside it (CommonMark), so a tool name cannot close its own span."""
    text = re.sub(r"[\r\n]+", " ", str(text))
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


_PARSER = MarkdownIt("commonmark")


def _contained(text: str) -> str:
    """Markdown written by a person or a model, with a code fence it left open closed at its
    end: a reply cut off inside a code block (``finish_reason: length``, an interruption)
    would otherwise turn everything after it in the file into code."""
    lines = text.split("\n")
    for token in _PARSER.parse(text):
        if token.type != "fence" or token.level != 0 or token.map is None or token.map[1] < len(lines):
            continue
        last = lines[-1].strip()
        closed = (token.map[1] - token.map[0] > 1 and len(last) >= len(token.markup)
                  and set(last) == {token.markup[0]})
        if not closed:
            return f"{text}\n{token.markup}"
    return text


#: The fence info string of a card section's kind (sessions_app/callcard.py).
_SECTION_INFO = {"command": "sh", "diff": "diff"}


def _card(payload: dict) -> str:
    """A call's card as Markdown: the same flags and sections, from the same renderer, as
    the page shows (:func:`callcard.card`), nothing folded."""
    call = callcard.card(payload)
    parts = [_quoted("Flagged", flag) for flag in call.flags]
    for section in call.sections:
        note = f" — {_plain(section.note)}" if section.note else ""
        label = f"*{_plain(section.label)}*{note}"
        parts.append(f"{label}\n\n{_fence(section.text, _SECTION_INFO.get(section.kind, ''))}" if section.text else label)
    return "\n\n".join(parts)


#: ``image_url(ref)`` → where a stored image of a user message can be fetched (the page's
#: own image address), or None when it has none.
ImageLink = Callable[[dict], "str | None"]


def _image_refs(images: Any, image_url: ImageLink | None) -> list[str]:
    """Markdown references for a user message's ``images``, never the image data itself.
    An entry is a URL, an object with ``url`` (and maybe ``name``), or a stored image's
    reference (``sha256``, ``media_type``), linked through ``image_url``; one with no
    address is named in words."""
    refs = []
    for image in images if isinstance(images, list) else []:
        url = image if isinstance(image, str) else image.get("url") if isinstance(image, dict) else None
        if url is None and isinstance(image, dict) and image_url is not None:
            url = image_url(image)
        if not isinstance(url, str) or not url or url.startswith("data:"):
            if isinstance(image, dict) and isinstance(image.get("sha256"), str):
                refs.append(f"*[an image, {image.get('media_type', '')} {image['sha256'][:12]}]*")
            continue
        name = image.get("name") if isinstance(image, dict) else None
        alt = _plain(name) if isinstance(name, str) and name.strip() else "image"
        target = re.sub(r"[<>\\\s]", lambda m: f"%{ord(m.group()):02X}" if m.group() != " " else " ", url)
        refs.append(f"![{alt}](<{target}>)")
    return refs


def _who(payload: Any, default: str) -> str:
    who = actor(payload)
    return _plain(who["username"]) if who else default


def _usage_line(payload: dict) -> str:
    parts = []
    for key, label in (("prompt_tokens", "context"), ("completion_tokens", "reply")):
        if isinstance(payload.get(key), int):
            parts.append(f"{label} {payload[key]} tokens")
    if payload.get("seed") is not None:
        parts.append(f"seed {payload['seed']}")
    return " · ".join(parts)


#: The kinds :func:`to_markdown` writes a block for (besides replies, reasoning, interrupts
#: and the server's stops, which are written as notes after a reply still open).
_WRITTEN = frozenset({
    Kind.MESSAGE_TAKEN, Kind.TOOL_START, Kind.TOOL_END, Kind.ANSWERED, Kind.ERROR, Kind.NOTICE, Kind.USAGE,
    Kind.CLEARED, Kind.SERVER_READY, Kind.ALLOWANCE_REVOKED, Kind.IMPORTED, Kind.VERSION_CHOSEN,
})

#: What a turn that ended with a reply still open says, by its ``turn_end`` reason, for a
#: transcript that carries no notice of the cut (one written before such notices).
_CUT_ENDINGS = {"stopped": "*The reply above is cut off: llama-server was stopped while it was replying.*"}


def imported_text(payload: Any) -> str:
    """The note after the events an ``imported`` event brought in (docs/transcript.md,
    "Import"), as the page and the Markdown export say it."""
    who = actor(payload)
    count = payload.get("events") if isinstance(payload, dict) else None
    return (f"Imported by {who['username'] if who else 'someone'} from an export: the {count} events above came "
            "from it. Who did what there is kept as names only, and nothing allowed there is allowed here.")


def _server_stopped(payload: dict) -> str:
    """The note of a ``server_stopped`` event, as the page words it."""
    who = actor(payload)
    name = _plain(who["username"]) if who else ""
    reason = payload.get("reason")
    if reason == "idle":
        done = f"put to sleep by {name}" if name else "put to sleep after its idle time"
        return f"*llama-server {done}. The next message starts it again.*"
    if reason == "restart":
        return "*llama-server stopped for the restart.*"
    return f"*llama-server stopped by {name}.*" if name else "*llama-server stopped.*"


def _excerpt(text: str, limit: int = 80) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _again(payload: dict, taken: dict[int, dict]) -> str:
    """The line above a message sent again (Regenerate, Edit): which message it replaced,
    so a reader can tell which reply the model no longer saw."""
    how = "Edited and sent again" if payload.get("edited") else "Sent again (Regenerate)"
    replaced = taken.get(replaces) if isinstance(replaces := payload.get("replaces"), int) else None
    if replaced is None:
        return f"*{how}: the model no longer saw the message it replaces, its reply or anything after it.*"
    said = _plain(_excerpt(str(replaced.get("text") or ""))) or "a message with no text"
    return (f"*{how} in place of {_who(replaced, 'User')}'s message “{said}”: the model no longer saw that "
            "message, its reply or anything after it.*")


def _markdown_block(kind: str, payload: dict, calls: dict[str, dict], taken: dict[int, dict],
                    image_url: ImageLink | None) -> str | None:
    """The Markdown of one event of a kind :func:`to_markdown` writes as a block of its own
    (a message, a tool call or its output, an answer, an error, a note…), or None.
    ``calls``: tool_start payloads by call id; ``taken``: message_taken payloads by seq."""
    if kind == Kind.MESSAGE_TAKEN:
        text = str(payload.get("text") or "")
        refs = _image_refs(payload.get("images"), image_url)
        body = "\n\n".join([_contained(text), *refs]) if refs else _contained(text)
        again = f"{_again(payload, taken)}\n\n" if payload.get("replaces") is not None else ""
        return f"{again}**{_who(payload, 'User')}:**\n\n{body}"
    if kind == Kind.TOOL_START:
        name = payload.get("display_name") or payload.get("tool") or "?"
        return f"**Tool call** {_code(payload.get('tool', ''))} ({_plain(name)}):\n\n{_card(payload)}"
    if kind == Kind.TOOL_END:
        call = calls.get(str(payload.get("id")), {})
        outcome = "output" if payload.get("ok", True) else "failed"
        return (f"**Tool {outcome}** {_code(call.get('tool', payload.get('id', '')))}:\n\n"
                f"{_fence(str(payload.get('output') or ''))}")
    if kind == Kind.ANSWERED:
        scope = payload.get("scope")
        covers = f" ({_plain(allowance_label(payload.get('tool') or '', scope))})" if isinstance(scope, dict) else ""
        return (f"*{_who(payload, 'Corral')} answered {_plain(payload.get('answer', ''))}{covers} for "
                f"{_code(payload.get('tool') or '')}.*")
    if kind == Kind.ALLOWANCE_REVOKED:
        scope = found if isinstance(found := payload.get("scope"), dict) else {}
        return (f"*{_who(payload, 'Someone')} revoked the allowance for "
                f"{_plain(allowance_label(payload.get('tool') or '', scope))}.*")
    if kind == Kind.ERROR:
        return _quoted("Error", payload.get("message", ""))
    if kind == Kind.NOTICE:
        return _quoted("Note", payload.get("message", ""))
    if kind == Kind.USAGE:
        line = _usage_line(payload)
        return f"*{line}*" if line else None
    if kind == Kind.CLEARED:
        return f"---\n\n*Conversation cleared by {_who(payload, 'someone')}; the model saw nothing above.*"
    if kind == Kind.SERVER_READY:
        return f"*llama-server ready with {_plain(payload.get('model', ''))}.*"
    if kind == Kind.IMPORTED:
        return f"---\n\n*{_plain(imported_text(payload))}*"
    if kind == Kind.VERSION_CHOSEN:
        chosen = taken.get(chosen_seq) if isinstance(chosen_seq := payload.get("seq"), int) else None
        said = _plain(_excerpt(str((chosen or {}).get("text") or ""))) or "an earlier message"
        return (f"*{_who(payload, 'Someone')} went back to the version “{said}”: from here the model sees "
                "that message and its reply again, and not the versions sent after it.*")
    return None


def to_markdown(events: Iterable[EventLike], *, title: str = "", image_url: ImageLink | None = None) -> str:
    """The conversation as Markdown, folded from ``events`` in seq order (see the module
    docstring). Streamed fragments of one reply or one reasoning run are joined; a user
    message's stored images are linked through ``image_url``."""
    out: list[str] = [f"# {_plain(title)}"] if title else []
    run_kind: str | None = None  # the reply text or reasoning being joined
    run: list[str] = []
    calls: dict[str, dict] = {}
    taken: dict[int, dict] = {}  # message_taken payloads by seq: what a message sent again replaced
    reply_last = False  # the last block written is a reply (a turn ending "stopped" then cut it)
    slept = False  # the last stop put the server to sleep: its next restart wakes it
    # Notes that arrive while a reply still streams (an interrupt is recorded at the click,
    # the reply's last fragments after it): written after the reply, never splitting it.
    notes: list[str] = []

    def close_run() -> None:
        nonlocal run_kind, run, reply_last
        text = "".join(run)
        if run_kind == Kind.ASSISTANT_TEXT and text.strip():
            out.append(f"**Model:**\n\n{_contained(text.strip())}")
            reply_last = True
        elif run_kind == Kind.REASONING and text.strip():
            out.append(f"<details><summary>Reasoning</summary>\n\n{_fence(text.strip())}\n\n</details>")
        run_kind, run = None, []
        out.extend(notes)
        notes.clear()

    for event in sorted(events, key=lambda e: e.seq):
        kind, payload = event.kind, event.payload if isinstance(event.payload, dict) else {}
        if kind in (Kind.ASSISTANT_TEXT, Kind.REASONING):
            if kind != run_kind:
                close_run()
                run_kind = kind
            run.append(str(payload.get("text") or ""))
            continue
        note = None
        if kind == Kind.INTERRUPTED:
            note = f"*Interrupted by {_who(payload, 'someone')}.*"
        elif kind == Kind.SERVER_STOPPED:
            note, slept = _server_stopped(payload), payload.get("reason") == "idle"
        elif kind == Kind.STATUS and payload.get("status") == "loading" and actor(payload):
            # A person's Restart, or a message waking a sleeping server (docs/transcript.md).
            note = f"*llama-server {'woken' if slept else 'restarted'} by {_who(payload, 'someone')}.*"
            slept = False
        if note is not None:
            notes.append(note)
            if run_kind is None:
                close_run()
            continue
        if kind == Kind.TURN_END and payload.get("reason") in _CUT_ENDINGS:
            close_run()
            if reply_last:
                out.append(_CUT_ENDINGS[payload["reason"]])
            reply_last = False
            continue
        if kind not in _WRITTEN and kind != Kind.TURN_END:
            # Writes nothing here (a status, the tool catalogue, …): a reply open across
            # it goes on, e.g. past the ``stopped`` status of a Stop server mid-reply.
            continue
        close_run()
        reply_last = False
        if kind == Kind.MESSAGE_TAKEN:
            taken[event.seq] = payload
        elif kind == Kind.TOOL_START:
            calls[str(payload.get("id"))] = payload
        if (block := _markdown_block(kind, payload, calls, taken, image_url)) is not None:
            out.append(block)
    close_run()
    return "\n\n".join(out) + "\n"
