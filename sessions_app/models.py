"""Agent sessions, their append-only transcripts and who is watching them (docs/behaviour.md §2, §4, §7)."""

from __future__ import annotations

from enum import IntEnum

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import OuterRef, Q, Subquery
from django.urls import reverse
from django.utils.html import escape

from machines_app.access import may_use
from machines_app.models import ModelFile

# A session's server rows live with the code that owns them (sessions_app.servers); imported
# here so that Django finds them among this app's models.
from .servers.models import ServerRecord, SlotSave  # noqa: F401
from .tools import MCP_SEPARATOR, McpServerConfig


class Access(IntEnum):
    """What one user may do with one session, each level including the ones below
    (docs/sharing.md). ``AgentSession.access_for`` is the one place that decides it."""

    NONE = 0  # may not even learn that the session exists (404)
    WATCH = 1  # the page and its websocket, read-only
    ACT = 2  # also send messages, answer questions, interrupt, withdraw their own queued messages
    MANAGE = 3  # the owner and staff: also clear, settings, model, permission mode, server, sharing, delete

    def may_withdraw(self, user_id: int | None, author_id: int | None) -> bool:
        """Whether this user may withdraw a queued message sent by ``author_id`` (None for
        messages recorded before authors had ids: only the owner and staff may)."""
        if self >= Access.MANAGE:
            return True
        return self >= Access.ACT and author_id is not None and author_id == user_id


class AgentSessionQuerySet(models.QuerySet):
    def visible_to(self, user) -> AgentSessionQuerySet:
        """The sessions ``user`` may watch: the same rule as ``AgentSession.access_for``
        (tests/test_sharing.py checks the two agree on every combination)."""
        if not (user.is_authenticated and user.is_active):
            return self.none()
        if user.is_staff:
            return self.filter(purpose=AgentSession.Purpose.CHAT)
        shared = [AgentSession.Visibility.TEAM_WATCH, AgentSession.Visibility.TEAM_ACT]
        return self.filter(Q(owner=user) | Q(visibility__in=shared), purpose=AgentSession.Purpose.CHAT)

    def with_model_name(self) -> AgentSessionQuerySet:
        """Each session with ``model_name``: its model file's display name (None when the
        machine no longer lists the file)."""
        name = ModelFile.objects.filter(machine=OuterRef("machine"), key=OuterRef("model_key")).values("display_name")
        return self.annotate(model_name=Subquery(name[:1]))

    def matching(self, query: str) -> AgentSessionQuerySet:
        """The sessions every word of ``query`` finds (any case) in the title, the model's
        name or key, the machine's name or the owner's username, or as the session's id.
        Call on :meth:`with_model_name`."""
        found = self
        for word in query.split():
            by_id = Q(pk=int(word)) if word.isascii() and word.isdigit() and int(word) < 2**63 else Q()
            found = found.filter(
                by_id | Q(title__icontains=word) | Q(model_name__icontains=word) | Q(model_key__icontains=word)
                | Q(machine__name__icontains=word) | Q(owner__username__icontains=word)
            )
        return found


class AgentSession(models.Model):
    """A chat with one model served by one llama-server on one machine.

    Named so it is never confused with ``django.contrib.sessions``. The transcript is the
    session's only memory (docs/behaviour.md §7); the columns below hold only what must be claimed or
    changed atomically (status, the turn flag and lease, the sequence counter).
    """

    class Status(models.TextChoices):
        """The session's status (docs/behaviour.md §4). The labels are the words the page
        shows for each (the one map of them: the badge, the session list)."""

        LOADING = "loading", "loading"
        IDLE = "idle", "idle"
        RUNNING = "running", "running"
        AWAITING_INPUT = "awaiting_input", "waiting for an answer"
        # The server went away by itself (crashed, never loaded): the reason is in the transcript.
        EXITED = "exited", "exited"
        # A person stopped the server (Stop server): nothing went wrong; Restart starts it again.
        STOPPED = "stopped", "stopped"
        UNKNOWN = "unknown", "unknown"
        # Stopped by Corral after the machine's idle time (docs/behaviour.md §5 "sleep"): the
        # next message starts the server again, its prompt cache restored.
        SLEEPING = "sleeping", "sleeping"

        @classmethod
        def server_down(cls) -> tuple[str, ...]:
            """The statuses in which the session has no server to send to (docs/behaviour.md §4)."""
            return (cls.EXITED, cls.STOPPED)

        @classmethod
        def reply_possible(cls) -> tuple[str, ...]:
            """The statuses in which a turn may be under way, so Stop reply has something to
            stop: running, waiting for an answer, and loading (a message that woke or waits
            for the server); ``unknown`` too, since it may hide either."""
            return (cls.RUNNING, cls.AWAITING_INPUT, cls.LOADING, cls.UNKNOWN)

        @classmethod
        def word(cls, value: str) -> str:
            """The word the page shows for a status value (the value itself when unknown here)."""
            return cls(value).label if value in cls.values else value

    class PermissionMode(models.TextChoices):
        MANUAL = "manual", "Ask before each tool call"
        BYPASS = "bypassPermissions", "Run tools without asking"

    class Purpose(models.TextChoices):
        """What the session is for. ``api``: the hidden session that holds the server of one
        model file for the OpenAI-compatible API (api_app, docs/api.md): no transcript page,
        listed nowhere, owned by Corral's system account; its server starts, sleeps and
        makes room like any session's."""

        CHAT = "chat", "Chat"
        API = "api", "API"

    class Visibility(models.TextChoices):
        """Who besides its owner and staff may see the session (docs/sharing.md)."""

        PRIVATE = "private", "Private"
        TEAM_WATCH = "team_watch", "The team may watch"
        TEAM_ACT = "team_act", "The team may act"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_sessions")
    # Deleting a machine deletes its sessions (the admin lists them first); each one's
    # server is stopped like any deleted session's (sessions_app.signals).
    machine = models.ForeignKey("machines_app.Machine", on_delete=models.CASCADE, related_name="sessions")
    model_key = models.CharField(max_length=1000)
    working_dir = models.CharField(max_length=1000)
    server_params = models.JSONField(default=dict, blank=True, help_text="contextSize, gpuLayers, threads, speculative")
    sampling = models.JSONField(default=dict, blank=True, help_text="temperature, top_p, top_k, max_tokens, seed")
    system_prompt = models.TextField(
        blank=True, help_text="Empty: the model file's default prompt, else the deployment's."
    )
    permission_mode = models.CharField(max_length=20, choices=PermissionMode.choices, default=PermissionMode.MANUAL)
    title = models.CharField(max_length=200, blank=True)
    visibility = models.CharField(max_length=20, choices=Visibility.choices, default=Visibility.PRIVATE)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.LOADING)
    created_at = models.DateTimeField(auto_now_add=True)
    last_activity_at = models.DateTimeField(auto_now_add=True)

    # Highest sequence number handed out; bumped with a row lock (see transcript append).
    last_seq = models.PositiveBigIntegerField(default=0)
    # A turn is in progress (set with the message that starts it, cleared with the queue
    # check that finds nothing more: docs/behaviour.md §10, atomically).
    turn_active = models.BooleanField(default=False)
    # docs/behaviour.md C16: who is running a turn step, until when. A step is claimed with a
    # conditional UPDATE; a second copy finds the lease held and leaves.
    lease_owner = models.CharField(max_length=64, blank=True)
    lease_expires = models.DateTimeField(null=True, blank=True)
    interrupt_requested = models.BooleanField(default=False)
    # docs/behaviour.md §5 "one start at a time": who is starting (or restarting) the session's
    # server, until when. Claimed with a conditional UPDATE like the step lease and renewed
    # while the start lives, so a second start task leaves, and a start lost with its
    # worker or the broker is seen as gone once the claim lapses (servers.start.StartClaim).
    start_owner = models.CharField(max_length=64, blank=True)
    start_expires = models.DateTimeField(null=True, blank=True)

    purpose = models.CharField(max_length=10, choices=Purpose.choices, default=Purpose.CHAT)
    # An API session's server is serving a request until then (renewed while a reply
    # streams): neither its idle time nor a start making room puts it to sleep meanwhile
    # (server_state.idle_sessions, servers.stop.sleep_server). A lease, so a request lost
    # with its web process frees it by itself.
    api_busy_until = models.DateTimeField(null=True, blank=True)

    objects = AgentSessionQuerySet.as_manager()

    class Meta:
        ordering = ["-last_activity_at"]
        # Granted by an admin (staff hold it without a grant): sessions_app.actions.may_bypass.
        permissions = [("bypass_permissions", "Can turn the permission gate off (run tools without asking)")]
        constraints = [
            # One API session per model file (api_app.serving): every API request for it shares one server.
            models.UniqueConstraint(fields=["machine", "model_key"], condition=Q(purpose="api"),
                                    name="one_api_session_per_model_file"),
        ]

    def __str__(self) -> str:
        return self.title or f"Session {self.pk}"

    def get_absolute_url(self) -> str:
        return reverse("session_detail", args=[self.pk])

    @property
    def display_title(self) -> str:
        return self.title or f"Session {self.pk}"

    @property
    def server_down(self) -> bool:
        """No server to send to: it exited or was stopped (docs/behaviour.md §4)."""
        return self.status in self.Status.server_down()

    @property
    def reply_possible(self) -> bool:
        """Stop reply can do something now (:meth:`Status.reply_possible`)."""
        return self.status in self.Status.reply_possible()

    def access_for(self, user) -> Access:
        """What ``user`` may do here: :meth:`shared_access`, held to WATCH when ``user`` may
        not use the session's machine (not in its allowed groups, or it is disabled:
        ``machines_app.access.machines_for``). Acting, managing included, is work on the
        machine; reading the transcript is not (docs/access.md)."""
        have = self.shared_access(user)
        if have > Access.WATCH and not may_use(user, self.machine_id):
            return Access.WATCH
        return have

    def shared_access(self, user) -> Access:
        """What the sharing alone grants ``user``, whatever the machine: MANAGE for its
        owner and staff; for any other active member WATCH or ACT as the owner shared it,
        NONE when private; NONE for an anonymous or deactivated user."""
        if not (user.is_authenticated and user.is_active):
            return Access.NONE
        if user.is_staff or self.owner_id == user.pk:
            return Access.MANAGE
        if self.visibility == self.Visibility.TEAM_ACT:
            return Access.ACT
        if self.visibility == self.Visibility.TEAM_WATCH:
            return Access.WATCH
        return Access.NONE

    def system_prompt_in_force(self) -> str | None:
        """The system prompt of the next request (docs/behaviour.md §17): the session's own,
        else its model file's default, else the deployment's; None when all are empty
        (then the request has no system message)."""
        if self.system_prompt:
            return self.system_prompt
        model = ModelFile.objects.filter(machine_id=self.machine_id, key=self.model_key).only("system_prompt").first()
        if model is not None and model.system_prompt:
            return model.system_prompt
        return DeploymentSettings.load().system_prompt or None


class DeploymentSettings(models.Model):
    """Deployment-wide defaults an admin sets in the admin pages: one row (pk 1), made on
    first read."""

    system_prompt = models.TextField(
        blank=True,
        help_text="System prompt of every session whose own prompt and model file's default are empty. "
        "Applies from each session's next request.",
    )

    class Meta:
        verbose_name = verbose_name_plural = "deployment settings"

    def __str__(self) -> str:
        return "Deployment settings"

    def save(self, *args, **kwargs) -> None:
        self.pk = 1
        super().save(*args, **kwargs)

    @classmethod
    def load(cls) -> DeploymentSettings:
        return cls.objects.get_or_create(pk=1)[0]


class TranscriptEvent(models.Model):
    """One append-only entry in a session's transcript (docs/behaviour.md §2, §7).

    ``seq`` is per session, starting at 1, without gaps; every pushed event carries it so a
    browser can tell a gap and catch up (docs/behaviour.md C17). ``payload`` shapes per ``kind`` are
    listed in :mod:`sessions_app.transcript`.
    """

    session = models.ForeignKey(AgentSession, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=30)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["session", "seq"]
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="unique_seq_per_session")]

    def __str__(self) -> str:
        return f"#{self.seq} {self.kind}"


class Watcher(models.Model):
    """One open websocket on a session page: who is watching now (docs/sharing.md).

    A row per connection (a person with two tabs has two), made when the socket opens
    and deleted when it closes. Several daphne processes share the table; a process that
    dies never deletes its rows, so each row carries ``expires_at``, pushed forward by
    its connection's heartbeat, and a row past it no longer counts.
    """

    session = models.ForeignKey(AgentSession, on_delete=models.CASCADE, related_name="watchers")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    channel_name = models.CharField(max_length=200, unique=True)
    connected_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"{self.user_id} on {self.session_id}"


class McpServerQuerySet(models.QuerySet):
    def configs(self) -> dict[str, McpServerConfig]:
        """The enabled servers' connection settings by name (what the tool runner needs)."""
        return {server.name: server.config() for server in self.filter(enabled=True)}


class McpServer(models.Model):
    """An MCP server whose tools every session may call, reached from the backend (docs/behaviour.md §9)."""

    name = models.SlugField(
        max_length=40, unique=True, help_text="Prefix of its tools' names, e.g. 'exa' → exa__web_search."
    )
    url = models.URLField(help_text="Streamable HTTP endpoint, e.g. https://mcp.exa.ai/mcp")
    headers = models.JSONField(default=dict, blank=True, help_text='Extra HTTP headers, e.g. {"x-api-key": "…"}')
    api_key = models.CharField(max_length=500, blank=True, help_text=escape("Sent as 'Authorization: Bearer <key>'."))
    enabled = models.BooleanField(default=True)

    objects = McpServerQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "MCP server"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse a name holding the separator between a server's name and its tools'
        (``__``): ``a__b`` with a tool ``c`` and ``a`` with a tool ``b__c`` would both be
        ``a__b__c`` (docs/behaviour.md §9). A validator on the field would need a migration;
        every form of this model (the admin's) calls this."""
        super().clean()
        if MCP_SEPARATOR in (self.name or ""):
            raise ValidationError({"name": f"A name may not contain '{MCP_SEPARATOR}': it separates a server's name "
                                           "from its tools' names."})

    def config(self) -> McpServerConfig:
        headers = {str(k): str(v) for k, v in (self.headers or {}).items()}
        if self.api_key:
            headers.setdefault("Authorization", f"Bearer {self.api_key}")
        return McpServerConfig(name=self.name, url=self.url, headers=headers)


class StoredImage(models.Model):
    """The bytes of an image a user message carries (docs/behaviour.md §16), kept once by
    content hash in the database every Corral host reads (sessions_app.images). Deleted
    when no transcript event refers to it any more (``images.forget_unreferenced``)."""

    # The thumbnail and the requests read ``data``; nothing lists these rows in bulk with it.

    sha256 = models.CharField(primary_key=True, max_length=64, help_text="SHA-256 of the bytes, 64 hex digits.")
    media_type = models.CharField(max_length=20, help_text="image/png, image/jpeg, image/webp or image/gif.")
    data = models.BinaryField(help_text="The image's bytes as attached.")
    size = models.PositiveIntegerField(help_text="Bytes.")
    # A kind llama-server cannot read (WebP) goes to it as PNG: made once, kept with the image.
    server_png = models.BinaryField(
        null=True, blank=True, help_text="The PNG sent to llama-server for a kind it cannot read."
    )
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.sha256[:12]} ({self.media_type}, {self.size} bytes)"
