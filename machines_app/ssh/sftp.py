"""SFTP for the link: a client that counts its round trips (:class:`SftpCounts`), and the
pipelined batches of :meth:`machines_app.ssh.connection.Link.read_ranges` and ``stat_many``
(many files' opens, reads and closes in flight at once, a few round trips per batch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import paramiko
from paramiko.sftp import (
    CMD_CLOSE,
    CMD_DATA,
    CMD_HANDLE,
    CMD_OPEN,
    CMD_READ,
    CMD_STATUS,
    SFTP_FLAG_READ,
    int64,
)

READ_CHUNK = 255 * 1024  # bytes asked by one SFTP read (OpenSSH's sftp-server answers up to 255 KiB)
PIPELINE_REQUESTS = 64  # SFTP requests in flight at once in a pipelined batch


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
