"""The inbox, the notifications page (push subscriptions), the web app manifest and the
service worker (docs/attention.md)."""

from __future__ import annotations

import ipaddress
import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_not_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from . import push
from .models import PushSubscription
from .waiting import render_card, waiting_for

#: The longest subscription the notifications page accepts, in bytes (a real one is ~400).
MAX_SUBSCRIPTION_BYTES = 4096


def _entries(request: HttpRequest) -> list[dict]:
    return [{"waiting": w, "card": render_card(request.user, w)} for w in waiting_for(request.user)]


@require_GET
@never_cache
def inbox(request: HttpRequest) -> HttpResponse:
    """Every question waiting for this person, newest first, each with its call's card
    and answers as its session page draws them; the page follows the attention socket."""
    return render(request, "attention_app/inbox.html", {"entries": _entries(request)})


@require_GET
@never_cache
def inbox_entries(request: HttpRequest) -> HttpResponse:
    """The inbox's list alone (the page fetches it when a question it does not show arrives)."""
    return render(request, "attention_app/_inbox_entries.html", {"entries": _entries(request)})


@require_GET
def notifications(request: HttpRequest) -> HttpResponse:
    """This person's push subscriptions (one per browser or device), each removable, and
    the switches for this browser (system notifications, sound, Web Push)."""
    return render(request, "attention_app/notifications.html", {
        "subscriptions": PushSubscription.objects.filter(user=request.user),
        "application_server_key": push.application_server_key(),
    })


def _device(user_agent: str) -> str:
    """"Chrome on Android", "Firefox on Linux", … from a User-Agent, in a few words."""
    ua = user_agent or ""
    browser = next((name for key, name in (("Edg/", "Edge"), ("Firefox/", "Firefox"), ("Chrome/", "Chrome"),
                                           ("Chromium/", "Chromium"), ("Safari/", "Safari")) if key in ua), "A browser")
    system = next((name for key, name in (("Android", "Android"), ("iPhone", "iPhone"), ("iPad", "iPad"),
                                          ("Windows", "Windows"), ("Mac OS", "macOS"), ("Linux", "Linux")) if key in ua),
                  "")
    return f"{browser} on {system}" if system else browser


def endpoint_refusal(endpoint: str) -> str:
    """Why Corral will not send to ``endpoint`` ('' when it will). Corral's workers POST to
    it, so only an ``https`` URL of a host on the public internet: a member must not make
    Corral knock on internal services. The host is resolved (``getaddrinfo``), so an
    address in disguise (``2130706433``, ``0x7f000001``, ``127.1``, a name that resolves
    to 127.0.0.1) is judged by where it leads; every address it leads to must be global
    (not loopback, private, link-local, shared 100.64/10, reserved). A name that does not
    resolve here is taken: sending to it will fail on its own. Every browser's push
    service is a public https URL (RFC 8030 §5)."""
    parsed = urlsplit(endpoint)
    try:
        host = parsed.hostname
        port = parsed.port or 443
    except ValueError:
        host = None
    if parsed.scheme != "https" or not host:
        return "That is not a push subscription (its endpoint is not an https URL)."
    inside = "A push subscription cannot point at this server's network."
    name = host.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return inside
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        addresses = set()
        try:
            addresses = {str(ipaddress.ip_address(host))}
        except ValueError:
            return ""  # a name this host cannot resolve: nothing to knock on
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if getattr(ip, "ipv4_mapped", None):
            ip = ip.ipv4_mapped
        if not ip.is_global:
            return inside
    return ""


@require_POST
def subscribe(request: HttpRequest) -> JsonResponse:
    """Keep this browser's push subscription: the JSON of ``PushSubscription.toJSON()``
    (``endpoint``, ``keys.p256dh``, ``keys.auth``). One endpoint belongs to one person: a
    browser that subscribes again under another login moves to them. 400 with a sentence
    when the body is not such a subscription or its endpoint is refused
    (:func:`endpoint_refusal`)."""
    if len(request.body) > MAX_SUBSCRIPTION_BYTES:
        return JsonResponse({"error": "That is not a push subscription (it is too long)."}, status=400)
    try:
        data = json.loads(request.body)
        endpoint, keys = data["endpoint"], data["keys"]
        p256dh, auth = keys["p256dh"], keys["auth"]
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "That is not a push subscription."}, status=400)
    if not all(isinstance(v, str) and v for v in (endpoint, p256dh, auth)):
        return JsonResponse({"error": "That is not a push subscription."}, status=400)
    if refusal := endpoint_refusal(endpoint):
        return JsonResponse({"error": refusal}, status=400)
    if len(endpoint) > 2000 or len(p256dh) > 200 or len(auth) > 100:
        return JsonResponse({"error": "That is not a push subscription (a part is too long)."}, status=400)
    subscription, _ = PushSubscription.objects.update_or_create(
        endpoint=endpoint,
        defaults={"user": request.user, "p256dh": p256dh, "auth": auth,
                  "device": _device(request.headers.get("User-Agent", ""))},
    )
    return JsonResponse({"id": subscription.pk, "device": subscription.device})


@require_POST
def remove_subscription(request: HttpRequest, subscription_id: int) -> HttpResponse:
    """Forget one of this person's subscriptions (someone else's is a 404, as missing)."""
    deleted, _ = PushSubscription.objects.filter(pk=subscription_id, user=request.user).delete()
    if not deleted:
        raise Http404("No such device.")
    flash.success(request, "That device will no longer be notified.")
    return redirect("notifications")


@login_not_required
@require_GET
def manifest(request: HttpRequest) -> JsonResponse:
    """The web app manifest (what a phone's "Add to home screen" installs). Without a login:
    browsers fetch it without cookies."""
    return JsonResponse({
        "name": "Corral",
        "short_name": "Corral",
        "description": "Agent sessions on your own llama.cpp servers, each tool call approved by a person.",
        "id": "/",
        "start_url": "/",
        "scope": "/",
        "display": "standalone",
        "background_color": "#ffffff",
        "theme_color": "#2f5d50",
        "icons": [
            {"src": static("corral/icon-192.png"), "sizes": "192x192", "type": "image/png", "purpose": "any"},
            {"src": static("corral/icon-512.png"), "sizes": "512x512", "type": "image/png", "purpose": "any"},
            {"src": static("corral/icon-maskable-512.png"), "sizes": "512x512", "type": "image/png",
             "purpose": "maskable"},
        ],
        "shortcuts": [{"name": "Inbox", "url": "/inbox/"}],
    }, content_type="application/manifest+json")


SERVICE_WORKER = Path(settings.BASE_DIR) / "static" / "corral" / "sw.js"


@login_not_required
@require_GET
def service_worker(request: HttpRequest) -> HttpResponse:
    """The service worker, served from ``/`` so that its scope is the whole site (a worker
    under /static/ could control only /static/). Never cached by HTTP: a new version takes
    over at the next visit."""
    response = HttpResponse(SERVICE_WORKER.read_text(), content_type="text/javascript")
    response["Cache-Control"] = "no-cache"
    return response
