"""Who a machine is and who we are to it: host keys pinned and matched the way OpenSSH
matches them (never accepted unseen, never replaced silently), the private key read from
memory, and the :class:`Target` that names one machine. :class:`LinkError`, what every part
of the link raises, is defined here, at the bottom of the package."""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, field
from typing import NoReturn

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey


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
