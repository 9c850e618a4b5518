"""What a tool call's card shows: the one renderer of a call for people (docs/behaviour.md §8).

A call's arguments are parsed once, when its ``tool_start`` event is recorded
(:func:`recorded`): the parsed object (``input``) is what the tool receives, and the same
payload is what :func:`card` turns into display sections for the live card, the page
after a reload and both exports. Nothing here imports Django; the machine's files are
read through a transport handed in (duck-typed: ``is_file``, ``is_dir``, ``read_head``,
``expand_path`` of :class:`machines_app.transports.Transport`).

What the card promises (the property tests hold it to this):

- a shell command is shown as the command, other tools as their fields (``name: value``),
  a file write or edit as a diff against the file as it was on the machine when the call
  was recorded;
- every character that is invisible, reorders text or is a control character (but for
  ``\\n`` and ``\\t``) is shown as an escape (``\\u202e``) and counted in a flag in words;
  :func:`unescape` of a section's text gives the original text back;
- nothing is cut without a visible "N more lines — show all".
"""

from __future__ import annotations

import difflib
import json
import posixpath
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "EDIT_TOOLS",
    "FILE_LIMIT",
    "HEAD_CHARS",
    "HEAD_LINES",
    "SHELL_TOOL",
    "Card",
    "ParsedArguments",
    "Section",
    "card",
    "escape",
    "file_before",
    "parse_arguments",
    "recorded",
    "unescape",
]

#: llama-server's built-in shell tool (``tools/server/server-tools.cpp``): ``{"command", "timeout"?}``.
SHELL_TOOL = "exec_shell_command"
#: llama-server's built-in tools that change a file: ``write_file {"path", "content"}`` and
#: ``edit_file {"path", "edits": [{"old_text", "new_text"}, …]}``.
EDIT_TOOLS = frozenset({"write_file", "edit_file"})

#: Bytes of a file read for its diff; a larger file is "too large to compare" (read
#: ``FILE_LIMIT + 1`` bytes to know). The "before" text is stored in the event, so this
#: also bounds what one call adds to the transcript.
FILE_LIMIT = 128 * 1024

#: A section shows at most this many lines, and at most this many characters, before the
#: rest is folded behind "N more lines — show all".
HEAD_LINES = 20
HEAD_CHARS = 2000

#: Characters that change the order text is displayed in (Unicode bidirectional
#: embeddings, overrides and isolates, the implicit marks, the Arabic letter mark).
BIDI = frozenset(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C))

#: Invisible characters outside the format/unassigned categories: the combining grapheme
#: joiner, Hangul fillers, Khmer inherent vowels, Mongolian free variation selectors,
#: the Braille blank and the variation selectors (all draw nothing, or nothing of their own).
INVISIBLE = frozenset(
    chr(c)
    for c in (
        0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, *range(0x180B, 0x1810), 0x2800, 0x3164, 0xFFA0,
        *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0),
    )
)

#: Unicode categories escaped as "invisible": format (zero-width, soft hyphen, tags, BOM),
#: private use, surrogates and unassigned code points.
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Co", "Cs", "Cn"})
#: Escaped as "control": C0/C1 controls (``\n`` and ``\t`` excepted) and the Unicode line
#: and paragraph separators, which break lines where nothing seems to.
_CONTROL_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})

_WORDS = {
    "bidi": ("bidirectional control character", "it can make text read in another order than it runs"),
    "control": ("control character", "a terminal or editor may act on it rather than show it"),
    "invisible": ("invisible character", "zero-width, formatting, an unusual space or unassigned"),
}


def char_class(ch: str) -> str | None:
    """``"bidi"``, ``"control"``, ``"invisible"`` for a character the card shows as an
    escape, None for one shown as itself."""
    if ch in "\n\t ":
        return None
    if ch in BIDI:
        return "bidi"
    category = unicodedata.category(ch)
    if category in _CONTROL_CATEGORIES:
        return "control"
    if category in _INVISIBLE_CATEGORIES or category == "Zs" or ch in INVISIBLE:
        return "invisible"
    return None


def _escape_of(ch: str) -> str:
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape(text: str, found: Counter | None = None) -> str:
    """``text`` with every character of :func:`char_class` written as ``\\uXXXX`` (or
    ``\\UXXXXXXXX`` beyond the BMP), each counted in ``found`` by class.

    A backslash stays a single backslash unless what follows it would read as an escape
    (a backslash, ``u``, ``U`` or an escaped character): then it is doubled, so that
    :func:`unescape` gives ``text`` back exactly while ``sed 's/a\\.b//'`` still reads as written.
    """
    out = []
    for index, ch in enumerate(text):
        if ch == "\\":
            following = text[index + 1 : index + 2]
            out.append("\\\\" if following and (following in "\\uU" or char_class(following)) else "\\")
            continue
        kind = char_class(ch)
        if kind is None:
            out.append(ch)
            continue
        if found is not None:
            found[kind] += 1
            found[f"{kind}:{_escape_of(ch)}"] += 1
        out.append(_escape_of(ch))
    return "".join(out)


_ESCAPED = re.compile(r"\\(\\|u[0-9a-f]{4}|U[0-9a-f]{8})")


def unescape(text: str) -> str:
    """The inverse of :func:`escape`: ``unescape(escape(s)) == s`` for every string ``s``."""
    return _ESCAPED.sub(lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1)[1:], 16)), text)


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedArguments:
    """A call's arguments parsed once: ``input`` is the object the tool receives (``{}``
    when they did not parse), ``duplicate_keys`` the keys named more than once in any
    object of the text, ``error`` why the call may not run: the text is not a JSON object,
    or names a key twice (None when it may)."""

    input: dict[str, Any]
    duplicate_keys: list[str] = field(default_factory=list)
    error: str | None = None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_arguments(text: str) -> ParsedArguments:
    """Parse a call's argument text as llama-server's parser (nlohmann::json) would accept
    it — ``NaN``/``Infinity`` and lone surrogates refused. Empty text is ``{}``
    (docs/behaviour.md C04); anything else that is not a JSON object has an ``error`` in
    words (``"Expecting ',' delimiter at line 1 column 9"``), and so has an object that
    names a key twice (``duplicate_keys`` lists them; ``input`` is then ``{}``): a call
    with an ``error`` is never run. This is the one parser of call arguments; the stream's
    assembler (completions.parse_arguments) reads them through it."""
    if not text.strip():
        return ParsedArguments({})
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen and key not in duplicates:
                duplicates.append(key)
            seen.add(key)
        return dict(items)

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=_refuse_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        return ParsedArguments({}, error=f"{exc.msg} at line {exc.lineno} column {exc.colno}")
    except UnicodeError:
        return ParsedArguments({}, error="it holds a lone surrogate escape, which is not valid text")
    except ValueError as exc:
        return ParsedArguments({}, error=str(exc))
    if not isinstance(value, dict):
        return ParsedArguments({}, error=f"it is a JSON {_json_type(value)}, not an object")
    if duplicates:
        # JSON readers keep a repeated key's last value, people read the first: such a call
        # is never run (docs/behaviour.md §9), so no card can show one command while another runs.
        keys = ", ".join(repr(key) for key in duplicates)
        return ParsedArguments({}, duplicates, error=f"duplicate key {keys}: a key is written more than once")
    return ParsedArguments(value, duplicates)


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


# --------------------------------------------------------------------------- the file before


class FileReader(Protocol):
    def expand_path(self, path: str) -> str: ...
    def is_file(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes: ...


def target_path(path: str, working_dir: str, transport: FileReader) -> str:
    """The absolute path a built-in file tool acts on: llama-server expands a leading
    ``~`` and resolves a relative path against the call's working directory."""
    if path == "~" or path.startswith("~/"):
        return transport.expand_path(path)
    return posixpath.normpath(posixpath.join(working_dir, path))


def file_before(tool: str, arguments: Mapping[str, Any], working_dir: str, transport: FileReader) -> dict | None:
    """The file a ``write_file``/``edit_file`` call would change, as it is now on the
    machine: ``{"path": absolute path, "state": ..., ...}`` with ``state`` one of

    - ``"text"`` — ``text`` holds its content (UTF-8, at most :data:`FILE_LIMIT` bytes);
    - ``"absent"`` — no such file (a write creates it);
    - ``"binary"`` / ``"huge"`` — not UTF-8 text / over the limit, with ``size`` (bytes read);
    - ``"directory"``, or ``"unreadable"`` with ``reason``.

    None for other tools or a call without a string ``path``. Never raises: a machine that
    cannot be asked gives ``"unreadable"`` and the reason.
    """
    path = arguments.get("path")
    if tool not in EDIT_TOOLS or not isinstance(path, str) or not path:
        return None
    try:
        full = target_path(path, working_dir, transport)
        if not transport.is_file(full):
            return {"path": full, "state": "directory" if transport.is_dir(full) else "absent"}
        data = transport.read_head(full, FILE_LIMIT + 1)
    except Exception as exc:  # a transport error, a permission, a NUL in the path: said, not raised
        return {"path": path, "state": "unreadable", "reason": str(exc) or type(exc).__name__}
    if len(data) > FILE_LIMIT:
        return {"path": full, "state": "huge", "size": len(data)}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return {"path": full, "state": "binary", "size": len(data)}
    if "\x00" in text:
        return {"path": full, "state": "binary", "size": len(data)}
    return {"path": full, "state": "text", "text": text}


class _Unreachable:
    """A :class:`FileReader` for a machine that cannot be reached: every read raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self, *args: Any) -> Any:
        raise OSError(self.reason)

    expand_path = is_file = is_dir = read_head = _fail


def recorded(
    tool: str,
    text: str,
    *,
    working_dir: str = "",
    transport: Callable[[], FileReader] | None = None,
) -> dict[str, Any]:
    """What a ``tool_start`` payload stores of a call's arguments ``text`` (as the model
    wrote them): ``input`` (the parsed object), and when they apply ``duplicate_keys``,
    ``arguments_error`` and ``file_before`` (read through ``transport()``, called only
    for a file write or edit)."""
    parsed = parse_arguments(text)
    payload: dict[str, Any] = {"input": parsed.input}
    if parsed.duplicate_keys:
        payload["duplicate_keys"] = parsed.duplicate_keys
    if parsed.error is not None:
        payload["arguments_error"] = parsed.error
    elif transport is not None and tool in EDIT_TOOLS:
        try:
            reader = transport()
        except Exception as exc:  # a machine Corral cannot reach at all (TransportError): said on the card
            reader = _Unreachable(str(exc) or type(exc).__name__)
        before = file_before(tool, parsed.input, working_dir, reader)
        if before is not None:
            payload["file_before"] = before
    return payload


# --------------------------------------------------------------------------- the card


@dataclass(frozen=True)
class Section:
    """One part of a card. ``kind``: ``"command"`` (a shell command), ``"field"`` (one
    argument), ``"diff"`` (a unified diff), ``"raw"`` (the arguments as the model wrote
    them). ``head`` is shown at once, ``rest`` behind ``more`` ("57 more lines — show
    all"; empty when nothing is folded); both are escaped (:func:`escape`). ``note`` is a
    sentence about it (``"new file"``)."""

    kind: str
    label: str
    head: str
    rest: str = ""
    more: str = ""
    note: str = ""

    @property
    def text(self) -> str:
        """The whole escaped text, folded part included."""
        return self.head + self.rest


@dataclass(frozen=True)
class Card:
    """A call as people read it: ``flags`` (sentences, shown first) and ``sections``."""

    flags: tuple[str, ...]
    sections: tuple[Section, ...]

    @property
    def folded(self) -> bool:
        """Part of the call is behind a "show all"."""
        return any(section.rest for section in self.sections)

    def as_text(self) -> str:
        """The card as plain text, nothing folded: flags, then each section's label, note
        and text (the Markdown export writes the same parts)."""
        parts = [f"! {flag}" for flag in self.flags]
        for section in self.sections:
            parts.append(f"{section.label}:" + (f" ({section.note})" if section.note else ""))
            parts.append(section.text)
        return "\n".join(parts)


def _fold(text: str) -> tuple[str, str, str]:
    """(head, rest, words): at most :data:`HEAD_LINES` lines and :data:`HEAD_CHARS`
    characters shown; ``words`` says how much is folded."""
    lines = text.splitlines(keepends=True)
    head_len, count = 0, 0
    for line in lines:
        if count == HEAD_LINES or head_len + len(line) > HEAD_CHARS:
            break
        head_len += len(line)
        count += 1
    if count == 0 and lines:  # one line longer than the budget: cut inside it
        head_len = HEAD_CHARS
    head, rest = text[:head_len], text[head_len:]
    if not rest:
        return text, "", ""
    more_lines = len(rest.splitlines())
    if more_lines <= 1:
        words = f"{len(rest):,} more characters — show all"
    else:
        words = f"{more_lines:,} more lines ({len(rest):,} characters) — show all"
    return head, rest, words


def _section(kind: str, label: str, text: str, found: Counter, note: str = "") -> Section:
    head, rest, more = _fold(escape(text, found))
    return Section(kind, escape(label, found), head, rest, more, note)


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2)


def _size(size: int) -> str:
    return f"{size:,} bytes" if size < 10_000 else f"{size / 1024:,.0f} KB"


def _diff(before: str, after: str, path: str, *, new: bool = False) -> str:
    """A unified diff of ``before`` → ``after`` (from ``/dev/null`` for a ``new`` file),
    with git's marker after a last line that has no line break."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile="/dev/null" if new else path, tofile=path,
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out).rstrip("\n")


def _apply_edits(text: str, edits: Any) -> tuple[str, list[str]]:
    """``text`` after ``edit_file``'s exact replacements, and a sentence for each edit that
    cannot be placed exactly (llama-server may still place it, matching loosely)."""
    problems = []
    if not isinstance(edits, list):
        return text, ["edits is not a list: the tool will refuse the call"]
    for number, edit in enumerate(edits):
        old = edit.get("old_text") if isinstance(edit, Mapping) else None
        new = edit.get("new_text") if isinstance(edit, Mapping) else None
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            problems.append(f"edits[{number}] lacks old_text or new_text: the tool will refuse the call")
            continue
        found = text.count(old)
        if found != 1:
            where = "is not in the file as it is now" if found == 0 else f"is in the file {found} times"
            problems.append(f"edits[{number}].old_text {where}: the tool may refuse the call or match it loosely")
            continue
        text = text.replace(old, new, 1)
    return text, problems


def _file_sections(tool: str, arguments: Mapping[str, Any], before: Mapping[str, Any], found: Counter) -> list[Section]:
    path = str(before.get("path") or arguments.get("path"))
    state = before.get("state")
    if tool == "write_file":
        content = arguments.get("content")
        if not isinstance(content, str):
            return []
        if state == "text":
            old = str(before.get("text", ""))
            if old == content:
                return [Section("diff", escape(f"changes to {path}", found), "", note="no change: the file already holds this text")]
            return [_section("diff", f"changes to {path}", _diff(old, content, path), found)]
        if state == "absent":
            return [_section("diff", f"changes to {path}", _diff("", content, path, new=True),
                             found, note="new file")]
        return [_section("field", "content", content, found, note=_state_note(before, "replaced by this text"))]
    # edit_file
    edits = arguments.get("edits")
    sections = []
    if state == "text":
        old = str(before.get("text", ""))
        new, problems = _apply_edits(old, edits)
        if new != old:
            sections.append(_section("diff", f"changes to {path}", _diff(old, new, path), found))
        note = "; ".join(problems) if problems else ("" if new != old else "no change")
        if problems or new == old:
            sections.append(_section("field", "edits", _value_text(edits), found, note=note))
        return sections
    note = "the file does not exist: the tool will refuse the call" if state == "absent" else _state_note(before, "edited")
    return [_section("field", "edits", _value_text(edits), found, note=note)]


def _state_note(before: Mapping[str, Any], what: str) -> str:
    state = before.get("state")
    if state == "binary":
        return f"the file is binary ({_size(int(before.get('size', 0)))}): no diff; it would be {what}"
    if state == "huge":
        return f"the file is over {_size(FILE_LIMIT)}: too large to compare; it would be {what}"
    if state == "directory":
        return "the path is a directory: the tool will refuse the call"
    if state == "unreadable":
        return f"the file could not be read to compare ({before.get('reason', '')}); it would be {what}"
    return ""


def _flags(payload: Mapping[str, Any], found: Counter) -> list[str]:
    flags = []
    error = payload.get("arguments_error")
    duplicates = payload.get("duplicate_keys") or []
    if duplicates:
        names = ", ".join(escape(str(key), found) for key in duplicates)
        flags.append(f"The arguments name the same key more than once ({names}): a reader keeps only one of the "
                     "values, so this call is not run; they are shown as the model wrote them.")
    elif error:
        flags.append(f"The arguments did not parse as a JSON object ({escape(str(error), found)}), so this call "
                     "is not run; they are shown as the model wrote them.")
    for kind, (noun, why) in _WORDS.items():
        count = found[kind]
        if count:
            examples = sorted(key.split(":", 1)[1] for key in found if key.startswith(f"{kind}:"))
            listed = " ".join(examples[:6]) + (" …" if len(examples) > 6 else "")
            flags.append(f"{count} {noun}{'s' if count != 1 else ''} ({listed}): {why}. Shown as escapes.")
    return flags


def card(payload: Mapping[str, Any]) -> Card:
    """The card of a call from its ``tool_start`` payload (docs/transcript.md): ``tool``,
    ``input``, ``arguments``/``raw_arguments`` and the optional ``duplicate_keys``,
    ``arguments_error`` and ``file_before`` written by :func:`recorded`.

    A payload recorded before arguments were parsed at record time (no ``arguments_error``
    but ``raw_arguments`` differing from ``arguments``) reads as arguments that did not
    parse."""
    tool = str(payload.get("tool") or "")
    arguments = payload.get("input")
    written = payload.get("raw_arguments")
    if written is None:
        written = payload.get("arguments")
    written = written if isinstance(written, str) else ""
    facts = dict(payload)
    if not isinstance(arguments, Mapping):
        arguments = {}
    if not facts.get("arguments_error") and (payload.get("raw_arguments") is not None or not arguments):
        facts["arguments_error"] = parse_arguments(written).error
    found: Counter = Counter()
    sections: list[Section] = []
    if facts.get("arguments_error"):
        sections.append(_section("raw", "arguments as the model wrote them", written, found))
    else:
        before = payload.get("file_before")
        shown: set[str] = set()
        if tool in EDIT_TOOLS and isinstance(before, Mapping):
            sections.append(_section("field", "path", _value_text(arguments.get("path", "")), found))
            file_sections = _file_sections(tool, arguments, before, found)
            sections.extend(file_sections)
            shown = {"path", "content", "edits"} if file_sections else {"path"}
        for key, value in arguments.items():
            if key in shown:
                continue
            if tool == SHELL_TOOL and key == "command" and isinstance(value, str):
                sections.append(_section("command", "command", value, found))
            else:
                sections.append(_section("field", str(key), _value_text(value), found))
        if not arguments:
            sections.append(Section("field", "arguments", "", note="none"))
    flags = _flags(facts, found)
    return Card(tuple(flags), tuple(sections))
