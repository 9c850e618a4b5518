"""What an admin does to an SSH machine: pin its host key, re-pin a changed one, test the
connection, store the private key Corral uses (docs/ssh.md).

``check_*`` validate and answer without writing; ``do_*`` write. Every failure is a
MachineError whose message is for the admin.
"""

from __future__ import annotations

import paramiko

from . import keystore, ssh
from .models import Machine
from .transports import RelayTransport, SSHTransport, TransportError, reader_for, ssh_target, transport_for


class MachineError(Exception):
    """An admin action on a machine failed; the message says why in the admin's terms."""


def check_offered_host_key(host: str, port: int, expected_fingerprint: str = "") -> tuple[str, str]:
    """Connect once, without authenticating, and read the host key ``host:port`` offers.

    Returns (the known_hosts line to pin — ``<host entry> <type> <base64>``, the entry
    written as OpenSSH writes it, ``[host]:port`` off port 22 — and the key's SHA256
    fingerprint). When the admin
    gave the fingerprint they expect (from ``ssh-keygen -lf`` on the machine), a
    different key is refused naming both.
    """
    try:
        key = ssh.scan_host_key(host, port)
    except ssh.LinkError as exc:
        raise MachineError(str(exc)) from None
    found = ssh.fingerprint(key)
    expected = expected_fingerprint.strip()
    if expected and expected.removeprefix("SHA256:") != found.removeprefix("SHA256:"):
        raise MachineError(
            f"{ssh.host_entry(host, port)} offers host key {found}, not the expected {expected}; nothing was pinned"
        )
    return f"{ssh.host_entry(host, port)} {ssh.public_key_line(key)}", found


def do_repin(machine: Machine) -> tuple[str, str]:
    """Pin the key the machine offered when it was refused for a changed key.

    That key was recorded at the refusal, so what is pinned is exactly what the admin was
    shown (not whatever answers now). Returns (old, new) fingerprints.
    """
    machine.refresh_from_db()
    if not machine.offered_host_key:
        raise MachineError(f"Machine '{machine.name}': no changed host key was seen; nothing to re-pin")
    old, new = machine.host_key_fingerprint, machine.offered_key_fingerprint
    ssh.drop_link(ssh_target(machine))
    Machine.objects.filter(pk=machine.pk).update(
        host_key=f"{machine.host_entry} {machine.offered_host_key}",
        offered_host_key="",
        link_state=Machine.LinkState.UNCHECKED,
        link_reason="",
    )
    machine.refresh_from_db()
    return old, new


def _containment_sentence(machine: Machine, transport) -> str:
    """Whether ``machine``'s tools are contained, in words, checked through ``transport``
    (MachineError when it cannot be asked)."""
    try:
        bwrap = check_containment(machine, transport)
    except TransportError as exc:
        raise MachineError(str(exc)) from None
    return f"tools contained by bubblewrap ({bwrap})" if bwrap else f"tools NOT contained: {machine.containment_reason}"


def do_test_connection(machine: Machine) -> str:
    """Connect (host key checked, key authentication) and answer a sentence for the admin.
    The machine's link state is updated either way. Another Corral host's local machine is
    asked through that host (machines_app/transports/relay.py): its answer, or that it did
    not answer, is the test."""
    try:
        transport = reader_for(machine)
    except TransportError as exc:
        raise MachineError(str(exc)) from None
    if isinstance(transport, RelayTransport):
        return (f"Machine '{machine.name}' is the local machine of the Corral host {transport.host}, which answers; "
                f"{_containment_sentence(machine, transport)}.")
    if not isinstance(transport, SSHTransport):
        # Reachable by being here; what is left to check is whether its tools are contained.
        return f"Machine '{machine.name}' is this backend itself: always reachable; {_containment_sentence(machine, transport)}."
    try:
        home = transport.check()
        bwrap = check_containment(machine, transport)
    except TransportError as exc:
        raise MachineError(str(exc)) from None
    contained = (f"tools contained by bubblewrap ({bwrap})" if bwrap
                 else f"tools NOT contained: {machine.containment_reason}")
    return (
        f"Machine '{machine.name}' answers as {machine.user or 'the SSH user'} (home {home}), "
        f"host key {machine.host_key_fingerprint}; {contained}."
    )


def check_containment(machine: Machine, transport=None) -> str:
    """bubblewrap's absolute path on ``machine`` when a sandbox can be made there, else ''
    (the machine's 'bubblewrap' field empty, the program missing, or the kernel refusing
    its namespaces). What was found is noted on the machine, for its admin page
    (docs/security.md "What a tool can reach"). Raises TransportError when the machine
    cannot be asked."""
    if not machine.bwrap_path.strip():
        machine.note_containment(False, "the machine's 'bubblewrap' field is empty: an admin turned the sandbox off")
        return ""
    bwrap, reason = (transport or transport_for(machine)).find_bwrap(machine.bwrap_path.strip())
    machine.note_containment(bool(bwrap), reason)
    return bwrap


def containment_warning(machine: Machine) -> str:
    """The admin's sentence for a machine whose tools are not contained ('' otherwise):
    what a tool there can read, and what to do about it."""
    if machine.containment != Machine.Containment.EXPOSED:
        return ""
    if machine.transport == Machine.Transport.LOCAL:
        return (
            f"Tools on {machine.name} are not contained ({machine.containment_reason}): a tool call there can read "
            "Corral's own files on this backend — its database with every server's key, its secret key, the SSH keys "
            "of every machine. Install bubblewrap (apt-get install bubblewrap) and fill in the 'bubblewrap' field."
        )
    return (
        f"Tools on {machine.name} are not contained ({machine.containment_reason}): every tool call there runs as "
        f"{machine.user or 'the SSH user'} and can read Corral's files in ~/.corral on that machine — other "
        "sessions' saved prompt caches (their conversations), server logs, key files while a server starts — and "
        "signal other sessions' servers. Install bubblewrap there (Debian/Ubuntu: apt-get install bubblewrap), "
        "then restart the servers; or give Corral an account of its own on that machine."
    )


def _parse_private_key(text: str) -> paramiko.PKey:
    try:
        return ssh.parse_private_key(text)
    except ValueError as exc:
        raise MachineError(str(exc)) from None


def do_store_private_key(machine: Machine, text: str) -> str:
    """Store a pasted private key for ``machine`` in the database, encrypted with a key
    derived from ``SECRET_KEY`` (:mod:`machines_app.keystore`), so every Corral host
    reaches the machine with it. Returns the public key's fingerprint (for the admin to
    compare with authorized_keys); the key itself is never shown again. Raises
    MachineError for text that is no private key Corral can use."""
    key = _parse_private_key(text)
    sealed = keystore.seal_key(text.strip() + "\n")
    ssh.drop_link(ssh_target(machine))
    Machine.objects.filter(pk=machine.pk).update(private_key_sealed=sealed)
    machine.private_key_sealed = sealed
    return ssh.fingerprint(key)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def private_key_state(machine: Machine) -> str:
    """The admin page's sentence about the machine's stored private key: its public key's
    fingerprint, or what is wrong and what to do (none stored; not readable with this
    installation's SECRET_KEY). Never the key."""
    if not machine.private_key_sealed:
        return _sentence(keystore.missing_sentence(machine.name))
    try:
        text = keystore.open_key(machine.private_key_sealed)
    except keystore.KeyUnreadable:
        return _sentence(keystore.unreadable_sentence(machine.name))
    try:
        return f"Stored, encrypted (public key {ssh.fingerprint(ssh.parse_private_key(text))})."
    except ValueError as exc:
        return f"The stored key cannot be used ({exc}): paste it again."
