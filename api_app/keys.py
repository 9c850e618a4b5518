"""Making, checking and revoking personal API keys (docs/api.md "Keys").

A key is ``corral-`` followed by 43 URL-safe characters (256 random bits). Only its
SHA-256 is stored: a key of that strength needs no slow hash, and one digest lookup finds
it. The key is shown once, when it is made.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from .models import ApiKey

#: What every key starts with (secret scanners and people recognise it).
KEY_PREFIX = "corral-"
#: Characters of a key shown in lists: the prefix and five more.
SHOWN = len(KEY_PREFIX) + 5
MAX_KEYS = 50


class KeyRefused(Exception):
    """A key that cannot be made: ``str()`` is the sentence for the page."""


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(user, name: str) -> tuple[ApiKey, str]:
    """A new key for ``user`` named ``name`` (stripped, at most 100 characters): the row
    and the key itself, which is never stored. Raises KeyRefused for an empty name or when
    the member already holds :data:`MAX_KEYS` live keys."""
    # Control characters (NUL among them, which PostgreSQL refuses in text) become spaces.
    name = " ".join("".join(c if c.isprintable() else " " for c in (name or "")).split())[:100]
    if not name:
        raise KeyRefused("Give the key a name, e.g. the tool or computer it is for.")
    if ApiKey.objects.filter(user=user, revoked_at__isnull=True).count() >= MAX_KEYS:
        raise KeyRefused(f"You hold {MAX_KEYS} keys already; revoke one first.")
    token = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(user=user, name=name, prefix=token[:SHOWN], digest=digest_of(token))
    return key, token


def revoke_key(user, key_id: int) -> bool:
    """Revoke one of ``user``'s keys; False when they hold no live key with that id."""
    return bool(ApiKey.objects.filter(pk=key_id, user=user, revoked_at__isnull=True).update(revoked_at=timezone.now()))


@dataclass(frozen=True)
class Refusal:
    """Why a request's key does not open the API: ``code`` for the error body, ``message`` in words."""

    code: str
    message: str


def bearer(header: str) -> str:
    """The token of an ``Authorization: Bearer …`` header ('' when there is none)."""
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authenticate(token: str) -> tuple[object | None, ApiKey | None, Refusal | None]:
    """``(user, key, None)`` for a live key of an active account (its last use noted now),
    else ``(None, None, refusal)``."""
    if not token:
        return None, None, Refusal("missing_api_key", (
            "No API key was sent. Send 'Authorization: Bearer corral-…' with a key made on Corral's API keys page."))
    key = ApiKey.objects.select_related("user").filter(digest=digest_of(token)).first()
    refusal = refusal_of(key)
    if key is None or refusal is not None:
        return None, None, refusal
    with transaction.atomic():
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
    return key.user, key, None


def refusal_of(key: ApiKey | None) -> Refusal | None:
    """Why ``key`` (with its ``user`` loaded; None: no such key) opens the API no more, or
    None while it does: unknown (mistyped, or deleted with its account), revoked, or its
    account turned off. Asked when a request comes and again while it is served."""
    if key is None:
        return Refusal("invalid_api_key", (
            "This API key is not known to Corral (mistyped, or its account was deleted). Make one on the API keys "
            "page."))
    if key.revoked:
        return Refusal("invalid_api_key", (
            f"This API key ('{key.name}', {key.prefix}…) was revoked on {key.revoked_at:%Y-%m-%d %H:%M} UTC. Make a "
            "new one on the API keys page."))
    if not key.user.is_active:
        return Refusal("invalid_api_key", "The account this API key belongs to is turned off.")
    return None
