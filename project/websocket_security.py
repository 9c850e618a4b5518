"""Websocket origin check: a page may open a session's socket only from Corral's own origin.

``AllowedHostsOriginValidator`` compares the Origin's host with ALLOWED_HOSTS but not its
port or scheme, so a page served on another localhost port (say, a web server a model
started with a tool call) could ride a member's cookie, and so could a page on
``https://host`` when Corral is ``http://host`` (another server on the same name). This
check requires the Origin's scheme, host *and* port to be those of the page the socket
belongs to: the Host the socket was opened on, and the scheme Corral is served over —
``https`` behind the HTTPS proxy (``CORRAL_HTTPS``), else ``https`` for a ``wss`` socket
and ``http`` for a ``ws`` one. A port left out means the scheme's default (80, 443).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings

DEFAULT_PORTS = {"http": 80, "https": 443}


def page_scheme(scope) -> str:
    """The scheme of the page a websocket of ``scope`` was opened from: ``https`` behind
    the HTTPS proxy (every page is redirected there), else the socket's own (``wss`` →
    ``https``, ``ws`` → ``http``)."""
    if settings.CORRAL_HTTPS:
        return "https"
    return "https" if scope.get("scheme") == "wss" else "http"


def origin_of(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of ``scheme://netloc``, the host lower-cased and the port
    filled in from the scheme; None for one that is not an http(s) origin (a bad port,
    user info, no host)."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or "@" in netloc or parts.path:
        return None
    return parts.scheme, parts.hostname.lower(), port if port is not None else DEFAULT_PORTS[parts.scheme]


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether the ``Origin`` header ``origin`` is the page ``scheme://host`` (``host``:
    the socket's ``Host`` header)."""
    if not origin or not host:
        return False
    parts = urlsplit(origin)
    theirs = origin_of(parts.scheme.lower(), parts.netloc) if not parts.path and not parts.query else None
    ours = origin_of(scheme, host)
    return theirs is not None and theirs == ours


class SameOriginValidator:
    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            headers = dict(scope.get("headers", []))
            origin = headers.get(b"origin", b"").decode("latin-1")
            host = headers.get(b"host", b"").decode("latin-1")
            if not same_origin(origin, host, page_scheme(scope)):
                return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
