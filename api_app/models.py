"""Personal API keys (docs/api.md "Keys")."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ApiKey(models.Model):
    """One member's key for the OpenAI-compatible API.

    Only the SHA-256 of the key is stored (``digest``, hex): the key itself is shown once,
    when it is made, and cannot be read back. ``prefix`` is its first characters
    (``corral-Xy12ab``), enough to tell keys apart in a list. A revoked key stays listed,
    refused with a sentence saying so.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, help_text="What the key is for, e.g. 'laptop editor'.")
    prefix = models.CharField(max_length=20)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None
