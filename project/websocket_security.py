"""Websocket origin check: a page may open a session's socket only from Corral's own origin.

``AllowedHostsOriginValidator`` compares the Origin's host with ALLOWED_HOSTS but not its
port, so a page served on another localhost port (say, a web server a model started with
a tool call) could ride a member's cookie. This check requires the Origin's host *and
port* to be the Host the socket was opened on.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier


class SameOriginValidator:
    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            headers = dict(scope.get("headers", []))
            origin = headers.get(b"origin", b"").decode("latin-1")
            host = headers.get(b"host", b"").decode("latin-1")
            if not origin or not host or urlsplit(origin).netloc.lower() != host.lower():
                return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
