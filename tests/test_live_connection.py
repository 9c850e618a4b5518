"""The live page stays connected, and a socket that cannot be served is closed with a
reason the page can show (docs/live-page.md).

In-process tests drive the real ASGI application (origin checks, login, routing) with
Channels' WebsocketCommunicator and the real Redis channel layer; the real-stack tests
run daphne: an idle socket under a short Redis socket timeout, a dropped socket, and the
page's messages in Chromium.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.db import connection
from django.test import Client

from machines_app.models import Machine
from machines_app.transports import LocalTransport
from project.asgi import application
from project.channel_layer import group_channel
from sessions_app import actions
from sessions_app.live import broadcast
from sessions_app.live.consumers import CloseCode
from sessions_app.models import AgentSession

from .conftest import Stack, WSRecorder, wait_for
from .helpers import HOST, cookie_of, log_in, members

pytestmark = pytest.mark.django_db(transaction=True)

async def quiet(comm, seconds: float = 0.3) -> bool:
    """True when nothing but who-is-watching lists arrives for ``seconds`` (they come and
    go with every socket: docs/sharing.md)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        # receive_nothing peeks; receive_output with a timeout would cancel the application.
        if await comm.receive_nothing(left):
            return True
        message = await comm.receive_output()
        if message.get("type") != "websocket.send" or '"presence"' not in message.get("text", ""):
            return False
    return True


async def next_output(comm, timeout: float = 10) -> dict:
    """The next output that is not a who-is-watching list."""
    while True:
        message = await comm.receive_output(timeout=timeout)
        if message.get("type") != "websocket.send" or '"presence"' not in message.get("text", ""):
            return message


@pytest.fixture
def session(alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    return AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                       status="idle", title="Watched")


def test_pushes_from_synchronous_code_go_to_the_channel_the_layer_subscribes_to():
    """broadcast publishes without the layer's event loop; the group's channel name must
    be the one channels_redis's pub/sub layer subscribes a consumer to."""
    from channels_redis.pubsub import RedisPubSubLoopLayer

    prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"]
    layer = RedisPubSubLoopLayer(hosts=[settings.REDIS_URL], prefix=prefix)
    assert group_channel(prefix, "session-7") == layer._get_group_channel_name("session-7")


def communicator(path: str, cookie: str = "") -> WebsocketCommunicator:
    headers = [(b"origin", b"http://" + HOST), (b"host", HOST)]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=headers)


async def closed_with(comm: WebsocketCommunicator) -> int:
    """The close code of a socket that was accepted and then closed by the server."""
    connected, _ = await comm.connect(timeout=10)
    assert connected, "the handshake is accepted, so the browser sees the close code"
    message = await comm.receive_output(timeout=10)
    assert message["type"] == "websocket.close", message
    assert type(message["code"]) is int, "daphne takes a plain int only"
    return message["code"]


# --- every path, query and frame is handled ----------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/ws/sessions/abc/", "/ws/sessions/-1/", "/ws/sessions/1.5/", "/ws/sessions/%C2%B2/", "/ws/sessions/",
     "/ws/sessions/99999999999999999999999999/", "/ws/nothing", "/", "/ws/sessions/1/extra/"],
)
def test_it_closes_a_socket_on_a_path_that_names_no_session_as_gone(alice, path):
    assert async_to_sync(closed_with)(communicator(path, cookie_of(alice))) == CloseCode.GONE


@pytest.mark.parametrize("after", ["abc", "-1", "1e3", "1.0", "%C2%B2", "%00", str(2**63), "9" * 40, "+1", " 1"])
def test_it_closes_a_socket_with_a_malformed_after_as_a_bad_request(alice, session, after):
    path = f"/ws/sessions/{session.pk}/?after={after}"
    assert async_to_sync(closed_with)(communicator(path, cookie_of(alice))) == CloseCode.BAD_REQUEST


def test_it_closes_a_socket_whose_after_is_beyond_the_last_event_as_a_bad_request(alice, session):
    actions.record_event(session.pk, "error", {"message": "one"})
    cookie = cookie_of(alice)
    assert async_to_sync(closed_with)(communicator(f"/ws/sessions/{session.pk}/?after=2", cookie)) == 4400

    async def at_the_last_event() -> None:
        comm = communicator(f"/ws/sessions/{session.pk}/?after=1", cookie)
        assert (await comm.connect(timeout=10))[0]
        assert await quiet(comm)  # open, with nothing to catch up
        await comm.disconnect()

    async_to_sync(at_the_last_event)()


def test_it_closes_a_socket_with_non_ascii_bytes_in_its_query_as_a_bad_request(alice, session):
    comm = communicator(f"/ws/sessions/{session.pk}/", cookie_of(alice))
    comm.scope["query_string"] = b"after=\xff\xfe"
    assert async_to_sync(closed_with)(comm) == CloseCode.BAD_REQUEST


def test_it_tells_a_stranger_to_log_in_and_another_member_that_the_session_is_gone(session, bob):
    path = f"/ws/sessions/{session.pk}/"
    assert async_to_sync(closed_with)(communicator(path)) == CloseCode.LOGGED_OUT
    assert async_to_sync(closed_with)(communicator(path, "sessionid=forged")) == CloseCode.LOGGED_OUT
    # Someone else's session gets the same answer as a missing one (as the HTTP views' 404).
    assert async_to_sync(closed_with)(communicator(path, cookie_of(bob))) == CloseCode.GONE
    missing = f"/ws/sessions/{session.pk + 1000}/"
    assert async_to_sync(closed_with)(communicator(missing, cookie_of(bob))) == CloseCode.GONE


def test_it_tells_a_deactivated_user_to_log_in(session, alice):
    cookie = cookie_of(alice)
    type(alice).objects.filter(pk=alice.pk).update(is_active=False)
    assert async_to_sync(closed_with)(communicator(f"/ws/sessions/{session.pk}/", cookie)) == CloseCode.LOGGED_OUT


def test_frames_from_the_browser_are_ignored_and_the_socket_stays_live(alice, session):
    cookie = cookie_of(alice)

    async def scenario() -> None:
        comm = communicator(f"/ws/sessions/{session.pk}/", cookie)
        connected, _ = await comm.connect(timeout=10)
        assert connected
        for frame in ["not json", "{", '{"type": "transcript.event", "seq": 99}', " ", "\x00"]:
            await comm.send_to(text_data=frame)
        await comm.send_to(bytes_data=b"\x00\xff binary")
        await comm.send_json_to({"hello": "world"})
        await database_sync_to_async(actions.record_event)(session.pk, "error", {"message": "still here"})
        message = json.loads((await next_output(comm))["text"])  # its own who-is-watching list aside
        assert message["seq"] == 1 and "still here" in message["ops"][0]["html"]
        await comm.disconnect()

    async_to_sync(scenario)()


def test_the_socket_and_the_first_paint_read_one_context_size(alice, session):
    """The gauge's n_ctx is the last server_ready's, else the session's contextSize — for
    the page's first paint and for the socket alike (live.header.context_size), also when
    the last server did not say it and an earlier one did."""
    AgentSession.objects.filter(pk=session.pk).update(server_params={"contextSize": 1024})
    actions.record_event(session.pk, "server_ready", {"model_key": "m.gguf", "model": "M", "n_ctx": 2048})
    actions.record_event(session.pk, "server_ready", {"model_key": "m.gguf", "model": "M"})  # /props unanswered
    browser = Client()
    browser.force_login(alice)
    assert "context 0 / 1024 tokens" in browser.get(f"/sessions/{session.pk}/").content.decode()
    cookie = cookie_of(alice)

    async def scenario() -> str:
        comm = communicator(f"/ws/sessions/{session.pk}/?after=2", cookie)
        assert (await comm.connect(timeout=10))[0]
        await database_sync_to_async(actions.record_event)(
            session.pk, "usage", {"prompt_tokens": 90, "completion_tokens": 10})
        message = json.loads((await next_output(comm))["text"])
        await comm.disconnect()
        return next(op["html"] for op in message["ops"] if op.get("id") == "context-gauge")

    assert "context 100 / 1024 tokens" in async_to_sync(scenario)()


def test_a_closed_socket_leaves_its_groups_at_once(alice, session):
    cookie = cookie_of(alice)
    login_key = cookie.split("=", 1)[1]
    group = broadcast.group_name(session.pk)

    async def scenario() -> None:
        comm = communicator(f"/ws/sessions/{session.pk}/", cookie)
        assert (await comm.connect(timeout=10))[0]
        await comm.receive_nothing(0.2)  # connect() has run to its end
        assert members(group) == 1 and members(broadcast.login_group_name(login_key)) == 1
        await comm.disconnect()
        # UNSUBSCRIBE is sent, not waited for: Redis takes it within a moment.
        for _ in range(100):
            if members(group) == 0 and members(broadcast.login_group_name(login_key)) == 0:
                break
            await asyncio.sleep(0.02)
        assert members(group) == 0 and members(broadcast.login_group_name(login_key)) == 0

    async_to_sync(scenario)()


# --- a socket is closed when its session or its login ends ----------------------------------------


def test_deleting_the_session_closes_its_watchers_sockets_as_gone(alice, session):
    cookie = cookie_of(alice)

    async def scenario() -> None:
        comm = communicator(f"/ws/sessions/{session.pk}/", cookie)
        assert (await comm.connect(timeout=10))[0]
        await quiet(comm, 0.2)
        await database_sync_to_async(lambda: AgentSession.objects.filter(pk=session.pk).delete())()
        message = await next_output(comm)
        assert message == {"type": "websocket.close", "code": CloseCode.GONE} and type(message["code"]) is int

    async_to_sync(scenario)()


def test_logging_out_closes_the_sockets_of_that_login_only(alice, session):
    client = Client()
    client.force_login(alice)
    leaving = f"sessionid={client.cookies['sessionid'].value}"
    staying = cookie_of(alice)  # alice logged in on another browser too

    async def scenario() -> None:
        here = communicator(f"/ws/sessions/{session.pk}/", leaving)
        there = communicator(f"/ws/sessions/{session.pk}/", staying)
        assert (await here.connect(timeout=10))[0] and (await there.connect(timeout=10))[0]
        await quiet(here, 0.2)
        response = await database_sync_to_async(client.post)("/logout/")
        assert response.status_code == 302
        closed = await next_output(here)
        assert closed == {"type": "websocket.close", "code": CloseCode.LOGGED_OUT} and type(closed["code"]) is int
        assert await quiet(there, 0.5)
        await there.disconnect()

    async_to_sync(scenario)()


# --- the real stack: an idle socket stays, a dropped one leaves -----------------------------------


@pytest.fixture
def short_timeout_web(stack, tmp_path):
    """A second daphne whose Redis URL asks for a 1 s socket timeout: the configuration in
    which idle sockets used to die (a layer whose reads blocked for 5 s), kept as a case:
    an idle subscription must outlive any socket timeout."""
    port = LocalTransport().free_port()
    env = {**stack.env, "REDIS_URL": settings.REDIS_URL + "?socket_timeout=1"}
    web = Stack(base_url=f"http://127.0.0.1:{port}", ws_base=f"ws://127.0.0.1:{port}", data_dir=tmp_path, env=env)
    web.start_web()
    yield web
    web.stop_web()


def test_an_idle_socket_stays_connected_across_many_redis_socket_timeouts(stack, short_timeout_web, alice, session):
    # Two pages idle side by side: one on daphne with redis-py's default timeout (5 s), one
    # on daphne whose URL asks for 1 s.
    logs = [stack.data_dir / "web.log", short_timeout_web.data_dir / "web.log"]
    logged_before = [log.stat().st_size for log in logs]
    pages = [WSRecorder(web.ws_url(session.pk), cookie=cookie_of(alice), origin=web.base_url)
             for web in (stack, short_timeout_web)]
    try:
        wait_for(lambda: members(broadcast.group_name(session.pk)) == 2, 10, what="the sockets to join their group")
        time.sleep(12)  # twelve 1 s timeouts, two of the 5 s ones
        assert [ws.close_code for ws in pages] == [None, None], "an idle socket was closed"
        actions.record_event(session.pk, "error", {"message": "after the quiet"})
        wait_for(lambda: all(ws.seqs == [1] for ws in pages), 10, what="the event after the quiet")
    finally:
        for ws in pages:
            ws.close()
    for log, before in zip(logs, logged_before, strict=True):
        logged = log.read_bytes()[before:].decode(errors="replace")
        assert "TimeoutError" not in logged and "Traceback" not in logged, logged


#: Seconds from a websocket's opening to daphne's first keepalive ping (its default).
DAPHNE_PING_INTERVAL = 20.0


def test_a_dropped_socket_leaves_the_sessions_group_at_once(stack, alice, session):
    group = broadcast.group_name(session.pk)
    opened = time.monotonic()
    ws = WSRecorder(stack.ws_url(session.pk), cookie=cookie_of(alice), origin=stack.base_url)
    wait_for(lambda: members(group) == 1, 10, what="the socket to join its group")
    # The network goes: no close frame, the TCP connection just ends.
    ws._conn.socket.shutdown(socket.SHUT_RDWR)
    ws._conn.socket.close()
    # The only other way daphne learns of a dead socket is its keepalive ping, first sent
    # 20 s after the socket opened (daphne's --ping-interval): a leave before then is the
    # TCP close being acted on, however loaded the box (not a speed bound).
    before_ping = DAPHNE_PING_INTERVAL - (time.monotonic() - opened)
    assert before_ping > 0, "the socket took the whole ping interval to join; nothing to tell apart"
    wait_for(lambda: members(group) == 0, before_ping, interval=0.02, what="the group left before any ping")


# --- what the page says -----------------------------------------------------------------------------


def test_the_page_says_why_it_stopped_following_and_offers_a_way_on(stack, page, alice, session):
    second = AgentSession.objects.create(owner=alice, machine=session.machine, model_key="m.gguf",
                                         working_dir=session.working_dir, status="idle", title="Second")
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    other = page.context.new_page()
    other.set_default_timeout(30_000)
    other.goto(f"{stack.base_url}/sessions/{second.pk}/")
    other.wait_for_selector("#conn-state[data-state=live]")

    # A paste larger than the server takes in one request: the composer says so.
    page.evaluate("document.getElementById('id_text').value = 'x'.repeat(3 * 1024 * 1024)")
    page.click("#send-button")
    too_large = page.wait_for_selector("#composer-error", state="visible")
    assert too_large.inner_text().startswith("This is too large to send: the server takes at most 2.5 MB")

    # Deleted while watched: the page says so and links back to the list. (In a thread of
    # its own: Playwright's event loop runs in this one, and the push needs async_to_sync.)
    def delete() -> None:
        try:
            AgentSession.objects.filter(pk=session.pk).delete()
        finally:
            connection.close()

    deleting = threading.Thread(target=delete)
    deleting.start()
    deleting.join(10)
    gone = page.wait_for_selector(f'#conn-closed [data-close-code="{CloseCode.GONE}"]', state="visible")
    assert "This session is gone" in gone.inner_text()
    assert page.get_attribute("#conn-state", "data-state") == "closed"
    assert page.get_attribute(f'#conn-closed [data-close-code="{CloseCode.GONE}"] a', "href") == "/"

    # Logged out in one tab: the other says so, and "Log in again" comes back to it.
    page.click("header form button[type=submit]")
    page.wait_for_url("**/login/**")
    note = other.wait_for_selector(f'#conn-closed [data-close-code="{CloseCode.LOGGED_OUT}"]', state="visible")
    assert "You are logged out" in note.inner_text()
    time.sleep(1)
    assert other.get_attribute("#conn-state", "data-state") == "closed"  # no retrying
    other.click(f'#conn-closed [data-close-code="{CloseCode.LOGGED_OUT}"] a')
    other.fill("#id_username", "alice")
    other.fill("#id_password", "alice-password-1")
    other.click("button[type=submit]")
    other.wait_for_url(f"{stack.base_url}/sessions/{second.pk}/")
    other.wait_for_selector("#conn-state[data-state=live]")


def test_a_lost_last_push_is_caught_up_without_a_later_event(alice, session, settings, monkeypatch):
    """docs/behaviour.md C17: a gap shows at the next event — but when the push lost was the
    last one (a turn's end, a status), no next event comes: the heartbeat catches up."""
    settings.CORRAL_PRESENCE_SECONDS = 0.5
    cookie, real = cookie_of(alice), broadcast.push_event

    async def scenario() -> list[int]:
        comm = communicator(f"/ws/sessions/{session.pk}/", cookie)
        assert (await comm.connect(timeout=10))[0]
        assert await quiet(comm)
        monkeypatch.setattr(broadcast, "push_event", lambda *args, **kwargs: None)  # this push is lost
        await database_sync_to_async(actions.record_event)(session.pk, "error", {"message": "the last one"})
        monkeypatch.setattr(broadcast, "push_event", real)
        seqs, end = [], asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < end and not seqs:
            if await comm.receive_nothing(0.3):
                continue
            message = await comm.receive_output()
            if '"seq"' in message.get("text", ""):
                seqs.append(json.loads(message["text"])["seq"])
        await comm.disconnect()
        return seqs

    assert async_to_sync(scenario)() == [1]
