"""Who is watching, told to one daphne's sockets once per change (docs/sharing.md, "Who is here").

A change of who watches a session (a socket opened or closed, an expired row dropped) is
announced by ``broadcast.push_presence`` to the session's group, and every socket of that
session receives it. Each used to read the list from the database, render it and send
it: W sockets joining one session cost W² reads, renders and messages (50 sockets:
2,500; daphne busy for seconds, and the streaming reply's tokens waiting behind it).

Now a socket only hands the announcement to its process's :class:`PresenceBoard` (no
database, nothing sent). The board waits :data:`COALESCE_SECONDS`, so that the
announcements of a burst of joins become one, then reads the list once, renders and
encodes it once, and sends the same frame to each of the process's sockets of that session whose page does not
already show exactly that list. So one change costs one read and one render per daphne,
and a message only to the sockets that must learn something: every socket gets the list
when it joins, and again only when the names change. A second tab of someone already
listed changes nothing anyone else sees, and sends nothing to anyone else.

The list is still read when the announcement has arrived, never carried in it, so the
last list sent after several changes is the last state, whichever process announced
first. One board per event loop (daphne runs one; tests run several, one after another).
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Protocol

from . import presence
from .db_thread import database_sync_to_async
from .items import render_presence

logger = logging.getLogger(__name__)

#: Seconds a board waits after an announcement before reading the list, so that the
#: announcements of many sockets joining at once are answered by one read.
COALESCE_SECONDS = 0.25
#: Sockets sent a list between two turns of the event loop.
YIELD_EVERY = 20


class Watching(Protocol):
    """A session socket as the board sees it (sessions_app.live.consumers.SessionConsumer)."""

    async def show_presence(self, names: list[str], frame: str) -> None: ...


class PresenceBoard:
    """The sockets of one event loop, by session, and the lists they were last sent."""

    def __init__(self) -> None:
        self.sockets: dict[int, set[Watching]] = {}
        self.pending: dict[int, asyncio.Task] = {}
        self.again: set[int] = set()  # announced while its list was being read

    def add(self, session_id: int, socket: Watching) -> None:
        """Count ``socket`` among the session's sockets here (it is sent the next list)."""
        self.sockets.setdefault(session_id, set()).add(socket)

    def discard(self, session_id: int, socket: Watching) -> None:
        sockets = self.sockets.get(session_id)
        if sockets is not None:
            sockets.discard(socket)
            if not sockets:
                del self.sockets[session_id]

    def changed(self, session_id: int) -> None:
        """Who watches the session may have changed: read and send the list soon, once
        however many announcements arrive meanwhile."""
        if session_id not in self.sockets:
            return
        if session_id in self.pending:
            self.again.add(session_id)
            return
        self.pending[session_id] = asyncio.ensure_future(self._send_lists(session_id))

    async def _send_lists(self, session_id: int) -> None:
        try:
            while True:
                await asyncio.sleep(COALESCE_SECONDS)
                self.again.discard(session_id)
                names = await database_sync_to_async(presence.watching)(session_id)
                frame = json.dumps({"presence": names, "ops": [
                    {"op": "replace", "id": "presence", "html": render_presence(names)}]})
                for n, socket in enumerate(list(self.sockets.get(session_id, ()))):
                    if n and n % YIELD_EVERY == 0:
                        # Sending is no wait: 200 sockets in one go would hold the loop,
                        # and the streamed reply's tokens behind it (docs/live-page.md).
                        await asyncio.sleep(0)
                    await socket.show_presence(names, frame)
                if session_id not in self.again or session_id not in self.sockets:
                    return
        except Exception:
            # A busy database now and then: the next change or heartbeat sends it again.
            logger.warning("who is watching session %s could not be read", session_id, exc_info=True)
        finally:
            self.pending.pop(session_id, None)
            self.again.discard(session_id)


_boards: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PresenceBoard] = weakref.WeakKeyDictionary()


def board() -> PresenceBoard:
    """The running event loop's board."""
    loop = asyncio.get_running_loop()
    found = _boards.get(loop)
    if found is None:
        found = _boards[loop] = PresenceBoard()
    return found
