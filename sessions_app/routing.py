from django.urls import path, re_path

from attention_app.consumers import AttentionConsumer

from .live.consumers import RefusedConsumer, SessionConsumer

websocket_urlpatterns = [
    path("ws/sessions/<int:session_id>/", SessionConsumer.as_asgi()),
    path("ws/attention/", AttentionConsumer.as_asgi()),
    # Every other path, a session id that is not a number included: a clean close, never
    # the router's "No route found" error.
    re_path(r"", RefusedConsumer.as_asgi()),
]
