"""How Corral acts on a machine: one Transport per kind of link (SPEC §2, §11).

Every machine operation — list model files, read a file's head, start a process, check a
pid, reach a port, read a log tail, stop — goes through a :class:`Transport`. Tests that
need a fake replace this seam, never the domain code above it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path


class TransportError(Exception):
    """The machine could not be reached or refused the operation.

    ``permanent`` is False for a link that may come back (SSH down): callers report the
    session as ``unknown`` rather than ``exited``.
    """

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


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

    @abstractmethod
    def list_gguf(self, models_dir: str) -> list[tuple[str, int]]:
        """Every ``*.gguf`` under ``models_dir`` as (key relative to it, '/'-separated; size in bytes).

        Raises TransportError when the directory does not exist or cannot be read.
        """

    @abstractmethod
    def read_head(self, path: str, nbytes: int) -> bytes:
        """Up to the first ``nbytes`` of the file at absolute ``path``."""

    @abstractmethod
    def spawn(self, argv: list[str], log_path: str, cwd: str | None = None) -> ProcessId:
        """Start ``argv`` detached, stdout+stderr appended to ``log_path`` (mode 0600)."""

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

    def stop(self, proc: ProcessId, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL (case C21: a llama-server
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

    def list_gguf(self, models_dir: str) -> list[tuple[str, int]]:
        root = Path(self.expand_path(models_dir))
        if not root.is_dir():
            raise TransportError(f"models directory {root} does not exist on this machine")
        found = []
        for path in root.rglob("*"):
            if path.suffix.lower() == ".gguf" and path.is_file():
                found.append((path.relative_to(root).as_posix(), path.stat().st_size))
        return sorted(found)

    def read_head(self, path: str, nbytes: int) -> bytes:
        with open(path, "rb") as f:
            return f.read(nbytes)

    def spawn(self, argv: list[str], log_path: str, cwd: str | None = None) -> ProcessId:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.chmod(log_path, 0o600)
        try:
            # A session of its own: the server outlives a worker restart (adoption, SPEC §5)
            # and stop can signal its whole process group.
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
            )
        except OSError as exc:
            raise TransportError(f"could not start {argv[0]}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        start_time = self._stat(proc.pid)
        return ProcessId(proc.pid, start_time[1] if start_time else "")

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
            os.killpg(proc.pid, sig)
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


def transport_for(machine) -> Transport:
    """The transport for a :class:`machines_app.models.Machine`."""
    if machine.transport == "local":
        return LocalTransport()
    raise TransportError(f"machine {machine.name}: SSH machines are not supported yet")
