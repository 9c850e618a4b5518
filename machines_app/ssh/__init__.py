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

The package, one job a module, each importing only those above it:

* :mod:`.keys` — host keys pinned and matched, the private key, :class:`Target`, :class:`LinkError`;
* :mod:`.sftp` — the SFTP client that counts round trips, and its pipelined batches;
* :mod:`.connection` — :class:`Link`, one authenticated connection: sessions, commands, SFTP, heartbeat;
* :mod:`.links` — one link per machine per process (:func:`link_for`, :func:`drop_link`);
* :mod:`.forwards` — local port forwards to a port on the machine (:func:`forward_port`).

The public names are re-exported here. A limit (``SESSION_WAIT``…) is read where it is
defined, so a test that changes one patches that module (``machines_app.ssh.connection``).
"""

from .connection import (
    CHANNEL_OPEN_TIMEOUT,
    CONNECT_TIMEOUT,
    DEAD_AFTER,
    HEARTBEAT_INTERVAL,
    IO_TIMEOUT,
    OUTPUT_LIMIT,
    SESSION_WAIT,
    SFTP_WINDOW,
    Link,
    LinkBusy,
    scan_host_key,
)
from .forwards import FORWARD_IDLE, close_forward, forward_port, open_forwards
from .keys import (
    HostKeyChanged,
    HostKeyUnknown,
    LinkError,
    Target,
    fingerprint,
    host_entry,
    parse_pins,
    parse_private_key,
    pinned_key,
    public_key_line,
)
from .links import CONNECT_TRIES, RETRY_AFTER, drop_link, link_for
from .sftp import PIPELINE_REQUESTS, READ_CHUNK, SftpCounts

__all__ = [
    "CHANNEL_OPEN_TIMEOUT",
    "CONNECT_TIMEOUT",
    "CONNECT_TRIES",
    "DEAD_AFTER",
    "FORWARD_IDLE",
    "HEARTBEAT_INTERVAL",
    "IO_TIMEOUT",
    "OUTPUT_LIMIT",
    "PIPELINE_REQUESTS",
    "READ_CHUNK",
    "RETRY_AFTER",
    "SESSION_WAIT",
    "SFTP_WINDOW",
    "HostKeyChanged",
    "HostKeyUnknown",
    "Link",
    "LinkBusy",
    "LinkError",
    "SftpCounts",
    "Target",
    "close_forward",
    "drop_link",
    "fingerprint",
    "forward_port",
    "host_entry",
    "link_for",
    "open_forwards",
    "parse_pins",
    "parse_private_key",
    "pinned_key",
    "public_key_line",
    "scan_host_key",
]
