"""ASGI entry point: HTTP through Django, websockets through Channels (login required)."""

import os
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from project import heap  # noqa: E402
from project.websocket_security import SameOriginValidator  # noqa: E402
from sessions_app.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": SameOriginValidator(
            AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
        ),
    }
)

if "daphne.cli" in sys.modules:
    # Started by daphne's command line: its server wakes only when something is due
    # (project/daphne_server.py). Imported here, where daphne has already installed its reactor.
    from project import daphne_server

    daphne_server.install()

# Daphne imports this once, at start: what it built is kept for the process's life
# (project/heap.py).
heap.freeze_startup_objects()
