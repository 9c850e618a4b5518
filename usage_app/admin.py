"""Quotas are set here; usage rows are shown, never added or changed (each one is a
server's report: docs/usage.md)."""

from django.contrib import admin

from .models import Hold, Quota, UsageRecord
from .quota import COUNTED


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ("__str__", "user", "group", "tokens_per_day")
    autocomplete_fields = ("user", "group")
    fields = ("user", "group", "tokens_per_day")

    def get_form(self, request, obj=None, change=False, **kwargs):
        kwargs["help_texts"] = {
            "user": "One member: their own quota wins over any group's.",
            "group": "Everyone in the group: a member in several groups gets the largest.",
            "tokens_per_day": f"Counted per UTC day: {COUNTED}. 0 stops the member's messages altogether.",
        }
        return super().get_form(request, obj, change, **kwargs)


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = ("at", "member_name", "machine_name", "model_name", "source", "prompt_tokens", "cached_tokens",
                    "completion_tokens", "seconds")
    list_filter = ("source", "machine_name")
    search_fields = ("member_name", "model_name", "model_key")
    date_hierarchy = "at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Hold)
class HoldAdmin(admin.ModelAdmin):
    """The API requests in flight that hold part of a member's quota (usage_app.quota.reserve).
    Shown so that an admin can see why a member is refused while nothing was spent yet; a
    hold is deleted by its request when that ends, and lapses by itself at ``until``, so
    deleting one here only frees the member's day early."""

    list_display = ("member", "until")
    list_select_related = ("member",)
    search_fields = ("member__username",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
