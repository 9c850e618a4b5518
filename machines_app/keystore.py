"""SSH private keys kept in the database, encrypted (docs/ssh.md "The private key").

Every Corral host reads the same database, so a key pasted in the admin on one host
reaches the machine from every host. The column holds a Fernet token (AES-128-CBC with
HMAC-SHA256, from the ``cryptography`` package) made with a key derived from Django's
``SECRET_KEY`` by HKDF-SHA256 under the fixed label :data:`INFO`: the database alone
(a dump, a backup) does not give the key away, and every host that shares the
``SECRET_KEY`` can read it. A token made under another ``SECRET_KEY`` cannot be read:
:func:`open_key` raises :class:`KeyUnreadable` and the admin pastes the key again.

The PEM text lives only in memory, in :class:`machines_app.ssh.Target` (never in its
repr), and is never logged, exported or shown again in a form.
"""

from __future__ import annotations

import base64

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

#: HKDF's ``info``: what the derived key is for. A fixed label, so the same ``SECRET_KEY``
#: always gives the same key, and a key derived for anything else never opens these.
INFO = b"corral: machine SSH private keys, v1"


class KeyUnreadable(Exception):
    """A stored key that this installation's ``SECRET_KEY`` cannot open (the secret was
    changed, or the column was altered)."""


def _fernet(secret: str | None = None) -> Fernet:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(
        (settings.SECRET_KEY if secret is None else secret).encode()
    )
    return Fernet(base64.urlsafe_b64encode(derived))


def seal_key(pem: str, secret: str | None = None) -> str:
    """``pem`` (a private key's text) as the token stored in ``Machine.private_key_sealed``
    (URL-safe base64 text). ``secret``: the ``SECRET_KEY`` to derive from (default the
    installation's; the data migration passes it the same way)."""
    return _fernet(secret).encrypt(pem.encode()).decode("ascii")


def open_key(token: str, secret: str | None = None) -> str:
    """The private key's text sealed in ``token``. Raises :class:`KeyUnreadable` when the
    token was made under another ``SECRET_KEY`` or is damaged."""
    try:
        return _fernet(secret).decrypt(token.encode("ascii")).decode()
    except (InvalidToken, UnicodeError, ValueError):
        raise KeyUnreadable("the stored key cannot be decrypted with this installation's SECRET_KEY") from None


def unreadable_sentence(machine_name: str) -> str:
    """What the admin page and a session say about a key :func:`open_key` refuses."""
    return (f"the SSH key of {machine_name} cannot be read with this installation's SECRET_KEY: "
            "paste it again in the admin")


def missing_sentence(machine_name: str) -> str:
    """What they say about an SSH machine with no key stored."""
    return f"no SSH private key is stored for {machine_name}: paste it in the admin"
