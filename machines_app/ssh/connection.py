"""One authenticated SSH connection to a machine (:class:`Link`): the sessions its sshd
allows, bounded commands, its one SFTP session, direct-tcpip channels, and a heartbeat that
closes it when the peer stops answering (the waits are listed in :mod:`machines_app.ssh`)."""

from __future__ import annotations

import logging
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import paramiko
from paramiko.sftp import CMD_ATTRS, CMD_STAT

from .keys import HostKeyChanged, LinkError, Target, _RefuseUnknown, host_entry, parse_pins, parse_private_key
from .sftp import _SFTP, SftpCounts, _expect, _Pipe, _RangeRead

log = logging.getLogger("machines_app.ssh")  # the package's logger: one name for all of the link

CONNECT_TIMEOUT = 10.0  # seconds for TCP connect, SSH banner and authentication each
CHANNEL_OPEN_TIMEOUT = 10.0  # seconds for the server to open a session or a direct-tcpip channel
IO_TIMEOUT = 15.0  # seconds a single SFTP request may take before the link is called lost
HEARTBEAT_INTERVAL = 5.0  # seconds between two "are you there" requests on an idle or busy link
DEAD_AFTER = 10.0  # seconds without an answer after which a connection is closed as dead
OUTPUT_LIMIT = 64 * 1024  # bytes of a command's (merged) output kept; the rest is drained and dropped
SESSION_WAIT = 60.0  # seconds a command waits for a session on a busy connection before it gives up
SFTP_WINDOW = 16 * 1024 * 1024  # bytes the SFTP channel may have in flight towards us (SSH window)


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
                        results[index] = paramiko.SFTPAttributes._from_msg(msg)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP in machines_app.ssh.sftp
                    except OSError as exc:
                        results[index] = exc

                pipe.send(CMD_STAT, (sftp._adjust_cwd(path),), took)  # type: ignore[attr-defined]  # paramiko's private SFTP hooks: see PRIVATE_SFTP in machines_app.ssh.sftp
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
