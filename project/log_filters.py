"""Logging filters that keep the log one line per event (docs/operations.md, "Logs").

Two sources wrote tracebacks for conditions that are expected in a team's day:

- ``django.request`` attaches the exception to every refused request: each 403 (a click
  on a session that is not yours, an answer to a question already answered) wrote a full
  traceback. A refusal is the product working; its one line ("Forbidden (...): /path")
  says everything.
- paramiko's transport thread logs ``Exception (client): <reason>`` and then the
  traceback, one log record per line (``paramiko.util.tb_strings``): a machine that is
  down or still starting its sshd wrote hundreds of lines per start.
"""

from __future__ import annotations

import logging
import threading


class OneLineRefusals(logging.Filter):
    """A 4xx response's record loses its exception, so it is one
    line. 5xx records keep theirs (a bug must be found from the log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if status is not None and 400 <= status < 500:
            record.exc_info = None
            record.exc_text = None
        return True


_CONTINUES = ("During handling of the above exception", "The above exception was the direct cause")


class NoParamikoTracebacks(logging.Filter):
    """On records of ``paramiko`` and its children: drops the records that are lines of a traceback. paramiko logs the
    reason first (``Exception (client): Error reading SSH protocol banner``), which is kept;
    then ``Traceback (most recent call last):``, the frames (indented) and the exception's
    own line, each as a record of its own from the same thread, which are dropped, as are
    empty records."""

    def __init__(self) -> None:
        super().__init__()
        self._in_traceback = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("paramiko"):
            return True
        message = record.msg if isinstance(record.msg, str) else str(record.msg)
        inside = getattr(self._in_traceback, "value", False)
        if message.startswith("Traceback (most recent call last)") or message.startswith(_CONTINUES):
            self._in_traceback.value = True
            return False
        if not message.strip():
            return False
        if inside:
            if not message[0].isspace():
                self._in_traceback.value = False  # the exception's own line closes it
            return False
        return True
