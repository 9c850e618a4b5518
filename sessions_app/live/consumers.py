"""Push-only websocket for one session's live transcript (docs/behaviour.md §12).

Connect to ``/ws/sessions/<id>/?after=<last seq the page has>``. The consumer joins the
session's group first, then reads what the page missed from the database, then forwards
group messages — so nothing falls between the two (register, then fetch, then apply).
Every transcript message sent is ``{"seq": n, "ops": [...]}`` in strictly increasing
``seq`` order: a group message that repeats one already sent is dropped, and a gap is
filled from the database before going on. Who is watching travels apart, without a seq:
``{"presence": [username, ...], "ops": [...]}`` (docs/sharing.md).

Who may connect, and which buttons the rendered HTML carries, is
``AgentSession.access_for``'s answer, asked again — with the browser's login — whenever the
session's sharing changes, whenever the reader's account or the session's machine changes
(docs/access.md) and on every presence heartbeat. A socket that cannot be served is accepted and then
closed with one of :class:`CloseCode` (a refused handshake looks like a network error to a
browser, which would retry for ever); the page shows each code's sentence and way forward
(docs/live-page.md). Frames from the browser are ignored: actions go through the HTTP views.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from importlib import import_module
from types import SimpleNamespace
from urllib.parse import parse_qs

from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from django.contrib.auth import get_user_model

from ..actions import find_session, may_grant_always
from ..events import load_kinds
from ..models import Access, AgentSession, TranscriptEvent
from ..transcript import Kind
from . import broadcast, live_link, presence
from .db_thread import database_sync_to_async
from .header import context_size
from .items import ALLOWANCE_KINDS, BLOCK_KINDS, TOOL_KINDS, VERSION_KINDS, Viewer, prime_window
from .presence_board import board
from .sentences import progress_text
from .transcript_view import TranscriptView

logger = logging.getLogger(__name__)

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
    #: The session is no longer shared with this user (its owner made it private, or
    #: their account lost a right) while the page followed it.
    NOT_SHARED = 4403
    #: No such session for this user: deleted, never theirs, or no session id at all.
    #: Someone else's private session gets the same answer as a missing one, as in the
    #: HTTP views.
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


#: The kinds whose images the page shows (each image is looked up in the database).
MESSAGE_KINDS = frozenset({Kind.MESSAGE_TAKEN, Kind.MESSAGE_QUEUED})


#: The last tail frame encoded: (dom id, text, the frame's JSON text).
_last_tail: tuple[str, str, str] = ("", "", "")


def tail_frame(dom_id: str, text: str) -> str:
    """The JSON text of ``{"ops": [{"op": "tail", "id": dom_id, "text": text}]}``, encoded
    once for all the sockets of this process that receive the same tail one after another
    (every watcher of a session gets the same streamed text: W sockets, one encoding)."""
    global _last_tail
    if _last_tail[0] != dom_id or _last_tail[1] != text:
        _last_tail = (dom_id, text, json.dumps({"ops": [{"op": "tail", "id": dom_id, "text": text}]}))
    return _last_tail[2]


#: The last event frame encoded: (session id, seq, its operations, the frame's JSON text).
_last_event: tuple[int, int, list, str] = (0, 0, [], "")


def event_frame(session_id: int, seq: int, ops: list) -> str:
    """The JSON text of ``{"seq": seq, "ops": ops}``, encoded once for the sockets of this
    process that send the same operations for the same event one after another (pages
    of one session drawn for the same rights; the operations are compared, not assumed)."""
    global _last_event
    if _last_event[:2] != (session_id, seq) or _last_event[2] != ops:
        _last_event = (session_id, seq, ops, json.dumps({"seq": seq, "ops": ops}))
    return _last_event[3]


@dataclass(frozen=True)
class JoinedAt:
    """What a page opened at seq ``after`` of a session already holds, as its socket needs
    it: ``window``, the stored events that may leave something open on the page at
    ``after`` (``items.prime_window`` of the transcript's tail); ``versions``, the
    :data:`~.items.VERSION_KINDS` events up to ``after``; ``ready``, the payload of the
    last ``server_ready`` up to ``after`` (None: none). Stored events never change, so
    this is the same for every page opening at the same seq (:func:`joined_at`)."""

    window: tuple[TranscriptEvent, ...]
    versions: tuple[TranscriptEvent, ...]
    ready: dict | None


#: Sessions' :class:`JoinedAt`, newest last, by (session id, its creation, seq): read on
#: the database thread only. 200 pages opening at one seq read the transcript once, not
#: 200 times (docs/live-page.md, "What it costs").
_joined: OrderedDict[tuple[int, object, int], JoinedAt] = OrderedDict()
#: How many (session, seq) pairs :data:`_joined` keeps.
JOINED_KEPT = 64


def joined_at(session: AgentSession, after: int) -> JoinedAt:
    """The session's :class:`JoinedAt` seq ``after`` (≥ 0), read from the database the
    first time a page opens there and kept for the next pages (database thread). The key
    holds the session's creation time too: a test database reusing an id is another session."""
    key = (session.pk, session.created_at, after)
    found = _joined.get(key)
    if found is not None:
        _joined.move_to_end(key)
        return found
    if after == 0:
        found = JoinedAt((), (), None)
    else:
        before = TranscriptEvent.objects.filter(session_id=session.pk, seq__lte=after)
        # Only the tail after the last event that leaves nothing open matters; read it
        # newest first and stop there, rather than the whole transcript.
        tail = []
        for event in before.order_by("-seq").iterator(chunk_size=200):
            tail.append(event)
            if len(prime_window([event])) == 0:
                break
        ready = (before.filter(kind="server_ready").order_by("-seq").values_list("payload", flat=True).first())
        found = JoinedAt(tuple(prime_window(tail[::-1])), tuple(load_kinds(session.pk, VERSION_KINDS, upto=after)),
                         ready if isinstance(ready, dict) else None)
    _joined[key] = found
    while len(_joined) > JOINED_KEPT:
        _joined.popitem(last=False)
    return found


def clear_join_cache() -> None:
    """Forget every :class:`JoinedAt` (tests that count the database's statements)."""
    _joined.clear()


class SessionConsumer(AsyncJsonWebsocketConsumer):
    cut_off = False  # set when the user lost access mid-connection: send nothing more
    heartbeat: asyncio.Task | None = None
    presence_shown: list[str] | None = None  # the who-is-watching list this page shows

    async def connect(self) -> None:
        self.session_id = int(self.scope["url_route"]["kwargs"]["session_id"])
        self.group = broadcast.group_name(self.session_id)
        self.joined: list[str] = []
        # Two trips to the database thread in all: many pages opening at once each wait
        # behind every other's trips, and daphne drops a handshake not accepted within 5 s
        # (docs/live-page.md). The thread keeps its connection from one trip to the next
        # while pages are open (sessions_app/live/db_thread.py).
        refusal = await database_sync_to_async(self._open)()
        if refusal is not None:
            await self.accept()
            await self.close(code=refusal.value)
            return
        await self.accept()
        # Counted as open from here (Redis lost closes it too), so its next trip to the
        # database thread keeps that thread's connection (sessions_app/live/db_thread.py).
        live_link.watch(self)
        # The account's and the machine's groups: a change to either (a deactivation, a
        # new password, a group left, the machine disabled) asks this socket again at once.
        groups = [self.group, broadcast.user_group_name(self.scope["user"].pk),
                  broadcast.machine_group_name(self.machine_id)]
        if login_key := self._login_key():
            groups.append(broadcast.login_group_name(login_key))
        try:
            for group in groups:
                await self.channel_layer.group_add(group, self.channel_name)
                self.joined.append(group)
            missed = await database_sync_to_async(self._start)()  # after the groups: nothing falls between
            self._join()
            await broadcast.push_presence(self.session_id)
        except live_link.UNREACHABLE:
            # Redis is down: nothing could reach this page; it says so and tries again.
            await live_link.lost(self)
            return
        await self._send_events(missed)

    def _open(self) -> CloseCode | None:
        """Whether this socket can be served (:meth:`_refusal`); when it can, the page's
        renderer is made (database thread)."""
        refusal = self._refusal()
        if refusal is None:
            self.last_sent = _after(self.scope)
            session, user = self._opened
            self._joined_state = joined_at(session, self.last_sent)
            self.renderer = TranscriptView(
                self.session_id, call_events=self._call_events, machine_name=session.machine.name if session.machine else "",
                viewer=Viewer(user.pk, self.access, may_grant_always(session, user)), n_ctx=self._n_ctx(session),
                allowance_events=self._allowance_events,
            )
        self._opened = None  # the rows read for the handshake: only the renderer keeps what it needs
        return refusal

    def _start(self) -> list[TranscriptEvent]:
        """Count this connection as watching, learn what the page holds open, and read
        the events it missed (database thread)."""
        presence.join(self.session_id, self.scope["user"].pk, self.channel_name)
        self._prime()
        return self._events_after(self.last_sent)

    async def disconnect(self, code: int) -> None:
        live_link.forget(self)
        # Leave at once: the last of this daphne's consumers in a group unsubscribes it.
        # With Redis down the subscription goes with its connection anyway.
        for group in getattr(self, "joined", []):
            with contextlib.suppress(*live_link.UNREACHABLE):
                await self.channel_layer.group_discard(group, self.channel_name)
        self.joined = []
        if self.heartbeat is not None:
            board().discard(self.session_id, self)
            self.heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.heartbeat
            if await database_sync_to_async(presence.leave)(self.channel_name):
                with contextlib.suppress(*live_link.UNREACHABLE):
                    await broadcast.push_presence(self.session_id)

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        """Frames from the browser, text or binary, JSON or not, are ignored (push-only)."""

    async def session_gone(self, message: dict) -> None:
        """The session was deleted while this page watched it."""
        self.cut_off = True
        await self.close(code=CloseCode.GONE.value)

    async def login_ended(self, message: dict) -> None:
        """This browser's login ended (logged out elsewhere in it, in another tab)."""
        self.cut_off = True
        await self.close(code=CloseCode.LOGGED_OUT.value)

    async def access_changed(self, message: dict) -> None:
        """The reader's account, or the session's machine, changed (broadcast.push_access_changed):
        ask again at once what this page may show (docs/access.md)."""
        if not self.cut_off:
            await self._recheck()

    # --- who is watching (docs/sharing.md)

    def _join(self) -> None:
        """Start the heartbeat and tell this process's board (the row is written by
        :meth:`_start`); the caller announces the change to the other daphnes."""
        board().add(self.session_id, self)
        self.heartbeat = asyncio.create_task(self._beat(self.scope["user"].pk))
        board().changed(self.session_id)  # this process's sockets learn of it without Redis

    async def _beat(self, user_id: int) -> None:
        wait = presence.heartbeat_seconds()  # the first a whole beat after joining
        while True:
            await asyncio.sleep(wait)
            wait = presence.until_next_beat(asyncio.get_running_loop().time())
            try:
                # One trip to the database thread for the whole beat (W pages: W trips a beat).
                changed, holds, access, missed = await database_sync_to_async(self._beat_reads)(user_id)
                if changed:
                    await broadcast.push_presence(self.session_id)
                # Rights can also change without a sharing event (an account deactivated,
                # staff status taken away): ask again on every beat.
                if await self._recheck(holds, access):
                    return
                # A lost push is caught up at the next event's gap; when the lost one was
                # the last (a turn's end, a status) no gap ever shows: look every beat.
                await self._send_events(missed)
            except Exception:
                # A busy database or Redis now and then must not end the heartbeat (the
                # watcher would vanish from the list while still watching): try next beat.
                logger.warning("presence heartbeat of session %s failed", self.session_id, exc_info=True)

    def presence_changed(self, message: dict) -> None:
        """Who watches may have changed: this process's board reads the list once for all
        its sockets of the session, and sends it to those whose page shows another
        (sessions_app.live.presence_board: one read per change, not one per socket)."""
        if not self.cut_off:
            board().changed(self.session_id)

    async def show_presence(self, names: list[str], frame: str) -> None:
        """Send the who-is-watching list, unless the page shows it already (``frame``: the
        message's JSON text, ``{"presence": names, "ops": [{"op": "replace", "id":
        "presence", "html": …}]}``, encoded once by the board for all its sockets)."""
        if self.cut_off or names == self.presence_shown:
            return
        self.presence_shown = names
        await self.send(text_data=frame)

    async def dispatch(self, message: dict) -> None:
        """Channels' own dispatch, without its hop to the database thread before each
        transcript message (``aclose_old_connections``): a streamed fragment is folded
        without the database (docs/live-page.md, "What it costs"), and every handler that
        does reach the database goes through ``database_sync_to_async``, which closes
        stale connections itself, before and after."""
        if message.get("type") == "transcript.event":
            await self.transcript_event(message)
        elif message.get("type") == "transcript.tail":
            await self.transcript_tail(message)
        elif message.get("type") == "transcript.progress":
            await self.transcript_progress(message)
        elif message.get("type") == "presence.changed":
            self.presence_changed(message)  # no database here either: the board reads, once
        else:
            await super().dispatch(message)

    async def transcript_tail(self, message: dict) -> None:
        """A reply's text streamed but not stored yet (broadcast.push_tail): shown in its
        open block's tail, ``{"ops": [{"op": "tail", "id": …, "text": …}]}`` without a
        seq, only when this page holds exactly the events the worker had stored (``after``)
        and that block is open; else dropped, and the stored event brings the text. The
        page empties a tail when stored text reaches its block, and all of them when it
        reconnects: text is counted once, by seq (docs/live-page.md)."""
        block = self.renderer.block
        if self.cut_off or message["after"] != self.last_sent or block is None or self._newer_tail_waiting():
            return
        if BLOCK_KINDS.get(message["kind"]) != block.type:
            return
        await self.send(text_data=tail_frame(block.dom_id, message["text"]))

    def _newer_tail_waiting(self) -> bool:
        """Whether a later tail already waits in this socket's queue (channels_redis's
        pub/sub layer: raw messages in an ``asyncio.Queue``). A tail holds all the text
        since its stored event, so the later one says all this one does: a daphne that has
        fallen behind (200 pages joining while a reply streams) sends each page the newest
        tail only, instead of every one it missed. False whenever the queue cannot be
        read (another layer, encrypted messages): then every tail is sent."""
        try:
            waiting = self.channel_layer.channels[self.channel_name]._queue
        except (AttributeError, KeyError, TypeError):
            return False
        return any(isinstance(raw, bytes) and b"transcript.tail" in raw for raw in waiting)

    async def transcript_progress(self, message: dict) -> None:
        """How far a completion has come (broadcast.push_progress), as
        ``{"ops": [{"op": "progress", "text": …}]}`` without a seq: the page shows the
        sentence in #progress until the turn ends (docs/live-page.md, "Progress")."""
        if self.cut_off:
            return
        text = progress_text(message.get("state") or {})
        if text:
            await self.send_json({"ops": [{"op": "progress", "text": text}]})

    async def transcript_event(self, message: dict) -> None:
        seq = message["seq"]
        if self.cut_off or seq <= self.last_sent:
            return  # already sent (catch-up overlapped the live stream)
        if seq > self.last_sent + 1:
            await self._catch_up()  # a gap: read the missing events (and this one) from the DB
            return
        await self._send(seq, message["kind"], message["payload"])

    def _beat_reads(self, user_id: int) -> tuple[bool, bool, Access, list[TranscriptEvent]]:
        """A heartbeat's database work (database thread): refresh this connection's row
        (whether the list may have changed), whether the login holds, what the user may
        do now, and the events after the last one sent."""
        changed = presence.beat(self.session_id, user_id, self.channel_name)
        return changed, self._login_holds(), self._access_now(), self._events_after(self.last_sent)

    async def _recheck(self, holds: bool | None = None, access: Access | None = None) -> bool:
        """Ask again whether this browser's login stands and what ``access_for`` answers.
        True when the page may follow the session no more: a login that ended (account
        turned off, password changed, logged out) closes the socket with LOGGED_OUT
        (4401), lost access with NOT_SHARED (4403), and nothing more is sent. When the
        rights changed otherwise (less or more than before: the machine's groups, the
        sharing), the page is told to reload (its buttons were drawn for the old ones)."""
        if holds is None:
            holds, access = await database_sync_to_async(lambda: (self._login_holds(), self._access_now()))()
        if not holds:
            self.cut_off = True
            await self.close(code=CloseCode.LOGGED_OUT.value)
            return True
        if access == Access.NONE:
            self.cut_off = True
            await self.close(code=CloseCode.NOT_SHARED.value)
            return True
        if access != self.access:
            self.access = access
            self.renderer.viewer = Viewer(self.scope["user"].pk, access)
            await self.send_json({"ops": [{"op": "reload"}]})
        return False

    async def _send(self, seq: int, kind: str, payload: dict) -> None:
        event = TranscriptEvent(seq=seq, kind=kind, payload=payload)
        if kind in TOOL_KINDS or kind in ALLOWANCE_KINDS or (kind in MESSAGE_KINDS and payload.get("images")):
            # A tool call's row may need the call's earlier events from the database, the
            # list of allowances every grant and revoke, a message's images whether their
            # bytes are still stored (live.items.image_items).
            ops = await database_sync_to_async(self.renderer.feed)(event)
        else:
            # Every other kind is folded from the event alone (templates and Markdown, no
            # query): done here, without a hop to the database thread and back for each
            # streamed fragment.
            ops = self.renderer.feed(event)
        self.last_sent = seq
        await self.send(text_data=event_frame(self.session_id, seq, ops))
        if kind == "settings" and "visibility" in payload:
            await self._recheck()

    async def _catch_up(self) -> None:
        await self._send_events(await database_sync_to_async(self._events_after)(self.last_sent))

    async def _send_events(self, events: list[TranscriptEvent]) -> None:
        """Send the events read from the database that the page has not had yet."""
        for event in events:
            if event.seq > self.last_sent and not self.cut_off:
                await self._send(event.seq, event.kind, event.payload)

    def _access_now(self) -> Access:
        """What the user may do now: the account is read afresh (the scope's copy is
        from the handshake and would not show a deactivation)."""
        user = self.scope.get("user")
        session = find_session(self.session_id)
        if user is None or session is None or not user.is_authenticated:
            return Access.NONE
        self.machine_id = session.machine_id
        current = get_user_model().objects.filter(pk=user.pk).first()
        return session.access_for(current) if current is not None else Access.NONE

    def _access_at_handshake(self) -> Access:
        """:meth:`_access_now` for the handshake, from the rows it has just read: the
        account as Channels' login lookup loaded it moments ago in this same handshake
        (read afresh only on later checks), and the session read once for the access, the
        page's ``after``, the machine's name, the gauge and "always" — one session read and
        no account read (docs/live-page.md, "What it costs"). Keeps both in ``_opened``."""
        user = self.scope["user"]
        session = find_session(self.session_id)
        if session is None:
            return Access.NONE
        self.machine_id = session.machine_id
        self._opened = (session, user)
        return session.access_for(user)

    def _refusal(self) -> CloseCode | None:
        """Why this socket cannot be served, checked in this order: nobody logged in, no
        such session for this user (a private session of someone else included), a
        malformed or impossible ``after``; None when it can (``self.access`` is then set)."""
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            return CloseCode.LOGGED_OUT
        self.access = self._access_at_handshake()
        if self.access == Access.NONE:
            return CloseCode.GONE
        after = _after(self.scope)
        last_seq = self._opened[0].last_seq
        if after is None or after > last_seq:
            # Beyond the last event stored the page holds events this server never had
            # (a restored database): every push would look old to it. A reload mends it.
            return CloseCode.BAD_REQUEST
        return None

    def _login_holds(self) -> bool:
        """Whether this browser's login still stands as the next HTTP request would find
        it: ``django.contrib.auth.get_user`` on the login's session read afresh — the
        account there and active, the session's password hash still the account's
        (Django's session verification: a password changed ends every other login), the
        login not ended. The handshake's copy of both is stale by then."""
        user, key = self.scope.get("user"), self._login_key()
        if user is None or not user.is_authenticated or not key:
            return False
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
        current = auth.get_user(SimpleNamespace(session=store))
        return current.is_authenticated and current.pk == user.pk

    def _login_key(self) -> str:
        """The Django session key of this browser's login (its logout closes this socket)."""
        session = self.scope.get("session")
        return (session.session_key or "") if session is not None else ""

    def _call_events(self, call_id: str, before_seq: int) -> list[TranscriptEvent]:
        """The earlier events of one tool call (runs in the sync thread of feed())."""
        return list(
            TranscriptEvent.objects.filter(
                session_id=self.session_id, kind__in=TOOL_KINDS, payload__id=call_id, seq__lt=before_seq
            ).order_by("seq")
        )

    def _allowance_events(self, upto: int) -> list[TranscriptEvent]:
        """What the list of allowances folds from, up to seq ``upto`` (sync thread of feed())."""
        return load_kinds(self.session_id, [*ALLOWANCE_KINDS, Kind.IMPORTED], upto=upto)

    def _n_ctx(self, session: AgentSession) -> int | None:
        """The context size the page's gauge shows now (live.header.context_size: the last
        ``server_ready``'s up to ``last_sent``, else the session's contextSize; the view
        takes later ones from the events). That one event is read once per seq for every
        page opening there (:func:`joined_at`), never the whole transcript."""
        ready = self._joined_state.ready
        return context_size(ready if isinstance(ready, dict) else None, (session.server_params or {}).get("contextSize"))

    def _events_after(self, after: int) -> list[TranscriptEvent]:
        return list(TranscriptEvent.objects.filter(session_id=self.session_id, seq__gt=after).order_by("seq"))

    def _prime(self) -> None:
        """Learn what the page may still hold open at ``last_sent`` (no operations sent)."""
        if self.last_sent == 0:
            return
        state = self._joined_state
        self.renderer.know_messages(state.versions)
        self.renderer.prime(state.window)
