from django.contrib import admin

from .models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Staff see every member's keys (never the key itself: only its start) and may revoke them."""

    list_display = ("name", "user", "prefix", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "user__username", "prefix")
    readonly_fields = ("user", "prefix", "created_at", "last_used_at")
    fields = ("user", "name", "prefix", "created_at", "last_used_at", "revoked_at")

    def get_readonly_fields(self, request, obj=None):
        # A revoked key stays revoked: clearing the date must not bring back a key its owner
        # revoked because it leaked.
        fields = super().get_readonly_fields(request, obj)
        return (*fields, "revoked_at") if obj is not None and obj.revoked else fields

    def has_add_permission(self, request) -> bool:
        return False  # a key is made by its owner, on their API keys page, and shown to them once
