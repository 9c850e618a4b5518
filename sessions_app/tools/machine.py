"""llama-server's built-in tools that Corral runs itself, on the session's machine, through
its transport (docs/behaviour.md §9, "Built-in tools run by Corral").

llama-server's own ``POST /tools`` cannot be bounded from outside (llama.cpp
tools/server/server-tools.cpp): ``grep_search`` reads every file it lists whole into the
server's memory (a folder holding a GGUF is an out-of-memory kill of the process holding
the model), ``read_file`` checks a size only when ``end_line`` is missing and then reads
the whole file too, ``edit_file`` reads its file whole, and ``exec_shell_command``'s
timeout kills only ``sh`` while it reads the pipe until every child closes it (C47: ``sleep
900 &`` holds the call for 15 minutes). A call in flight cannot be stopped either.

So these tools run here, with the names, JSON schemas (still read from ``GET /tools``) and
answers of llama-server's, and with bounds:

- ``exec_shell_command``: ``sh -c`` in a session and process group of its own
  (Transport.run_command): the timeout (default 10 s, at most 60, as llama-server) and
  *Stop reply* kill the whole group; a child left in the background is ended
  ``COMMAND_GRACE`` after the shell exits; output capped at ``max_output_size`` bytes
  (at most 16 KiB); ends with ``"\\n[exit code: N]"`` as llama-server's does.
- ``read_file``: a binary file (a NUL in its first 8 KiB) or one that is not a regular
  file answers a sentence; a file over 16 KiB without ``end_line`` answers llama-server's
  own "file too large" sentence; a line range is read in chunks from the start, at most
  ``READ_FILE_SCAN_MAX`` bytes, output at most 16 KiB — never the whole file.
- ``grep_search``: the file list comes from ``find`` on the machine (junk directories
  skipped), filtered by ``include``/``exclude`` as llama-server matches them; files over
  ``GREP_FILE_MAX`` bytes are skipped and named; ``grep -I`` (binary files skipped, files
  streamed, never loaded) runs in its own process group with a timeout and Stop. At most
  100 matches, llama-server's output format.
- ``edit_file`` stays llama-server's, but a file over ``EDIT_FILE_MAX`` bytes (or binary)
  answers a sentence first.

Every other built-in goes to ``POST /tools`` unchanged. No Django import: the transport is
handed in.
"""

from __future__ import annotations

import posixpath
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from machines_app.transports import Transport

__all__ = ["HANDLED", "Answer", "guard", "run"]

#: llama-server's limits (server-tools.cpp), kept so the model sees the same tool.
READ_FILE_MAX_SIZE = 16 * 1024
SHELL_MAX_OUTPUT = 16 * 1024
SHELL_DEFAULT_TIMEOUT = 10
SHELL_MAX_TIMEOUT = 60
GREP_MAX_RESULTS = 100
JUNK_DIRS = (".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build", "target",
             ".cache", ".idea", ".vscode")

#: Corral's own bounds.
READ_FILE_SCAN_MAX = 64 * 1024 * 1024  # bytes read from a file's start looking for a line range
READ_CHUNK = 256 * 1024
BINARY_SNIFF = 8192  # bytes looked at for a NUL (as git and grep do)
GREP_FILE_MAX = 16 * 1024 * 1024  # a larger file is skipped, and named, by grep_search
GREP_TIMEOUT = 30.0
GREP_OUTPUT_MAX = 1024 * 1024
LIST_OUTPUT_MAX = 8 * 1024 * 1024
LIST_TIMEOUT = 15.0
EDIT_FILE_MAX = 8 * 1024 * 1024

STOPPED = " [stopped: Stop reply]"


class Answer(NamedTuple):
    """A tool's answer to the model: ``output`` text and whether it did its job."""

    output: str
    ok: bool


#: The built-ins :func:`run` runs itself (their llama-server names).
HANDLED = frozenset({"exec_shell_command", "read_file", "grep_search"})


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB" if n >= 1024 * 1024 else f"{n} bytes"


def resolve(cwd: str, path: str, transport: Transport) -> str:
    """``path`` as llama-server resolves it: ``~`` expanded (the home of the account the
    server runs as), a relative path joined to ``cwd``, ``.``/``..`` dropped."""
    if path == "~" or path.startswith("~/"):
        path = transport.expand_path(path)
    return posixpath.normpath(posixpath.join(cwd, path))


def _is_binary(transport: Transport, path: str) -> bool:
    return b"\0" in transport.read_head(path, BINARY_SNIFF)


# --------------------------------------------------------------------------- exec_shell_command


def _int(arguments: Mapping[str, Any], name: str, default: int) -> int:
    value = arguments.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def exec_shell_command(
    arguments: Mapping[str, Any], transport: Transport, cwd: str, cancel: threading.Event | None
) -> Answer:
    command = arguments.get("command")
    if not isinstance(command, str):
        return Answer("exec_shell_command needs a \"command\" (a string).", False)
    timeout = max(1, min(_int(arguments, "timeout", SHELL_DEFAULT_TIMEOUT), SHELL_MAX_TIMEOUT))
    max_output = max(0, min(_int(arguments, "max_output_size", SHELL_MAX_OUTPUT), SHELL_MAX_OUTPUT))
    result = transport.run_command(["sh", "-c", command], cwd=cwd, timeout=timeout, max_output=max_output,
                                   cancel=cancel)
    text = result.output.decode("utf-8", "replace")
    if result.truncated:
        text += "\n[output truncated]"
    text += f"\n[exit code: {result.exit_code}]"
    if result.timed_out:
        text += " [exit due to timed out]"
    if result.cancelled:
        text += STOPPED
    return Answer(text, not result.cancelled)


# --------------------------------------------------------------------------- read_file


def read_file(arguments: Mapping[str, Any], transport: Transport, cwd: str) -> Answer:
    path = arguments.get("path")
    if not isinstance(path, str):
        return Answer("read_file needs a \"path\" (a string).", False)
    start_line = _int(arguments, "start_line", 1)
    end_line = _int(arguments, "end_line", -1)
    append_loc = arguments.get("append_loc") is True
    full = resolve(cwd, path, transport)
    info = transport.file_info(full)
    if info is None:
        return Answer(f"cannot stat file: {path}", False)
    if info.kind != "file":
        return Answer(f"{path} is {'a directory' if info.kind == 'dir' else 'not a regular file'}; read_file reads "
                      "files only.", False)
    if _is_binary(transport, full):
        return Answer(f"{path} is a binary file ({info.size} bytes); read_file shows text files only.", False)
    if info.size > READ_FILE_MAX_SIZE and end_line == -1:
        # llama-server's own sentence, word for word.
        return Answer(f"file too large ({info.size} bytes, max {READ_FILE_MAX_SIZE}). Use start_line/end_line to read "
                      "a portion.", False)
    lines = _scan_lines(transport, full, info.size)
    result: list[str] = []
    used = 0
    lineno = 0
    scanned_all = True
    for lineno, line, complete in lines:
        if lineno < start_line:
            continue
        if end_line != -1 and lineno > end_line:
            break
        out_line = (f"{lineno}\u2192" if append_loc else "") + line + "\n"
        if used + len(out_line.encode()) > READ_FILE_MAX_SIZE or not complete:
            result.append("[output truncated]")
            break
        result.append(out_line)
        used += len(out_line.encode())
    else:
        scanned_all = lines.whole
    text = "".join(result)
    if not scanned_all:
        text += (f"[stopped reading after the first {_mib(READ_FILE_SCAN_MAX)} of this {_mib(info.size)} file "
                 f"(line {lineno}); use grep_search or exec_shell_command (sed -n, tail) for later parts]")
    return Answer(text, True)


class _Lines:
    """The lines of a file read in chunks from its start, each cut at ``READ_FILE_MAX_SIZE``
    bytes (``complete`` False then): ``(lineno, text, complete)``. ``whole`` is False when
    the scan stopped at ``READ_FILE_SCAN_MAX`` before the end."""

    def __init__(self, transport: Transport, path: str, size: int) -> None:
        self.transport, self.path, self.size = transport, path, size
        self.whole = True

    def __iter__(self):
        offset, lineno, partial, cut = 0, 0, bytearray(), False
        while True:
            if offset >= READ_FILE_SCAN_MAX:
                self.whole = offset >= self.size
                break
            chunk = self.transport.read_head(self.path, READ_CHUNK, offset)
            if not chunk:
                break
            offset += len(chunk)
            pieces = chunk.split(b"\n")
            for piece in pieces[:-1]:
                lineno += 1
                partial += piece
                yield lineno, bytes(partial[:READ_FILE_MAX_SIZE]).decode("utf-8", "replace"), not (
                    cut or len(partial) > READ_FILE_MAX_SIZE)
                partial, cut = bytearray(), False
            partial += pieces[-1]
            if len(partial) > READ_FILE_MAX_SIZE:
                del partial[READ_FILE_MAX_SIZE + 1:]
                cut = True
        if partial:
            lineno += 1
            yield lineno, bytes(partial[:READ_FILE_MAX_SIZE]).decode("utf-8", "replace"), not (
                cut or len(partial) > READ_FILE_MAX_SIZE)


def _scan_lines(transport: Transport, path: str, size: int) -> _Lines:
    return _Lines(transport, path, size)


# --------------------------------------------------------------------------- grep_search


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + re.escape(body[1:]) if body[:1] in "!^" and body else re.escape(body)) + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def path_glob_match(pattern: str, rel_path: str) -> bool:
    """llama-server's rule: a pattern without ``/`` matches the base name at any depth; one
    with ``/`` the whole relative path, anchored with ``**/`` unless it starts with ``**/``
    or ``/``."""
    if "/" not in pattern:
        return bool(_glob_regex(pattern).fullmatch(posixpath.basename(rel_path)))
    if not (pattern == "**" or pattern.startswith("**/") or pattern.startswith("/")):
        pattern = "**/" + pattern
    return bool(_glob_regex(pattern).fullmatch(rel_path))


def _list_files(transport: Transport, base: str, cancel: threading.Event | None) -> tuple[list[tuple[str, int]], bool]:
    """Regular files under ``base`` as (relative path, size), junk directories skipped; and
    whether the list is whole."""
    prune = " -o ".join(f"-name {name}" for name in JUNK_DIRS)
    script = f"find . -mindepth 1 -type d \\( {prune} \\) -prune -o -type f -printf '%s\\t%P\\0'"
    result = transport.run_command(["sh", "-c", script], cwd=base, timeout=LIST_TIMEOUT, max_output=LIST_OUTPUT_MAX,
                                   cancel=cancel)
    files = []
    for item in result.output.split(b"\0"):
        size, tab, rel = item.partition(b"\t")
        if tab and size.isdigit():
            files.append((rel.decode("utf-8", "surrogateescape"), int(size)))
    return files, not (result.truncated or result.timed_out or result.cancelled)


def grep_search(
    arguments: Mapping[str, Any], transport: Transport, cwd: str, cancel: threading.Event | None
) -> Answer:
    path, pattern = arguments.get("path"), arguments.get("pattern")
    if not isinstance(path, str) or not isinstance(pattern, str):
        return Answer("grep_search needs a \"path\" and a \"pattern\" (strings).", False)
    include = arguments.get("include") if isinstance(arguments.get("include"), str) else "**"
    exclude = arguments.get("exclude") if isinstance(arguments.get("exclude"), str) else ""
    show_num = arguments.get("return_line_numbers") is True
    ctx = max(0, _int(arguments, "context_lines", 0))
    show_num = show_num or ctx > 0
    full = resolve(cwd, path, transport)
    info = transport.file_info(full)
    notes: list[str] = []
    if info is not None and info.kind == "file":
        where, files, whole = posixpath.dirname(full), [(posixpath.basename(full), info.size)], True
        names = {posixpath.basename(full): path}
    elif info is not None and info.kind == "dir":
        where = full
        listed, whole = _list_files(transport, full, cancel)
        files = [(rel, size) for rel, size in listed
                 if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
        names = {rel: rel for rel, _ in files}
    else:
        return Answer(f"path does not exist: {path}", False)
    big = [rel for rel, size in files if size > GREP_FILE_MAX]
    small = [rel for rel, size in files if size <= GREP_FILE_MAX]
    if big:
        shown = ", ".join(names[rel] for rel in big[:10]) + (f" and {len(big) - 10} more" if len(big) > 10 else "")
        notes.append(f"[skipped {len(big)} file{'s' if len(big) != 1 else ''} over {_mib(GREP_FILE_MAX)}: {shown}]")
    if not whole:
        notes.append("[results truncated: time budget or too many files]")
    matches, lines, stopped = 0, [], False
    if small:
        flags = ["-I", "-H", "-n", "-Z", "-s"]
        flags.append("-F" if arguments.get("literal") is True else "-P")
        if arguments.get("ignore_case") is True:
            flags.append("-i")
        if ctx:
            flags.append(f"-C{ctx}")
        # The list goes on stdin (never on a command line: it may be long); `./` so a name
        # starting with `-` is never an option.
        stdin = b"".join(b"./" + rel.encode("utf-8", "surrogateescape") + b"\0" for rel in small)
        argv = ["xargs", "-0", "-r", "grep", *flags, "-e", pattern, "--"]
        result = transport.run_command(argv, cwd=where, timeout=GREP_TIMEOUT, max_output=GREP_OUTPUT_MAX,
                                       stdin=stdin, cancel=cancel)
        stopped = result.cancelled
        # grep's own complaints (file errors are silenced by -s): a pattern it cannot read.
        complaints = [line for line in result.output.decode("utf-8", "replace").splitlines()
                      if line.startswith("grep: ")]
        if complaints and b"\0" not in result.output:
            return Answer(f"invalid regex: {complaints[-1].removeprefix('grep: ')}", False)
        for raw in result.output.split(b"\n"):
            if matches >= GREP_MAX_RESULTS:
                break
            if b"\0" not in raw:
                continue  # "--" between context groups, a stray line
            name, _, rest = raw.partition(b"\0")
            rel = name.decode("utf-8", "surrogateescape").removeprefix("./")
            m = re.match(rb"(\d+)([:-])", rest)
            if not m:
                continue
            is_match = m.group(2) == b":"
            shown = names.get(rel, rel)
            text = rest[m.end():].decode("utf-8", "replace")
            sep = ":" if is_match else "-"
            lines.append(f"{shown}{sep}" + (f"{int(m.group(1))}{sep}" if show_num else "") + text + "\n")
            if is_match:
                matches += 1
        if result.timed_out:
            notes.append(f"[search stopped after {GREP_TIMEOUT:g} seconds; narrow the path/pattern/include]")
        elif result.truncated:
            notes.append("[output truncated]")
    out = "".join(lines) + f"\n---\nTotal matches: {matches}\n"
    if matches >= GREP_MAX_RESULTS:
        out += f"[{GREP_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
    out += "".join(note + "\n" for note in notes)
    if stopped:
        out += STOPPED.strip() + "\n"
    return Answer(out, not stopped)


# --------------------------------------------------------------------------- public


def guard(name: str, arguments: Mapping[str, Any], transport: Transport, cwd: str) -> Answer | None:
    """For a built-in that llama-server runs (``name`` not in :data:`HANDLED`): a sentence
    when the call would load a file too large or binary into the server (``edit_file``),
    else None (send it to ``POST /tools``)."""
    if name != "edit_file" or not isinstance(arguments.get("path"), str):
        return None
    full = resolve(cwd, arguments["path"], transport)
    info = transport.file_info(full)
    if info is None or info.kind != "file":
        return None  # llama-server says it in its own words
    if info.size > EDIT_FILE_MAX:
        return Answer(f"{arguments['path']} is too large to edit ({info.size} bytes, max {EDIT_FILE_MAX}); "
                      "use exec_shell_command (sed, a script) for it.", False)
    if _is_binary(transport, full):
        return Answer(f"{arguments['path']} is a binary file; edit_file edits text files only.", False)
    return None


def run(
    name: str, arguments: Mapping[str, Any], transport: Transport, cwd: str, cancel: threading.Event | None = None
) -> Answer:
    """Run built-in ``name`` (one of :data:`HANDLED`) with ``arguments`` in ``cwd`` on the
    machine of ``transport``; ``cancel`` set ends it within a fraction of a second, keeping
    what it printed. Raises TransportError when the machine cannot be reached (the caller
    says so as for any unreachable tool)."""
    if name == "exec_shell_command":
        return exec_shell_command(arguments, transport, cwd, cancel)
    if name == "read_file":
        return read_file(arguments, transport, cwd)
    if name == "grep_search":
        return grep_search(arguments, transport, cwd, cancel)
    raise ValueError(f"{name} is not run by Corral")
