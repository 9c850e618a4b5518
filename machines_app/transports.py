"""How Corral acts on a machine: one Transport per kind of link (docs/behaviour.md §2, §11).

Every machine operation — list model files, read a file's head, start a process, check a
pid, reach a port, read a log tail, stop — goes through a :class:`Transport`. Tests that
need a fake replace this seam, never the domain code above it.
"""

from __future__ import annotations

import os
import posixpath
import random
import selectors
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from . import keystore, ssh
from .sandbox import Sandbox, bwrap_argv, local_secrets, probe_argv, server_environment

if TYPE_CHECKING:
    import paramiko


class TransportError(Exception):
    """The machine could not be reached or refused the operation.

    ``permanent`` is False for a link that may come back (SSH down): callers report the
    session as ``unknown`` rather than ``exited``.
    """

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


class ElsewhereError(TransportError):
    """The machine is another Corral host's local machine: its processes, loopback ports and
    files are on that host, and only that host's workers touch them (docs/operations.md,
    "More hosts"). A process that meets this must not conclude anything about the server."""


def is_here(transport: str, corral_host: str) -> bool:
    """Whether a machine of ``transport`` owned by the host ``corral_host`` can be reached
    from this process: an SSH machine from any host; a local machine from its own host only
    (an unclaimed one, ``corral_host`` empty, from any: one host, as before hosts had ids)."""
    return transport != "local" or not corral_host or corral_host == settings.CORRAL_HOST_ID


def _refuse_elsewhere(name: object, corral_host: str) -> None:
    raise ElsewhereError(
        f"Machine '{name}' is the local machine of the Corral host {corral_host}; only that host reaches it "
        f"(this is {settings.CORRAL_HOST_ID or 'a host without an id'}).")


@dataclass(frozen=True)
class CommandResult:
    """What :meth:`Transport.run_command` saw.

    ``output``: stdout and stderr merged, at most the ``max_output`` bytes asked for (the
    rest was read and dropped: ``truncated``). ``exit_code``: the command's status, 128 + N
    when signal N ended it, -1 when it is not known. ``timed_out`` / ``cancelled``: the
    command was ended (its whole process group killed) at the timeout / on ``cancel``.
    """

    output: bytes
    exit_code: int
    truncated: bool = False
    timed_out: bool = False
    cancelled: bool = False


@dataclass(frozen=True)
class FileInfo:
    """A path's kind (``"file"``, ``"dir"`` or ``"other"``, links followed) and size in bytes."""

    kind: str
    size: int


#: Seconds between two looks at a running command (its output, its exit, a cancel).
COMMAND_POLL = 0.05
#: Seconds a command's output is still read after its shell exited; then its process
#: group is killed: a child it left in the background never holds the call (docs/behaviour.md C47).
COMMAND_GRACE = 0.3


class _Output:
    """Bytes kept up to a cap; the rest is counted and dropped (the pipe must keep draining,
    or the command blocks on a full pipe)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.kept)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            self.kept += chunk[:room]


def _status_code(status: int) -> int:
    return 128 - status if status < 0 else status


@dataclass(frozen=True)
class ProcessId:
    """A process on a machine: ``pid`` plus its start time from ``/proc/<pid>/stat``
    (field 22, clock ticks since boot), so a reused pid is never mistaken for ours."""

    pid: int
    start_time: str


def parse_proc_stat(text: str) -> tuple[str, str]:
    """``/proc/<pid>/stat`` text → (state letter, start time field).

    The command name (field 2) may contain spaces and parentheses, so fields are counted
    after the last ``)``: state is field 3, starttime field 22 (proc(5)).
    """
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], rest[19]


def parse_proc_group(text: str) -> int:
    """``/proc/<pid>/stat`` text → its process group id (field 5, proc(5))."""
    return int(text[text.rindex(")") + 2 :].split()[2])


class Transport(ABC):
    """Operations on one machine. Paths are that machine's own."""

    @abstractmethod
    def expand_path(self, path: str) -> str:
        """``~`` and relative parts expanded on that machine; returns an absolute path."""

    @abstractmethod
    def real_path(self, path: str) -> str:
        """``path`` as that machine's ``realpath`` answers it: ``~`` expanded to the home
        directory of the account Corral uses there, then every symlink and ``..`` resolved.
        A part that does not exist is kept as written (``realpath -m``), so a path can be
        compared before it is known to exist. ``path`` is absolute or starts with ``~``.

        Working directories and workspace roots are compared on these (machines_app.workspaces).
        Raises TransportError when the machine cannot be asked.
        """

    def list_gguf(self, models_dir: str) -> list[tuple[str, int]]:
        """Every ``*.gguf`` under ``models_dir`` as (key relative to it, '/'-separated; size in bytes).

        Raises TransportError when the directory does not exist or cannot be read.
        """
        return [(key, size) for key, size, _mtime in self.list_gguf_stamped(models_dir)]

    @abstractmethod
    def list_gguf_stamped(self, models_dir: str) -> list[tuple[str, int, int]]:
        """As :meth:`list_gguf`, each with its modification time too (whole seconds since
        the epoch, the resolution SFTP gives): (key, size, mtime), sorted by key. A linked
        file counts with its target's size and time."""

    @abstractmethod
    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        """Up to ``nbytes`` of the file at absolute ``path`` from byte ``offset`` (fewer only
        where the file ends): a model's head is read on from where the last read stopped
        (machines_app.discovery.read_model_head), never again from the start."""

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        """For each ``(absolute path, offset, nbytes)`` what :meth:`read_head` gives, or the
        OSError that file gave. Over SSH one pipelined batch (a few round trips for all of
        them); here one read after the other. Raises TransportError when the machine
        cannot be asked."""
        answers: list[bytes | OSError] = []
        for path, offset, nbytes in ranges:
            try:
                answers.append(self.read_head(path, nbytes, offset))
            except OSError as exc:
                answers.append(exc)
        return answers

    @abstractmethod
    def spawn(
        self, argv: list[str], log_path: str, cwd: str | None = None, *, bwrap: str = "", sandbox: Sandbox | None = None
    ) -> ProcessId:
        """Start ``argv`` detached, stdout+stderr written to a fresh ``log_path`` (mode 0600).

        With ``bwrap`` (bubblewrap's absolute path there, from :meth:`find_bwrap`) it runs
        in a sandbox (machines_app.sandbox): ``sandbox`` plus what :meth:`own_secrets` says
        of this machine hidden. The ProcessId answered is then the server's own (the
        child of bubblewrap's init, as this machine sees it), so liveness, memory and
        adoption follow the server, and a stop signals its process group, which holds the
        whole sandbox. Raises TransportError."""

    @abstractmethod
    def find_bwrap(self, name: str) -> tuple[str, str]:
        """(absolute path, "") of the bubblewrap ``name`` names on this machine (looked up
        on the PATH of a non-interactive shell when it has no ``/``) when it can make a
        sandbox there; ("", why not, in a sentence) when it is missing or cannot (a
        kernel without unprivileged namespaces). Raises TransportError when the machine
        cannot be asked."""

    @abstractmethod
    def own_secrets(self) -> Sandbox:
        """What a sandboxed server on this machine must never reach: Corral's private
        directory there (and on the backend's own machine its data directory and code)."""

    def reachable_by_tools(self, path: str, mask: tuple[str, ...] = ()) -> bool:
        """Whether a tool in this machine's sandbox could see the file at ``path`` (links and
        ``..`` resolved there, :meth:`real_path`): not inside a directory :meth:`own_secrets`
        hides, not a file it or ``mask`` masks. What Corral reads itself for a tool (read_file, a write's
        diff on the card) is held to this, so it shows nothing the sandbox hides. Raises
        TransportError when the machine cannot be asked."""
        real = self.real_path(path)
        secrets = self.own_secrets()
        hidden = [self.real_path(root) for root in secrets.hide]
        masked = {self.real_path(file) for file in (*secrets.mask, *mask)}
        return real not in masked and not any(
            real == root or real.startswith(root.rstrip("/") + "/") for root in hidden)

    def _sandboxed(self, bwrap: str, argv: list[str], cwd: str, mask: tuple[str, ...] = ()) -> list[str]:
        """``argv`` run in ``cwd`` inside this machine's tool sandbox (see :meth:`run_command`),
        the files of ``mask`` (secrets outside Corral's directories) empty there too."""
        own = self.own_secrets()
        existing = tuple(path for path in mask if self.file_info(path) is not None)
        sandbox = Sandbox(mask=existing).with_hidden(*own.hide, read_only=own.read_only, mask=own.mask)
        return bwrap_argv(bwrap, sandbox, ["--chdir", cwd, "--", *argv])

    def _server_in_sandbox(self, outer: ProcessId, timeout: float = 10.0) -> ProcessId:
        """The server bubblewrap ``outer`` runs: the one child of its init (pid 1 of the
        new PID namespace), as this machine numbers it. ``outer`` itself when bubblewrap
        exited first (it could not set the sandbox up: its words are in the log, and the
        readiness wait reports them). Raises TransportError when no server shows up."""
        deadline = time.monotonic() + timeout
        pid = outer.pid
        for _level in ("init", "server"):
            while True:
                children = self.read_proc(pid, f"task/{pid}/children").split()
                if children and children[0].isdigit():
                    pid = int(children[0])
                    break
                if not self.process_alive(outer):
                    return outer
                if time.monotonic() > deadline:
                    raise TransportError(f"bubblewrap (pid {outer.pid}) started no llama-server within {timeout:.0f} s")
                time.sleep(0.02)
        try:
            _state, start_time = parse_proc_stat(self.read_proc(pid, "stat"))
        except (ValueError, IndexError):
            return outer
        return ProcessId(pid, start_time)

    @abstractmethod
    def write_private(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` readable by its owner only (mode 0600 from the
        first byte: the file is created with that mode, never chmod-ed after writing).

        Raises TransportError when it cannot be written.
        """

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete the file at ``path``; nothing when it is already gone."""

    @abstractmethod
    def process_alive(self, proc: ProcessId) -> bool:
        """True while that very process (pid and start time) runs; False once it is gone.

        Raises TransportError(permanent=False) when liveness cannot be told.
        """

    @abstractmethod
    def send_signal(self, proc: ProcessId, sig: int) -> None:
        """Signal the process group of ``proc`` if it is still that process."""

    @abstractmethod
    def log_tail(self, log_path: str, lines: int = 15) -> str:
        """The last ``lines`` lines of a log file, '' when there is none."""

    @abstractmethod
    def base_url(self, port: int) -> str:
        """An http URL through which this backend reaches ``127.0.0.1:port`` on that machine."""

    @abstractmethod
    def free_port(self) -> int:
        """A TCP port free on that machine's loopback at the time of asking."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is an existing directory on that machine."""

    @abstractmethod
    def is_file(self, path: str) -> bool:
        """Whether ``path`` is an existing file on that machine."""

    @abstractmethod
    def make_private_dir(self, path: str) -> None:
        """Create the directory ``path`` (its parent existing or made too) readable by its
        owner only (0700), or make an existing one so. A link at ``path`` is refused, never
        followed (docs/behaviour.md C43). Raises TransportError."""

    @abstractmethod
    def is_own_file(self, path: str) -> bool:
        """Whether ``path`` is a regular file itself: a link there (to a file or not) is
        not, so a file Corral reads back is never one a link points at (docs/behaviour.md C43).
        Raises TransportError when the machine cannot be asked."""

    @abstractmethod
    def list_files(self, directory: str) -> list[tuple[str, float]]:
        """``(name, modification time in seconds since the epoch)`` of each regular file
        directly in ``directory`` (links and folders left out); [] when there is no such
        directory. Raises TransportError when the machine cannot be asked."""

    @abstractmethod
    def private_dir(self) -> str:
        """A directory on that machine, readable by its owner only, where Corral keeps a
        session's server log and key file (created on first use)."""

    def release_port(self, port: int) -> None:  # noqa: B027 - a hook: most transports hold nothing per port
        """This backend no longer needs to reach ``port`` (its server was stopped)."""

    def run_command(
        self,
        argv: list[str],
        *,
        cwd: str,
        timeout: float,
        max_output: int,
        stdin: bytes = b"",
        cancel: threading.Event | None = None,
        bwrap: str = "",
        mask: tuple[str, ...] = (),
    ) -> CommandResult:
        """Run ``argv`` in ``cwd`` on that machine, in a session and process group of its own
        (a tool call: docs/behaviour.md §9, C47), and wait for it, at most ``timeout`` seconds.

        With ``bwrap`` (bubblewrap's absolute path there) it runs in the sandbox a server of
        that machine runs in (:meth:`own_secrets` hidden, the files of ``mask`` empty, a PID
        namespace of its own, no secret in its environment: docs/security.md "What a tool
        can reach"): a tool Corral runs reaches no more than one llama-server runs.

        stdout and stderr are merged; ``max_output`` bytes are kept. ``stdin`` is written to
        it, then closed (empty: ``/dev/null``). The command ends, its whole process group
        killed (SIGKILL), at ``timeout``, within ``COMMAND_POLL`` of ``cancel`` being set, and
        ``COMMAND_GRACE`` after its first process exits: a child left running in the
        background, holding the output open or not, never holds the call and never outlives
        it. What it printed before is kept. Raises TransportError when it cannot be started
        (the machine unreachable, ``cwd`` missing)."""
        if bwrap:
            argv = self._sandboxed(bwrap, argv, cwd, mask)
        return self._run_command(argv, cwd=cwd, timeout=timeout, max_output=max_output, stdin=stdin, cancel=cancel)

    @abstractmethod
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
        """:meth:`run_command` once ``argv`` is what runs (wrapped in the sandbox or not)."""

    @abstractmethod
    def file_info(self, path: str) -> FileInfo | None:
        """What is at absolute ``path`` (links followed), or None when nothing is or it
        cannot be looked at. Raises TransportError when the machine cannot be asked."""

    @abstractmethod
    def read_proc(self, pid: int, name: str) -> str:
        """The text of ``/proc/<pid>/<name>`` on that machine ('' when the process is gone)."""

    @abstractmethod
    def run_probe(self, argv: list[str]) -> str | None:
        """Run a short read-only command there (``argv[0]`` looked up on the PATH); its
        output, or None when the program is not there or fails."""

    def memory_of(self, proc: ProcessId) -> int | None:
        """Resident memory of that process in bytes (``VmRSS`` of ``/proc/<pid>/status``,
        proc(5)); None when it is gone or another process has its pid."""
        if not self.process_alive(proc):
            return None
        for line in self.read_proc(proc.pid, "status").splitlines():
            if line.startswith("VmRSS:"):
                fields = line.split()
                if len(fields) >= 2 and fields[1].isdigit():
                    return int(fields[1]) * 1024  # proc(5) reports kB
        return None

    def gpu_memory(self) -> dict[int, int] | None:
        """GPU memory in use per process id, in bytes, from ``nvidia-smi
        --query-compute-apps=pid,used_memory`` (MiB); None when the machine has no
        ``nvidia-smi`` (no NVIDIA GPU, or no driver)."""
        output = self.run_probe(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        )
        if output is None:
            return None
        used: dict[int, int] = {}
        for row in output.splitlines():
            parts = [part.strip() for part in row.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                used[int(parts[0])] = used.get(int(parts[0]), 0) + int(parts[1]) * 1024 * 1024
        return used

    def stop(self, proc: ProcessId, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL (docs/behaviour.md C21: a llama-server
        that served tool calls was seen to hang in "cleaning up before exit…")."""
        if not self.process_alive(proc):
            return
        self.send_signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self.process_alive(proc):
                return
            time.sleep(0.1)
        self.send_signal(proc, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.process_alive(proc):
            time.sleep(0.1)


#: The bubblewrap processes this process started and has not reaped yet.
_SANDBOXES: list[subprocess.Popen] = []


class LocalTransport(Transport):
    """The machine the backend runs on."""

    def expand_path(self, path: str) -> str:
        try:
            return str(Path(os.path.expanduser(path)).resolve())
        except (OSError, ValueError, RuntimeError) as exc:
            raise TransportError(f"{path!r} is not a usable path: {exc}") from None

    def real_path(self, path: str) -> str:
        try:
            return os.path.realpath(os.path.expanduser(path))
        except (OSError, ValueError) as exc:
            raise TransportError(f"{path!r} is not a usable path: {exc}") from None

    def list_gguf_stamped(self, models_dir: str) -> list[tuple[str, int, int]]:
        root = Path(self.expand_path(models_dir))
        if not root.is_dir():
            raise TransportError(f"models directory {root} does not exist on this machine")
        found = []
        for path in root.rglob("*"):
            if path.suffix.lower() == ".gguf" and path.is_file():
                info = path.stat()
                found.append((path.relative_to(root).as_posix(), info.st_size, int(info.st_mtime)))
        return sorted(found)

    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    def spawn(
        self, argv: list[str], log_path: str, cwd: str | None = None, *, bwrap: str = "", sandbox: Sandbox | None = None
    ) -> ProcessId:
        if bwrap:
            own = self.own_secrets()
            argv = bwrap_argv(bwrap, (sandbox or Sandbox()).with_hidden(*own.hide, read_only=own.read_only, mask=own.mask),
                              argv)
        Path(log_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            # A fresh file, never one someone prepared there (a link planted at the path is
            # removed, not written through: docs/behaviour.md C43), owner-only from creation.
            Path(log_path).unlink(missing_ok=True)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise TransportError(f"could not open the log {log_path}: {exc.strerror or exc}") from exc
        try:
            # A session of its own: the server outlives a worker restart (adoption, docs/behaviour.md §5)
            # and stop can signal its whole process group.
            # umask 077: what the server writes itself (its saved slots) is its owner's only,
            # as a remote server's is (docs/behaviour.md C43).
            # server_environment: Corral's secrets (SECRET_KEY, DATABASE_URL, REDIS_URL,
            # CORRAL_*) are never in a server's environment, sandboxed or not.
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                umask=0o077, env=server_environment(os.environ),
            )
        except OSError as exc:
            raise TransportError(f"could not start {argv[0]}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        start_time = self._stat(proc.pid)
        started = ProcessId(proc.pid, start_time[1] if start_time else "")
        if not bwrap:
            return started
        # bubblewrap is this process's child, the server its grandchild: bubblewrap is
        # reaped when it ends (process_alive polls it), never left a zombie.
        _SANDBOXES.append(proc)
        return self._server_in_sandbox(started)

    def find_bwrap(self, name: str) -> tuple[str, str]:
        path = shutil.which(name) if "/" not in name else (name if os.access(name, os.X_OK) else None)
        if not path:
            return "", (f"bubblewrap ({name}) is not installed on this machine: apt-get install bubblewrap "
                        "(./corral run installs it)")
        try:
            probe = subprocess.run(probe_argv(path), stdin=subprocess.DEVNULL, capture_output=True, timeout=15,
                                   env=server_environment(os.environ))
        except (OSError, subprocess.TimeoutExpired) as exc:
            return "", f"bubblewrap ({path}) could not make a sandbox here: {exc}"
        if probe.returncode != 0:
            said = probe.stderr.decode(errors="replace").strip()[-300:]
            return "", f"bubblewrap ({path}) could not make a sandbox here: {said or f'exit status {probe.returncode}'}"
        return os.path.realpath(path), ""

    def own_secrets(self) -> Sandbox:
        # The data directory (secret key, SQLite database, SSH keys under ssh/, images,
        # logs, key files, slots); Corral's code and virtualenv read-only; a SQLite
        # database kept elsewhere masked.
        data = str(settings.DATA_DIR)
        databases = [str(value) for db in settings.DATABASES.values() if "sqlite" in db.get("ENGINE", "")
                     for value in (db.get("NAME"), (db.get("TEST") or {}).get("NAME")) if value]
        secret_files = [f"{name}{suffix}" for name in databases for suffix in ("", "-wal", "-shm", "-journal")]
        code = [str(settings.BASE_DIR), os.path.realpath(sys.prefix)]
        return local_secrets(data, code, secret_files)

    def write_private(self, path: str, text: str) -> None:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # O_EXCL after an unlink: a file someone else prepared at that path is never reused.
            Path(path).unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError as exc:
            raise TransportError(f"could not write {path}: {exc.strerror or exc}") from exc

    def remove(self, path: str) -> None:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:
            pass

    def _stat(self, pid: int) -> tuple[str, str] | None:
        try:
            return parse_proc_stat(Path(f"/proc/{pid}/stat").read_text())
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            return None

    def process_alive(self, proc: ProcessId) -> bool:
        _SANDBOXES[:] = [outer for outer in _SANDBOXES if outer.poll() is None]
        stat = self._stat(proc.pid)
        if stat is None or stat[1] != proc.start_time:
            return False
        if stat[0] in ("Z", "X"):
            # Our own child that exited: reap it so the pid is released.
            try:
                os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            return False
        return True

    def send_signal(self, proc: ProcessId, sig: int) -> None:
        if not self.process_alive(proc):
            return
        try:
            group = parse_proc_group(Path(f"/proc/{proc.pid}/stat").read_text())
        except (OSError, ValueError, IndexError):
            return
        # Its process group: the one it leads (started in a session of its own), or, in a
        # sandbox, bubblewrap's (which holds everything in it). Never Corral's own.
        try:
            if group > 1 and group != os.getpgrp():
                os.killpg(group, sig)
            else:
                os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            os.kill(proc.pid, sig)

    def log_tail(self, log_path: str, lines: int = 15) -> str:
        try:
            with open(log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines)).rstrip("\n")
        except FileNotFoundError:
            return ""

    def base_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def is_file(self, path: str) -> bool:
        try:
            return Path(path).is_file()
        except (OSError, ValueError):
            return False

    def is_dir(self, path: str) -> bool:
        try:
            return Path(self.expand_path(path)).is_dir()
        except (OSError, ValueError):  # a name too long, a NUL, no permission: not a directory we can use
            return False

    def read_proc(self, pid: int, name: str) -> str:
        try:
            return Path(f"/proc/{int(pid)}/{name}").read_text(errors="replace")
        except OSError:
            return ""

    def run_probe(self, argv: list[str]) -> str | None:
        if shutil.which(argv[0]) is None:
            return None
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    def make_private_dir(self, path: str) -> None:
        try:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            # Opened without following a link: a link planted at the path fails here.
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        except OSError as exc:
            raise TransportError(f"could not make the private directory {path}: {exc.strerror or exc}") from exc

    def is_own_file(self, path: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def private_dir(self) -> str:
        return str(settings.CORRAL_LOG_DIR)

    def list_files(self, directory: str) -> list[tuple[str, float]]:
        try:
            with os.scandir(directory) as entries:
                return [(e.name, e.stat(follow_symlinks=False).st_mtime) for e in entries
                        if e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise TransportError(f"could not list {directory}: {exc.strerror or exc}") from exc

    def file_info(self, path: str) -> FileInfo | None:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        kind = "file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"
        return FileInfo(kind, st.st_size)

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
        try:
            # A session of its own: the pgid is the pid, and killpg reaches all it started
            # (bubblewrap's init included: it keeps the group). Never Corral's secrets in
            # its environment (sandbox.server_environment), sandboxed or not.
            proc = subprocess.Popen(
                argv, cwd=cwd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, env=server_environment(os.environ),
            )
        except OSError as exc:
            raise TransportError(f"could not run {argv[0]} in {cwd}: {exc.strerror or exc}") from exc
        if stdin:
            threading.Thread(target=_feed, args=(proc, stdin), daemon=True).start()
        out = _Output(max_output)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        eof, exited_at, timed_out, cancelled = False, None, False, False
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                if eof:
                    time.sleep(COMMAND_POLL)
                elif selector.select(COMMAND_POLL):
                    eof = _read_some(fd, out)
                now = time.monotonic()
                # WNOWAIT: the shell stays a zombie, so its pid (the group id) is not reused
                # before the group is killed below.
                if exited_at is None and os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    exited_at = now
                if exited_at is not None and (eof or now - exited_at >= COMMAND_GRACE):
                    break
                if cancel is not None and cancel.is_set():
                    cancelled = True
                    break
                if now >= deadline:
                    timed_out = True
                    break
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # What was printed before the kill is still in the pipe: keep it.
            until = time.monotonic() + 0.5
            while not eof and time.monotonic() < until and selector.select(COMMAND_POLL):
                eof = _read_some(fd, out)
        status = proc.wait()
        proc.stdout.close()
        return CommandResult(bytes(out.kept), _status_code(status), out.truncated, timed_out, cancelled)


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(data)
        proc.stdin.close()
    except (OSError, ValueError):  # the command exited without reading it all
        pass


def _read_some(fd: int, out: _Output) -> bool:
    """Read what the pipe holds (a few chunks at most, so a command that prints without
    end still lets the caller look at the clock) into ``out``; True at end of file."""
    for _ in range(16):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        out.add(chunk)
    return False


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
        for key, attr in zip(links, targets, strict=True):
            if not isinstance(attr, OSError) and stat.S_ISREG(attr.st_mode or 0):
                found.append((key, attr.st_size or 0, attr.st_mtime or 0))
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


class _LeaderLine:
    """Splits what a remote command writes into the process group id its wrapper prints
    first, on a line of its own (``pgid``; -1 when the first line is not one, e.g. ``cd``
    failed), and the command's own output, which goes to ``out``."""

    def __init__(self, out: _Output) -> None:
        self.out = out
        self.head = bytearray()  # the output until the group id's line is read
        self.pgid: int | None = None

    def take(self, chunk: bytes) -> None:
        if self.pgid is not None:
            self.out.add(chunk)
            return
        self.head.extend(chunk)
        line, newline, rest = bytes(self.head).partition(b"\n")
        if newline and line.strip().isdigit():
            self.pgid = int(line)
            self.head.clear()
            self.out.add(rest)
        elif newline or len(self.head) > 64:  # not our line (cd failed): all of it is output
            self.out.add(bytes(self.head))
            self.head.clear()
            self.pgid = -1

    def flush(self) -> None:
        """What is still held (a command that wrote less than a line) is output too."""
        if self.head:
            self.out.add(bytes(self.head))
            self.head.clear()


def _follow(channel: paramiko.Channel, take: Callable[[bytes], None], *, deadline: float,
            cancel: threading.Event | None) -> tuple[bool, bool, bool]:
    """Read ``channel`` (``COMMAND_POLL`` timeout set) into ``take`` until the command has
    exited and its output ended (or ``COMMAND_GRACE`` seconds passed since it exited: a
    background child may hold the output open), until ``deadline`` (``time.monotonic()``)
    or until ``cancel`` is set. Returns (output ended, timed out, cancelled)."""
    eof, exited_at = False, None
    while True:
        if not eof:
            try:
                chunk = channel.recv(65536)
                if chunk:
                    take(chunk)
                else:
                    eof = True
            except TimeoutError:
                pass
        else:
            time.sleep(COMMAND_POLL)
        now = time.monotonic()
        if exited_at is None and channel.exit_status_ready():
            exited_at = now
        if exited_at is not None and (eof or now - exited_at >= COMMAND_GRACE):
            return eof, False, False
        if cancel is not None and cancel.is_set():
            return eof, False, True
        if now >= deadline:
            return eof, True, False


def _drain(channel: paramiko.Channel, take: Callable[[bytes], None], *, seconds: float) -> None:
    """What the channel still holds, for up to ``seconds`` (after the command's group was killed)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            chunk = channel.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            return
        take(chunk)
def _target(name: str, host: str, port: int, user: str, sealed: str, host_keys: str) -> ssh.Target:
    """An :class:`ssh.Target` whose private key is opened from its sealed form (the
    database's ``private_key_sealed``, :mod:`machines_app.keystore`); a key that is not
    there or cannot be opened becomes the target's ``key_problem`` sentence."""
    private_key, problem = "", ""
    if not sealed:
        problem = keystore.missing_sentence(name)
    else:
        try:
            private_key = keystore.open_key(sealed)
        except keystore.KeyUnreadable:
            problem = keystore.unreadable_sentence(name)
    return ssh.Target(host=host, port=port, user=user, private_key=private_key, host_keys=host_keys,
                      key_problem=problem)


def ssh_target(machine) -> ssh.Target:
    """How to reach an SSH :class:`machines_app.models.Machine`: its key comes from the
    database, so every Corral host reaches it the same way."""
    return _target(machine.name, machine.host, machine.port, machine.user, machine.private_key_sealed,
                   machine.host_key)


def machine_place(machine) -> dict[str, object]:
    """What :func:`transport_at` needs to reach ``machine`` again, as plain JSON: name,
    transport and, for SSH, host, port, user, the private key as sealed in the database
    (the encrypted token, readable only with the installation's ``SECRET_KEY``) and the
    pinned host key.

    For a task that must reach a machine whose row may be deleted before it runs (the
    server of a session deleted with its machine, docs/behaviour.md §5)."""
    return {
        "name": machine.name, "transport": machine.transport, "corral_host": getattr(machine, "corral_host", ""),
        "host": machine.host, "port": machine.port,
        "user": machine.user, "private_key_sealed": machine.private_key_sealed, "host_key": machine.host_key,
    }


def transport_at(place: dict) -> Transport:
    """The transport for a :func:`machine_place`; its link state is reported nowhere
    (the row may be gone). Raises TransportError for a place it cannot reach
    (ElsewhereError: another host's local machine)."""
    if place.get("transport") == "local":
        if not is_here("local", str(place.get("corral_host") or "")):
            _refuse_elsewhere(place.get("name"), str(place.get("corral_host")))
        return LocalTransport()
    if place.get("transport") == "ssh" and place.get("host"):
        name = str(place.get("name") or place["host"])
        target = _target(name, str(place["host"]), int(place.get("port") or 22), str(place.get("user") or ""),
                         str(place.get("private_key_sealed") or ""), str(place.get("host_key") or ""))
        return SSHTransport(name, target)
    raise TransportError(f"Machine '{place.get('name')}' cannot be reached: transport {place.get('transport')!r}")


def transport_for(machine) -> Transport:
    """The transport for a :class:`machines_app.models.Machine`. An SSH machine's link
    state is written back to its row as it changes (see ``Machine.note_link``). Raises
    ElsewhereError for another host's local machine (:func:`is_here`)."""
    if machine.transport == "local":
        if not is_here("local", machine.corral_host):
            _refuse_elsewhere(machine.name, machine.corral_host)
        return LocalTransport()
    if machine.transport == "ssh":
        if not machine.host:
            raise TransportError(f"Machine '{machine.name}' has no host")
        refused = machine.link_reason if machine.link_state == machine.LinkState.HOST_KEY_CHANGED else ""
        return SSHTransport(machine.name, ssh_target(machine), report=machine.note_link, refused=refused)
    raise TransportError(f"Machine '{machine.name}' has an unknown transport {machine.transport!r}")


class ToolView:
    """A machine as a tool call sees it: what Corral does there *for a tool* (the built-ins
    it runs itself, sessions_app.machine_tools; the file a write's card compares with,
    sessions_app.callcard) reaches no more than a tool in that machine's sandbox would
    (docs/security.md "What a tool can reach").

    Commands run in the sandbox when ``bwrap`` is bubblewrap's path there ('' where the
    machine has none: the same exposure as its server's tools). A path inside what the
    sandbox hides (Corral's data directory here, ``~/.corral`` there), or a masked secret
    file (its own, or one of ``mask``), reads as nothing there: no file, no directory, no bytes. Everything else is the
    wrapped transport's. Raises what the transport raises."""

    def __init__(self, transport: Transport, bwrap: str, mask: tuple[str, ...] = ()) -> None:
        self.transport, self.bwrap, self.mask = transport, bwrap, mask
        self._reach: dict[str, bool] = {}

    def __getattr__(self, name: str):
        return getattr(self.transport, name)

    def reachable(self, path: str) -> bool:
        if path not in self._reach:
            self._reach[path] = self.transport.reachable_by_tools(path, self.mask)
        return self._reach[path]

    def run_command(self, argv: list[str], **kwargs) -> CommandResult:
        return self.transport.run_command(argv, bwrap=self.bwrap, mask=self.mask, **kwargs)

    def file_info(self, path: str) -> FileInfo | None:
        return self.transport.file_info(path) if self.reachable(path) else None

    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        return self.transport.read_head(path, nbytes, offset) if self.reachable(path) else b""

    def is_file(self, path: str) -> bool:
        return self.reachable(path) and self.transport.is_file(path)

    def is_dir(self, path: str) -> bool:
        return self.reachable(path) and self.transport.is_dir(path)
