"""Daily token quotas (docs/usage.md, "Quotas"): how many tokens a member may still use
today, and the sentence that refuses a message once they are spent.

A day is a UTC day. What counts is :data:`COUNTED`: the prompt tokens the server had to
read (not those it took from its prompt cache) plus the reply's tokens, summed over every
finished completion of the member's since 00:00 UTC, from sessions and API requests alike.
A turn under way when the quota runs out finishes; the next message is refused.

An API request is let through by :func:`reserve`, which checks and holds in one step:
each request in flight holds one token of the day (a :class:`~usage_app.models.Hold`)
until :func:`release` drops it with its usage recorded, so with ``n`` tokens left at most
``n`` requests run at once. The check takes a lock on the member's account row, so two
web processes checking the same member wait for each other.
"""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from .models import Hold, Quota, UsageRecord

__all__ = ["COUNTED", "HOLD", "day_start", "quota_for", "refusal", "release", "renew_hold", "reserve", "standing",
           "used_today"]

#: How long a request's hold lasts unless renewed (the API renews it every few seconds).
HOLD = timedelta(seconds=60)

#: What a quota counts, in words (the page and the admin say it).
COUNTED = "prompt tokens not taken from the prompt cache, plus reply tokens"

#: The refusal once the day's tokens are spent.
SPENT = ("You have used your {quota:,} tokens for today (resets at 00:00 UTC, in {left}). "
         "An admin can give you a larger daily quota.")
#: The refusal while requests in flight hold the last of the day's tokens.
HELD = ("Your requests still running hold the last of your {quota:,} tokens for today ({held} in flight); "
        "send this one when they have finished.")
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


def _held(member, now: datetime) -> int:
    """How many of ``member``'s API requests are in flight (live holds)."""
    return Hold.objects.filter(member=member, until__gte=now).count()


def _refusal(state: dict | None, held: int, now: datetime) -> str | None:
    if state is None or state["left"] - held > 0:
        return None
    if state["quota"] == 0:
        return NONE_AT_ALL
    if state["left"] > 0:
        return HELD.format(quota=state["quota"], held=held)
    return SPENT.format(quota=state["quota"], left=_until_midnight(now))


def refusal(member, now: datetime | None = None) -> str | None:
    """The sentence that refuses new work to ``member`` because today's quota is spent (or
    held by their API requests in flight), or None while they may go on (no quota, or
    tokens left). For a message's Send, checked before anything starts; an API request is
    checked and held at once by :func:`reserve`."""
    now = now or timezone.now()
    if quota_for(member) is None:
        return None
    held = _held(member, now)  # before the rows: see reserve
    return _refusal(standing(member, now), held, now)


def reserve(member, now: datetime | None = None) -> tuple[int | None, str | None]:
    """Check ``member``'s quota for one API request and hold a token of it, atomically.

    Returns ``(hold id, None)`` when the request may go on (release it with
    :func:`release`), ``(None, None)`` for a member without a quota (nothing held), or
    ``(None, sentence)`` when it is refused (:func:`refusal`'s sentences). The member's
    account row is locked for the check, so concurrent requests of one member are checked
    one after the other, each seeing the holds of those before it."""
    with transaction.atomic():
        list(get_user_model().objects.select_for_update(no_key=True).filter(pk=member.pk).values_list("pk", flat=True))
        now = now or timezone.now()
        if quota_for(member) is None:
            return None, None
        Hold.objects.filter(member=member, until__lt=now).delete()
        # The holds are read before the rows. Each read sees what was committed when it
        # began, and a request that finishes drops its hold and writes its row in one
        # transaction, without this lock: finishing between the two reads, it is counted
        # twice for this check (as its hold and its row), never not at all.
        held = _held(member, now)
        if sentence := _refusal(standing(member, now), held, now):
            return None, sentence
        return Hold.objects.create(member=member, until=now + HOLD).pk, None


def renew_hold(hold_id: int | None) -> None:
    """Keep a request's hold for another :data:`HOLD` (no-op for None)."""
    if hold_id is not None:
        Hold.objects.filter(pk=hold_id).update(until=timezone.now() + HOLD)


def release(hold_id: int | None) -> None:
    """Drop a request's hold (no-op for None or a hold already gone). Called in the
    transaction that records the request's usage: the request counts as its hold until
    its row exists, then as its row."""
    if hold_id is not None:
        Hold.objects.filter(pk=hold_id).delete()


def refusal_for_id(member_id: int, now: datetime | None = None) -> str | None:
    """:func:`refusal` for the member with primary key ``member_id``; None when no such
    account exists any more (a deleted author's queued message is not held back here)."""
    member = get_user_model().objects.filter(pk=member_id).first()
    return refusal(member, now) if member is not None else None
