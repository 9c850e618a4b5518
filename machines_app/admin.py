"""The admin of machines and their model files, as far as machines_app knows them.

machines_app knows nothing of sessions (tests/test_layers.py): what the machine pages
show of the sessions' servers there — the running servers, those Corral has no record
of, "Stop all idle servers", the model files read in the background — and the rule a
model file's system prompt is held to are added by sessions_app's admin, which registers
its extension of these classes in their place (sessions_app/servers/admin.py,
sessions_app/admin.py).
"""

from typing import ClassVar

from django import forms
from django.contrib import admin, messages
from django.template.defaultfilters import filesizeformat

from . import actions as machine_actions
from . import ssh
from .llama_server import BUILTIN_CHAT_TEMPLATES
from .models import Machine, ModelFile
from .template_files import TemplateFileRefused, check_template_file
from .transports import TransportError, reader_for

# Corral's name on every admin page (title, header, the index), not Django's.
admin.site.site_header = "Corral administration"
admin.site.site_title = "Corral administration"
admin.site.index_title = "Machines, models, members and sessions"
# The list pages need the width (the model files' table was cut off at 1366 px beside the
# navigation column); every section is one click away on the index and in the breadcrumbs.
admin.site.enable_nav_sidebar = False


class SecretTextarea(forms.Textarea):
    """A text area that never writes a value into the page — not even the one just typed,
    when the form comes back for an error in another field (docs/security.md): a secret
    typed into the admin goes one way only."""

    def format_value(self, value):
        return None


class MachineForm(forms.ModelForm):
    """The machine form; for SSH it connects once to read and pin the host key, and takes
    the private key write-only (stored encrypted in the database, never shown back)."""

    private_key = forms.CharField(
        required=False, strip=False, widget=SecretTextarea(attrs={"rows": 4, "autocomplete": "off"}),
        help_text="Paste the private key Corral uses for this machine (OpenSSH format, no passphrase). It is "
        "stored in the database, encrypted with this installation's SECRET_KEY, and never shown again; leave empty to "
        "keep the current one.",
    )
    expected_fingerprint = forms.CharField(
        required=False, label="Expected host key fingerprint",
        help_text="Optional: the SHA256 fingerprint from `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the "
        "machine. When the host key is empty, Corral connects once, shows the key offered and pins it; with this "
        "filled in it pins only a key with this fingerprint.",
    )

    class Meta:
        model = Machine
        fields = [
            "name", "transport", "host", "port", "user", "private_key", "expected_fingerprint", "host_key",
            "models_dir", "llama_server_path", "bwrap_path", "workspace_roots", "allowed_groups", "idle_stop_seconds", "memory_budget_mib", "enabled",
        ]

    #: Said on the key's field when the form comes back with a key typed in: it is not shown.
    KEY_NOT_KEPT = "The private key you pasted is not shown again: paste it again before saving."

    def clean(self):
        data = self._clean_together()
        if data.get("private_key") and self.errors and "private_key" not in self.errors:
            self.add_error("private_key", self.KEY_NOT_KEPT)
        return data

    def _clean_together(self):
        data = super().clean()
        self.pinned_fingerprint = ""
        if data.get("host_key"):
            try:
                ssh.parse_pins(data["host_key"], data.get("host") or "", data.get("port") or 22)
            except ValueError as exc:
                self.add_error("host_key", str(exc))
        if data.get("private_key"):
            try:
                machine_actions._parse_private_key(data["private_key"])
            except machine_actions.MachineError as exc:
                self.add_error("private_key", str(exc))
        if data.get("transport") != Machine.Transport.SSH:
            return data
        if not data.get("host"):
            self.add_error("host", "An SSH machine needs a host.")
            return data
        if data["host"].startswith("-") or any(c.isspace() or c in "[]@/," for c in data["host"]):
            self.add_error(
                "host", "A host is a name or an address: no spaces, brackets, '@', '/' or ',', not starting with '-'."
            )
            return data
        if not data.get("private_key") and not self.instance.private_key_sealed:
            self.add_error("private_key", "Paste the private key Corral uses for this machine.")
        if not data.get("host_key"):
            try:
                line, fingerprint = machine_actions.check_offered_host_key(
                    data["host"], data.get("port") or 22, data.get("expected_fingerprint", "")
                )
            except machine_actions.MachineError as exc:
                self.add_error("host_key", str(exc))
                return data
            data["host_key"] = line
            self.pinned_fingerprint = fingerprint
        return data


@admin.register(Machine)
class MachineAdmin(admin.ModelAdmin):
    form = MachineForm
    list_display: tuple[str, ...] = (
        "name", "transport", "address", "state", "tools", "models_dir", "enabled", "models_refreshed_at",
    )
    list_filter = ("transport", "enabled", "link_state", "allowed_groups")
    filter_horizontal = ("allowed_groups",)
    actions = ["test_connection", "repin_host_key"]
    readonly_fields: ClassVar[tuple[str, ...]] = (
        "tool_containment", "stored_private_key", "host_key_fingerprint",
        "link_state", "link_reason", "link_checked_at",
        "offered_key_fingerprint", "models_refreshed_at", "models_refresh_error",
    )

    #: The fields only an SSH machine has: the local machine's page leaves them out, with
    #: its link state (this backend is always reachable; nothing checks a link to it).
    SSH_FIELDS = ("host", "port", "user", "private_key", "expected_fingerprint", "host_key")
    SSH_READONLY = (
        "stored_private_key", "host_key_fingerprint", "link_state", "link_reason", "link_checked_at",
        "offered_key_fingerprint",
    )

    def _is_local(self, obj) -> bool:
        return obj is not None and obj.transport == Machine.Transport.LOCAL

    def get_fields(self, request, obj=None):
        fields = super().get_fields(request, obj)
        if self._is_local(obj):
            return [f for f in fields if f not in (*self.SSH_FIELDS, *self.SSH_READONLY)]
        return fields

    def get_readonly_fields(self, request, obj=None):
        fields = super().get_readonly_fields(request, obj)
        if not self._is_local(obj):
            return fields
        # "local" stays local (an SSH machine is added as its own row): with no SSH fields
        # on the page, an SSH transport here could not be filled in.
        return ["transport", *(f for f in fields if f not in self.SSH_READONLY)]

    def get_form(self, request, obj=None, change=False, **kwargs):
        if self._is_local(obj):
            # The form keeps the machine's SSH fields as they are (empty for a local machine).
            kwargs["fields"] = [f for f in MachineForm.Meta.fields if f not in (*self.SSH_FIELDS, "transport")]
        return super().get_form(request, obj, change, **kwargs)

    @admin.display(description="address")
    def address(self, obj: Machine) -> str:
        if obj.transport != Machine.Transport.SSH:
            # docs/operations.md "More hosts": each host has its own local machine.
            return f"Corral host {obj.corral_host}" if obj.corral_host else "this backend"
        return f"{obj.user}@{obj.host_entry}" if obj.user else obj.host_entry

    @admin.display(description="state")
    def state(self, obj: Machine) -> str:
        if obj.transport != Machine.Transport.SSH:
            return "reachable"
        label = obj.get_link_state_display()
        return f"{label}: {obj.link_reason}" if obj.link_reason else label

    @admin.display(description="tools")
    def tools(self, obj: Machine) -> str:
        """Whether the last start found the tools there contained (docs/security.md)."""
        return obj.get_containment_display()

    @admin.display(description="tool containment")
    def tool_containment(self, obj: Machine) -> str:
        """What the last server start (or Test connection) found: contained by bubblewrap,
        or the plain warning of what a tool there can read and what to do."""
        return machine_actions.containment_warning(obj) or obj.get_containment_display()

    @admin.display(description="private key")
    def stored_private_key(self, obj: Machine) -> str:
        """The stored key's public fingerprint, or why there is no usable key (none stored;
        not readable with this installation's SECRET_KEY) and what to do. Never the key."""
        return machine_actions.private_key_state(obj) if obj is not None and obj.pk else ""

    def change_view(self, request, object_id, form_url="", extra_context=None):
        # The warnings at the top of the page too, where an admin cannot miss them.
        machine = self.get_object(request, object_id)
        warning = machine_actions.containment_warning(machine) if machine is not None else ""
        if warning and request.method == "GET":
            self.message_user(request, warning, messages.WARNING)
        if machine is not None and machine.transport == Machine.Transport.SSH and request.method == "GET":
            state = machine_actions.private_key_state(machine)
            if not state.startswith("Stored"):
                self.message_user(request, state, messages.ERROR)
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        self.saved(request, obj, form, change)
        if form.cleaned_data.get("private_key"):
            fingerprint = machine_actions.do_store_private_key(obj, form.cleaned_data["private_key"])
            self.message_user(request, f"Private key stored for {obj.name} (public key {fingerprint}).")
        if getattr(form, "pinned_fingerprint", ""):
            self.message_user(
                request,
                f"Pinned the host key {obj.host_entry} offers: {form.pinned_fingerprint}. Compare it with "
                "`ssh-keygen -lf` on the machine; from now on any other key is refused.",
                messages.WARNING,
            )

    def saved(self, request, obj: Machine, form, change: bool) -> None:
        """Called once the row is saved, before its private key is stored: what the
        sessions' side does with a new machine or one moved to other files (reads its model
        files: sessions_app.servers.admin). Nothing here."""

    @admin.action(description="Test connection")
    def test_connection(self, request, queryset):
        for machine in queryset:
            try:
                self.message_user(request, machine_actions.do_test_connection(machine))
            except machine_actions.MachineError as exc:
                self.message_user(request, str(exc), messages.ERROR)

    @admin.action(description="Re-pin the changed host key (the key the machine offered when refused)")
    def repin_host_key(self, request, queryset):
        for machine in queryset:
            try:
                old, new = machine_actions.do_repin(machine)
            except machine_actions.MachineError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                continue
            self.message_user(request, f"{machine.name} ({machine.host_entry}): host key re-pinned, {old} → {new}.")


class ModelFileForm(forms.ModelForm):
    """What an admin sets on a discovered model file (docs/behaviour.md §17): its default
    system prompt and the chat template its server uses — a llama.cpp built-in name or a
    Jinja file that must exist on the file's machine (checked there, like model paths)."""

    chat_template = forms.ChoiceField(
        required=False, choices=[("", "— the file's own —"), *((n, n) for n in BUILTIN_CHAT_TEMPLATES)],
        help_text=ModelFile._meta.get_field("chat_template").help_text,
    )

    class Meta:
        model = ModelFile
        fields = ["system_prompt", "chat_template", "chat_template_file"]

    def clean(self):
        data = super().clean()
        path = (data.get("chat_template_file") or "").strip()
        data["chat_template_file"] = path
        if path and data.get("chat_template"):
            self.add_error("chat_template_file", "Choose a built-in template or a template file, not both.")
            return data
        if not path:
            return data
        machine = self.instance.machine
        try:
            # docs/security.md: a readable regular file of a template's size, no secret by where it lies.
            check_template_file(
                reader_for(machine), path, machine.name, local=machine.transport == Machine.Transport.LOCAL
            )
        except TemplateFileRefused as exc:
            self.add_error("chat_template_file", str(exc))
        except TransportError as exc:
            self.add_error("chat_template_file", f"Could not check the file on {machine.name}: {exc}")
        return data


@admin.register(ModelFile)
class ModelFileAdmin(admin.ModelAdmin):
    form = ModelFileForm
    # The columns an admin chooses by, narrow enough for a 1366 px screen (the rest are on
    # each file's page).
    list_display = (
        "display_name", "machine", "key", "size", "context", "template", "takes_images", "state",
    )
    list_filter = ("machine", "architecture", "has_mtp", "has_vision")
    search_fields = ("display_name", "key", "name")
    # Every field the form does not edit, chat_template_caps included (listing it again
    # showed it twice on the page).
    # special_tokens too: thousands of strings for some vocabularies (Gemma's <unused…>), kept for requests.
    # file_size is shown by file_size_display, in bytes a person reads.
    readonly_fields = [
        "file_size_display" if f.name == "file_size" else f.name
        for f in ModelFile._meta.fields if f.name not in (*ModelFileForm.Meta.fields, "special_tokens")
    ]

    class Media:
        css = {"all": ("corral/admin.css",)}

    @admin.display(description="size", ordering="file_size")
    def size(self, obj):
        """What the file holds, as the file says: parameters and quantisation, then its size
        on disk ("135M · Q4_1 · 93.8 MB")."""
        return " · ".join(part for part in (obj.size_label, obj.quantization, filesizeformat(obj.file_size)) if part)

    @admin.display(description="file size", ordering="file_size")
    def file_size_display(self, obj):
        return f"{filesizeformat(obj.file_size)} ({obj.file_size:,} bytes)"

    @admin.display(description="context", ordering="context_length")
    def context(self, obj):
        return f"{obj.context_length:,} tokens" if obj.context_length else "–"

    def save_model(self, request, obj, form, change):
        if {"chat_template", "chat_template_file"} & set(form.changed_data):
            obj.chat_template_caps = {}  # they were the old template's; the next start reports the new one's
        super().save_model(request, obj, form, change)

    @admin.display(description="chat template")
    def template(self, obj):
        return obj.chat_template_file or obj.chat_template or ("the file's" if obj.has_chat_template else "none")

    def has_add_permission(self, request):
        return False  # model files are discovered, not typed in

    @admin.display(boolean=True)
    def is_complete(self, obj):
        return obj.is_complete

    @admin.display(boolean=True, description="takes images", ordering="has_vision")
    def takes_images(self, obj):
        return obj.has_vision

    @admin.display(description="can start")
    def state(self, obj):
        """"yes", or why not in plain words (a damaged file, missing split parts)."""
        return obj.problem or "yes"
