"""Which transport reaches a machine: from its row (:func:`transport_for`), or from the plain
JSON a task carries when the row may be gone (:func:`machine_place`, :func:`transport_at`);
and whether this Corral host may reach it at all (:func:`is_here`)."""

from __future__ import annotations

from django.conf import settings

from .. import keystore, ssh
from .base import ElsewhereError, Transport, TransportError
from .local import LocalTransport
from .remote import SSHTransport


def is_here(transport: str, corral_host: str) -> bool:
    """Whether a machine of ``transport`` owned by the host ``corral_host`` can be reached
    from this process: an SSH machine from any host; a local machine from its own host only
    (an unclaimed one, ``corral_host`` empty, from any: one host, as before hosts had ids)."""
    return transport != "local" or not corral_host or corral_host == settings.CORRAL_HOST_ID


def _refuse_elsewhere(name: object, corral_host: str) -> None:
    raise ElsewhereError(
        f"Machine '{name}' is the local machine of the Corral host {corral_host}; only that host reaches it "
        f"(this is {settings.CORRAL_HOST_ID or 'a host without an id'}).")


def _target(name: str, host: str, port: int, user: str, sealed: str, host_keys: str) -> ssh.Target:
    """An :class:`ssh.Target` whose private key is opened from its sealed form (the
    database's ``private_key_sealed``, :mod:`machines_app.keystore`); a key that is not
    there or cannot be opened becomes the target's ``key_problem`` sentence."""
    private_key, problem = "", ""
    if not sealed:
        problem = keystore.missing_sentence(name)
    else:
        try:
            private_key = keystore.open_key(sealed)
        except keystore.KeyUnreadable:
            problem = keystore.unreadable_sentence(name)
    return ssh.Target(host=host, port=port, user=user, private_key=private_key, host_keys=host_keys,
                      key_problem=problem)


def ssh_target(machine) -> ssh.Target:
    """How to reach an SSH :class:`machines_app.models.Machine`: its key comes from the
    database, so every Corral host reaches it the same way."""
    return _target(machine.name, machine.host, machine.port, machine.user, machine.private_key_sealed,
                   machine.host_key)


def machine_place(machine) -> dict[str, object]:
    """What :func:`transport_at` needs to reach ``machine`` again, as plain JSON: name,
    transport and, for SSH, host, port, user, the private key as sealed in the database
    (the encrypted token, readable only with the installation's ``SECRET_KEY``) and the
    pinned host key.

    For a task that must reach a machine whose row may be deleted before it runs (the
    server of a session deleted with its machine, docs/behaviour.md §5)."""
    return {
        "name": machine.name, "transport": machine.transport, "corral_host": getattr(machine, "corral_host", ""),
        "host": machine.host, "port": machine.port,
        "user": machine.user, "private_key_sealed": machine.private_key_sealed, "host_key": machine.host_key,
    }


def transport_at(place: dict) -> Transport:
    """The transport for a :func:`machine_place`; its link state is reported nowhere
    (the row may be gone). Raises TransportError for a place it cannot reach
    (ElsewhereError: another host's local machine)."""
    if place.get("transport") == "local":
        if not is_here("local", str(place.get("corral_host") or "")):
            _refuse_elsewhere(place.get("name"), str(place.get("corral_host")))
        return LocalTransport()
    if place.get("transport") == "ssh" and place.get("host"):
        name = str(place.get("name") or place["host"])
        target = _target(name, str(place["host"]), int(place.get("port") or 22), str(place.get("user") or ""),
                         str(place.get("private_key_sealed") or ""), str(place.get("host_key") or ""))
        return SSHTransport(name, target)
    raise TransportError(f"Machine '{place.get('name')}' cannot be reached: transport {place.get('transport')!r}")


def transport_for(machine) -> Transport:
    """The transport for a :class:`machines_app.models.Machine`. An SSH machine's link
    state is written back to its row as it changes (see ``Machine.note_link``). Raises
    ElsewhereError for another host's local machine (:func:`is_here`)."""
    if machine.transport == "local":
        if not is_here("local", machine.corral_host):
            _refuse_elsewhere(machine.name, machine.corral_host)
        return LocalTransport()
    if machine.transport == "ssh":
        if not machine.host:
            raise TransportError(f"Machine '{machine.name}' has no host")
        refused = machine.link_reason if machine.link_state == machine.LinkState.HOST_KEY_CHANGED else ""
        return SSHTransport(machine.name, ssh_target(machine), report=machine.note_link, refused=refused)
    raise TransportError(f"Machine '{machine.name}' has an unknown transport {machine.transport!r}")
