from django.contrib import admin

from .models import Identity


@admin.register(Identity)
class IdentityAdmin(admin.ModelAdmin):
    """Read-only: an identity is made by a sign-in; deleting one makes the next sign-in of
    that person create a new account."""

    list_display = ("user", "subject", "issuer", "last_login_at")
    search_fields = ("user__username", "subject")
    readonly_fields = ("user", "issuer", "subject", "created_at", "last_login_at")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
