"""Push subscriptions of people's devices and the pages they have open (docs/attention.md)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class PushSubscription(models.Model):
    """One browser's Web Push subscription (the Push API's ``PushSubscription.toJSON()``):
    where to send (``endpoint``, the push service's URL) and the keys a message is
    encrypted with (RFC 8291: ``p256dh``, the browser's P-256 public key, and ``auth``, its
    16-byte secret, both base64url). A person may have several (a laptop, a phone); each is
    listed and removable on their notifications page, and dropped when the push service
    answers 404 or 410 (the browser unsubscribed or the subscription expired)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="push_subscriptions")
    endpoint = models.URLField(max_length=2000, unique=True)
    p256dh = models.CharField(max_length=200)
    auth = models.CharField(max_length=100)
    #: What the person sees in the list: the browser and system, from its User-Agent.
    device = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.user} — {self.device or 'a browser'}"


class OpenPage(models.Model):
    """One open Corral page of a person (its attention socket), and whether the browser shows
    it now (``document.visibilityState``): Web Push is sent only when none of theirs is
    visible. A row not refreshed by its socket's heartbeat before ``expires_at`` belongs to a
    process that died without closing it, and no longer counts."""

    channel_name = models.CharField(max_length=200, unique=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    visible = models.BooleanField(default=False)
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.user} {'visible' if self.visible else 'hidden'}"
