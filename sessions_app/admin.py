from django.contrib import admin

from .models import AgentSession, McpServer, TranscriptEvent


class TranscriptEventInline(admin.TabularInline):
    model = TranscriptEvent
    fields = ("seq", "kind", "payload", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("seq",)
    show_change_link = False

    def has_add_permission(self, request, obj=None):
        return False  # the transcript is append-only, written by the product


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    list_display = ("__str__", "owner", "machine", "model_key", "status", "last_activity_at")
    list_filter = ("status", "machine")
    search_fields = ("title", "model_key", "owner__username")
    readonly_fields = ("last_seq", "turn_active", "lease_owner", "lease_expires", "created_at", "last_activity_at")
    inlines = [TranscriptEventInline]


@admin.register(TranscriptEvent)
class TranscriptEventAdmin(admin.ModelAdmin):
    list_display = ("session", "seq", "kind", "created_at")
    list_filter = ("kind",)
    readonly_fields = ("session", "seq", "kind", "payload", "created_at")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(McpServer)
class McpServerAdmin(admin.ModelAdmin):
    list_display = ("name", "url", "enabled")
    list_filter = ("enabled",)
