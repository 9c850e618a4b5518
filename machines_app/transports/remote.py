"""A machine reached over SSH: every operation of :class:`machines_app.transports.base.Transport`
built from the link of :mod:`machines_app.ssh` (SFTP for files and ``/proc``, ``sh -c`` with
every argument quoted for commands)."""

from __future__ import annotations

import posixpath
import random
import shlex
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .. import ssh
from ..sandbox import Sandbox, bwrap_argv, probe_argv
from .base import CommandResult, FileInfo, ProcessId, Transport, TransportError, parse_proc_group, parse_proc_stat
from .commands import COMMAND_POLL, _drain, _follow, _LeaderLine, _Output

#: How often ``list_gguf`` may look at a directory entry: a models directory with more
#: entries than this is refused rather than walked for minutes.
MAX_LISTED_ENTRIES = 20000
#: Bytes read from the end of a remote log for its tail.
LOG_TAIL_BYTES = 64 * 1024

LinkReport = Callable[[str, str, str], None]


class SSHTransport(Transport):
    """A machine reached over SSH (paramiko, :mod:`machines_app.ssh`); nothing installed
    there but ``llama-server``, ``sh``, ``setsid``/``nohup`` and an SFTP server.

    Files are listed, heads read, liveness and logs checked over SFTP; commands (spawn,
    signal, write a key file) are built with :func:`shlex.quote` on every argument and run
    with ``sh -c``. ``report(state, reason, offered_key)`` is told how the link went
    (``"reachable"``, ``"unreachable"``, ``"host_key_changed"``) so the machine list shows it.
    """

    def __init__(
        self, name: str, target: ssh.Target, report: LinkReport | None = None, *, refused: str = ""
    ) -> None:
        self.name = name
        self.target = target
        self.report = report
        self.refused = refused  # a changed host key stays refused until an admin re-pins
        self._reported: tuple[str, str] = ("", "")

    @contextmanager
    def _link(self) -> Iterator[ssh.Link]:
        """The live link; every LinkError becomes a TransportError naming the machine."""
        if self.refused:
            raise TransportError(f"Machine '{self.name}': {self.refused}", permanent=False)
        try:
            link = ssh.link_for(self.target)
            yield link
        except ssh.HostKeyChanged as exc:
            self._report("host_key_changed", str(exc), ssh.public_key_line(exc.offered))
            raise TransportError(f"Machine '{self.name}': {exc}", permanent=False) from None
        except ssh.LinkBusy as exc:
            raise TransportError(f"Machine '{self.name}': {exc}", permanent=False) from None
        except ssh.LinkError as exc:
            self._report("unreachable", str(exc), "")
            raise TransportError(f"Machine '{self.name}' is unreachable: {exc}", permanent=False) from None
        else:
            self._report("reachable", "", "")

    def _report(self, state: str, reason: str, offered: str) -> None:
        if self.report is not None and (state, reason) != self._reported:
            self._reported = (state, reason)
            self.report(state, reason, offered)

    def check(self) -> str:
        """Connect (or reuse the live connection) and answer the remote home directory.
        Raises TransportError; used by the admin's "test connection"."""
        with self._link() as link:
            return link.home()

    def _run(self, script: str, *, stdin: bytes = b"", timeout: float = 30.0) -> tuple[int, str]:
        with self._link() as link:
            return link.run(script, stdin=stdin, timeout=timeout)

    def expand_path(self, path: str) -> str:
        if "\x00" in path:
            raise TransportError(f"{path!r} is not a usable path: it contains a NUL character")
        with self._link() as link:
            home = link.home()
        if path == "~" or path.startswith("~/"):
            path = home + path[1:]
        elif path.startswith("~"):
            raise TransportError(f"{path!r}: only ~ (the home of {self.target.user or 'the SSH user'}) is expanded")
        return posixpath.normpath(posixpath.join(home, path))

    def real_path(self, path: str) -> str:
        if "\x00" in path or "\n" in path:
            raise TransportError(f"{path!r} is not a usable path: it contains a control character")
        if path == "~" or path.startswith("~/"):
            with self._link() as link:
                path = link.home() + path[1:]
        elif path.startswith("~"):
            raise TransportError(f"{path!r}: only ~ (the home of {self.target.user or 'the SSH user'}) is expanded")
        # realpath -m on that machine: symlinks resolved there, before any "..", and a part
        # that does not exist kept as written (GNU coreutils; busybox has -m too).
        status, output = self._run(f"realpath -m -- {shlex.quote(path)}", timeout=15)
        # The last line: whatever the account's shell start-up files print comes first
        # (seen: pyenv's "cannot rehash" when many commands log in at once).
        resolved = output.strip().splitlines()[-1] if output.strip() else ""
        if status != 0 or not resolved.startswith("/"):
            raise TransportError(f"{path!r} could not be resolved on {self.name}: {resolved or 'no answer'}")
        return resolved

    def list_gguf_stamped(self, models_dir: str) -> list[tuple[str, int, int]]:
        root = self.expand_path(models_dir)
        found: list[tuple[str, int, int]] = []
        links: list[str] = []
        seen = 0
        with self._link() as link, link.sftp() as sftp:
            try:
                if not stat.S_ISDIR(sftp.stat(root).st_mode or 0):
                    raise TransportError(f"models directory {root} is not a directory on {self.name}")
            except FileNotFoundError:
                raise TransportError(f"models directory {root} does not exist on {self.name}") from None
            except PermissionError:
                raise TransportError(f"models directory {root} cannot be read on {self.name}") from None
            pending = [""]
            while pending:
                relative = pending.pop()
                try:
                    entries = sftp.listdir_attr(posixpath.join(root, relative) if relative else root)
                except OSError:
                    continue  # an unreadable subdirectory: skipped, as a local walk skips it
                for attr in entries:
                    seen += 1
                    if seen > MAX_LISTED_ENTRIES:
                        raise TransportError(f"models directory {root} on {self.name} holds more than "
                                             f"{MAX_LISTED_ENTRIES} entries; point it at the models only")
                    key = posixpath.join(relative, attr.filename) if relative else attr.filename
                    mode = attr.st_mode or 0
                    if stat.S_ISDIR(mode):
                        pending.append(key)
                        continue
                    if not attr.filename.lower().endswith(".gguf"):
                        continue
                    if stat.S_ISLNK(mode):
                        links.append(key)  # its target is asked below, all links at once
                    elif stat.S_ISREG(mode):
                        found.append((key, attr.st_size or 0, attr.st_mtime or 0))
        # A linked model counts as a file (a local walk follows the link too); a linked
        # directory is not walked, as locally.
        with self._link() as link:
            targets = link.stat_many([posixpath.join(root, key) for key in links])
        for key, target in zip(links, targets, strict=True):
            if not isinstance(target, OSError) and stat.S_ISREG(target.st_mode or 0):
                found.append((key, target.st_size or 0, target.st_mtime or 0))
        return sorted(found)

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        if not ranges:
            return []
        with self._link() as link:
            return link.read_ranges(ranges)

    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        """Up to ``nbytes`` from byte ``offset``, read in requests of at most 32 KiB, one
        after the other (no prefetch), each bounded by the link's I/O timeout: never more
        than asked, never the weights."""
        with self._link() as link, link.sftp() as sftp:
            with sftp.open(path, "rb") as f:
                f.seek(offset)
                chunks, remaining = [], nbytes
                while remaining > 0:
                    chunk = f.read(min(remaining, 32768))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    remaining -= len(chunk)
                return b"".join(chunks)

    def _resolve_binary(self, binary: str) -> str:
        """The absolute path of ``binary`` on the machine, found the way a non-interactive
        ``sh`` finds it; refused when it is not there (never shown as started)."""
        status, output = self._run(f"command -v -- {shlex.quote(binary)}", timeout=15)
        path = output.strip().splitlines()[-1] if output.strip() else ""
        if status != 0 or not path.startswith("/"):
            raise TransportError(
                f"{binary} was not found on machine '{self.name}' (searched the PATH of a non-interactive shell); "
                "give the absolute path of llama-server on that machine"
            )
        return path

    def spawn(
        self, argv: list[str], log_path: str, cwd: str | None = None, *, bwrap: str = "", sandbox: Sandbox | None = None
    ) -> ProcessId:
        argv = [self._resolve_binary(argv[0]), *argv[1:]]
        if bwrap:
            argv = bwrap_argv(bwrap, (sandbox or Sandbox()).with_hidden(*self.own_secrets().hide), argv)
        # setsid: a session of its own, so closing the SSH channel sends it no SIGHUP and
        # stop can signal its group; nohup in case a SIGHUP comes anyway; stdin from
        # /dev/null and output to the log, so nothing ties it to the channel. `$!` is its
        # pid: in a shell without job control setsid need not fork, so the pid stays.
        script = (
            "umask 077 && "
            f"mkdir -p -- {shlex.quote(posixpath.dirname(log_path))} && "
            f"cd -- {shlex.quote(cwd or '.')} && "
            # A fresh log, never one someone prepared (a planted link is removed, then
            # noclobber creates the file anew).
            f"rm -f -- {shlex.quote(log_path)} && set -C && "
            f"{{ setsid nohup {shlex.join(argv)} > {shlex.quote(log_path)} 2>&1 < /dev/null & }} && "
            "echo $!"
        )
        status, output = self._run(script, timeout=30)
        pid_text = output.strip().splitlines()[-1] if output.strip() else ""
        if status != 0 or not pid_text.isdigit():
            raise TransportError(f"could not start {argv[0]} on machine '{self.name}': {output.strip()[-500:]}")
        pid = int(pid_text)
        stat_fields = self._stat(pid)
        started = ProcessId(pid, stat_fields[1] if stat_fields else "")
        return self._server_in_sandbox(started) if bwrap else started

    def find_bwrap(self, name: str) -> tuple[str, str]:
        quoted = shlex.quote(name)
        script = (
            f"b=$(command -v -- {quoted}) || {{ echo 'not found'; exit 127; }}; "
            f'"$b" {shlex.join(probe_argv("x")[1:])} 2>&1 || exit 3; echo "$b"'
        )
        status, output = self._run(script, timeout=20)
        found = output.strip().splitlines()[-1] if output.strip() else ""
        if status == 0 and found.startswith("/"):
            return found, ""
        if status == 127:
            return "", (f"bubblewrap ({name}) is not installed on machine '{self.name}' (searched the PATH of a "
                        "non-interactive shell)")
        return "", f"bubblewrap ({name}) could not make a sandbox on machine '{self.name}': {output.strip()[-300:]}"

    def own_secrets(self) -> Sandbox:
        return Sandbox(hide=(self.private_dir(),))

    def write_private(self, path: str, text: str) -> None:
        # umask 077 before creation and noclobber (O_EXCL) after removing whatever was
        # there: the file is 0600 from its first byte and never one someone prepared. The
        # text travels on stdin, never on a command line (`ps` shows those to everyone).
        script = (
            "umask 077 && "
            f"mkdir -p -- {shlex.quote(posixpath.dirname(path))} && "
            f"rm -f -- {shlex.quote(path)} && "
            f"set -C && cat > {shlex.quote(path)}"
        )
        status, output = self._run(script, stdin=text.encode(), timeout=30)
        if status != 0:
            raise TransportError(f"could not write {path} on machine '{self.name}': {output.strip()[-300:]}")

    def remove(self, path: str) -> None:
        try:
            with self._link() as link, link.sftp() as sftp:
                sftp.remove(path)
        except (OSError, TransportError):
            pass

    def _stat(self, pid: int) -> tuple[str, str] | None:
        """(state, start time) from the machine's ``/proc/<pid>/stat``; None when gone."""
        with self._link() as link, link.sftp() as sftp:
            try:
                with sftp.open(f"/proc/{int(pid)}/stat", "r") as f:
                    text = f.read(4096).decode("utf-8", "replace")
            except OSError:
                return None
        try:
            return parse_proc_stat(text)
        except (ValueError, IndexError):
            return None

    def process_alive(self, proc: ProcessId) -> bool:
        stat_fields = self._stat(proc.pid)
        return stat_fields is not None and stat_fields[1] == proc.start_time and stat_fields[0] not in ("Z", "X")

    def send_signal(self, proc: ProcessId, sig: int) -> None:
        if not self.process_alive(proc):
            return
        number, pid = int(sig), int(proc.pid)
        try:
            group = parse_proc_group(self.read_proc(pid, "stat"))
        except (ValueError, IndexError):
            group = pid
        # Its whole process group (setsid made it, or the bubblewrap around it, the
        # leader); the pid alone if that fails.
        self._run(f"kill -{number} -- -{int(group)} 2>/dev/null || kill -{number} {pid} 2>/dev/null; true", timeout=15)

    def log_tail(self, log_path: str, lines: int = 15) -> str:
        try:
            with self._link() as link, link.sftp() as sftp:
                with sftp.open(log_path, "r") as f:
                    size = f.stat().st_size or 0
                    f.seek(max(size - LOG_TAIL_BYTES, 0))
                    text = f.read(LOG_TAIL_BYTES).decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip("\n").split("\n")[-lines:])

    def base_url(self, port: int) -> str:
        return f"http://127.0.0.1:{ssh.forward_port(self.target, port)}"

    def release_port(self, port: int) -> None:
        ssh.close_forward(self.target, port)

    def free_port(self) -> int:
        """A port nothing listens on in the machine's ``/proc/net/tcp{,6}`` (no helper
        program needed there), picked at random from the dynamic range."""
        busy: set[int] = set()
        with self._link() as link, link.sftp() as sftp:
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                try:
                    with sftp.open(table, "r") as f:
                        text = f.read(4 * 1024 * 1024).decode("ascii", "replace")
                except OSError:
                    continue
                for row in text.splitlines()[1:]:
                    fields = row.split()
                    if len(fields) > 1 and ":" in fields[1]:
                        busy.add(int(fields[1].rsplit(":", 1)[1], 16))
        candidates = [p for p in random.sample(range(20000, 60000), 200) if p not in busy]
        if not candidates:
            raise TransportError(f"no free port found on machine '{self.name}'")
        return candidates[0]

    def _kind(self, path: str) -> int | None:
        with self._link() as link, link.sftp() as sftp:
            try:
                return sftp.stat(path).st_mode
            except OSError:
                return None

    def is_file(self, path: str) -> bool:
        mode = self._kind(path)
        return mode is not None and stat.S_ISREG(mode)

    def is_dir(self, path: str) -> bool:
        try:
            mode = self._kind(self.expand_path(path))
        except TransportError as exc:
            if "NUL" in str(exc):
                return False
            raise
        return mode is not None and stat.S_ISDIR(mode)

    def read_proc(self, pid: int, name: str) -> str:
        with self._link() as link, link.sftp() as sftp:
            try:
                with sftp.open(f"/proc/{int(pid)}/{name}", "r") as f:
                    return f.read(65536).decode("utf-8", "replace")
            except OSError:
                return ""

    def run_probe(self, argv: list[str]) -> str | None:
        command = shlex.quote(argv[0])
        status, output = self._run(
            f"command -v -- {command} >/dev/null 2>&1 || exit 127; {shlex.join(argv)} 2>/dev/null", timeout=15
        )
        return output if status == 0 else None

    def make_private_dir(self, path: str) -> None:
        quoted = shlex.quote(path)
        # umask 077: created 0700 from the start; `test -L` first: a link is refused, never
        # followed (mkdir -p and chmod would follow it).
        script = (
            "umask 077 && "
            f"if [ -L {quoted} ]; then echo 'a link is in the way'; exit 3; fi && "
            f"mkdir -p -- {quoted} && chmod 700 -- {quoted}"
        )
        status, output = self._run(script, timeout=30)
        if status != 0:
            raise TransportError(
                f"could not make the private directory {path} on machine '{self.name}': {output.strip()[-300:]}"
            )

    def is_own_file(self, path: str) -> bool:
        with self._link() as link, link.sftp() as sftp:
            try:
                return stat.S_ISREG(sftp.lstat(path).st_mode or 0)
            except OSError:
                return False

    def private_dir(self) -> str:
        with self._link() as link:
            return posixpath.join(link.home(), ".corral")

    def list_files(self, directory: str) -> list[tuple[str, float]]:
        with self._link() as link, link.sftp() as sftp:
            try:
                entries = sftp.listdir_attr(directory)
            except FileNotFoundError:
                return []
            except OSError as exc:
                raise TransportError(f"could not list {directory} on machine '{self.name}': {exc}") from exc
        return [(e.filename, float(e.st_mtime or 0)) for e in entries if stat.S_ISREG(e.st_mode or 0)]

    def file_info(self, path: str) -> FileInfo | None:
        with self._link() as link, link.sftp() as sftp:
            try:
                attr = sftp.stat(path)
            except OSError:
                return None
        mode = attr.st_mode or 0
        kind = "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"
        return FileInfo(kind, attr.st_size or 0)

    def _run_command(
        self,
        argv: list[str],
        *,
        cwd: str,
        timeout: float,
        max_output: int,
        stdin: bytes,
        cancel: threading.Event | None,
    ) -> CommandResult:
        # setsid -w: a session of its own (its leader's pid is the group id, printed first
        # on a line of its own, then exec keeps that pid for the command), waited for, so
        # the channel's exit status says when the command itself ended.
        script = (
            f"cd -- {shlex.quote(cwd)} || exit 126; "
            f"exec setsid -w sh -c 'echo $$; exec \"$@\"' corral-tool {shlex.join(argv)}"
            + ("" if stdin else " < /dev/null")
        )
        with self._link() as link:
            channel = link.start(script, stdin=stdin)
        out = _Output(max_output)
        leader = _LeaderLine(out)
        try:
            channel.settimeout(COMMAND_POLL)
            eof, timed_out, cancelled = _follow(channel, leader.take, deadline=time.monotonic() + timeout,
                                                cancel=cancel)
            if leader.pgid is not None and leader.pgid > 1:
                pgid = leader.pgid
                self._run(f"kill -9 -{pgid} 2>/dev/null; kill -9 -- -{pgid} 2>/dev/null; true", timeout=15)
            if not eof:
                _drain(channel, leader.take, seconds=0.5)
            status = channel.recv_exit_status() if channel.status_event.wait(0.5) else -1
        except (OSError, EOFError) as exc:
            raise TransportError(f"Machine '{self.name}': lost the command's channel ({exc})", permanent=False) from None
        finally:
            link.release_channel(channel)
        leader.flush()
        return CommandResult(bytes(out.kept), status, out.truncated, timed_out, cancelled)
