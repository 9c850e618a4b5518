"""Following a tool command while it runs (docs/behaviour.md §9, C47): its output kept up to
a cap, its exit noticed, its process group ended at a timeout, a cancel or soon after it
exits. :class:`machines_app.transports.local.LocalTransport` follows a pipe,
:class:`machines_app.transports.remote.SSHTransport` an SSH channel.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko


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
