"""Daily token quotas (docs/usage.md, "Quotas"): how many tokens a member may still use
today, and the sentence that refuses a message once they are spent.

A day is a UTC day. What counts is :data:`COUNTED`: the prompt tokens the server had to
read (not those it took from its prompt cache) plus the reply's tokens, summed over every
finished completion of the member's since 00:00 UTC, from sessions and API requests alike.
A turn under way when the quota runs out finishes; the next message is refused.
"""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

from django.contrib.auth import get_user_model
from django.db.models import F, Sum
from django.utils import timezone

from .models import Quota, UsageRecord

__all__ = ["COUNTED", "day_start", "quota_for", "refusal", "standing", "used_today"]

#: What a quota counts, in words (the page and the admin say it).
COUNTED = "prompt tokens not taken from the prompt cache, plus reply tokens"

#: The refusal once the day's tokens are spent.
SPENT = ("You have used your {quota:,} tokens for today (resets at 00:00 UTC, in {left}). "
         "An admin can give you a larger daily quota.")
#: The refusal for a quota of 0.
NONE_AT_ALL = "Your daily token quota is 0, so you cannot send messages; an admin can give you one."


def day_start(now: datetime | None = None) -> datetime:
    """00:00 UTC of the day ``now`` (default: now) falls on, as an aware datetime."""
    now = now or timezone.now()
    return datetime.combine(now.astimezone(UTC).date(), time.min, tzinfo=UTC)


def quota_for(member) -> int | None:
    """``member``'s tokens per day: their own quota, else the largest of their groups',
    else None (no limit)."""
    if member is None or not member.is_authenticated:
        return None
    own = Quota.objects.filter(user=member).values_list("tokens_per_day", flat=True).first()
    if own is not None:
        return own
    groups = Quota.objects.filter(group__user=member).values_list("tokens_per_day", flat=True)
    return max(groups, default=None)


def used_today(member, now: datetime | None = None) -> int:
    """The tokens ``member`` used since 00:00 UTC, as a quota counts them (:data:`COUNTED`)."""
    total = UsageRecord.objects.filter(member=member, at__gte=day_start(now)).aggregate(
        n=Sum(F("prompt_tokens") - F("cached_tokens") + F("completion_tokens"))
    )["n"]
    return int(total or 0)


def standing(member, now: datetime | None = None) -> dict | None:
    """``{"quota": int, "used": int, "left": int}`` for today, or None for a member without
    a quota."""
    quota = quota_for(member)
    if quota is None:
        return None
    used = used_today(member, now)
    return {"quota": quota, "used": used, "left": max(quota - used, 0)}


def _until_midnight(now: datetime) -> str:
    minutes = max(int((day_start(now) + timedelta(days=1) - now).total_seconds() // 60), 1)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def refusal(member, now: datetime | None = None) -> str | None:
    """The sentence that refuses new work to ``member`` because today's quota is spent, or
    None while they may go on (no quota, or tokens left). For a message's Send and for an
    API request, checked before anything starts."""
    now = now or timezone.now()
    state = standing(member, now)
    if state is None or state["left"] > 0:
        return None
    if state["quota"] == 0:
        return NONE_AT_ALL
    return SPENT.format(quota=state["quota"], left=_until_midnight(now))


def refusal_for_id(member_id: int, now: datetime | None = None) -> str | None:
    """:func:`refusal` for the member with primary key ``member_id``; None when no such
    account exists any more (a deleted author's queued message is not held back here)."""
    member = get_user_model().objects.filter(pk=member_id).first()
    return refusal(member, now) if member is not None else None
