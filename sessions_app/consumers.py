"""Push-only websocket for one session's live transcript (SPEC §12, cases C17, C19).

Connect to ``/ws/sessions/<id>/?after=<last seq the page has>``. The consumer joins the
session's group first, then reads what the page missed from the database, then forwards
group messages — so nothing falls between the two (register, then fetch, then apply).
Every message sent is ``{"seq": n, "ops": [...]}`` in strictly increasing ``seq`` order:
a group message that repeats one already sent is dropped, and a gap is filled from the
database before going on.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from . import broadcast
from .actions import can_access
from .models import AgentSession, TranscriptEvent
from .presenters import TOOL_KINDS, TranscriptView, prime_window

FORBIDDEN = 4403


class SessionConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.session_id = int(self.scope["url_route"]["kwargs"]["session_id"])
        self.group = broadcast.group_name(self.session_id)
        if not await self._allowed():
            # Accept, then close with our own code: the page sees 4403 and stops
            # reconnecting (a refused handshake looks like a network error to a browser).
            await self.accept()
            await self.close(code=FORBIDDEN)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        try:
            self.last_sent = max(0, int(query.get("after", ["0"])[0]))
        except ValueError:
            self.last_sent = 0
        self.renderer = TranscriptView(
            self.session_id, call_events=self._call_events, machine_name=await self._machine_name()
        )
        await self.accept()
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.membership = asyncio.ensure_future(self._keep_membership())
        await database_sync_to_async(self._prime)()
        await self._catch_up()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "membership"):
            self.membership.cancel()
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def _keep_membership(self) -> None:
        """Re-join the group every CORRAL_GROUP_REFRESH_SECONDS while connected. A group
        forgets a member after the layer's ``group_expiry`` (settings): so the channel of
        a socket whose daphne died (no disconnect ever ran) leaves soon, while live ones
        stay."""
        with contextlib.suppress(Exception):  # a Redis outage: the next round tries again
            while True:
                await asyncio.sleep(settings.CORRAL_GROUP_REFRESH_SECONDS)
                await self.channel_layer.group_add(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        pass  # push-only: actions go through the HTTP views

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
    def _allowed(self) -> bool:
        user = self.scope.get("user")
        session = AgentSession.objects.filter(pk=self.session_id).first()
        return bool(user is not None and session is not None and can_access(user, session))

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
        """Learn what the page may still hold open at ``last_sent`` (no operations sent)."""
        if self.last_sent == 0:
            return
        before = TranscriptEvent.objects.filter(session_id=self.session_id, seq__lte=self.last_sent)
        # Only the tail after the last event that leaves nothing open matters; read it
        # newest first and stop there, rather than the whole transcript.
        tail = []
        for event in before.order_by("-seq").iterator(chunk_size=200):
            tail.append(event)
            if len(prime_window([event])) == 0:
                break
        self.renderer.prime(prime_window(tail[::-1]))
