from django.contrib import admin
from django.shortcuts import redirect
from django.urls import reverse

from .models import AgentSession, DeploymentSettings, McpServer, TranscriptEvent
from .transcript import actor


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    list_display = ("__str__", "owner", "machine", "model_key", "status", "visibility", "last_activity_at")
    list_filter = ("status", "visibility", "machine")
    search_fields = ("title", "model_key", "owner__username")
    # Who owns a session, where it runs, where its tools act, whether the gate asks and who
    # else may see it, and its system prompt (each change a settings event: docs/behaviour.md §17),
    # are set through the product only, where they are checked and
    # recorded (docs/access.md, docs/sharing.md).
    readonly_fields = (
        "owner", "machine", "working_dir", "permission_mode", "visibility", "system_prompt",
        "last_seq", "turn_active", "lease_owner", "lease_expires", "created_at", "last_activity_at", "transcript",
    )

    def has_add_permission(self, request):
        return False  # sessions start from the new-session form, which checks and starts them

    @admin.display(description="Transcript")
    def transcript(self, obj):
        # One row per streamed fragment would make this page huge: link to the events.
        from django.urls import reverse
        from django.utils.html import format_html

        url = reverse("admin:sessions_app_transcriptevent_changelist") + f"?session__id__exact={obj.pk}"
        return format_html('<a href="{}">{} events</a>', url, obj.last_seq)


@admin.register(TranscriptEvent)
class TranscriptEventAdmin(admin.ModelAdmin):
    list_display = ("session", "seq", "kind", "by", "created_at")
    list_filter = ("kind", "session")
    ordering = ("session", "seq")
    readonly_fields = ("session", "seq", "kind", "by", "payload", "created_at")

    @admin.display(description="By")
    def by(self, obj) -> str:
        """Who did the user action this event records (blank for what nobody did)."""
        who = actor(obj.payload)
        return who["username"] if who else ""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(McpServer)
class McpServerAdmin(admin.ModelAdmin):
    list_display = ("name", "url", "enabled")
    list_filter = ("enabled",)


@admin.register(DeploymentSettings)
class DeploymentSettingsAdmin(admin.ModelAdmin):
    """The one row of deployment-wide defaults: the admin's list links straight to it."""

    def has_add_permission(self, request):
        return not DeploymentSettings.objects.exists()

    def has_delete_permission(self, request, obj=None):
        return False

    def changelist_view(self, request, extra_context=None):
        settings_row = DeploymentSettings.load()
        return redirect(reverse("admin:sessions_app_deploymentsettings_change", args=[settings_row.pk]))
