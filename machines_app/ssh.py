"""The SSH link to a remote machine (paramiko): pinned host keys, one connection per
machine per process, bounded commands and SFTP, and local port forwards (docs/ssh.md).

No Django import: :class:`machines_app.transports.SSHTransport` builds the machine's
operations on top of this and turns :class:`LinkError` into ``TransportError``.

Every wait here is bounded: connecting (``CONNECT_TIMEOUT``), opening a channel
(``CHANNEL_OPEN_TIMEOUT``), each read on a channel (the caller's timeout) and the peer
itself — a heartbeat asks the server for an answer every ``HEARTBEAT_INTERVAL`` seconds
and closes the connection when none comes within ``DEAD_AFTER``, which wakes every
thread reading from it. So a powered-off machine or a cut network ends as a LinkError
within seconds, never as a thread blocked for ever.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import select
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0  # seconds for TCP connect, SSH banner and authentication each
CHANNEL_OPEN_TIMEOUT = 10.0  # seconds for the server to open a session or a direct-tcpip channel
IO_TIMEOUT = 15.0  # seconds a single SFTP request may take before the link is called lost
HEARTBEAT_INTERVAL = 5.0  # seconds between two "are you there" requests on an idle or busy link
DEAD_AFTER = 10.0  # seconds without an answer after which a connection is closed as dead
RETRY_AFTER = 3.0  # seconds a failed connect is answered from memory, so callers never pile up on a dead machine
FORWARD_IDLE = 120.0  # seconds a local forward with no connection stays open before it closes
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's (merged) output kept; the rest is drained and dropped


class LinkError(Exception):
    """The machine could not be reached, refused us, or stopped answering.

    ``permanent`` is False for a link that may come back by itself (network, sshd down);
    True for a refusal that needs an admin (host key, authentication).
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class HostKeyUnknown(LinkError):
    """The machine offered a host key that is not pinned (no key pinned for that host entry)."""

    def __init__(self, entry: str, offered: paramiko.PKey) -> None:
        self.entry, self.offered = entry, offered
        super().__init__(
            f"host key of {entry} is not pinned (it offers {offered.get_name()} {fingerprint(offered)}); "
            "an admin has to pin it before Corral connects",
            permanent=True,
        )


class HostKeyChanged(LinkError):
    """The machine offered a host key other than the pinned one: refused, never accepted."""

    def __init__(self, entry: str, pinned: paramiko.PKey, offered: paramiko.PKey) -> None:
        self.entry, self.pinned, self.offered = entry, pinned, offered
        super().__init__(
            f"host key of {entry} changed: pinned {fingerprint(pinned)}, offered now {fingerprint(offered)}. "
            "Connection refused; if the machine was really re-installed, an admin re-pins its key",
            permanent=True,
        )


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint of a public key: ``SHA256:<unpadded base64>``, as
    ``ssh-keygen -lf`` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def host_entry(host: str, port: int) -> str:
    """The name a host key is filed under, as OpenSSH writes known_hosts: ``host`` on
    port 22, ``[host]:port`` on any other port."""
    return host if port == 22 else f"[{host}]:{port}"


def public_key_line(key: paramiko.PKey) -> str:
    """``<type> <base64>``: how a pinned key is stored."""
    return f"{key.get_name()} {key.get_base64()}"


def parse_pins(text: str, host: str, port: int) -> paramiko.HostKeys:
    """The pinned host keys for ``host:port`` from the machine's ``host_key`` text.

    Each non-empty line is either ``<type> <base64>`` (pinned for this machine's host
    entry) or a known_hosts line, plain (``[gpu1]:2222 ssh-ed25519 AAAA…``) or hashed
    (``|1|salt|hash ssh-ed25519 AAAA…``), matched the way OpenSSH matches it.
    Raises ValueError naming the line that is neither.
    """
    keys = paramiko.HostKeys()
    entry = host_entry(host, port)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        bare = len(fields) == 2 or (len(fields) >= 2 and fields[0].startswith(("ssh-", "ecdsa-", "sk-")))
        if bare:
            # A bare key is pinned for this machine's own entry (which is never put into
            # the text parsed: a host name is data, not known_hosts syntax).
            line = f"pinned {fields[0]} {fields[1]}"
        try:
            parsed = HostKeyEntry.from_line(line, number)
        except (paramiko.SSHException, InvalidHostKey, ValueError, TypeError) as exc:
            raise ValueError(f"host key line {number} is not a public key or known_hosts line: {exc}") from None
        if parsed is None or parsed.key is None:
            raise ValueError(f"host key line {number} is not a public key or known_hosts line")
        for name in [entry] if bare else parsed.hostnames:
            keys.add(name, parsed.key.get_name(), parsed.key)
    return keys


def pinned_key(keys: paramiko.HostKeys, host: str, port: int) -> paramiko.PKey | None:
    """The first pinned key matching this machine's host entry (plain or hashed)."""
    found = keys.lookup(host_entry(host, port))
    return next(iter(found.values())) if found else None


@dataclass(frozen=True)
class Target:
    """Everything needed to reach one machine. ``host_keys`` is the machine's pinned
    ``host_key`` text (see :func:`parse_pins`); ``key_path`` the private key file on this
    backend. Equal targets share one connection per process."""

    host: str
    port: int
    user: str
    key_path: str
    host_keys: str = field(repr=False)

    @property
    def entry(self) -> str:
        return host_entry(self.host, self.port)


class _RefuseUnknown(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, raising a typed error that carries the offered key, so
    the admin sees its fingerprint. Never adds the key anywhere."""

    def missing_host_key(self, client, hostname, key):
        raise HostKeyUnknown(hostname, key)


def scan_host_key(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> paramiko.PKey:
    """The host key ``host:port`` offers, read without authenticating (for pinning).

    Raises LinkError when nothing SSH answers there.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise LinkError(f"cannot connect to {host_entry(host, port)}: {exc.strerror or exc}") from None
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise LinkError(f"{host_entry(host, port)} did not answer as an SSH server: {exc}") from None
    finally:
        transport.close()


class Link:
    """One authenticated SSH connection with a heartbeat (see the module docstring)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        try:
            pins = parse_pins(target.host_keys, target.host, target.port)
        except ValueError as exc:
            raise LinkError(f"{target.entry}: {exc}", permanent=True) from None
        client = paramiko.SSHClient()
        for name, by_type in pins.items():
            for key in by_type.values():
                client.get_host_keys().add(name, key.get_name(), key)
        client.set_missing_host_key_policy(_RefuseUnknown())
        try:
            client.connect(
                target.host,
                port=target.port,
                username=target.user or None,
                key_filename=target.key_path or None,
                timeout=CONNECT_TIMEOUT,
                banner_timeout=CONNECT_TIMEOUT,
                auth_timeout=CONNECT_TIMEOUT,
                channel_timeout=CHANNEL_OPEN_TIMEOUT,
                look_for_keys=False,
                allow_agent=False,
            )
        except LinkError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyChanged(target.entry, exc.expected_key, exc.key) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise LinkError(
                f"{target.user}@{target.entry} refused the private key ({exc}); check the machine's key and "
                "the user's authorized_keys",
                permanent=True,
            ) from None
        except FileNotFoundError:
            client.close()
            raise LinkError(
                f"the private key for {target.entry} is missing on the Corral backend", permanent=True
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise LinkError(f"cannot reach {target.entry}: {reason}") from None
        self.client = client
        self.transport: paramiko.Transport = client.get_transport()
        self._home: str | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.RLock()
        self._heartbeat = threading.Thread(target=self._beat, name=f"ssh-heartbeat {target.entry}", daemon=True)
        self._heartbeat.start()

    @property
    def active(self) -> bool:
        return self.transport.is_active()

    def close(self) -> None:
        self.client.close()

    def _beat(self) -> None:
        """Ask the server for an answer now and then; close the link when none comes.

        paramiko's own keepalive only sends; an unanswered request is what tells a
        powered-off peer from a quiet one. Closing the transport ends every channel,
        which wakes every reader."""
        while self.active:
            time.sleep(HEARTBEAT_INTERVAL)
            answered = threading.Event()

            def ask() -> None:
                try:
                    self.transport.global_request("keepalive@openssh.com", wait=True)
                except Exception:  # noqa: BLE001 - a closed transport; the loop below sees it
                    pass
                answered.set()

            threading.Thread(target=ask, daemon=True).start()
            if not answered.wait(DEAD_AFTER) and self.active:
                log.warning("ssh %s: no answer for %s s; closing the connection", self.target.entry, DEAD_AFTER)
                self.close()
                return

    def lost(self, exc: BaseException | None = None) -> LinkError:
        """Close this link (it is no longer trusted) and say so in the machine's terms."""
        self.close()
        detail = f": {exc}" if exc is not None and str(exc) else ""
        return LinkError(f"lost the SSH connection to {self.target.entry}{detail}")

    # --- commands ------------------------------------------------------------------------

    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 30.0) -> tuple[int, str]:
        """Run ``script`` with ``sh -c`` on the machine; (exit status, merged output).

        ``script`` must already be quoted by the caller (:func:`shlex.quote` on every user
        string); it reaches ``sh`` as one quoted argument, so the login shell of the
        remote user never interprets it. stdout and stderr are merged (so neither can fill
        up and block the other); output beyond ``OUTPUT_LIMIT`` is drained and dropped,
        marked "[output truncated]". Raises LinkError when the command does not finish in
        ``timeout`` seconds (the channel is closed) or the link breaks.
        """
        try:
            channel = self.transport.open_session(timeout=CHANNEL_OPEN_TIMEOUT)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.lost(exc) from None
        try:
            channel.set_combine_stderr(True)
            channel.settimeout(timeout)
            channel.exec_command("sh -c " + shlex.quote(script))
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
            deadline = time.monotonic() + timeout
            kept, truncated = bytearray(), False
            while True:
                if time.monotonic() > deadline:
                    raise LinkError(f"a command on {self.target.entry} did not finish within {timeout:g} s")
                chunk = channel.recv(32768)
                if not chunk:
                    break
                room = OUTPUT_LIMIT - len(kept)
                kept += chunk[: max(room, 0)]
                truncated = truncated or len(chunk) > room
            if not channel.status_event.wait(max(deadline - time.monotonic(), 0.1)):
                raise LinkError(f"a command on {self.target.entry} did not finish within {timeout:g} s")
            text = kept.decode("utf-8", "replace") + ("\n[output truncated]" if truncated else "")
            return channel.recv_exit_status(), text
        except TimeoutError:
            raise LinkError(f"a command on {self.target.entry} did not finish within {timeout:g} s") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.lost(exc) from None
        finally:
            channel.close()

    def start(self, script: str, *, stdin: bytes = b"") -> paramiko.Channel:
        """Start ``script`` with ``sh -c`` (quoted as :meth:`run` does) and hand back its
        channel, stdout and stderr merged, ``stdin`` sent and closed; the caller reads,
        waits and closes. Raises LinkError."""
        try:
            channel = self.transport.open_session(timeout=CHANNEL_OPEN_TIMEOUT)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.lost(exc) from None
        try:
            channel.set_combine_stderr(True)
            channel.exec_command("sh -c " + shlex.quote(script))
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            channel.close()
            raise self.lost(exc) from None
        return channel

    @contextmanager
    def sftp(self) -> Iterator[paramiko.SFTPClient]:
        """This link's SFTP session, one at a time (a lock), every request waiting at most
        ``IO_TIMEOUT`` seconds. One session per link, kept open: a liveness check four
        times a second must not start an sftp-server process on the machine each time.

        File errors (no such file, permission) come out as paramiko raises them
        (FileNotFoundError, PermissionError, OSError); a timeout or a broken link as
        LinkError, and the link is closed."""
        with self._sftp_lock:
            if self._sftp is None or self._sftp.get_channel().closed:
                try:
                    self._sftp = self.client.open_sftp()
                except (paramiko.SSHException, OSError, EOFError) as exc:
                    self._sftp = None
                    raise self.lost(exc) from None
                self._sftp.get_channel().settimeout(IO_TIMEOUT)
            try:
                yield self._sftp
            except TimeoutError:
                self._sftp = None
                raise self.lost(TimeoutError(f"no answer within {IO_TIMEOUT:g} s")) from None
            except (paramiko.SSHException, EOFError, ConnectionError) as exc:
                self._sftp = None
                raise self.lost(exc) from None

    def home(self) -> str:
        """The remote user's home directory (where ``~`` and relative paths point)."""
        if self._home is None:
            with self.sftp() as sftp:
                self._home = sftp.normalize(".")
        return self._home

    def open_forward_channel(self, remote_port: int, origin: tuple[str, int]) -> paramiko.Channel:
        """A ``direct-tcpip`` channel to ``127.0.0.1:remote_port`` on the machine.

        Raises LinkError; paramiko's ChannelException ("Connect failed": nothing listens
        there yet) passes through unchanged so a caller can tell it apart."""
        try:
            return self.transport.open_channel(
                "direct-tcpip", ("127.0.0.1", remote_port), origin, timeout=CHANNEL_OPEN_TIMEOUT
            )
        except paramiko.ChannelException:
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.lost(exc) from None


# --- one link per machine per process ------------------------------------------------------

_lock = threading.Lock()
_links: dict[Target, Link] = {}
_failures: dict[Target, tuple[float, LinkError]] = {}
_forwards: dict[tuple[Target, int], _Forward] = {}
_pid = os.getpid()


def _after_fork_check() -> None:
    """A forked child must not share its parent's sockets: start with empty registries."""
    global _pid
    if os.getpid() != _pid:
        _links.clear()
        _failures.clear()
        _forwards.clear()
        _pid = os.getpid()


def link_for(target: Target) -> Link:
    """The live connection to ``target`` in this process, connecting (bounded) when there
    is none or the last one died. Raises LinkError; a connect that failed less than
    ``RETRY_AFTER`` seconds ago fails again at once with the same error."""
    with _lock:
        _after_fork_check()
        link = _links.get(target)
        if link is not None and link.active:
            return link
        _links.pop(target, None)
        failure = _failures.get(target)
        if failure is not None and time.monotonic() - failure[0] < RETRY_AFTER:
            raise failure[1]
    # Connect outside the lock: one slow machine must not hold up the others.
    try:
        link = Link(target)
    except LinkError as exc:
        with _lock:
            _failures[target] = (time.monotonic(), exc)
        raise
    with _lock:
        _failures.pop(target, None)
        current = _links.get(target)
        if current is not None and current.active:
            link.close()
            return current
        _links[target] = link
        return link


def drop_link(target: Target) -> None:
    """Close this process's connection to ``target`` (a re-pinned key, a deleted machine)."""
    with _lock:
        link = _links.pop(target, None)
        _failures.pop(target, None)
    if link is not None:
        link.close()


# --- forwards -----------------------------------------------------------------------------


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
        readable, _, _ = select.select([conn, channel], [], [], 1.0)
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
