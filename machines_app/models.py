"""Machines, the model files on them, their memory and the stops pending there (docs/behaviour.md §2).

A session's running llama-server is recorded by sessions_app (:mod:`sessions_app.servers.models`)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.html import escape

from . import ssh
from .workspaces import parse_roots, validate_workspace_roots


def this_host() -> str:
    """The id of the Corral host this process runs on (settings.CORRAL_HOST_ID): a local
    machine created here is this host's own."""
    return settings.CORRAL_HOST_ID


def reached_by(host: str | None, path: str = "") -> models.Q:
    """The machines whose servers one process looks after, as a filter on ``path`` (``""``
    for Machine itself, ``"machine__"`` from a row that points at one): with ``host``
    None, those every host reaches — SSH machines and an unclaimed local one; with a host
    id, that host's own local machine (docs/operations.md, "More hosts")."""
    if host is None:
        return models.Q(**{f"{path}transport": "ssh"}) | models.Q(**{f"{path}corral_host": ""})
    return models.Q(**{f"{path}transport": "local", f"{path}corral_host": host})


class Machine(models.Model):
    """A computer that serves models: the local one, or one reached over SSH (docs/behaviour.md §2, §11)."""

    class Transport(models.TextChoices):
        LOCAL = "local", "Local"
        SSH = "ssh", "SSH"

    name = models.CharField(max_length=100, unique=True)
    transport = models.CharField(max_length=10, choices=Transport.choices, default=Transport.LOCAL)
    # docs/operations.md "More hosts": a local machine is the computer of one Corral host;
    # only that host's workers touch its servers (its tasks go to that host's queues).
    corral_host = models.CharField(
        "Corral host", max_length=63, blank=True, default=this_host,
        help_text="For a local machine: the id of the Corral host it is (each host has its own local machine; "
        "its servers are started, watched and stopped by that host's workers only). Empty: the one host of a "
        "deployment that has one. Not used for SSH machines.",
    )
    class LinkState(models.TextChoices):
        UNCHECKED = "unchecked", "not checked yet"
        REACHABLE = "reachable", "reachable"
        UNREACHABLE = "unreachable", "unreachable"
        HOST_KEY_CHANGED = "host_key_changed", "host key changed"

    host = models.CharField(max_length=255, blank=True)
    port = models.PositiveIntegerField(default=22)
    user = models.CharField(max_length=100, blank=True)
    # machines_app.keystore: the pasted key, encrypted with a key derived from SECRET_KEY, in
    # the database every Corral host reads; never a file on one host.
    private_key_sealed = models.TextField(
        "private key (encrypted)", blank=True, editable=False,
        help_text="The private key pasted in the admin, encrypted with this installation's SECRET_KEY. Never "
        "shown again.",
    )
    host_key = models.TextField(
        blank=True,
        help_text="Pinned host key ('ssh-ed25519 AAAA…', or known_hosts lines, plain or hashed); connections "
        "offering another key are refused.",
    )
    link_state = models.CharField(max_length=20, choices=LinkState.choices, default=LinkState.UNCHECKED)
    link_reason = models.TextField(blank=True, help_text="Why the machine is unreachable, in plain words.")
    link_checked_at = models.DateTimeField(null=True, blank=True)
    offered_host_key = models.TextField(
        blank=True, help_text="The key the machine offered when it was refused for a changed key (to re-pin)."
    )
    models_dir = models.CharField(max_length=500, default="~/models")
    llama_server_path = models.CharField(max_length=500, default="llama-server")
    enabled = models.BooleanField(default=True)
    # Where members may point a session's tools (docs/access.md). The default keeps a new
    # machine's members in their home directory there, which is what the new-session form
    # offers; an admin who clears the field opens every directory to them.
    workspace_roots = models.TextField(
        blank=True,
        default="~",
        validators=[validate_workspace_roots],
        help_text="Directories members may use as a working directory, one per line: absolute (/srv/work) or in "
        "the home directory on that machine (~, ~/projects). Symlinks are followed before comparing. Empty: any "
        "directory. Staff are not limited.",
    )
    allowed_groups = models.ManyToManyField(
        "auth.Group",
        blank=True,
        related_name="machines",
        help_text="Only members of these groups see this machine and start sessions on it. None selected: everyone. "
        "Staff are not limited.",
    )
    models_refreshed_at = models.DateTimeField(null=True, blank=True)
    models_refresh_error = models.TextField(blank=True)
    # docs/behaviour.md §5 "sleep": an idle server holds its memory (GPU memory on a GPU box)
    # for nothing; after this long it is stopped, its prompt cache saved, and started again
    # by the next message.
    idle_stop_seconds = models.PositiveIntegerField(
        "idle time",
        null=True,
        blank=True,
        help_text="Seconds without activity after which a session's llama-server is stopped to free its memory "
        "(the session shows 'sleeping'; its next message starts the server again and restores its prompt cache). "
        "Empty: never.",
    )

    # docs/security.md "What a tool can reach": every llama-server on the machine runs in a
    # bubblewrap sandbox that hides Corral's files there, unless this is empty.
    bwrap_path = models.CharField(
        "bubblewrap", max_length=500, blank=True, default="bwrap",
        help_text="bubblewrap on that machine (bwrap, or its absolute path). Each llama-server, and every command "
        "its tools run, is started in a sandbox that hides Corral's files there and Corral's other processes. "
        "Empty: no sandbox, and tools can read Corral's files on that machine (on this backend: its database, "
        "secret key and SSH keys). Where bubblewrap is missing, a server on this backend is not started; one on "
        "an SSH machine starts without the sandbox and this page says so.",
    )

    class Containment(models.TextChoices):
        UNCHECKED = "unchecked", "not checked yet (no server started since)"
        CONTAINED = "contained", "contained by bubblewrap"
        EXPOSED = "exposed", "NOT contained"

    containment = models.CharField(
        "tool containment", max_length=20, choices=Containment.choices, default=Containment.UNCHECKED
    )
    containment_reason = models.TextField(blank=True, help_text="Why tools there are not contained, in plain words.")

    # docs/behaviour.md §5 "Room on a machine": starts are measured against the machine's
    # free memory (its GPUs' where nvidia-smi answers) unless an admin sets what Corral may use.
    memory_budget_mib = models.PositiveIntegerField(
        "memory budget (MiB)", null=True, blank=True,
        help_text="What Corral's llama-servers may use on this machine in all, in MiB (their resident memory plus "
        "GPU memory). Set: it wins over what the machine reports free. Empty: a start is measured against the "
        "machine's free GPU memory (where nvidia-smi answers) or its available memory (/proc/meminfo).",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def owner_host(self) -> str:
        """The host id whose own queues this machine's work goes to: ``corral_host`` for a
        local machine, "" (any host, the shared queues) for an SSH one or an unclaimed
        local one."""
        return self.corral_host if self.transport == self.Transport.LOCAL else ""

    def note_containment(self, contained: bool, reason: str = "") -> None:
        """Record what the last server start found about the machine's sandbox (the admin
        shows it, docs/security.md); written only when it changes."""
        state = self.Containment.CONTAINED if contained else self.Containment.EXPOSED
        reason = "" if contained else reason[:2000]
        if (self.containment, self.containment_reason) == (state, reason):
            return
        Machine.objects.filter(pk=self.pk).update(containment=state, containment_reason=reason)
        self.containment, self.containment_reason = state, reason

    @property
    def workspace_root_list(self) -> list[str]:
        """The workspace roots as written, one per line ([] = no limit); see machines_app.workspaces."""
        return parse_roots(self.workspace_roots)

    @property
    def host_entry(self) -> str:
        """How the host key is filed: ``host``, or ``[host]:port`` off port 22 (OpenSSH)."""
        return ssh.host_entry(self.host, self.port)

    @property
    def host_key_fingerprint(self) -> str:
        """SHA256 fingerprint of the pinned key for this host entry; '' when none is pinned."""
        return _fingerprint_of(self.host_key, self.host, self.port)

    @property
    def offered_key_fingerprint(self) -> str:
        return _fingerprint_of(self.offered_host_key, self.host, self.port)

    def note_link(self, state: str, reason: str, offered_key: str = "") -> None:
        """Record how the last connection went (the machine list shows it). A changed host
        key is kept, with the key offered, until an admin re-pins (see
        ``machines_app.actions.do_repin``). Written only when the state or its reason
        changes (``link_checked_at`` is when that happened): the health watch checks
        every couple of seconds and must not write each time."""
        if (self.link_state, self.link_reason) == (state, reason[:2000]) and not offered_key:
            return
        fields = {"link_state": state, "link_reason": reason[:2000], "link_checked_at": timezone.now()}
        if offered_key:
            fields["offered_host_key"] = offered_key
        rows = Machine.objects.filter(pk=self.pk)
        if state != self.LinkState.HOST_KEY_CHANGED:
            rows = rows.exclude(link_state=self.LinkState.HOST_KEY_CHANGED)
        rows.update(**fields)
        for name, value in fields.items():
            setattr(self, name, value)


def _fingerprint_of(text: str, host: str, port: int) -> str:
    try:
        key = ssh.pinned_key(ssh.parse_pins(text, host, port), host, port)
    except ValueError:
        return ""
    return ssh.fingerprint(key) if key is not None else ""


class ModelFile(models.Model):
    """One GGUF model on one machine, as read from the file's head (docs/behaviour.md §3).

    ``key`` is the path relative to the machine's models directory, ``/``-separated; for a
    split set it is the first part's. The list for a machine is answered by
    :func:`machines_app.catalog.models_for` everywhere (picker, spawn form, API).
    """

    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="model_files")
    key = models.CharField(max_length=1000)
    display_name = models.CharField(max_length=300)
    name = models.CharField(max_length=300, blank=True, help_text="general.name from the GGUF metadata")
    architecture = models.CharField(max_length=100, blank=True)
    size_label = models.CharField(max_length=50, blank=True)
    quantization = models.CharField(max_length=50, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    file_size = models.BigIntegerField(default=0)
    has_chat_template = models.BooleanField(default=False)
    # Help texts are HTML to the admin: a <placeholder> would be taken for a tag and vanish.
    has_mtp = models.BooleanField(
        default=False, help_text=escape("The file has a multi-token-prediction head: <arch>.nextn_predict_layers > 0")
    )
    has_vision = models.BooleanField(default=False, help_text="An mmproj file sits beside it.")
    projector_key = models.CharField(
        max_length=1000, blank=True, help_text="The mmproj file beside it (key), given to llama-server with --mmproj."
    )
    split_count = models.PositiveIntegerField(default=1)
    missing_parts = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True)
    sampling_defaults = models.JSONField(
        default=dict, blank=True,
        help_text="The file's general.sampling.* keys, by request name (temperature, top_k, …): llama-server "
        "applies them to a request that does not set its own.",
    )
    # The strings the server's tokenizer would read as the template's special tokens
    # (machines_app.gguf.special_token_texts), broken up in every message before a request
    # (docs/security.md "Text never becomes control tokens"). None: not read yet (a row from
    # before this was kept); catalog.special_tokens reads it then.
    special_tokens = models.JSONField(null=True, blank=True, default=None, editable=False)
    # Set by an admin, kept across refreshes (a refresh updates the row in place by key).
    system_prompt = models.TextField(
        blank=True,
        help_text="Default system prompt for sessions on this model file; wins over the deployment default, "
        "a session's own prompt wins over it.",
    )
    chat_template = models.CharField(
        max_length=50, blank=True,
        help_text="A llama.cpp built-in chat template (--chat-template NAME), for a file that has none or a "
        "wrong one. Built-in templates cannot take tools.",
    )
    chat_template_file = models.CharField(
        max_length=1000, blank=True,
        help_text="Or a Jinja chat template file on this machine (--chat-template-file): an absolute path or "
        "one in the home directory there (~/templates/x.jinja).",
    )
    # What llama-server reported for the template in GET /props after the last start
    # (chat_template_caps: supports_tools, supports_system_role, …); {} until a first start
    # or after the template was changed (docs/behaviour.md §17).
    chat_template_caps = models.JSONField(default=dict, blank=True, editable=False)
    # What a server of it needs in memory (machines_app.memory.model_shape, plus
    # "projector_size" in bytes): read from the head at discovery; {} before.
    memory_shape = models.JSONField(default=dict, blank=True, editable=False)

    class Meta:
        ordering = ["display_name", "key"]
        constraints = [models.UniqueConstraint(fields=["machine", "key"], name="unique_model_key_per_machine")]

    def __str__(self) -> str:
        return f"{self.display_name} on {self.machine}"

    @property
    def is_complete(self) -> bool:
        return not self.missing_parts and not self.error

    @property
    def problem(self) -> str:
        """Why this file cannot be started, in the user's terms ('' when it can)."""
        if self.error:
            return self.error
        if self.missing_parts:
            parts = ", ".join(str(n) for n in self.missing_parts)
            return f"split model is incomplete: part(s) {parts} of {self.split_count} missing"
        return ""

    @property
    def template_label(self) -> str:
        """Which chat template a server for this file uses, in the picker's words."""
        if self.chat_template_file:
            return f"chat template file {self.chat_template_file}"
        if self.chat_template:
            return f"built-in chat template '{self.chat_template}'"
        if self.has_chat_template:
            return "the file's own chat template"
        return "no chat template: replies may be poor"

    @property
    def cannot_call_tools(self) -> bool:
        """llama-server said, at a start, that this file's template takes no tools
        (GET /props → chat_template_caps.supports_tools false); False while unknown."""
        return self.chat_template_caps.get("supports_tools") is False


class MemoryClaim(models.Model):
    """A start's place in its machine's memory (docs/behaviour.md §5 "Room on a machine").

    ``granted``: the start was let through and counts at ``need`` bytes until its server is
    ready (then its real use counts and the claim goes). Not granted: the start waits in
    the machine's line, in ``queued_at`` order; a claim whose session is no longer
    ``loading`` (stopped, failed) is out of the line and is cleared by the next admission.
    ``told_ahead``: how many were ahead when the session was last told.
    """

    session = models.OneToOneField("sessions_app.AgentSession", on_delete=models.CASCADE, related_name="memory_claim")
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="memory_claims")
    need = models.BigIntegerField(help_text="Bytes the start needs (machines_app.memory.estimate).")
    granted = models.BooleanField(default=False)
    queued_at = models.DateTimeField(default=timezone.now)
    tried_at = models.DateTimeField(null=True, blank=True)
    told_ahead = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["queued_at", "pk"]

    def __str__(self) -> str:
        return f"{'granted' if self.granted else 'waiting'}: session {self.session_id} on {self.machine}"


class MachineSample(models.Model):
    """The machine's memory as the health watch read it (the machines page's plot). Bytes;
    ``gpus``: ``[{"index", "total", "used", "free"}]`` from nvidia-smi, [] without;
    ``corral_used``: what Corral's servers there use (resident + GPU memory); ``error``:
    why nothing could be read."""

    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="samples")
    taken_at = models.DateTimeField(default=timezone.now, db_index=True)
    ram_total = models.BigIntegerField(null=True, blank=True)
    ram_available = models.BigIntegerField(null=True, blank=True)
    gpus = models.JSONField(default=list, blank=True)
    corral_used = models.BigIntegerField(default=0)
    server_use = models.JSONField(default=dict, blank=True, help_text="session id -> [resident, GPU] bytes")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["taken_at"]


class PendingStop(models.Model):
    """A llama-server Corral set out to stop (Stop, a delete, an idle sleep) while its
    machine could not be reached (docs/behaviour.md §5 "no orphans"). The process may still
    run there, holding its memory; the watch stops it (pid and start time checked) as soon
    as the machine answers again, and no new server starts on that machine before.

    ``place`` is :func:`machines_app.transports.machine_place` of the machine, so a server
    whose machine row was deleted meanwhile is still stopped; ``session_id`` is the session
    it served (which may be gone), for the notice in its transcript and the key file's name.
    """

    machine = models.ForeignKey(Machine, null=True, blank=True, on_delete=models.SET_NULL)
    place = models.JSONField(default=dict)
    session_id = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField()
    start_time = models.CharField(max_length=40)
    port = models.PositiveIntegerField()
    reason = models.TextField(blank=True, help_text="Why the machine could not be reached, as last tried.")
    created_at = models.DateTimeField(auto_now_add=True)
    tried_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"stop pending: llama-server pid {self.pid} on {self.place.get('name', '?')}"
