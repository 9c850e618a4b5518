from __future__ import annotations

from django.conf import settings
from django.db import models


class Identity(models.Model):
    """The account an identity provider's person signs in as: the pair (issuer, ``sub``)
    names them for good, where an e-mail address or a user name at the provider may
    change or be reused. Created at the first sign-in (accounts_app/sso.py)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identity")
    issuer = models.CharField(max_length=500, help_text="The identity provider's issuer URL.")
    subject = models.CharField(max_length=255, help_text="The provider's permanent id for this person (the sub claim).")
    created_at = models.DateTimeField(auto_now_add=True)
    last_login_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "single sign-on identity"
        verbose_name_plural = "single sign-on identities"
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="sso_identity_once")]

    def __str__(self) -> str:
        return f"{self.subject} at {self.issuer}"
