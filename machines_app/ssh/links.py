"""One link per machine per process: :func:`link_for` connects once (a burst of callers
waits for that one connect), answers a recent failure from memory for ``RETRY_AFTER``
seconds, and a forked child starts with nothing of its parent's."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable

from .connection import CONNECT_TIMEOUT, Link, _Dropped
from .keys import LinkError, Target

RETRY_AFTER = 3.0  # seconds a failed connect is answered from memory, so callers never pile up on a dead machine
CONNECT_TRIES = 4  # connects tried when sshd drops us before the handshake (its MaxStartups)

_lock = threading.Lock()
_links: dict[Target, Link] = {}
_failures: dict[Target, tuple[float, LinkError]] = {}
_connecting: dict[Target, threading.Lock] = {}
_pid = os.getpid()
#: What else a forked child forgets (:mod:`machines_app.ssh.forwards` adds its forwards).
_fork_resets: list[Callable[[], None]] = []


def _after_fork_check() -> None:
    """A forked child must not share its parent's sockets: start with empty registries."""
    global _pid
    if os.getpid() != _pid:
        _links.clear()
        _failures.clear()
        _connecting.clear()
        for reset in _fork_resets:
            reset()
        _pid = os.getpid()


def link_for(target: Target) -> Link:
    """The live connection to ``target`` in this process, connecting (bounded) when there
    is none or the last one died. Raises LinkError; a connect that failed less than
    ``RETRY_AFTER`` seconds ago fails again at once with the same error."""
    with _lock:
        _after_fork_check()
        link = _live(target)
        if link is not None:
            return link
        connecting = _connecting.setdefault(target, threading.Lock())
    # One connect per machine at a time (a burst of callers waits for it rather than
    # opening a connection each, which sshd's MaxStartups would drop), outside the
    # registry's lock: one slow machine must not hold up the others.
    with connecting:
        with _lock:
            link = _live(target)
            if link is not None:
                return link
        try:
            link = _connect(target)
        except LinkError as exc:
            with _lock:
                _failures[target] = (time.monotonic(), exc)
            raise
        with _lock:
            _failures.pop(target, None)
            _links[target] = link
            return link


def _live(target: Target) -> Link | None:
    """The live link to ``target`` (under ``_lock``); raises the last connect's error while
    it is fresher than ``RETRY_AFTER``."""
    link = _links.get(target)
    if link is not None and link.active:
        return link
    _links.pop(target, None)
    failure = _failures.get(target)
    if failure is not None and time.monotonic() - failure[0] < RETRY_AFTER:
        raise failure[1]
    return None


def _connect(target: Target) -> Link:
    """A new Link, tried again (up to ``CONNECT_TRIES``, a short random pause between)
    when the server closed the connection before the handshake was done: that is how
    sshd's ``MaxStartups`` drops a connection beyond its unauthenticated ones (other
    processes of this backend connecting at the same moment), and not a machine that is
    down (connection refused, a timeout: those fail at once)."""
    for attempt in range(1, CONNECT_TRIES + 1):
        started = time.monotonic()
        try:
            return Link(target)
        except _Dropped as exc:
            # A drop is quick; a connection that went quiet until a timeout is a machine
            # that hangs, and trying again would only multiply the wait.
            if attempt == CONNECT_TRIES or time.monotonic() - started > CONNECT_TIMEOUT / 2:
                raise LinkError(str(exc)) from None
            time.sleep(random.uniform(0.1, 0.5) * attempt)
    raise AssertionError("unreachable")


def drop_link(target: Target) -> None:
    """Close this process's connection to ``target`` (a re-pinned key, a deleted machine)."""
    with _lock:
        link = _links.pop(target, None)
        _failures.pop(target, None)
    if link is not None:
        link.close()
