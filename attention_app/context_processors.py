"""The inbox count in every page's top bar (docs/attention.md); read only when a page draws it."""

from django.utils.functional import SimpleLazyObject


def attention(request) -> dict:
    def count() -> int:
        from .waiting import count_for

        user = getattr(request, "user", None)
        return count_for(user) if user is not None else 0

    return {"inbox_count": SimpleLazyObject(count)}
