"""The admin of a session's servers (docs/behaviour.md §5): their records, shown and never
edited, and what the machine pages say of the servers on each machine — the running
ones with their memory, those Corral has no record of (each with a Stop button), the
stops still pending, and the action that puts every idle one to sleep.

machines_app's admin knows nothing of sessions (tests/test_layers.py); this module
registers its extension of the machine admin in its place.
"""

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from machines_app import admin as machines_admin
from machines_app.models import Machine, PendingStop
from machines_app.transports import ProcessId, TransportError, reader_for

from .. import dispatch, orphans
from ..server_state import idle_sessions
from .models import ServerRecord


class InternalRowAdmin(admin.ModelAdmin):
    """Rows only Corral writes: shown, never added or changed, and deleted only with
    their session (a delete of one alone would leave a gap in a transcript, or a server
    running that nothing tracks). Delete permission stays, so that the admin may delete
    a session and the rows that go with it."""

    refuse_delete = "These rows go with their session."

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        # Asked by the admin's delete of a session (or of its owner or machine) for every
        # row that goes with it: whoever may delete sessions may delete these along.
        return request.user.has_perm("sessions_app.delete_agentsession")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), "show_delete": False})

    def delete_view(self, request, object_id, extra_context=None):
        if request.method == "POST":
            raise PermissionDenied(self.refuse_delete)
        self.message_user(request, self.refuse_delete, messages.WARNING)
        return HttpResponseRedirect(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist"))


@admin.register(ServerRecord)
class ServerRecordAdmin(InternalRowAdmin):
    list_display = ("session", "machine", "model_key", "pid", "port", "started_at", "ready_at", "stopping")
    readonly_fields = [f.name for f in ServerRecord._meta.fields if f.name != "api_key"]
    exclude = ("api_key",)  # the server's key never reaches a page
    refuse_delete = (
        "A llama-server record goes when its server stops: use Stop server on the session's page, or delete "
        "the session (its server is stopped)."
    )


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / (1024 * 1024):.0f} MiB"


admin.site.unregister(Machine)


@admin.register(Machine)
class MachineAdmin(machines_admin.MachineAdmin):
    """The machine admin (machines_app.admin.MachineAdmin) with the sessions' servers on
    each machine, and its model files read in the background (a task handed on by
    :mod:`sessions_app.dispatch`) when it is added or moved, or on *Refresh models*."""

    list_display = (
        "name", "transport", "address", "state", "tools", "running_sessions", "models_dir", "enabled",
        "models_refreshed_at",
    )
    actions = ["refresh_models", "test_connection", "repin_host_key", "stop_idle_servers"]
    readonly_fields = (
        "tool_containment", "running_servers", "unrecorded_servers", "stored_private_key", "host_key_fingerprint",
        "link_state", "link_reason", "link_checked_at",
        "offered_key_fingerprint", "models_refreshed_at", "models_refresh_error",
    )

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(running=Count("serverrecord"))

    @admin.display(description="running sessions", ordering="running")
    def running_sessions(self, obj: Machine) -> int:
        return obj.running  # type: ignore[attr-defined]  # annotated by get_queryset

    @admin.display(description="running servers")
    def running_servers(self, obj: Machine) -> str:
        """Each llama-server on the machine with its session, status, resident memory and
        GPU memory (when the machine has ``nvidia-smi``), read from the machine now."""
        records = list(ServerRecord.objects.filter(machine=obj).select_related("session").order_by("started_at"))
        if not records:
            return "none"
        try:
            transport = reader_for(obj)  # another host's local machine: asked through that host
            gpu = transport.gpu_memory()
            memory = {r.pk: transport.memory_of(ProcessId(r.pid, r.start_time)) for r in records}
        except TransportError as exc:
            return f"The machine cannot be asked about its servers now: {exc}"
        now = timezone.now()
        rows = format_html_join(
            "",
            "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td class=\"rss\">{}</td>"
            "<td class=\"vram\">{}</td><td>{}</td></tr>",
            (
                (
                    reverse("session_detail", args=[r.session_id]), r.session.display_title,
                    r.session.get_status_display(), r.model_key, r.pid, _mib(memory[r.pk]),
                    _mib(gpu.get(r.pid)) if gpu is not None else "no nvidia-smi",
                    f"{int((now - r.session.last_activity_at).total_seconds())} s",
                )
                for r in records
            ),
        )
        return format_html(
            "<table class=\"running-servers\"><thead><tr><th>session</th><th>status</th><th>model</th><th>pid</th>"
            "<th>memory (RSS)</th><th>GPU memory</th><th>quiet for</th></tr></thead><tbody>{}</tbody></table>"
            "<p class=\"help\">Staff can put every idle one to sleep with the action \u201cStop all idle servers\u201d "
            "on the machine list.</p>",
            rows,
        )

    @admin.display(description="servers Corral has no record of")
    def unrecorded_servers(self, obj: Machine) -> str:
        """The stops still pending on this machine, and every llama-server running there that
        Corral started (its command line names Corral's private directory) but has no record
        of, each with a Stop button (docs/behaviour.md §5 "no orphans")."""
        if obj is None or obj.pk is None:
            return "none"
        pending = list(PendingStop.objects.filter(machine=obj).order_by("created_at"))
        parts: list[str] = []
        if pending:
            parts.append(format_html(
                "<p class=\"pending-stops\">Stops pending (the machine could not be reached; the watch stops them "
                "when it answers): {}</p>",
                format_html_join(", ", "pid {} (session {}, since {})",
                                 ((p.pid, p.session_id or "deleted", p.created_at) for p in pending)),
            ))
        try:
            found = orphans.unrecorded_servers(obj)
        except TransportError as exc:
            parts.append(format_html("<p>The machine cannot be asked about its processes now: {}</p>", exc))
            return format_html_join("", "{}", ((p,) for p in parts))
        if not found:
            parts.append("none")
            return format_html_join("", "{}", ((p,) for p in parts))
        url = reverse("admin:machines_app_machine_stop_unrecorded", args=[obj.pk])
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td><button type=\"submit\" "
            "formaction=\"{}\" formmethod=\"post\" name=\"process\" value=\"{}:{}\">Stop</button></td></tr>",
            (
                (s.proc.pid, s.session_id, s.port, " ".join(s.argv)[:300], url, s.proc.pid, s.proc.start_time)
                for s in found
            ),
        )
        parts.append(format_html(
            "<table class=\"unrecorded-servers\"><thead><tr><th>pid</th><th>session (from its key file)</th>"
            "<th>port</th><th>command line</th><th></th></tr></thead><tbody>{}</tbody></table>",
            rows,
        ))
        return format_html_join("", "{}", ((p,) for p in parts))

    def get_urls(self):
        return [
            path("<int:machine_id>/stop-unrecorded/", self.admin_site.admin_view(self.stop_unrecorded_view),
                 name="machines_app_machine_stop_unrecorded"),
            *super().get_urls(),
        ]

    def stop_unrecorded_view(self, request, machine_id: int):
        """POST ``process=<pid>:<start time>``: stop that unrecorded server (staff who may
        change machines only; it is looked up again on the machine before anything is sent)."""
        machine = self.get_object(request, str(machine_id))
        if request.method != "POST" or machine is None or not self.has_change_permission(request, machine):
            raise PermissionDenied
        back = HttpResponseRedirect(reverse("admin:machines_app_machine_change", args=[machine.pk]))
        pid_text, _, start_time = request.POST.get("process", "").partition(":")
        if not pid_text.isdigit() or not start_time.isdigit():
            self.message_user(request, "No server was chosen.", messages.ERROR)
            return back
        try:
            stopped = orphans.stop_unrecorded(machine, int(pid_text), start_time)
        except TransportError as exc:
            self.message_user(request, f"Could not stop it: {exc}", messages.ERROR)
            return back
        if stopped is None:
            self.message_user(request, f"pid {pid_text} on {machine.name} is no longer a server Corral has no "
                              "record of (it ended, or it is a session's server now); nothing was stopped.",
                              messages.WARNING)
        else:
            self.message_user(request, f"Stopped llama-server pid {stopped.proc.pid} on {machine.name} "
                              f"(it was started for session {stopped.session_id}, port {stopped.port}).")
        return back

    @admin.action(description="Stop all idle servers (they sleep; the next message starts them again)")
    def stop_idle_servers(self, request, queryset):
        by = {"id": request.user.pk, "username": request.user.get_username()}
        for machine in queryset:
            idle = idle_sessions(machine)
            for session_id in idle:
                dispatch.enqueue(dispatch.SLEEP_SERVER, session_id, False, by)
            self.message_user(request, f"{machine.name}: putting {len(idle)} idle server(s) to sleep.")

    def saved(self, request, obj: Machine, form, change: bool) -> None:
        if not change or {"transport", "host", "port", "user", "models_dir"} & set(form.changed_data):
            # A new machine's models, or a machine moved to other files, are read now (in
            # the background, once the row is saved), so the picker lists them without a
            # Refresh models first.
            dispatch.enqueue_on_commit(dispatch.REFRESH_MODELS, obj.pk)
            self.message_user(request, f"Reading the model files on {obj.name}; they are listed in a moment.")

    @admin.action(description="Refresh models (read GGUF heads)")
    def refresh_models(self, request, queryset):
        for machine in queryset:
            dispatch.enqueue(dispatch.REFRESH_MODELS, machine.pk)
        names = ", ".join(m.name for m in queryset)
        self.message_user(request, f"Reading model files on {names}; reload this page in a moment.")
