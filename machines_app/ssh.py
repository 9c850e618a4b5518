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
import io
import logging
import os
import random
import select
import shlex
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey
from paramiko.sftp import (
    CMD_ATTRS,
    CMD_CLOSE,
    CMD_DATA,
    CMD_HANDLE,
    CMD_OPEN,
    CMD_READ,
    CMD_STAT,
    CMD_STATUS,
    SFTP_FLAG_READ,
    int64,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0  # seconds for TCP connect, SSH banner and authentication each
CHANNEL_OPEN_TIMEOUT = 10.0  # seconds for the server to open a session or a direct-tcpip channel
IO_TIMEOUT = 15.0  # seconds a single SFTP request may take before the link is called lost
HEARTBEAT_INTERVAL = 5.0  # seconds between two "are you there" requests on an idle or busy link
DEAD_AFTER = 10.0  # seconds without an answer after which a connection is closed as dead
RETRY_AFTER = 3.0  # seconds a failed connect is answered from memory, so callers never pile up on a dead machine
FORWARD_IDLE = 120.0  # seconds a local forward with no connection stays open before it closes
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's (merged) output kept; the rest is drained and dropped
SESSION_WAIT = 60.0  # seconds a command waits for a session on a busy connection before it gives up
CONNECT_TRIES = 4  # connects tried when sshd drops us before the handshake (its MaxStartups)
SFTP_WINDOW = 16 * 1024 * 1024  # bytes the SFTP channel may have in flight towards us (SSH window)
READ_CHUNK = 255 * 1024  # bytes asked by one SFTP read (OpenSSH's sftp-server answers up to 255 KiB)
PIPELINE_REQUESTS = 64  # SFTP requests in flight at once in a pipelined batch


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
    ``host_key`` text (see :func:`parse_pins`); ``private_key`` the text of the private key
    (OpenSSH or PEM, from the database: :mod:`machines_app.keystore`; never in the repr);
    ``key_problem`` a sentence saying why there is no usable key (the connection is then
    refused with it, never tried). Equal targets share one connection per process."""

    host: str
    port: int
    user: str
    private_key: str = field(repr=False)
    host_keys: str = field(repr=False)
    key_problem: str = ""

    @property
    def entry(self) -> str:
        return host_entry(self.host, self.port)


def parse_private_key(text: str) -> paramiko.PKey:
    """The private key in ``text`` (ed25519, ECDSA or RSA; OpenSSH or PEM form), read from
    memory — never from a file. Raises ValueError with a sentence for a key protected by
    a passphrase or text that is no such key."""
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text.strip() + "\n"))
        except paramiko.PasswordRequiredException:
            raise ValueError("This private key is protected by a passphrase; Corral needs one without.") from None
        except (paramiko.SSHException, ValueError, TypeError, IndexError):
            continue
    raise ValueError("This is not an OpenSSH private key (ed25519, ECDSA or RSA).")


class _RefuseUnknown(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, raising a typed error that carries the offered key, so
    the admin sees its fingerprint. Never adds the key anywhere."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> NoReturn:
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


class LinkBusy(LinkError):
    """The connection is up but every session its sshd allows stayed in use for
    ``SESSION_WAIT`` seconds: the machine is busy, not unreachable."""


class _Dropped(LinkError):
    """The server closed the connection before the SSH handshake was done."""


def _dropped_before_handshake(exc: BaseException) -> bool:
    """paramiko's words when the TCP connection was accepted, then closed or reset before
    the banner or key exchange (sshd's MaxStartups drop, "exceeded MaxStartups" in its log)."""
    if isinstance(exc, EOFError | ConnectionResetError):
        return True
    if isinstance(exc.__context__, TimeoutError):
        return False  # nothing answered in time (a machine that hangs): not a drop
    text = str(exc)
    return isinstance(exc, paramiko.SSHException) and (
        "Error reading SSH protocol banner" in text or "No existing session" in text
    ) and "timed out" not in text.lower()


class _Sessions:
    """The session channels one connection has open, and how many its sshd allows.

    OpenSSH refuses a session past ``MaxSessions`` (10 unless configured) with a channel
    open failure and logs "no more sessions"; it says nothing of the limit before. So
    there is no limit until the first refusal; then the limit is the number the server
    had opened for us at that moment (at least 1, raised when sessions asked for before
    the refusal open after it), and a command waits here for one of them to close — by
    us, or by the server when its command ended (a closed channel is noticed within
    ``_POLL`` seconds). A refusal while fewer are open than the learnt limit (a close the
    server has not finished yet) is waited out the same way."""

    _POLL = 0.2  # seconds between two looks at the open channels while waiting for room

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.asked = 0  # asked for, not answered yet
        self.channels: set[paramiko.Channel] = set()  # opened by the server, not closed yet
        self.limit: int | None = None
        self.cond = threading.Condition()

    @property
    def open(self) -> int:
        """Sessions of ours the server may count now (asked for, or open)."""
        with self.cond:
            self._prune()
            return self.asked + len(self.channels)

    def _prune(self) -> None:
        self.channels = {channel for channel in self.channels if not channel.closed}

    def acquire(self, deadline: float) -> None:
        with self.cond:
            while True:
                self._prune()
                if self.limit is None or self.asked + len(self.channels) < self.limit:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkBusy(
                        f"{self.entry} is busy: all {self.limit} sessions its sshd allows on one connection "
                        f"(MaxSessions) stayed in use for {SESSION_WAIT:g} s"
                    )
                self.cond.wait(min(left, self._POLL))
            self.asked += 1

    def opened(self, channel: paramiko.Channel) -> None:
        with self.cond:
            self.asked = max(self.asked - 1, 0)
            self.channels.add(channel)
            if self.limit is not None and len(self.channels) > self.limit:
                # Asked for before the refusal and opened after it: the server allows that many.
                self.limit = len(self.channels)

    def failed(self) -> None:
        """The session asked for did not open (the link broke)."""
        with self.cond:
            self.asked = max(self.asked - 1, 0)
            self.cond.notify()

    def release(self, channel: paramiko.Channel) -> None:
        with self.cond:
            self.channels.discard(channel)
            self.cond.notify()

    def refused(self, exc: paramiko.SSHException) -> None:
        """The server refused the session just asked for."""
        with self.cond:
            self.asked = max(self.asked - 1, 0)
            self._prune()
            if self.limit is None:
                # The ones the server opened (never those still asked for at the same
                # moment, which it may refuse too); learnt once: a later refusal below it
                # is a close still under way, which must not shrink the limit step by step.
                self.limit = max(len(self.channels), 1)
                log.info("ssh %s: the server refused a session with %s open (%s); at most %s at once from now on",
                         self.entry, len(self.channels), exc, self.limit)
            # Wait for a close (or a moment, for the server to finish one) before trying again.
            self.cond.wait(0.05 if not self.channels else self._POLL)


@dataclass
class SftpCounts:
    """What a link's SFTP sessions cost: ``requests`` sent, and ``round_trips``: how many
    times a request went out with none of ours in flight, i.e. the client waited a whole
    round trip for the link (a pipelined batch counts once, a ``read()`` loop once per read)."""

    requests: int = 0
    round_trips: int = 0
    in_flight: int = 0


# PRIVATE_SFTP: pipelined reads (many SFTP requests in flight over one round trip, see
# :meth:`Link.read_ranges`) need paramiko's own request and answer hooks — ``_async_request``,
# ``_read_response``, ``_convert_status``, ``_adjust_cwd``, ``SFTPAttributes._from_msg`` —
# which paramiko's public API does not offer (its ``readv`` pipelines one file only).
# requirements.txt therefore keeps paramiko below its next major version, and the SSH
# tests against a real OpenSSH server (tests/test_ssh*.py, bench/discovery_ssh.py) run
# every one of these paths.
class _SFTP(paramiko.SFTPClient):
    """paramiko's SFTP client, counting into :class:`SftpCounts` (every request passes
    through ``_async_request``, every answer through ``_read_packet``)."""

    def __init__(self, channel: paramiko.Channel, counts: SftpCounts) -> None:
        self.counts = counts
        self.link_channel = channel  # get_channel(), typed as never None
        super().__init__(channel)

    def _async_request(self, fileobj: object, t: int, *args: object) -> int:
        counts = self.counts
        counts.requests += 1
        if counts.in_flight == 0:
            counts.round_trips += 1
        counts.in_flight += 1
        request_id: int = super()._async_request(fileobj, t, *args)  # type: ignore[misc]  # PRIVATE_SFTP
        return request_id

    def _read_packet(self) -> tuple[int, bytes]:
        packet: tuple[int, bytes] = super()._read_packet()  # type: ignore[misc]  # PRIVATE_SFTP
        self.counts.in_flight = max(self.counts.in_flight - 1, 0)
        return packet


def _expect(sftp: paramiko.SFTPClient, t: int, msg: paramiko.Message, wanted: int) -> None:
    """Raise the OSError (EOFError at the end of a file) an SFTP status answer carries, or
    SFTPError for an answer of the wrong kind."""
    if t == CMD_STATUS:
        sftp._convert_status(msg)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP (raises for anything but OK)
    if t != wanted:
        raise paramiko.SFTPError(f"unexpected SFTP answer {t} (wanted {wanted})")


class _Pipe:
    """SFTP requests kept in flight together (at most ``PIPELINE_REQUESTS``), each answer
    handed to its callback, which may send more (an open's answer sends its reads). Uses
    paramiko's request machinery (``_async_request``: the answer goes to an object's
    ``_async_response``), the way its own prefetch does."""

    def __init__(self, sftp: paramiko.SFTPClient) -> None:
        self.sftp = sftp
        self.queue: deque = deque()
        self.waiting: dict[int, Callable] = {}

    def send(self, t: int, args: tuple, took: Callable[[int, paramiko.Message], None]) -> None:
        self.queue.append((t, args, took))

    def _async_response(self, t: int, msg: paramiko.Message, num: int) -> None:
        took = self.waiting.pop(num, None)
        if took is not None:
            took(t, msg)

    def run(self) -> None:
        while self.queue or self.waiting:
            while self.queue and len(self.waiting) < PIPELINE_REQUESTS:
                t, args, took = self.queue.popleft()
                self.waiting[self.sftp._async_request(self, t, *args)] = took  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP
            if self.waiting:
                self.sftp._read_response()  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP


class _RangeRead:
    """One file's part of :meth:`Link.read_ranges`: open, reads of ``READ_CHUNK`` (a short
    answer asked again for the rest), close."""

    def __init__(self, pipe: _Pipe, results: list, index: int, path: str, offset: int, nbytes: int) -> None:
        self.pipe, self.results, self.index = pipe, results, index
        self.path, self.offset, self.nbytes = path, offset, nbytes
        self.parts: dict[int, bytes] = {}
        self.handle: bytes | None = None
        self.pending = 0
        self.end = offset + nbytes  # lowered to where the file ends

    def open(self) -> None:
        sftp = self.pipe.sftp
        self.pipe.send(CMD_OPEN, (sftp._adjust_cwd(self.path), SFTP_FLAG_READ, paramiko.SFTPAttributes()), self._opened)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP

    def _opened(self, t: int, msg: paramiko.Message) -> None:
        try:
            _expect(self.pipe.sftp, t, msg, CMD_HANDLE)
        except OSError as exc:
            self.results[self.index] = exc
            return
        self.handle = msg.get_binary()
        for start in range(self.offset, self.end, READ_CHUNK):
            self._read(start, min(READ_CHUNK, self.end - start))
        self._maybe_close()

    def _read(self, start: int, size: int) -> None:
        self.pending += 1
        self.pipe.send(CMD_READ, (self.handle, int64(start), int(size)),
                       lambda t, msg: self._got(start, size, t, msg))

    def _got(self, start: int, size: int, t: int, msg: paramiko.Message) -> None:
        self.pending -= 1
        try:
            _expect(self.pipe.sftp, t, msg, CMD_DATA)
            data = msg.get_string()
        except EOFError:
            self.end = min(self.end, start)
            data = b""
        except OSError as exc:
            self.results[self.index] = exc
            self.end = self.offset
            data = b""
        if data and start < self.end:
            self.parts[start] = data
            if len(data) < size and start + len(data) < self.end:
                self._read(start + len(data), size - len(data))  # a short answer: ask for the rest
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.pending or self.handle is None:
            return
        handle, self.handle = self.handle, None
        self.pipe.send(CMD_CLOSE, (handle,), lambda t, msg: None)
        if isinstance(self.results[self.index], OSError):
            return
        data, at = bytearray(), self.offset
        for start in sorted(self.parts):
            if start != at or at >= self.end:
                break
            data += self.parts[start][: self.end - at]
            at += len(self.parts[start])
        self.results[self.index] = bytes(data)


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
        if target.key_problem:
            raise LinkError(target.key_problem, permanent=True)
        try:
            pkey = parse_private_key(target.private_key)
        except ValueError as exc:
            raise LinkError(f"the private key stored for {target.entry} cannot be used: {exc}", permanent=True) from None
        try:
            client.connect(
                target.host,
                port=target.port,
                username=target.user or None,
                pkey=pkey,
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
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            if _dropped_before_handshake(exc):
                raise _Dropped(f"cannot reach {target.entry}: {reason}") from None
            raise LinkError(f"cannot reach {target.entry}: {reason}") from None
        self.client = client
        transport = client.get_transport()
        assert transport is not None  # connect() returned: the transport is there
        self.transport: paramiko.Transport = transport
        self._home: str | None = None
        self._sftp: _SFTP | None = None
        self._sftp_lock = threading.RLock()
        self._sessions = _Sessions(target.entry)
        self.sftp_counts = SftpCounts()
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
            threading.Thread(target=self._ask_keepalive, args=(answered,), daemon=True).start()
            if not answered.wait(DEAD_AFTER) and self.active:
                log.warning("ssh %s: no answer for %s s; closing the connection", self.target.entry, DEAD_AFTER)
                self.close()
                return

    def _ask_keepalive(self, answered: threading.Event) -> None:
        """One ``keepalive@openssh.com`` request; ``answered`` is set when it returns."""
        try:
            self.transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a closed transport; the beat loop sees it
            pass
        answered.set()

    def lost(self, exc: BaseException | None = None) -> LinkError:
        """Close this link (it is no longer trusted) and say so in the machine's terms."""
        self.close()
        detail = f": {exc}" if exc is not None and str(exc) else ""
        return LinkError(f"lost the SSH connection to {self.target.entry}{detail}")

    # --- commands ------------------------------------------------------------------------

    def _open_session(self, window_size: int | None = None) -> paramiko.Channel:
        """A new session channel (a command or the SFTP subsystem), waiting for room while
        the connection has as many open as its sshd allows (``MaxSessions``, 10 by
        OpenSSH's default). The limit is learnt from the server's refusal ("open failed",
        paramiko's ChannelException): a refused channel is a full connection, never a lost
        one, so the caller waits for one of ours to close and tries again on the same
        connection. Raises LinkError when no session comes within ``SESSION_WAIT`` seconds
        or the link breaks. The caller hands the channel to :meth:`_closed` when done."""
        deadline = time.monotonic() + SESSION_WAIT
        while True:
            self._sessions.acquire(deadline)
            try:
                channel = self.transport.open_session(window_size=window_size, timeout=CHANNEL_OPEN_TIMEOUT)
            except paramiko.ChannelException as exc:
                self._sessions.refused(exc)
                continue
            except paramiko.SSHException as exc:
                # paramiko keeps one refusal per connection: of two refused at once, one
                # sees the ChannelException, the other "Unable to open channel." Either is
                # a refusal while the connection is up.
                if self.active and "Unable to open channel" in str(exc):
                    self._sessions.refused(exc)
                    continue
                self._sessions.failed()
                raise self.lost(exc) from None
            except (OSError, EOFError) as exc:
                self._sessions.failed()
                raise self.lost(exc) from None
            except BaseException:
                self._sessions.failed()
                raise
            self._sessions.opened(channel)
            return channel

    def _closed(self, channel: paramiko.Channel) -> None:
        """Close a channel from :meth:`_open_session` and give its room to the next waiter."""
        try:
            channel.close()
        finally:
            self._sessions.release(channel)

    def release_channel(self, channel: paramiko.Channel) -> None:
        """Close a channel handed out by :meth:`start` (its reader is done with it)."""
        self._closed(channel)

    def run(self, script: str, *, stdin: bytes = b"", timeout: float = 30.0) -> tuple[int, str]:
        """Run ``script`` with ``sh -c`` on the machine; (exit status, merged output).

        ``script`` must already be quoted by the caller (:func:`shlex.quote` on every user
        string); it reaches ``sh`` as one quoted argument, so the login shell of the
        remote user never interprets it. stdout and stderr are merged (so neither can fill
        up and block the other); output beyond ``OUTPUT_LIMIT`` is drained and dropped,
        marked "[output truncated]". Raises LinkError when the command does not finish in
        ``timeout`` seconds (the channel is closed) or the link breaks.
        """
        channel = self._open_session()
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
            self._closed(channel)

    def start(self, script: str, *, stdin: bytes = b"") -> paramiko.Channel:
        """Start ``script`` with ``sh -c`` (quoted as :meth:`run` does) and hand back its
        channel, stdout and stderr merged, ``stdin`` sent and closed; the caller reads,
        waits and gives it back with :meth:`release_channel` (which closes it and frees its
        session for the next command). Raises LinkError."""
        channel = self._open_session()
        try:
            channel.set_combine_stderr(True)
            channel.exec_command("sh -c " + shlex.quote(script))
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self._closed(channel)
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
            if self._sftp is None or self._sftp.link_channel.closed:
                if self._sftp is not None:
                    self._sessions.release(self._sftp.link_channel)  # the closed one's room
                    self._sftp = None
                # A session like any command's (MaxSessions), with a window wide enough
                # for pipelined reads across a slow link.
                channel = self._open_session(window_size=SFTP_WINDOW)
                try:
                    channel.invoke_subsystem("sftp")
                    self._sftp = _SFTP(channel, self.sftp_counts)
                except (paramiko.SSHException, OSError, EOFError) as exc:
                    self._closed(channel)
                    raise self.lost(exc) from None
                self._sftp.link_channel.settimeout(IO_TIMEOUT)
            try:
                yield self._sftp
            except TimeoutError:
                self._sftp = None
                raise self.lost(TimeoutError(f"no answer within {IO_TIMEOUT:g} s")) from None
            except (paramiko.SSHException, EOFError, ConnectionError) as exc:
                self._sftp = None
                raise self.lost(exc) from None

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        """For each ``(path, offset, nbytes)``, up to ``nbytes`` of that file from ``offset``
        (fewer only where the file ends), or the OSError that file gave (no such file,
        permission). Every open, read and close of the batch is pipelined on this link's
        SFTP session (:class:`_Pipe`): a batch costs about three round trips however many
        files it holds, where one ``read()`` after another costs one per 32 KiB. The caller
        bounds the batch's total size (it is all held in memory). Raises LinkError as
        :meth:`sftp` does."""
        results: list[bytes | OSError] = [b""] * len(ranges)
        with self.sftp() as sftp:
            pipe = _Pipe(sftp)
            for index, (path, offset, nbytes) in enumerate(ranges):
                _RangeRead(pipe, results, index, path, offset, nbytes).open()
            pipe.run()
        return results

    def stat_many(self, paths: list[str]) -> list[paramiko.SFTPAttributes | OSError]:
        """``stat`` (links followed) of every path, pipelined as :meth:`read_ranges` is."""
        results: list[paramiko.SFTPAttributes | OSError] = [OSError("no answer")] * len(paths)
        with self.sftp() as sftp:
            pipe = _Pipe(sftp)
            for index, path in enumerate(paths):

                def took(t: int, msg: paramiko.Message, index: int = index) -> None:
                    try:
                        _expect(sftp, t, msg, CMD_ATTRS)
                        results[index] = paramiko.SFTPAttributes._from_msg(msg)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP
                    except OSError as exc:
                        results[index] = exc

                pipe.send(CMD_STAT, (sftp._adjust_cwd(path),), took)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP
            pipe.run()
        return results

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
_connecting: dict[Target, threading.Lock] = {}
_forwards: dict[tuple[Target, int], _Forward] = {}
_pid = os.getpid()


def _after_fork_check() -> None:
    """A forked child must not share its parent's sockets: start with empty registries."""
    global _pid
    if os.getpid() != _pid:
        _links.clear()
        _failures.clear()
        _connecting.clear()
        _forwards.clear()
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
