"""The rows of a session's llama-server (docs/behaviour.md §2, §5): the running process
(:class:`ServerRecord`) and its saved prompt caches (:class:`SlotSave`).

They were machines_app's once; their tables keep those names (``db_table``), so moving
them here (migrations sessions_app 0014, machines_app 0018) moved no data.
"""

from __future__ import annotations

from django.db import models

from machines_app.models import Machine


class ServerRecord(models.Model):
    """A llama-server started for a session (docs/behaviour.md §2, §5).

    ``pid`` and ``start_time`` (the process start time as the machine's ``/proc`` reports it,
    in clock ticks since boot) together identify the process, so a reused pid is never
    taken for ours. ``port`` is the port on the serving machine (loopback there).
    """

    session = models.OneToOneField("sessions_app.AgentSession", on_delete=models.CASCADE, related_name="server")
    # A machine deleted with its sessions takes their records along; their servers were
    # handed to the stop task as the sessions went (docs/behaviour.md §5).
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE)
    model_key = models.CharField(max_length=1000)
    server_params = models.JSONField(default=dict, blank=True, help_text="The session's server parameters at start.")
    pid = models.PositiveIntegerField()
    start_time = models.CharField(max_length=40)
    port = models.PositiveIntegerField()
    # The server's own API key (docs/security.md): sent by Corral on every request, kept for
    # adoption after a restart, never shown in a page, the admin or a log.
    api_key = models.CharField(max_length=100, blank=True, editable=False)
    log_path = models.CharField(max_length=1000)
    started_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopping = models.BooleanField(default=False)
    # What a saved slot must match to be restored into this server (llama_server.slot_fingerprint),
    # read from the server once ready; '' when it could not be read (no save then).
    slot_key = models.CharField(max_length=64, blank=True)

    class Meta:
        db_table = "machines_app_serverrecord"

    def __str__(self) -> str:
        return f"llama-server pid {self.pid} on {self.machine} port {self.port}"


class SlotSave(models.Model):
    """A session's KV cache saved to its machine's disk by llama-server's slot save
    (docs/behaviour.md §5 "warm prompts"): one per session and model file, so a session
    switched away from a model and back finds that model's cache.

    ``fingerprint`` is the ``slot_key`` of the server that saved it; the file is restored
    only into a server with the same one, and deleted when a server of that model has
    another (docs/behaviour.md C44). The file itself is ``llama_server.slot_file_name(session,
    pk)`` in the machine's slot directory.
    """

    session = models.ForeignKey("sessions_app.AgentSession", on_delete=models.CASCADE, related_name="slot_saves")
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE)
    model_key = models.CharField(max_length=1000)
    fingerprint = models.CharField(max_length=64)
    n_tokens = models.PositiveIntegerField(default=0, help_text="Tokens in the saved KV cache (n_saved).")
    saved_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "machines_app_slotsave"
        constraints = [
            models.UniqueConstraint(fields=["session", "machine", "model_key"], name="one_slot_save_per_session_model")
        ]

    def __str__(self) -> str:
        return f"slot of session {self.session_id} for {self.model_key} ({self.n_tokens} tokens)"
