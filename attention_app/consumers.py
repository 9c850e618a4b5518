"""The attention socket every Corral page opens: which questions wait for its reader, live
(docs/attention.md).

Connect to ``/ws/attention/`` (a login needed; none: accepted, then closed with 4401 as a
session page's socket is, and the page stops retrying). The server sends
``{"attention": {"count": n, "questions": [{key, session_id, call_id, url, title, body,
tag}, …]}}`` (newest first: attention_app.waiting) at connect and whenever that list
changes: a question asked or answered anywhere (``broadcast.push_attention``), an account
or a sharing changed, and on every heartbeat (a lost push is mended within one). The only
frame the browser sends is ``{"visible": true|false}``: whether it shows the page
(``document.visibilityState``), which decides whether Web Push is sent (attention_app.push).
Everything in a message is computed for this reader alone; a question they may not answer is
never named to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta
from importlib import import_module
from types import SimpleNamespace

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from django.utils import timezone

from sessions_app.live import broadcast, live_link, presence
from sessions_app.live.consumers import CloseCode
from sessions_app.live.db_thread import database_sync_to_async

from .models import OpenPage
from .waiting import waiting_for

logger = logging.getLogger(__name__)


class AttentionConsumer(AsyncJsonWebsocketConsumer):
    heartbeat: asyncio.Task | None = None

    async def connect(self) -> None:
        self.joined: list[str] = []
        self.sent: list | None = None
        self.visible = False
        user = self.scope.get("user")
        await self.accept()
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=CloseCode.LOGGED_OUT.value)
            return
        self.user_id = user.pk
        groups = [broadcast.ATTENTION_GROUP, broadcast.user_group_name(user.pk)]
        if key := self._login_key():
            groups.append(broadcast.login_group_name(key))
        try:
            for group in groups:
                await self.channel_layer.group_add(group, self.channel_name)
                self.joined.append(group)
        except live_link.UNREACHABLE:
            await live_link.lost(self)  # Redis is down: the page tries again (sessions_app/live/live_link.py)
            return
        live_link.watch(self)
        await database_sync_to_async(self._keep_page)()
        await self._refresh()
        self.heartbeat = asyncio.create_task(self._beat())

    async def disconnect(self, code: int) -> None:
        live_link.forget(self)
        for group in getattr(self, "joined", []):
            with contextlib.suppress(*live_link.UNREACHABLE):
                await self.channel_layer.group_discard(group, self.channel_name)
        self.joined = []
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.heartbeat
        if hasattr(self, "user_id"):
            await database_sync_to_async(OpenPage.objects.filter(channel_name=self.channel_name).delete)()

    async def receive_json(self, content, **kwargs) -> None:
        """``{"visible": bool}``; anything else is ignored."""
        if isinstance(content, dict) and isinstance(content.get("visible"), bool) and hasattr(self, "user_id"):
            self.visible = content["visible"]
            await database_sync_to_async(self._keep_page)()

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        if text_data is None:
            return
        try:
            await super().receive(text_data=text_data)
        except ValueError:
            pass  # not JSON: ignored, as every other frame the page does not send

    async def attention_changed(self, message: dict) -> None:
        await self._refresh()

    async def access_changed(self, message: dict) -> None:
        """The reader's account changed (broadcast.push_access_changed): their login may have
        ended, and what waits for them may differ."""
        if not await database_sync_to_async(self._login_holds)():
            await self.close(code=CloseCode.LOGGED_OUT.value)
            return
        await self._refresh()

    async def login_ended(self, message: dict) -> None:
        await self.close(code=CloseCode.LOGGED_OUT.value)

    async def _beat(self) -> None:
        wait = presence.heartbeat_seconds()  # the first a whole beat after opening, then the process's beat
        while True:
            await asyncio.sleep(wait)
            wait = presence.until_next_beat(asyncio.get_running_loop().time())
            try:
                # One trip to the database thread for the whole beat (was three: each a
                # wake-up of that thread and of daphne's loop; docs/live-page.md, "What it costs").
                questions = await database_sync_to_async(self._beat_reads)()
                if questions is None:
                    await self.close(code=CloseCode.LOGGED_OUT.value)
                    return
                await self._send_changed(questions)
            except Exception:
                # A busy database or Redis now and then must not end the heartbeat.
                logger.warning("attention heartbeat of user %s failed", self.user_id, exc_info=True)

    def _beat_reads(self) -> list[dict] | None:
        """A heartbeat's database work (database thread): None when this browser's login
        no longer stands; else this page's row refreshed and the questions read."""
        if not self._login_holds():
            return None
        self._keep_page()
        return self._questions()

    async def _refresh(self) -> None:
        """Send the list when it differs from the last one sent."""
        await self._send_changed(await database_sync_to_async(self._questions)())

    async def _send_changed(self, questions: list[dict]) -> None:
        if questions != self.sent:
            self.sent = questions
            await self.send_json({"attention": {"count": len(questions), "questions": questions}})

    def _questions(self) -> list[dict]:
        user = auth.get_user_model().objects.filter(pk=self.user_id).first()
        if user is None or not user.is_active:
            return []
        return [waiting.as_message(user.pk) for waiting in waiting_for(user)]

    def _keep_page(self) -> None:
        expires = timezone.now() + timedelta(seconds=presence.heartbeat_seconds() * presence.MISSED_BEATS)
        OpenPage.objects.update_or_create(
            channel_name=self.channel_name,
            defaults={"user_id": self.user_id, "visible": self.visible, "expires_at": expires},
        )
        OpenPage.objects.filter(expires_at__lte=timezone.now()).delete()

    def _login_key(self) -> str:
        session = self.scope.get("session")
        return (session.session_key or "") if session is not None else ""

    def _login_holds(self) -> bool:
        """Whether this browser's login still stands (the rule of
        ``sessions_app.live.consumers.SessionConsumer._login_holds``: Django's own ``get_user`` on
        the login's session read afresh)."""
        key = self._login_key()
        if not key:
            return False
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
        current = auth.get_user(SimpleNamespace(session=store))
        return current.is_authenticated and current.pk == self.user_id
