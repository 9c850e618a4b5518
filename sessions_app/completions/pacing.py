"""Reads of a reply's stream that another thread can break off at once, and that may be
paced so tokens gather into bursts (:class:`AbortableHTTP`; docs/live-page.md, "What it
costs").
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpcore
import httpx

from machines_app.llama_server import tls_context

__all__ = ["AbortableHTTP"]


class _PacedStream(httpcore.NetworkStream):
    """A network stream whose reads start at least ``read_every`` seconds apart, calling
    ``before_read()`` first. The pauses start once ``before_read`` has returned anything
    but ``False`` (None included): a hook that returns False while it has shown nothing
    has the reply's first token read, and shown, the moment it comes — paced from the
    start, it waited up to ``read_every`` after the response's headers, a delay every
    reply's first token paid (docs/live-page.md, "What it costs").

    httpcore reads only when everything read so far has been handed on (h11 needs more
    data), so ``before_read`` runs at the end of each burst of tokens: the step shows
    them then (docs/live-page.md, "What it costs"). The pause lets llama-server's tokens
    gather in the socket: one wake-up, one read and one burst for several tokens, where
    reading each token as it comes cost a wake-up and a trip through httpx per token —
    more CPU than everything else a reply costs Corral."""

    def __init__(self, stream: httpcore.NetworkStream, read_every: float,
                 before_read: Callable[[], bool | None] | None):
        self.stream, self.read_every, self.before_read = stream, read_every, before_read
        self.next_read = 0.0
        self.pacing = before_read is None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self.before_read is not None and self.before_read() is not False:
            self.pacing = True
        wait = self.next_read - time.monotonic()
        if self.pacing and wait > 0:
            time.sleep(wait)  # an abort shuts the socket: the read below then fails at once
        try:
            return self.stream.read(max_bytes, timeout)
        finally:
            self.next_read = time.monotonic() + self.read_every

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, timeout)

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _PacedStream(self.stream.start_tls(*args, **kwargs), self.read_every, self.before_read)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class _RecordingBackend(httpcore.SyncBackend):
    """httpcore's own socket backend, keeping the sockets it opens so they can be shut
    down, its streams paced (:class:`_PacedStream`) when ``read_every`` > 0."""

    def __init__(self, read_every: float = 0.0, before_read: Callable[[], bool | None] | None = None) -> None:
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.read_every, self.before_read = read_every, before_read

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        stream = super().connect_tcp(*args, **kwargs)
        with self._lock:
            self.sockets.append(stream.get_extra_info("socket"))
        if self.read_every > 0 or self.before_read is not None:
            return _PacedStream(stream, self.read_every, self.before_read)
        return stream


class AbortableHTTP:
    """An ``httpx.Client`` whose connections another thread can break off at once, and
    whose reads may be paced.

    Closing a socket does not wake a thread blocked reading it; shutting it down does.
    llama-server sends no byte while it processes a long prompt, so an interrupt must be
    able to end a read that may otherwise last minutes; the shutdown also tells
    llama-server that the client is gone, so it stops working on the request.

    ``read_every`` (seconds, 0 for none) and ``before_read`` pace the reads of every
    connection (:class:`_PacedStream`: the pauses start once ``before_read`` returns
    anything but False).
    """

    def __init__(self, *, read_every: float = 0.0, before_read: Callable[[], bool | None] | None = None) -> None:
        self._backend = _RecordingBackend(read_every, before_read)
        transport = httpx.HTTPTransport(verify=tls_context())  # shared: a new one costs ~26 ms CPU
        # httpx offers no public way to pass httpcore a network backend.
        transport._pool._network_backend = self._backend
        self.client = httpx.Client(transport=transport, verify=tls_context())

    def abort(self) -> None:
        with self._backend._lock:
            sockets = list(self._backend.sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def close(self) -> None:
        self.client.close()
