"""Corral's data directory: where it is, and making it ready before any process starts.

Settings only *read* from here (importing them writes nothing); the launcher calls
:func:`prepare` once before it runs ``manage.py``, daphne, Celery or pytest, so every
process finds the folders and the same secret key.

Layout under ``CORRAL_DATA_DIR`` (default ``<repo>/data``)::

    secret_key        Django's SECRET_KEY when the SECRET_KEY variable is not set (0600)
    host_id           this Corral host's id when CORRAL_HOST_ID is not set: which local
                      machine is its own, its queues and its workers' names
                      (docs/operations.md, "More hosts")
    vapid_private.pem the P-256 key Web Push messages are signed with (VAPID, RFC 8292; 0600):
                      browsers' subscriptions are bound to its public half, so it is kept
    logs/             one llama-server log per start, key files while a server starts,
                      slots/session-<id>/ (a session's saved KV caches)
    redis/            the embedded Redis's directory and its URL (``url``, 0600)
    static/           STATIC_ROOT (WhiteNoise warns when it is missing)
    corral.sqlite3    the default database

SSH private keys and attached images are in the database (encrypted keys:
machines_app/keystore.py; images: sessions_app/images.py), so every Corral host reads
them; an older installation's ``ssh/`` and ``images/`` are moved there by migrations.

All of it is hidden from every llama-server's sandbox, and so from the tools
(machines_app/sandbox.py, docs/security.md).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY_FILE = "secret_key"
VAPID_KEY_FILE = "vapid_private.pem"
HOST_ID_FILE = "host_id"
#: What a host id may be: it is part of queue names (``turns.<id>``) and worker names
#: (``turns@<id>``), so letters, digits, ``-`` and ``_`` only.
HOST_ID_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


def location() -> Path:
    """``CORRAL_DATA_DIR`` made absolute, or ``<repo>/data``; does not create it."""
    raw = os.environ.get("CORRAL_DATA_DIR", "").strip()
    return Path(raw or BASE_DIR / "data").expanduser().resolve()


def read_secret_key(data_dir: Path) -> str:
    """The key kept in ``data_dir/secret_key``; ``""`` when the file is missing or empty."""
    try:
        return (data_dir / SECRET_KEY_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def read_host_id(data_dir: Path) -> str:
    """This Corral host's id: ``CORRAL_HOST_ID`` when set, else the one kept in
    ``data_dir/host_id``; ``""`` when neither is there (:func:`prepare` writes the file).
    Raises ImproperlyConfigured, naming the variable, for a value of another shape than
    :data:`HOST_ID_SHAPE`."""
    raw = os.environ.get("CORRAL_HOST_ID", "").strip()
    if raw:
        if not HOST_ID_SHAPE.fullmatch(raw):
            raise ImproperlyConfigured(
                f"CORRAL_HOST_ID={raw!r} is not a host id: use 1 to 63 letters, digits, '-' or '_', "
                "starting with a letter or digit")
        return raw
    try:
        kept = (data_dir / HOST_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return ""
    return kept if HOST_ID_SHAPE.fullmatch(kept) else ""


def new_host_id() -> str:
    """A fresh host id: the host name (cut to 20 characters of the allowed ones, for the
    reader) and 8 random hex digits, which make it unique however many hosts share a name
    (cloned VMs)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:20].strip("-_") or "host"
    return f"{name}-{secrets.token_hex(4)}"


def prepare(data_dir: Path) -> None:
    """Create the data directory, ``logs/`` and ``static/``, a secret key, the host id
    (:func:`new_host_id`) and the VAPID key (:func:`ensure_vapid_key`) once.

    The key is 50 URL-safe random bytes (as ``check --deploy`` wants: long, varied, not
    Django's ``django-insecure-`` placeholder), written to a temporary file created with
    mode 0600 and renamed into place, so a reader never sees half a key and nobody else
    on the machine can read it. An existing non-empty key is kept: sessions and CSRF
    tokens signed with it stay valid. Idempotent; raises ``OSError`` when the directory
    cannot be written.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    # Owner only: the SQLite database (password hashes, session keys, servers' keys), logs
    # and slots are in here; the files Django and SQLite create are 0644 by the umask.
    try:
        data_dir.chmod(0o700)
    except OSError:
        pass  # not ours to change (a mount, another owner): its own mode stands
    (data_dir / "logs").mkdir(exist_ok=True)
    (data_dir / "static").mkdir(exist_ok=True)
    if not read_secret_key(data_dir):
        _write_private(data_dir, SECRET_KEY_FILE, secrets.token_urlsafe(50).encode())
    # Once per data directory, kept: the host's local machine row and its queues name it.
    kept = (data_dir / HOST_ID_FILE)
    if not (kept.exists() and HOST_ID_SHAPE.fullmatch(kept.read_text().strip())):
        _write_private(data_dir, HOST_ID_FILE, (new_host_id() + "\n").encode())
    ensure_vapid_key(data_dir)


def ensure_vapid_key(data_dir: Path) -> Path:
    """``data_dir/vapid_private.pem``, created once: a new P-256 private key (PKCS#8 PEM,
    the VAPID key of RFC 8292 that Web Push messages are signed with: attention_app/push.py).
    An existing file is kept — every browser's push subscription is bound to its public
    half, and a new key would make the push services refuse what Corral sends."""
    path = data_dir / VAPID_KEY_FILE
    if path.exists() and path.stat().st_size:
        return path
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    _write_private(data_dir, VAPID_KEY_FILE, pem)
    return path


def _write_private(data_dir: Path, name: str, content: bytes) -> None:
    """Write ``content`` to a temporary file created with mode 0600 and rename it into
    place, so a reader never sees half of it and nobody else on the machine can read it."""
    partial = data_dir / f".{name}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # in case a leftover file of that name had other bits
    with os.fdopen(fd, "wb") as out:
        out.write(content)
    os.replace(partial, data_dir / name)
