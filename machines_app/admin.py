from django.contrib import admin

from .models import Machine, ModelFile, ServerRecord


@admin.register(Machine)
class MachineAdmin(admin.ModelAdmin):
    list_display = ("name", "transport", "host", "models_dir", "enabled", "models_refreshed_at")
    list_filter = ("transport", "enabled", "allowed_groups")
    filter_horizontal = ("allowed_groups",)
    actions = ["refresh_models"]
    readonly_fields = ("models_refreshed_at", "models_refresh_error")

    @admin.action(description="Refresh models (read GGUF heads)")
    def refresh_models(self, request, queryset):
        from .tasks import refresh_models

        for machine in queryset:
            refresh_models.delay(machine.pk)
        names = ", ".join(m.name for m in queryset)
        self.message_user(request, f"Reading model files on {names}; reload this page in a moment.")


@admin.register(ModelFile)
class ModelFileAdmin(admin.ModelAdmin):
    list_display = (
        "display_name", "machine", "key", "architecture", "size_label", "quantization", "context_length",
        "has_chat_template", "has_mtp", "has_vision", "is_complete",
    )
    list_filter = ("machine", "architecture", "has_mtp", "has_vision")
    search_fields = ("display_name", "key", "name")
    readonly_fields = [f.name for f in ModelFile._meta.fields]

    def has_add_permission(self, request):
        return False  # model files are discovered, not typed in

    @admin.display(boolean=True)
    def is_complete(self, obj):
        return obj.is_complete


@admin.register(ServerRecord)
class ServerRecordAdmin(admin.ModelAdmin):
    list_display = ("session", "machine", "model_key", "pid", "port", "started_at", "ready_at", "stopping")
    readonly_fields = [f.name for f in ServerRecord._meta.fields if f.name != "api_key"]
    exclude = ("api_key",)  # the server's key never reaches a page

    def has_add_permission(self, request):
        return False
