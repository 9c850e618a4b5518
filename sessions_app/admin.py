"""The admin's view of sessions: for looking and deleting, not for running them.

Everything Corral keeps for itself (status, the turn flag, the lease, the interrupt flag,
the sequence counter) and everything the product checks and records when a person
changes it (owner, machine, model, parameters, working directory, permission mode,
sharing) is read-only here: a session is started, changed and stopped from its page
(docs/behaviour.md §5, docs/access.md). A session deleted here has its llama-server
stopped like one deleted from its page (``sessions_app.signals``).
"""

import json

from django import forms
from django.contrib import admin
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.html import escape, format_html
from django.utils.safestring import mark_safe

from machines_app import admin as machines_admin
from machines_app.models import ModelFile

from .events import load_events
from .forms import NewSessionForm
from .live.items import Viewer, render_item
from .live.transcript_view import build_items
from .models import Access, AgentSession, DeploymentSettings, McpServer, TranscriptEvent
from .rules import SessionError, check_system_prompt

# Also registers the admin of the sessions' servers, and the machine admin that shows them.
from .servers.admin import InternalRowAdmin
from .transcript import actor

#: The one column of a session an admin may change here: its title (no rule depends on it).
EDITABLE_SESSION_FIELDS = ("title",)

#: How much of an event's text the raw event list shows in its row.
EVENT_TEXT_CHARS = 120


def admin_system_prompt(text: str) -> str:
    """A default system prompt an admin sets (a model file's, the deployment's), held to the
    rule of a session's own (``check_system_prompt``: no control character, surrounding white
    space dropped), so no door lets through what the session form refuses. Raises
    ``ValidationError`` with the same sentence."""
    try:
        return check_system_prompt(text)
    except SessionError as exc:
        raise forms.ValidationError(str(exc)) from None


class ModelFileForm(machines_admin.ModelFileForm):
    """The model file form (machines_app.admin) with its default system prompt held to the
    rule of a session's own."""

    def clean_system_prompt(self) -> str:
        return admin_system_prompt(self.cleaned_data["system_prompt"])


admin.site.unregister(ModelFile)


@admin.register(ModelFile)
class ModelFileAdmin(machines_admin.ModelFileAdmin):
    form = ModelFileForm


class AgentSessionForm(forms.ModelForm):
    """The admin's one change to a session, its title, held to the session form's rule."""

    clean_title = NewSessionForm.clean_title


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    form = AgentSessionForm
    list_display = ("__str__", "owner", "machine", "model_key", "status", "visibility", "last_activity_at")
    list_filter = ("status", "visibility", "purpose", "machine")
    search_fields = ("title", "model_key", "owner__username")

    class Media:
        css = {"all": ("corral/admin.css",)}

    def get_readonly_fields(self, request, obj=None):
        internal = [f.name for f in AgentSession._meta.fields if f.name not in EDITABLE_SESSION_FIELDS]
        return [*internal, "conversation", "raw_events"]

    def has_add_permission(self, request):
        return False  # sessions start from the new-session form, which checks and starts them

    @admin.display(description="Raw events")
    def raw_events(self, obj):
        url = reverse("admin:sessions_app_transcriptevent_changelist") + f"?session__id__exact={obj.pk}"
        return format_html('<a href="{}">{} events</a>', url, obj.last_seq)

    @admin.display(description="Conversation")
    def conversation(self, obj):
        """The transcript as the session page shows it (one message per reply, its
        fragments joined), drawn by the page's own renderer for a watcher (no buttons)."""
        items = build_items(load_events(obj.pk), obj.pk, viewer=Viewer(access=Access.WATCH))
        if not items:
            return "Nothing said yet."
        # render_item escapes every text and sanitises the model's Markdown (docs/security.md).
        rendered = mark_safe("".join(render_item(item) for item in items))  # noqa: S308 (escaped by its templates)
        return format_html('<div class="corral-conversation">{}</div>', rendered)


def event_text(payload) -> str:
    """The words an event carries, cut to EVENT_TEXT_CHARS: a fragment's text, a
    message, an error, a tool's name and arguments or output; '' for the others."""
    if not isinstance(payload, dict):
        return ""
    for key in ("text", "message", "output"):
        if isinstance(payload.get(key), str):
            text = payload[key]
            break
    else:
        text = f"{payload.get('tool')} {payload.get('arguments') or ''}".strip() if payload.get("tool") else ""
    return text if len(text) <= EVENT_TEXT_CHARS else text[: EVENT_TEXT_CHARS - 1] + "…"


@admin.register(TranscriptEvent)
class TranscriptEventAdmin(InternalRowAdmin):
    list_display = ("session", "seq", "kind", "by", "text", "created_at")
    list_filter = ("kind", "session")
    ordering = ("session", "seq")
    readonly_fields = ("session", "seq", "kind", "by", "payload", "created_at")
    refuse_delete = "A transcript is append-only: its events go only with their session (delete the session)."

    @admin.display(description="By")
    def by(self, obj) -> str:
        """Who did the user action this event records (blank for what nobody did)."""
        who = actor(obj.payload)
        return who["username"] if who else ""

    @admin.display(description="Text")
    def text(self, obj) -> str:
        return event_text(obj.payload)


#: What the headers field shows for each stored value; sent back as it is, it keeps that value.
HEADER_KEPT = "(stored, not shown)"


class SecretHeadersWidget(forms.Textarea):
    """The headers as JSON with every value written as :data:`HEADER_KEPT`: header values
    are API keys more often than not, so none is written into the page — neither a stored
    one nor one just typed, when the form comes back for an error. Text that is not a
    JSON object is not shown back at all."""

    def format_value(self, value):
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return json.dumps({str(name): HEADER_KEPT for name in parsed}, ensure_ascii=False)


class McpServerForm(forms.ModelForm):
    """The MCP server form; its API key and its header values are write-only: typed in,
    never shown back (a value left as :data:`HEADER_KEPT` keeps the stored one)."""

    api_key = forms.CharField(
        required=False, strip=True, label="API key",
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text=escape("Sent as 'Authorization: Bearer <key>'. Never shown again; leave empty to keep the current "
                         "one."),
    )
    clear_api_key = forms.BooleanField(required=False, label="Remove the API key")

    class Meta:
        model = McpServer
        fields = ["name", "url", "headers", "api_key", "enabled"]
        widgets = {"headers": SecretHeadersWidget(attrs={"rows": 3, "autocomplete": "off"})}
        help_texts = {
            "headers": escape(f'Extra HTTP headers as JSON, e.g. {{"x-api-key": "…"}}. Stored values are never shown: '
                              f'each reads "{HEADER_KEPT}"; leave it so to keep it, or type a new one.'),
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A model field with a callable default (dict) would also write its stored value
        # into a hidden "initial-headers" input.
        self.fields["headers"].show_hidden_initial = False

    def clean_headers(self) -> dict:
        headers = self.cleaned_data.get("headers") or {}
        if not isinstance(headers, dict):
            raise forms.ValidationError('Give the headers as a JSON object: {"name": "value"}.')
        stored = self.instance.headers if self.instance.pk and isinstance(self.instance.headers, dict) else {}
        kept = {}
        for name, value in headers.items():
            if value == HEADER_KEPT:
                if name not in stored:
                    raise forms.ValidationError(f"Type the value of the header {name}: none is stored for it.")
                value = stored[name]
            kept[name] = value
        return kept

    def clean_api_key(self) -> str:
        typed = self.cleaned_data.get("api_key", "")
        if self.data.get("clear_api_key"):
            return ""
        return typed or (self.instance.api_key if self.instance.pk else "")


@admin.register(McpServer)
class McpServerAdmin(admin.ModelAdmin):
    form = McpServerForm
    list_display = ("name", "url", "enabled", "has_api_key")
    list_filter = ("enabled",)

    @admin.display(boolean=True, description="API key")
    def has_api_key(self, obj) -> bool:
        return bool(obj.api_key)

class DeploymentSettingsForm(forms.ModelForm):
    class Meta:
        model = DeploymentSettings
        fields = ["system_prompt"]

    def clean_system_prompt(self) -> str:
        return admin_system_prompt(self.cleaned_data["system_prompt"])


@admin.register(DeploymentSettings)
class DeploymentSettingsAdmin(admin.ModelAdmin):
    """The one row of deployment-wide defaults: the admin's list links straight to it."""

    form = DeploymentSettingsForm

    def has_add_permission(self, request):
        return not DeploymentSettings.objects.exists()

    def has_delete_permission(self, request, obj=None):
        return False

    def changelist_view(self, request, extra_context=None):
        settings_row = DeploymentSettings.load()
        return redirect(reverse("admin:sessions_app_deploymentsettings_change", args=[settings_row.pk]))
