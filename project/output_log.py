"""The output of ``./corral run``, kept: every line of the launcher and of every process
it starts goes to its terminal and to ``data/logs/corral.log``, rotated (docs/operations.md)."""

from __future__ import annotations

import fcntl
import logging
import logging.handlers
import os
import sys
import threading
from pathlib import Path


def append_to_output() -> None:
    """Make this process's stdout and stderr append-only (``O_APPEND`` on the open file
    itself). supervisord and its programs reopen ``/dev/stdout`` with offsets of their own:
    on ``./corral run > file`` the launcher's lines would otherwise overwrite theirs."""
    for fd in (1, 2):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            pass  # not a file we may change (closed, a special device): nothing to protect


#: ``CORRAL_LOG_MAX_BYTES`` and ``CORRAL_LOG_BACKUPS``: the size at which ``data/logs/corral.log``
#: is rotated, and how many rotated files (``corral.log.1`` …) are kept.
LOG_MAX_BYTES = 10_000_000
LOG_BACKUPS = 5


class OutputLog:
    """Everything ``./corral run`` prints — its own lines, the migrations', supervisord's
    and every program's — goes to its terminal (or whatever its output was) *and* to
    ``data/logs/corral.log``, rotated at ``max_bytes`` with ``backups`` older files kept
    (Python's ``RotatingFileHandler``): a long run's output no longer grows without bound
    on disk (a redirect such as ``>> corral.log`` does; it is no longer needed).

    How: file descriptors 1 and 2 of the launcher become the write end of a pipe, which
    every process it starts inherits (supervisord's programs write to ``/dev/stdout``);
    a thread copies what comes through to the original output as it comes and, a line at
    a time, to the log file."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                            encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.original = os.dup(1)
        self.original_err = os.dup(2)
        read_end, self.write_end = os.pipe()
        self.reader = threading.Thread(target=self._copy, args=(read_end,), name="output-log", daemon=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.write_end, 1)
        os.dup2(self.write_end, 2)
        self.reader.start()

    def _copy(self, read_end: int) -> None:
        partial = b""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                try:
                    os.write(self.original, chunk)
                except OSError:
                    pass  # the terminal went away: the file still gets every line
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    self._write(line)
        if partial:
            self._write(partial)
        self.handler.close()

    def _write(self, line: bytes) -> None:
        record = logging.makeLogRecord({"msg": line.decode("utf-8", "replace"), "args": None})
        self.handler.emit(record)

    def close(self) -> None:
        """Give the launcher its own output back and let the copy finish (what every
        process still writing sends is copied until the last one closes the pipe, up to
        a few seconds)."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.original, 1)
        os.dup2(self.original_err, 2)
        os.close(self.write_end)
        self.reader.join(5)
