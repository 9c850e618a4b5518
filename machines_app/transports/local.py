"""The machine the backend runs on: files read with ``open``, processes started with
``subprocess``, liveness and signals through ``/proc``."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from django.conf import settings

from ..sandbox import Sandbox, bwrap_argv, local_secrets, probe_argv, server_environment
from .base import CommandResult, FileInfo, ProcessId, Transport, TransportError, parse_proc_group, parse_proc_stat
from .commands import COMMAND_GRACE, COMMAND_POLL, _feed, _Output, _read_some, _status_code

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
