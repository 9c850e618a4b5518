"""Push-only websocket for one session's live transcript (SPEC §12, cases C17, C19).

Connect to ``/ws/sessions/<id>/?after=<last seq the page has>``. The consumer joins the
session's group first, then reads what the page missed from the database, then forwards
group messages — so nothing falls between the two (register, then fetch, then apply).
Every message sent is ``{"seq": n, "ops": [...]}`` in strictly increasing ``seq`` order:
a group message that repeats one already sent is dropped, and a gap is filled from the
database before going on.

A socket that cannot be served is accepted and then closed with one of :class:`CloseCode`
(a refused handshake looks like a network error to a browser, which would retry for
ever); the page shows each code's sentence and way forward (docs/live-page.md). Frames
from the browser are ignored: actions go through the HTTP views.
"""

from __future__ import annotations

import enum
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer

from . import broadcast
from .actions import can_access
from .models import AgentSession, TranscriptEvent
from .presenters import BLOCK_KINDS, NOTE_KINDS, QUEUE_KINDS, SILENT_KINDS, TOOL_KINDS, LiveRenderer

#: Largest ``after`` a page can hold (the ``seq`` column is a 64-bit integer).
MAX_SEQ = 2**63 - 1


class CloseCode(enum.IntEnum):
    """Why a session's socket was closed; the page stops reconnecting on each of these
    and says what to do (the sentences live in ``session_detail.html``). Close with
    ``.value``: daphne refuses anything but a plain ``int`` (and answers 1011)."""

    #: The query is not one the page sends: ``after`` not a whole number ≥ 0, or beyond
    #: the session's last event.
    BAD_REQUEST = 4400
    #: Nobody is logged in on this browser (logged out, or the login expired).
    LOGGED_OUT = 4401
    #: No such session for this user: deleted, never theirs, or no session id at all.
    #: Someone else's session gets the same answer as a missing one, as in the HTTP views.
    GONE = 4404


def _after(scope: dict) -> int | None:
    """The ``after`` query parameter: a whole number 0 ≤ n < 2⁶³ (0 when absent), else None."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    raw = query.get("after", ["0"])[0]
    if not (raw.isascii() and raw.isdigit()):
        return None
    value = int(raw)
    return value if value <= MAX_SEQ else None


class RefusedConsumer(AsyncWebsocketConsumer):
    """Any websocket path that is not a session's (``/ws/sessions/abc/``, ``/ws/x``):
    closed as GONE instead of the router's "No route found" 500."""

    async def connect(self) -> None:
        await self.accept()
        await self.close(code=CloseCode.GONE.value)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        pass


class SessionConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.session_id = int(self.scope["url_route"]["kwargs"]["session_id"])
        self.joined: list[str] = []
        refusal = await self._refusal()
        if refusal is not None:
            await self.accept()
            await self.close(code=refusal.value)
            return
        self.last_sent = _after(self.scope)
        self.renderer = LiveRenderer(
            self.session_id, call_events=self._call_events, machine_name=await self._machine_name()
        )
        await self.accept()
        groups = [broadcast.group_name(self.session_id)]
        if login_key := self._login_key():
            groups.append(broadcast.login_group_name(login_key))
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)
            self.joined.append(group)
        await database_sync_to_async(self._prime)()
        await self._catch_up()

    async def disconnect(self, code: int) -> None:
        # Leave at once, so no push goes to a socket that is gone (not when the group expires).
        for group in self.joined:
            await self.channel_layer.group_discard(group, self.channel_name)
        self.joined = []

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """Frames from the browser, text or binary, JSON or not, are ignored (push-only)."""

    async def session_gone(self, message: dict) -> None:
        """The session was deleted while this page watched it."""
        await self.close(code=CloseCode.GONE.value)

    async def login_ended(self, message: dict) -> None:
        """This browser's login ended (logged out elsewhere in it, in another tab)."""
        await self.close(code=CloseCode.LOGGED_OUT.value)

    async def transcript_event(self, message: dict) -> None:
        seq = message["seq"]
        if seq <= self.last_sent:
            return  # already sent (catch-up overlapped the live stream)
        if seq > self.last_sent + 1:
            await self._catch_up()  # a gap: read the missing events (and this one) from the DB
            return
        await self._send(seq, message["kind"], message["payload"])

    async def _send(self, seq: int, kind: str, payload: dict) -> None:
        event = TranscriptEvent(seq=seq, kind=kind, payload=payload)
        ops = await database_sync_to_async(self.renderer.feed)(event)
        self.last_sent = seq
        await self.send_json({"seq": seq, "ops": ops})

    async def _catch_up(self) -> None:
        events = await database_sync_to_async(self._events_after)(self.last_sent)
        for event in events:
            if event.seq > self.last_sent:
                await self._send(event.seq, event.kind, event.payload)

    @database_sync_to_async
    def _refusal(self) -> CloseCode | None:
        """Why this socket cannot be served, checked in this order: nobody logged in, no
        such session for this user, a malformed or impossible ``after``; None when it can."""
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            return CloseCode.LOGGED_OUT
        session = AgentSession.objects.filter(pk=self.session_id).first()
        if session is None or not can_access(user, session):
            return CloseCode.GONE
        after = _after(self.scope)
        if after is None or after > session.last_seq:
            # Beyond the last event stored the page holds events this server never had
            # (a restored database): every push would look old to it. A reload mends it.
            return CloseCode.BAD_REQUEST
        return None

    def _login_key(self) -> str:
        """The Django session key of this browser's login (its logout closes this socket)."""
        return self.scope["session"].session_key or ""

    def _call_events(self, call_id: str, before_seq: int) -> list[TranscriptEvent]:
        """The earlier events of one tool call (runs in the sync thread of feed())."""
        return list(
            TranscriptEvent.objects.filter(
                session_id=self.session_id, kind__in=TOOL_KINDS, payload__id=call_id, seq__lt=before_seq
            ).order_by("seq")
        )

    @database_sync_to_async
    def _machine_name(self) -> str:
        return AgentSession.objects.filter(pk=self.session_id).values_list("machine__name", flat=True).first() or ""

    def _events_after(self, after: int) -> list[TranscriptEvent]:
        return list(TranscriptEvent.objects.filter(session_id=self.session_id, seq__gt=after).order_by("seq"))

    def _prime(self) -> None:
        """Learn the block the page may hold open at ``last_sent`` (no operations sent)."""
        if self.last_sent == 0:
            return
        quiet = set(BLOCK_KINDS) | SILENT_KINDS | QUEUE_KINDS | NOTE_KINDS
        before = TranscriptEvent.objects.filter(session_id=self.session_id, seq__lte=self.last_sent)
        closing = before.exclude(kind__in=quiet).order_by("-seq").values_list("seq", flat=True).first() or 0
        self.renderer.prime(before.filter(seq__gt=closing).order_by("seq"))
