"""The live pages' database thread keeps its connection from one socket message to the
next while pages are open, replaces one PostgreSQL cut, and holds none once the last page
closes (sessions_app/live/db_thread.py).

The socket runs as daphne runs it: ``asyncio.run`` on this thread, outside
``async_to_sync``, so every ``database_sync_to_async`` goes to asgiref's one database thread
of the process (``async_to_sync`` would run them on the test's own thread instead).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import SyncToAsync
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import connection, connections

from machines_app.models import Machine
from project.asgi import application
from sessions_app.live import broadcast, live_link
from sessions_app.live.consumers import SessionConsumer
from sessions_app.models import AgentSession

from .helpers import HOST, cookie_of

pytestmark = pytest.mark.django_db(transaction=True)


def database_thread_connection():
    """The connection object the database thread holds now (None: closed)."""
    return SyncToAsync.single_thread_executor.submit(lambda: connections["default"].connection).result(10)


def test_the_web_process_keeps_its_database_connection_between_two_socket_messages(alice, tmp_path, monkeypatch):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle")
    cookie = cookie_of(alice)
    seen: list[tuple[object, int | None, int]] = []  # (the connection object, its backend pid, the thread)

    def recorded(real):
        """``real`` (the access check of the handshake, or of a later message), noting
        the connection it ran on."""
        def access(self):
            answer = real(self)  # its queries first: the connection is open after them
            pid = connection.connection.info.backend_pid if connection.vendor == "postgresql" else None
            seen.append((connection.connection, pid, threading.get_ident()))
            return answer
        return access

    monkeypatch.setattr(SessionConsumer, "_access_now", recorded(SessionConsumer._access_now))
    monkeypatch.setattr(SessionConsumer, "_access_at_handshake", recorded(SessionConsumer._access_at_handshake))
    # This process's count of open pages starts empty: a socket an earlier test never closed
    # (a communicator left without disconnect) would keep the connection by design.
    monkeypatch.setattr(live_link, "_open", set())

    async def access_changed(count: int) -> None:
        """One ``access.changed`` message to the page (an account or sharing change): the
        socket asks the database again what its reader may do."""
        await get_channel_layer().group_send(broadcast.user_group_name(alice.pk), {"type": "access.changed"})
        for _ in range(500):
            if len(seen) == count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(seen)} database trips, not {count}")

    async def scenario() -> None:
        comm = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/",
                                     headers=[(b"origin", b"http://" + HOST), (b"host", HOST), (b"cookie", cookie.encode())])
        assert (await comm.connect(timeout=10))[0]
        assert len(seen) == 1  # the handshake's
        await access_changed(2)
        await access_changed(3)
        first, second = seen[1], seen[2]
        assert first[0] is not None and first[0] is second[0], "one connection for both messages"
        assert first[2] == second[2] != threading.get_ident(), "on daphne's one database thread"
        if connection.vendor == "postgresql":
            # PostgreSQL cuts the idle connection (a restart, an admin): the next message
            # gets a new one (Django's health check before the first query), not an error.
            await asyncio.to_thread(terminate, second[1])
            await access_changed(4)
            assert seen[3][0] is not second[0] and seen[3][1] != second[1]
            await access_changed(5)
            assert seen[4][0] is seen[3][0]
        await comm.disconnect()

    asyncio.run(scenario())
    # The last page closed: the thread holds no connection (an idle daphne keeps none).
    assert database_thread_connection() is None


def terminate(pid: int) -> None:
    """Cut PostgreSQL backend ``pid`` from this thread's own connection (as ``pg_terminate_backend`` does)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    connection.close()
