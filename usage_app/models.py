"""One row per finished completion (:class:`UsageRecord`) and the daily token quotas an
admin sets (:class:`Quota`). Figures are summed from the rows when read (usage_app.figures),
so each row can be checked against the one server report it came from."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models
from django.db.models import Q
from django.utils import timezone

from machines_app.models import Machine


class UsageRecord(models.Model):
    """What one finished completion used, as llama-server reported it (its final ``usage``
    and ``timings``; usage_app.recording.record_usage).

    Who and where are kept twice: as a link (for filters) and as the name they had then, so
    a deleted member, machine or model file still shows under its name. Tokens are counts;
    ``cached_tokens`` is the part of ``prompt_tokens`` the server took from its prompt cache
    instead of reading again; ``seconds`` is ``prompt_ms + predicted_ms`` / 1000, the time
    the completion held the machine.
    """

    class Source(models.TextChoices):
        SESSION = "session", "session"
        API = "api", "API"

    member = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="usage_records")
    member_name = models.CharField(max_length=150)
    machine = models.ForeignKey(Machine, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records")
    machine_name = models.CharField(max_length=100)
    model_key = models.CharField(max_length=1000, help_text="the model file's path in the machine's models directory")
    model_name = models.CharField(max_length=300, help_text="its display name then")
    source = models.CharField(max_length=10, choices=Source.choices)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    seconds = models.FloatField(default=0.0)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["at"], name="usage_at_idx"),
                   models.Index(fields=["member", "at"], name="usage_member_at_idx")]
        ordering = ["-at"]

    def __str__(self) -> str:
        return (f"{self.member_name} on {self.machine_name}, {self.model_name}: {self.prompt_tokens} in, "
                f"{self.completion_tokens} out")

    @property
    def counted_tokens(self) -> int:
        """The tokens a quota counts (usage_app.quota.COUNTED)."""
        return self.prompt_tokens - self.cached_tokens + self.completion_tokens


class Quota(models.Model):
    """A daily token limit for one member or for everyone in one group (docs/usage.md,
    "Quotas"). A member's own quota wins over their groups'; of several groups' quotas the
    largest holds. Days are UTC."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="usage_quota")
    group = models.OneToOneField(Group, null=True, blank=True, on_delete=models.CASCADE, related_name="usage_quota")
    tokens_per_day = models.PositiveBigIntegerField(
        help_text="Prompt tokens not taken from the prompt cache plus reply tokens, per UTC day (0: none at all)."
    )

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(user__isnull=False, group__isnull=True) | Q(user__isnull=True, group__isnull=False)),
                name="quota_for_a_user_or_a_group",
                violation_error_message="A quota is for one member or for one group: choose exactly one.",
            ),
        ]

    def __str__(self) -> str:
        if self.user is not None:
            who = self.user.get_username()
        else:
            who = f"group {self.group.name}" if self.group is not None else "nobody"
        return f"{who}: {self.tokens_per_day:,} tokens a day"


class Hold(models.Model):
    """One API request of a member with a quota, in flight: until its usage is recorded it
    holds one token of the member's day, so that requests sent at once cannot all pass a
    check that none of them has spent anything yet (usage_app.quota.reserve). A hold whose
    request is lost with its web process lapses at ``until`` (renewed while it runs)."""

    member = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quota_holds")
    until = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["member", "until"], name="quota_hold_member_until_idx")]

    def __str__(self) -> str:
        return f"{self.member.get_username()}: a request in flight until {self.until:%H:%M:%S}"
