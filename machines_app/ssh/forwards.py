"""Local port forwards: a port on this backend's loopback that reaches a port on the
machine's (a server's HTTP port), over whatever link is live when a client connects."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Any

import paramiko

from .connection import Link
from .keys import LinkError, Target
from .links import _after_fork_check, _fork_resets, _lock, link_for

log = logging.getLogger("machines_app.ssh")  # the package's logger: one name for all of the link

FORWARD_IDLE = 120.0  # seconds a local forward with no connection stays open before it closes

_forwards: dict[tuple[Target, int], _Forward] = {}
_fork_resets.append(_forwards.clear)  # a forked child holds none of its parent's listeners


class _Forward:
    """A listening socket on this backend's loopback; each connection to it becomes a
    ``direct-tcpip`` channel to ``127.0.0.1:remote_port`` on the machine, opened over
    whatever connection is live at that moment (so a forward outlives a reconnect)."""

    def __init__(self, target: Target, remote_port: int) -> None:
        self.target, self.remote_port = target, remote_port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(1.0)
        self.local_port: int = self.sock.getsockname()[1]
        self.active_pumps = 0
        self.last_used = time.monotonic()
        self.closed = False
        threading.Thread(target=self._accept, name=f"ssh-forward {target.entry}:{remote_port}", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, origin = self.sock.accept()
            except TimeoutError:
                if self.active_pumps == 0 and time.monotonic() - self.last_used > FORWARD_IDLE:
                    _discard_forward(self)
                continue
            except OSError:
                return  # closed
            self.last_used = time.monotonic()
            threading.Thread(target=self._serve, args=(conn, origin), daemon=True).start()

    def _serve(self, conn: socket.socket, origin: tuple[str, int]) -> None:
        try:
            link = link_for(self.target)
            channel = link.open_forward_channel(self.remote_port, origin)
        except (LinkError, paramiko.ChannelException) as exc:
            # Nothing listens there yet (a server still loading) or the machine is lost:
            # the HTTP client sees a closed connection and says so in its own terms.
            log.debug("forward to %s:%s not opened: %s", self.target.entry, self.remote_port, exc)
            conn.close()
            return
        self.active_pumps += 1
        try:
            _pump(conn, channel, link)
        finally:
            self.active_pumps -= 1
            self.last_used = time.monotonic()
            channel.close()
            conn.close()


def _pump(conn: socket.socket, channel: paramiko.Channel, link: Link) -> None:
    """Copy bytes both ways until either side closes or the link dies (checked every
    second, so a dead link never leaves this thread blocked)."""
    while link.active and not channel.closed:
        waitables: list[Any] = [conn, channel]  # a socket and a paramiko Channel (it has fileno())
        readable, _, _ = select.select(waitables, [], [], 1.0)
        try:
            if conn in readable:
                data = conn.recv(65536)
                if not data:
                    return
                channel.sendall(data)
            if channel in readable:
                data = channel.recv(65536)
                if not data:
                    return
                conn.sendall(data)
        except (OSError, paramiko.SSHException, EOFError):
            return


def _discard_forward(forward: _Forward) -> None:
    with _lock:
        if _forwards.get((forward.target, forward.remote_port)) is forward:
            del _forwards[(forward.target, forward.remote_port)]
    forward.close()


def forward_port(target: Target, remote_port: int) -> int:
    """The local port (on 127.0.0.1 of this backend) that reaches ``127.0.0.1:remote_port``
    on the machine, opening the listener on first use in this process. Nothing connects
    to the machine until a client connects to that port."""
    with _lock:
        _after_fork_check()
        forward = _forwards.get((target, remote_port))
        if forward is None or forward.closed:
            forward = _forwards[(target, remote_port)] = _Forward(target, remote_port)
        forward.last_used = time.monotonic()
        return forward.local_port


def close_forward(target: Target, remote_port: int) -> None:
    """Close this process's forward to ``remote_port`` (its server was stopped)."""
    with _lock:
        forward = _forwards.pop((target, remote_port), None)
    if forward is not None:
        forward.close()


def open_forwards() -> list[tuple[str, int]]:
    """(host entry, remote port) of every forward this process holds (for tests and the admin)."""
    with _lock:
        return [(t.entry, port) for (t, port), f in _forwards.items() if not f.closed]
