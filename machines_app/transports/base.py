"""What a transport is: the :class:`Transport` interface every kind of link implements, what
its operations answer (:class:`CommandResult`, :class:`FileInfo`, :class:`ProcessId`) and
what they raise (:class:`TransportError`).

The operations built from the abstract ones (``reachable_by_tools``, ``memory_of``,
``gpu_memory``, ``stop``, the sandbox wrapping of ``run_command`` and ``spawn``) live here
once, for every transport.
"""

from __future__ import annotations

import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..sandbox import Sandbox, bwrap_argv


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
