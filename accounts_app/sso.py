"""Single sign-on with the team's OpenID Connect provider (Keycloak, Google Workspace,
Entra ID, Authentik, …), built on mozilla-django-oidc (docs/access.md, "Single sign-on").

The flow is the authorization code flow with PKCE and a nonce: "Sign in with …" on the
login page goes to ``accounts_app.views.SignIn``, which sends the browser to the provider;
the provider sends it back to ``accounts_app.views.Callback`` with a code, which :class:`Backend` exchanges for an
ID token (signature checked against the provider's keys, and its issuer, audience and
nonce against this sign-in) and the userinfo claims. The person is found by the pair
(issuer, ``sub``) (:class:`~accounts_app.models.Identity`), or an account is created at
the first sign-in; at every sign-in their Django groups become the ones the groups claim
names, so machines limited to groups (``Machine.allowed_groups``) follow the directory,
and open pages hear of the change as of any group change (sessions_app/access_changes.py).

Every failure — the provider unreachable, a refused sign-in, an answer that does not match
the sign-in this browser started — ends on a page with a sentence, never a 500
(the views, in accounts_app/views.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import SuspiciousOperation
from django.db import IntegrityError, models, transaction
from django.utils import timezone
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from .models import Identity

log = logging.getLogger(__name__)

#: How long discovered endpoints are kept before they are fetched again (seconds).
DISCOVERY_TTL = 3600.0

def _max_length(model, name: str) -> int:
    field = model._meta.get_field(name)
    return field.max_length if isinstance(field, models.Field) and field.max_length else 150


#: Django's longest group name; a longer one from the provider is skipped (and logged).
GROUP_NAME_MAX = _max_length(Group, "name")

_discovered: dict[str, tuple[float, dict]] = {}
_discovered_lock = threading.Lock()


class ProviderUnreachable(Exception):
    """The provider's discovery document could not be had or read; the message says why."""


def enabled() -> bool:
    return bool(settings.CORRAL_OIDC_ISSUER)


def endpoints() -> dict[str, str]:
    """The provider's ``authorization``, ``token``, ``userinfo`` and ``jwks`` URLs.

    Each comes from its ``CORRAL_OIDC_*`` setting when set, otherwise from
    ``<issuer>/.well-known/openid-configuration`` (OpenID Connect Discovery 1.0), fetched at
    the first sign-in and kept for :data:`DISCOVERY_TTL` seconds; the document's
    ``issuer`` must be the configured one. Raises :class:`ProviderUnreachable`.
    """
    explicit = {
        "authorization": settings.CORRAL_OIDC_AUTHORIZATION_ENDPOINT,
        "token": settings.CORRAL_OIDC_TOKEN_ENDPOINT,
        "userinfo": settings.CORRAL_OIDC_USERINFO_ENDPOINT,
        "jwks": settings.CORRAL_OIDC_JWKS_URI,
    }
    if all(explicit.values()):
        return explicit
    document = _discovery_document(settings.CORRAL_OIDC_ISSUER)
    names = {"authorization": "authorization_endpoint", "token": "token_endpoint",
             "userinfo": "userinfo_endpoint", "jwks": "jwks_uri"}
    found: dict[str, str] = {}
    for key, field in names.items():
        url = explicit[key] or document.get(field)
        if not isinstance(url, str) or not url:
            raise ProviderUnreachable(f"the provider's discovery document names no {field}; "
                                      f"set the CORRAL_OIDC_* endpoint settings instead")
        found[key] = url
    return found


def _discovery_document(issuer: str) -> dict:
    now = time.monotonic()
    with _discovered_lock:
        cached = _discovered.get(issuer)
        if cached and now - cached[0] < DISCOVERY_TTL:
            return cached[1]
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except ValueError:  # before RequestException: requests' JSONDecodeError is both
        raise ProviderUnreachable(f"{url} did not answer with JSON") from None
    except requests.RequestException as exc:
        raise ProviderUnreachable(f"{url} did not answer ({short(exc)})") from None
    if not isinstance(document, dict) or str(document.get("issuer", "")).rstrip("/") != issuer:
        said = document.get("issuer") if isinstance(document, dict) else None
        raise ProviderUnreachable(f"{url} names the issuer {said!r}, not {issuer!r} (CORRAL_OIDC_ISSUER)")
    with _discovered_lock:
        _discovered[issuer] = (now, document)
    return document


def short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"


# --- accounts and groups ------------------------------------------------------------------

_USERNAME_UNSAFE = re.compile(r"[^\w.@+-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _username_for(claims: dict) -> str:
    """A free Django username from ``preferred_username``, else the e-mail address, else
    ``sub``: characters Django does not take become ``_``; ``-2``, ``-3``… is added
    when the name is taken (a local account keeps its name: a provider's "admin" is not
    Corral's admin)."""
    User = get_user_model()
    for key in ("preferred_username", "email", "sub"):
        value = claims.get(key)
        if isinstance(value, str) and value.strip():
            base = _USERNAME_UNSAFE.sub("_", value.strip())[:140]
            break
    else:
        base = "user"
    name, n = base, 1
    while User.objects.filter(username__iexact=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def group_names(claims: dict) -> list[str]:
    """The group names in the groups claim (``CORRAL_OIDC_GROUPS_CLAIM``): a list of
    strings or one string. An absent claim means no groups (the directory says nothing,
    so nothing is granted); names that are not strings, too long, or hold control characters are skipped."""
    claim = settings.CORRAL_OIDC_GROUPS_CLAIM
    value = claims.get(claim)
    if value is None:
        log.warning("single sign-on: the provider sent no %r claim for %s: no groups", claim, claims.get("sub"))
        return []
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    names = []
    for item in items:
        # No control characters: a NUL (which PostgreSQL refuses in text) would break the
        # sign-in, a newline or an escape would hide in the admin's lists.
        if (isinstance(item, str) and item.strip() and len(item.strip()) <= GROUP_NAME_MAX
                and not _CONTROL.search(item)):
            names.append(item.strip())
        else:
            log.warning("single sign-on: group %r in the %r claim skipped (not a name Django can keep)", item, claim)
    return sorted(set(names))


def sync_account(user, claims: dict) -> None:
    """Bring ``user`` in line with the provider's ``claims``: e-mail and names, and the
    groups, which become exactly those named (missing ones are created). Django's m2m
    signals then tell the person's open pages (sessions_app/access_changes.py)."""
    changed = []
    for field, key in (("email", "email"), ("first_name", "given_name"), ("last_name", "family_name")):
        value = claims.get(key)
        if isinstance(value, str):
            # Control characters dropped: PostgreSQL refuses a NUL in text, which would
            # make every sign-in of this person fail.
            value = _CONTROL.sub("", value)[: _max_length(get_user_model(), field)]
            if getattr(user, field) != value:
                setattr(user, field, value)
                changed.append(field)
    if changed:
        user.save(update_fields=changed)
    groups = [Group.objects.get_or_create(name=name)[0] for name in group_names(claims)]
    user.groups.set(groups)


class Backend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend, made to answer only the provider's callback, to find
    people by (issuer, ``sub``) rather than by e-mail, to check the ID token's issuer and
    audience, and to read the claims of both the ID token and userinfo (Entra ID puts
    groups only in the ID token)."""

    def __init__(self, *args, **kwargs):
        # Django builds every backend for every login, password logins included: nothing
        # here may need the provider. Endpoints are read in authenticate().
        self.UserModel = get_user_model()

    def authenticate(self, request, **kwargs):
        """The user the provider's answer in ``request`` names, or None for any other
        login (a password). Raises ``SuspiciousOperation`` for an answer that does not
        verify, ``requests.RequestException`` / :class:`ProviderUnreachable` when the
        provider cannot be asked."""
        if request is None or not enabled() or "nonce" not in kwargs:
            return None
        urls = endpoints()
        self.OIDC_OP_TOKEN_ENDPOINT = urls["token"]
        self.OIDC_OP_USER_ENDPOINT = urls["userinfo"]
        self.OIDC_OP_JWKS_ENDPOINT = urls["jwks"]
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        return super().authenticate(request, **kwargs)

    def verify_token(self, token, **kwargs):
        payload = super().verify_token(token, **kwargs)
        issuer = str(payload.get("iss", "")).rstrip("/")
        if issuer != settings.CORRAL_OIDC_ISSUER:
            raise SuspiciousOperation(f"The ID token was issued by {issuer!r}, not by {settings.CORRAL_OIDC_ISSUER!r}.")
        audience = payload.get("aud")
        audiences = [audience] if isinstance(audience, str) else audience if isinstance(audience, list) else []
        if settings.OIDC_RP_CLIENT_ID not in audiences:
            raise SuspiciousOperation("The ID token was not issued for Corral (its audience is another client).")
        return payload

    def get_userinfo(self, access_token, id_token, payload):
        userinfo = super().get_userinfo(access_token, id_token, payload)
        if not isinstance(userinfo, dict) or userinfo.get("sub") != payload.get("sub"):
            raise SuspiciousOperation("The provider's userinfo names another person than its ID token.")
        return {**payload, **userinfo}

    def verify_claims(self, claims):
        return isinstance(claims.get("sub"), str) and bool(claims["sub"])

    def filter_users_by_claims(self, claims):
        return self.UserModel.objects.filter(sso_identity__issuer=settings.CORRAL_OIDC_ISSUER,
                                             sso_identity__subject=claims["sub"])

    def describe_user_by_claims(self, claims):
        return f"sub {claims.get('sub')}"

    def create_user(self, claims):
        try:
            with transaction.atomic():
                user = self.UserModel.objects.create_user(_username_for(claims))  # no usable password
                Identity.objects.create(user=user, issuer=settings.CORRAL_OIDC_ISSUER, subject=claims["sub"])
        except IntegrityError:
            # The same person's first sign-in in two tabs at once: the other one made it.
            user = self.filter_users_by_claims(claims).first()
            if user is None:
                raise
        else:
            log.info("single sign-on: account %r created for %s", user.username, claims["sub"])
        return self.update_user(user, claims)

    def update_user(self, user, claims):
        with transaction.atomic():
            sync_account(user, claims)
            Identity.objects.filter(user=user).update(last_login_at=timezone.now())
        return user
