"""The launcher's process helpers: a free loopback port, the data directory made ready,
children that die with the launcher, owner-only files, and a stop with a grace
(project/launcher.py and project/embedded_redis.py use them)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from pathlib import Path

from project import data_dir

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_data_dir() -> Path:
    """The data directory, made ready (folders, secret key) for every process after this."""
    path = data_dir.location()
    data_dir.prepare(path)
    return path


def die_with_parent() -> None:
    """In a child before exec: have Linux send it SIGTERM when the launcher dies, even
    by SIGKILL, so nothing of Corral outlives a launcher killed outright (prctl
    PR_SET_PDEATHSIG; elsewhere nothing is done)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):
        pass


def write_private(path: Path, text: str) -> None:
    """``text`` into a fresh file at ``path``, owner-only from creation (a file or link
    already there is removed first, never written through)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def stop_process(proc: subprocess.Popen | None, what: str, grace: float = 20.0) -> None:
    """SIGTERM ``proc``, wait up to ``grace`` seconds, then SIGKILL; None is a no-op."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        print(f"{what} did not stop within {grace:.0f} s: killing it", flush=True)
        proc.kill()
        proc.wait()
