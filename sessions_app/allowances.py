"""What "Always allow" may cover, and whether an allowance covers a call (docs/behaviour.md §8).

Pure functions, no Django. An *allowance* is what :func:`transcript.allowances` folds from
an ``answered`` event with ``answer: allow_always``: ``{"seq", "tool", "scope", "by", "at"}``.
Its ``scope`` is one of:

- ``{"kind": "exact", "command": str}`` — ``exec_shell_command`` with exactly this command;
- ``{"kind": "prefix", "words": [str, ...]}`` — ``exec_shell_command`` whose command is a
  *simple* command (:func:`simple_words`) whose first words are these;
- ``{"kind": "path", "path": str}`` — a file tool (:data:`FILE_TOOLS`) on this path;
- ``{"kind": "folder", "path": str}`` — a file tool on a path in this folder (or the folder);
- ``{"kind": "mcp", "server": str, "remote_name": str, "hash": str, "definition": dict}`` —
  one MCP tool of one server, as long as its definition hashes to ``hash``;
- ``{"kind": "tool"}`` — a read-only built-in that takes no path or command (``get_info``).

Paths in a scope are relative to the session's working directory, normalised (no ``.``,
``..`` or doubled slashes; ``"."`` is the working directory itself). A question offers the
scopes :func:`offers` lists, and only those may be granted (actions.do_answer), so a
forged answer cannot grant a scope of its own making.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shlex
import unicodedata
from collections.abc import Mapping
from typing import Any

from .callcard import escape

__all__ = [
    "FILE_TOOLS",
    "SHELL_TOOL",
    "changes",
    "definition_hash",
    "definition_parts",
    "label",
    "matches",
    "normal_path",
    "offers",
    "simple_words",
]

#: The built-in that runs a shell command (its argument: ``command``).
SHELL_TOOL = "exec_shell_command"

#: llama-server's built-ins that act on a path, and the argument that names it (GET /tools).
FILE_TOOLS: dict[str, str] = {
    "read_file": "path",
    "write_file": "path",
    "edit_file": "path",
    "grep_search": "path",
    "file_glob_search": "path",
}

#: Read-only built-ins that take neither a path nor a command: "always" covers the tool.
WHOLE_TOOLS = frozenset({"get_info"})

#: Characters that make a command more than one simple command, or feed it from or to
#: somewhere else: lists and pipes (``; & |``), substitutions and expansions (`` ` ``,
#: ``$`` — ``$(``, ``${``, ``$VAR``), redirections and process substitution (``< >``),
#: subshells and groups (``( ) { }``), and line breaks. A command with any of them never
#: matches a prefix allowance, quoted or not (a quoted ``;`` is harmless, but telling the
#: two apart is the shell's job, and a mistake here runs a command nobody approved).
COMPOUND_CHARS = frozenset(";&|`$<>(){}\n\r")

#: Programs that run whatever their arguments say (a shell, an interpreter, a wrapper, the
#: shell's own ``!``, ``coproc`` and ``trap``): a prefix allowance for them would be the
#: gate turned off, so only the exact command is offered. A name is looked up without a
#: version at its end (``python3.12``, ``perl5.36``, ``bash5`` are ``python``, ``perl``,
#: ``bash``: :func:`_runs_anything`).
RUNS_ANYTHING = frozenset({
    "sh", "bash", "zsh", "dash", "ksh", "mksh", "fish", "csh", "tcsh", "env", "sudo", "su", "doas", "exec",
    "eval", "command", "builtin", "xargs", "nohup", "nice", "timeout", "time", "watch", "strace", "ltrace",
    "ssh", "python", "pypy", "ipython", "perl", "ruby", "irb", "node", "nodejs", "deno", "bun", "php", "lua",
    "luajit", "tclsh", "wish", "expect", "rscript", "pwsh", "awk", "gawk", "mawk", "nawk", "busybox",
    "toybox", "find", "source", ".", "!", "coproc", "trap", "setsid", "stdbuf", "chroot", "unshare", "nsenter",
    "flock", "ionice", "chrt", "taskset", "script", "runuser", "pkexec", "sg", "parallel", "fakeroot",
    "firejail", "systemd-run", "gdb", "valgrind",
})

#: Characters that make the shell match a word against file names (a glob): the word that
#: runs is then whatever the machine's files say, not the word shown.
GLOB_CHARS = frozenset("*?[")

#: The most words a prefix allowance may name (the first word, or the first two).
MAX_PREFIX_WORDS = 2


# --------------------------------------------------------------------------- shell


def simple_words(command: Any) -> list[str] | None:
    """The words of ``command`` when it is one simple command, else None.

    None for: not a string; any character of :data:`COMPOUND_CHARS`; any other control
    character (tab included: it separates words, and shown in a button it would not be
    seen); quoting that does not close. Words are split the way ``sh`` splits them
    (:func:`shlex.split`, POSIX rules), so ``git "status"`` is ``["git", "status"]``.
    """
    if not isinstance(command, str) or not command.strip():
        return None
    for char in command:
        if char in COMPOUND_CHARS or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            return None
    try:
        words = shlex.split(command, comments=False, posix=True)
    except ValueError:
        return None
    return words or None


def _runs_anything(word: str) -> bool:
    """Whether a command named ``word`` (a name or a path) is one of :data:`RUNS_ANYTHING`,
    its version at the end left off: ``/usr/bin/python3.12`` is ``python``."""
    name = posixpath.basename(word).lower()
    return name in RUNS_ANYTHING or name.rstrip("0123456789.-") in RUNS_ANYTHING


def _prefix_offers(command: str) -> list[list[str]]:
    words = simple_words(command)
    if not words or "=" in words[0] or _runs_anything(words[0]) or GLOB_CHARS & set(words[0]):
        return []
    choices = []
    for count in range(min(MAX_PREFIX_WORDS, len(words)), 0, -1):
        prefix = words[:count]
        # A word that is itself an option, a path or a glob is no command name: "ls -la",
        # "cat *.txt" → "ls", "cat" only.
        if count > 1 and (prefix[-1].startswith("-") or "/" in prefix[-1] or GLOB_CHARS & set(prefix[-1])):
            continue
        choices.append(prefix)
    return choices


# --------------------------------------------------------------------------- paths


def normal_path(path: Any, working_dir: str) -> str | None:
    """``path`` (as a file tool was given it) relative to ``working_dir``, normalised:
    ``"src/./a.py"`` → ``"src/a.py"``, ``"/wd/src"`` → ``"src"``, the working directory
    itself → ``"."``. None when it is not a non-empty string, holds a control character,
    starts with ``~`` (expanded by nobody we can see), has a ``..`` part anywhere, or leads
    outside the working directory (another absolute path): such a call is always asked.

    Lexical only: a symlink inside the working directory is not followed here. That is why
    ``..`` is refused rather than folded: the machine follows ``link`` in ``link/../a``
    first, and ``..`` then leads next to wherever it points, not to ``a``.
    """
    if not isinstance(path, str) or not path or path.startswith("~") or not working_dir.startswith("/"):
        return None
    if ".." in path.split("/"):
        return None
    if any(unicodedata.category(char) == "Cc" for char in path):
        return None
    root = posixpath.normpath(working_dir)
    full = posixpath.normpath(posixpath.join(root, path))
    if full == root:
        return "."
    inside = root.rstrip("/") + "/"
    if not full.startswith(inside):
        return None
    return full[len(inside):]


def _in_folder(path: str, folder: str) -> bool:
    return folder == "." or path == folder or path.startswith(folder.rstrip("/") + "/")


# --------------------------------------------------------------------------- MCP


def definition_parts(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What an MCP tool's allowance is bound to, from its catalogue entry
    (``ToolEntry.as_payload``): ``{"description", "input_schema", "annotations"}``."""
    definition = found if isinstance(found := entry.get("definition"), Mapping) else {}
    function = found if isinstance(found := definition.get("function"), Mapping) else {}
    annotations = entry.get("annotations")
    return {
        "description": function.get("description") or "",
        "input_schema": function.get("parameters") or {},
        "annotations": dict(annotations) if isinstance(annotations, Mapping) else {},
    }


def definition_hash(entry: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of :func:`definition_parts` as canonical JSON (sorted keys)."""
    text = json.dumps(definition_parts(entry), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def changes(before: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    """What changed in an MCP tool's definition since ``before`` (the ``definition`` an
    allowance kept) to ``entry``'s, one phrase each: ``"its description"``, ``"its input
    schema"``, ``"its annotations (readOnlyHint: true → none)"``."""
    now = definition_parts(entry)
    said = []
    if before.get("description", "") != now["description"]:
        said.append("its description")
    if before.get("input_schema", {}) != now["input_schema"]:
        said.append("its input schema")
    old = before.get("annotations") or {}
    if old != now["annotations"]:
        keys = sorted(set(old) | set(now["annotations"]))
        moved = [f"{k}: {_shown(old.get(k))} → {_shown(now['annotations'].get(k))}"
                 for k in keys if old.get(k) != now["annotations"].get(k)]
        said.append(f"its annotations ({'; '.join(moved)})")
    return said


def _shown(value: Any) -> str:
    return "none" if value is None else json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- offers and matching


def _input(call: Mapping[str, Any]) -> Mapping[str, Any]:
    value = call.get("input")
    return value if isinstance(value, Mapping) else {}


def offers(call: Mapping[str, Any], entry: Mapping[str, Any] | None, working_dir: str) -> list[dict[str, Any]]:
    """The scopes a question about ``call`` (a ``tool_start`` payload) offers for "always",
    narrowest first; ``entry`` is the tool's catalogue entry. ``[]`` when none is safe to
    offer (an unknown tool; a shell command that is not a string; a path outside the
    working directory; a built-in this module does not know)."""
    tool = call.get("tool")
    if entry is None or not isinstance(tool, str):
        return []
    if entry.get("origin") == "mcp":
        server, remote = entry.get("server"), entry.get("remote_name")
        if not isinstance(server, str) or not isinstance(remote, str):
            return []
        return [{"kind": "mcp", "server": server, "remote_name": remote, "hash": definition_hash(entry),
                 "definition": definition_parts(entry)}]
    args = _input(call)
    if tool == SHELL_TOOL:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            return []
        return [{"kind": "exact", "command": command},
                *({"kind": "prefix", "words": words} for words in _prefix_offers(command))]
    if tool in FILE_TOOLS:
        path = normal_path(args.get(FILE_TOOLS[tool]), working_dir)
        if path is None:
            return []
        scopes: list[dict[str, Any]] = [{"kind": "path", "path": path}]
        folder = posixpath.dirname(path)
        if folder:  # a file at the top of the working directory: the file only
            scopes.append({"kind": "folder", "path": folder})
        return scopes
    if tool in WHOLE_TOOLS and entry.get("writes") is False:
        return [{"kind": "tool"}]
    return []


def matches(allowance: Mapping[str, Any], call: Mapping[str, Any], entry: Mapping[str, Any] | None,
            working_dir: str) -> bool:
    """Whether ``allowance`` covers ``call`` (a ``tool_start`` payload) of the tool whose
    catalogue entry is ``entry``, in a session working in ``working_dir``. Anything not
    understood is not covered (the call is asked)."""
    scope = allowance.get("scope")
    tool = call.get("tool")
    if not isinstance(scope, Mapping) or entry is None or not isinstance(tool, str):
        return False
    kind = scope.get("kind")
    if kind == "mcp":
        return (entry.get("origin") == "mcp" and entry.get("server") == scope.get("server")
                and entry.get("remote_name") == scope.get("remote_name")
                and definition_hash(entry) == scope.get("hash"))
    if entry.get("origin") == "mcp" or allowance.get("tool") != tool:
        return False
    args = _input(call)
    if kind == "exact":
        return tool == SHELL_TOOL and isinstance(scope.get("command"), str) and args.get("command") == scope["command"]
    if kind == "prefix":
        prefix = scope.get("words")
        if tool != SHELL_TOOL or not isinstance(prefix, list) or not 0 < len(prefix) <= MAX_PREFIX_WORDS:
            return False
        command = args.get("command")
        # Only a prefix the command itself would be offered: one stored before a name was
        # known to run anything (or forged into the transcript) covers nothing.
        return isinstance(command, str) and prefix in _prefix_offers(command)
    if kind in ("path", "folder"):
        wanted = scope.get("path")
        if tool not in FILE_TOOLS or not isinstance(wanted, str):
            return False
        path = normal_path(args.get(FILE_TOOLS[tool]), working_dir)
        if path is None:
            return False
        return path == wanted if kind == "path" else _in_folder(path, wanted)
    if kind == "tool":
        return tool in WHOLE_TOOLS and entry.get("writes") is False
    return False


# --------------------------------------------------------------------------- words


_VERBS = {"read_file": "reads of", "write_file": "writes to", "edit_file": "edits of",
          "grep_search": "searches in", "file_glob_search": "file searches in"}


def label(tool: str, scope: Mapping[str, Any]) -> str:
    """An allowance in words, as its button and the list of allowances say it:
    ``"this exact command: git status"``, ``"commands starting with: git status"``,
    ``"writes to notes.txt"``, ``"edits of files in src/"``, ``"calc's tool add (as defined now)"``.
    Invisible, control and bidirectional characters are written as escapes, as the card
    writes them (callcard.escape): the list must not read otherwise than what it covers."""
    return escape(_label(tool, scope))


def _label(tool: str, scope: Mapping[str, Any]) -> str:
    kind = scope.get("kind")
    if kind == "exact":
        return f"this exact command: {scope.get('command', '')}"
    if kind == "prefix":
        words = scope.get("words") or []
        return f"commands starting with: {shlex.join(words)}"
    if kind == "path":
        path = scope.get("path", "")
        return f"{_VERBS.get(tool, tool + ' on')} {'the working directory' if path == '.' else path}"
    if kind == "folder":
        return f"{_VERBS.get(tool, tool + ' on')} files in {scope.get('path', '')}/"
    if kind == "mcp":
        return f"{scope.get('server')}'s tool {scope.get('remote_name')} (as defined when allowed)"
    if kind == "tool":
        return f"every call of {tool}"
    return tool
