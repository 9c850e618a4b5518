"""Web Push: a question reaches a person's devices when no Corral page of theirs is visible
(docs/attention.md).

Each message is encrypted for one subscription as RFC 8291 says (``aes128gcm``, with the
browser's ``p256dh`` key and ``auth`` secret) and signed with Corral's VAPID key (RFC 8292:
``data/vapid_private.pem``, made at setup by ``project.data_dir.ensure_vapid_key``): both done
by ``pywebpush``. A push service that answers 404 or 410 says the subscription is gone (the
browser unsubscribed, the person cleared its data, it expired): it is deleted, as RFC 8030
§7.3 asks. Synchronous; runs in a Celery task (attention_app.tasks), never in a request.
"""

from __future__ import annotations

import base64
import json
import logging

from cryptography.hazmat.primitives import serialization
from django.conf import settings
from django.utils import timezone

from project import data_dir

from .models import OpenPage, PushSubscription

log = logging.getLogger(__name__)

#: Seconds a push service may take to answer one message.
SEND_TIMEOUT = 10
#: Seconds a push service keeps a message for a device that is offline (RFC 8030 ``TTL``):
#: a question is worth telling within the hour; after that the inbox says it.
TTL = 3600
#: Push services' answers that mean "this subscription no longer exists" (RFC 8030 §7.3).
GONE = (404, 410)


def vapid():
    """Corral's VAPID key as ``py_vapid`` holds it (made on first use when setup did not)."""
    from py_vapid import Vapid

    return Vapid.from_pem(data_dir.ensure_vapid_key(settings.DATA_DIR).read_bytes())


def application_server_key() -> str:
    """The VAPID public key as ``PushManager.subscribe`` wants its ``applicationServerKey``:
    the uncompressed P-256 point (65 bytes), base64url without padding."""
    raw = vapid().public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def has_visible_page(user_id: int) -> bool:
    """Whether a Corral page of this person is open and shown by its browser now."""
    return OpenPage.objects.filter(user_id=user_id, visible=True, expires_at__gt=timezone.now()).exists()


def send(subscription: PushSubscription, message: dict) -> bool:
    """Send ``message`` (JSON, what the service worker's ``push`` handler shows: ``title``,
    ``body``, ``url``, ``tag``) to one subscription. True when the push service took it;
    False when it refused or could not be reached (logged), and the subscription deleted
    when it answered 404 or 410."""
    from pywebpush import WebPushException, webpush

    info = {"endpoint": subscription.endpoint, "keys": {"p256dh": subscription.p256dh, "auth": subscription.auth}}
    try:
        webpush(info, data=json.dumps(message), vapid_private_key=vapid(),
                vapid_claims={"sub": settings.CORRAL_VAPID_SUBJECT}, ttl=TTL, timeout=SEND_TIMEOUT)
    except WebPushException as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in GONE:
            log.info("push subscription %s is gone (%s): deleted", subscription.pk, status)
            subscription.delete()
        else:
            log.warning("push to subscription %s refused: %s", subscription.pk, exc)
        return False
    except Exception as exc:  # requests' connection errors, a malformed key stored long ago
        log.warning("push to subscription %s failed: %s", subscription.pk, exc)
        return False
    PushSubscription.objects.filter(pk=subscription.pk).update(last_sent_at=timezone.now())
    return True


def notify_question(session_id: int, call_id: str) -> int:
    """Tell, on their subscribed devices, every person the question about ``call_id`` in
    session ``session_id`` waits for (attention_app.waiting) and who has no visible Corral
    page; nothing when it is already answered. Returns how many messages were taken."""
    from sessions_app.models import AgentSession

    from .waiting import may_answer, waiting_in

    session = AgentSession.objects.select_related("owner").filter(pk=session_id).first()
    if session is None:
        return 0
    question = next((w for w in waiting_in(session) if w.call_id == call_id), None)
    if question is None:
        return 0
    sent = 0
    by_user: dict[int, list[PushSubscription]] = {}
    for subscription in PushSubscription.objects.select_related("user"):
        by_user.setdefault(subscription.user_id, []).append(subscription)
    for subscriptions in by_user.values():
        user = subscriptions[0].user
        if not may_answer(user, session) or has_visible_page(user.pk):
            continue
        for subscription in subscriptions:
            sent += send(subscription, question.as_message(user.pk))
    return sent
