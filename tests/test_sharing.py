"""A team, not a set of private chats: who may see and act on a session (docs/sharing.md).

Fast tests of every access rule: private / team may watch / team may act × owner /
member / staff × every session view and the websocket, plus the session list.
"""

from __future__ import annotations

import json
from datetime import timedelta
from html.parser import HTMLParser

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.test import Client
from django.utils import timezone

from machines_app.models import Machine
from machines_app.transports import LocalTransport
from project.asgi import application
from sessions_app import actions, dispatch, turns
from sessions_app.live import broadcast
from sessions_app.models import Access, AgentSession, TranscriptEvent, Watcher

from .conftest import Stack, WSRecorder, wait_for

PRIVATE, WATCH_ONLY, ACT_TOO = AgentSession.Visibility.values
ROLES = ("owner", "member", "staff")

#: What each role may do, per sharing choice: the whole rule, written out once.
EXPECTED = {
    (PRIVATE, "owner"): Access.MANAGE, (PRIVATE, "member"): Access.NONE, (PRIVATE, "staff"): Access.MANAGE,
    (WATCH_ONLY, "owner"): Access.MANAGE, (WATCH_ONLY, "member"): Access.WATCH, (WATCH_ONLY, "staff"): Access.MANAGE,
    (ACT_TOO, "owner"): Access.MANAGE, (ACT_TOO, "member"): Access.ACT, (ACT_TOO, "staff"): Access.MANAGE,
}



@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """The named users are made for every test here; Django's real hasher takes about a
    second each on a busy machine, and no test here checks a password."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

@pytest.fixture
def machine(db, tmp_path):
    return Machine.objects.create(name="m1", models_dir=str(tmp_path))


@pytest.fixture
def make_session(machine, alice, tmp_path):
    def make(visibility: str = PRIVATE, **fields) -> AgentSession:
        return AgentSession.objects.create(
            owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
            title=f"Alice's {visibility}", visibility=visibility, **fields,
        )

    return make


@pytest.fixture
def users(alice, bob, charlie_staff):
    return {"owner": alice, "member": bob, "staff": charlie_staff}


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_it_decides_access_in_one_place_and_the_list_agrees(make_session, users, django_user_model):
    sessions = {visibility: make_session(visibility) for visibility in AgentSession.Visibility.values}
    retired = django_user_model.objects.create_user("dora", password="x", is_active=False)
    for (visibility, role), expected in EXPECTED.items():
        session, user = sessions[visibility], users[role]
        assert session.access_for(user) == expected, (visibility, role)
        listed = AgentSession.objects.visible_to(user).filter(pk=session.pk).exists()
        assert listed == (expected >= Access.WATCH), (visibility, role)
    for nobody in (AnonymousUser(), retired):
        for session in sessions.values():
            assert session.access_for(nobody) == Access.NONE
        assert not AgentSession.objects.visible_to(nobody).exists()


# Every session endpoint with what it needs; the body is a harmless request that the
# action refuses or does without side effects outside the database.
ENDPOINTS = [
    ("get", "/sessions/{pk}/", Access.WATCH, {}),
    ("post", "/sessions/{pk}/send/", Access.ACT, {"text": "hello from {role}"}),
    ("post", "/sessions/{pk}/interrupt/", Access.ACT, {}),
    ("post", "/sessions/{pk}/calls/c1/answer/", Access.ACT, {"answer": "allow_once"}),
    ("post", "/sessions/{pk}/queue/q1/drop/", Access.ACT, {}),
    ("post", "/sessions/{pk}/clear/", Access.MANAGE, {}),
    ("post", "/sessions/{pk}/stop/", Access.MANAGE, {}),
    ("post", "/sessions/{pk}/restart/", Access.MANAGE, {}),
    ("post", "/sessions/{pk}/mode/", Access.MANAGE, {"permission_mode": "manual"}),
    ("post", "/sessions/{pk}/model/", Access.MANAGE, {"model_key": "elsewhere.gguf"}),
    ("post", "/sessions/{pk}/settings/", Access.MANAGE, {"title": "renamed by {role}"}),
    ("post", "/sessions/{pk}/sharing/", Access.MANAGE, {"visibility": "{visibility}"}),
    ("post", "/sessions/{pk}/delete/", Access.MANAGE, {}),
]


def _cases():
    for method, path, need, data in ENDPOINTS:
        for visibility, role in EXPECTED:
            name = f"{path.split('/')[3] or 'page'}-{visibility}-{role}"
            yield pytest.param(method, path, need, data, visibility, role, id=name)


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "need", "data", "visibility", "role"), list(_cases()))
def test_every_view_asks_the_one_rule(make_session, users, method, path, need, data, visibility, role, monkeypatch):
    # A stop queues its task at once, not on commit: keep it from reaching a worker of
    # another test (the stop itself is tests/test_lifecycle.py's).
    stops: list[int] = []
    monkeypatch.setattr(dispatch, "enqueue",
                        lambda task, *args: stops.append(args[0]) if task == dispatch.STOP_SERVER else True)
    session = make_session(visibility)
    have = EXPECTED[(visibility, role)]
    body = {key: value.format(role=role, visibility=visibility) for key, value in data.items()}
    before = list(TranscriptEvent.objects.filter(session=session).values_list("seq", flat=True))
    response = getattr(logged_in(users[role]), method)(path.format(pk=session.pk), body)
    if have == Access.NONE:
        assert response.status_code == 404
    elif have < need:
        assert response.status_code == 403
        page = response.content.decode()
        if need == Access.ACT:
            assert "alice shares this session to watch only" in page
        else:
            assert "Only alice, who owns this session, or staff can do that." in page
    else:
        assert response.status_code in (200, 302), response.content[:300]
        if path.endswith("/stop/"):
            assert stops == [session.pk]
        return
    # Refused: nothing written, nothing changed, nothing queued.
    assert stops == []
    assert list(TranscriptEvent.objects.filter(session=session).values_list("seq", flat=True)) == before
    assert AgentSession.objects.filter(pk=session.pk, visibility=visibility, title=session.title).exists()


@pytest.mark.django_db
def test_a_refused_click_says_why_in_the_flash_line(make_session, bob):
    session = make_session(WATCH_ONLY)
    response = logged_in(bob).post(f"/sessions/{session.pk}/send/", {"text": "hi"}, headers={"HX-Request": "true"})
    assert response.status_code == 403
    assert response["HX-Retarget"] == "#flash"
    assert response.content.decode() == (
        '<p class="error">alice shares this session to watch only: you cannot send, answer or interrupt here.</p>\n'
    )


@pytest.mark.django_db
def test_a_member_withdraws_only_their_own_queued_message(make_session, alice, bob, charlie_staff):
    session = make_session(ACT_TOO, turn_active=True)
    actions.do_send_message(session, alice, "alice's next")
    actions.do_send_message(session, bob, "bob's next")
    alices, bobs = (e.payload["id"] for e in TranscriptEvent.objects.filter(session=session, kind="message_queued"))
    page = logged_in(bob).get(f"/sessions/{session.pk}/").content.decode()
    assert f"/queue/{bobs}/drop/" in page and f"/queue/{alices}/drop/" not in page

    with pytest.raises(actions.SessionError, match="Only its author or the session's owner"):
        actions.do_drop_queued(session, bob, alices)
    response = logged_in(bob).post(f"/sessions/{session.pk}/queue/{alices}/drop/", headers={"HX-Request": "true"})
    assert "Only its author or the session&#x27;s owner can withdraw that message." in response.content.decode()
    actions.do_drop_queued(session, bob, bobs)
    actions.do_drop_queued(session, alice, alices)  # the owner may withdraw anyone's; so may staff
    dropped = TranscriptEvent.objects.filter(session=session, kind="message_dropped").order_by("seq")
    assert [e.payload["by"]["username"] for e in dropped] == ["bob", "alice"]


@pytest.mark.django_db
def test_a_message_queued_before_authors_had_ids_is_the_owners_to_withdraw(make_session, bob):
    session = make_session(ACT_TOO, turn_active=True)
    actions.record_event(session.pk, "message_queued", {"id": "old", "text": "from before", "author": "bob"})
    with pytest.raises(actions.SessionError):
        actions.do_drop_queued(session, bob, "old")
    assert "/queue/old/drop/" not in logged_in(bob).get(f"/sessions/{session.pk}/").content.decode()


@pytest.mark.django_db
def test_the_list_has_mine_and_shared_with_me_and_staff_see_all(make_session, machine, alice, bob, charlie_staff):
    make_session(PRIVATE), make_session(WATCH_ONLY), make_session(ACT_TOO)
    AgentSession.objects.create(owner=bob, machine=machine, model_key="m.gguf", working_dir="/tmp", title="Bob's own")

    def sections(user) -> dict[str, str]:
        found: dict[str, list[str]] = {}

        class Tables(HTMLParser):
            current = None

            def handle_starttag(self, tag, attrs):
                table_id = dict(attrs).get("id", "")
                if table_id.startswith("sessions-"):
                    self.current = table_id
                    found[table_id] = []

            def handle_data(self, data):
                if self.current and data.strip():
                    found[self.current].append(data.strip())

        Tables().feed(logged_in(user).get("/").content.decode())
        return {key: " | ".join(value) for key, value in found.items()}

    bobs = sections(bob)
    assert "Bob's own" in bobs["sessions-mine"] and "Alice's" not in bobs["sessions-mine"]
    assert "Alice's team_watch" in bobs["sessions-shared"] and "Alice's team_act" in bobs["sessions-shared"]
    assert "Alice's private" not in str(bobs) and "sessions-others" not in bobs
    alices = sections(alice)
    assert alices["sessions-shared"] == "Nobody shares a session with the team yet."
    assert "Alice's private" in alices["sessions-mine"] and "Bob's own" not in str(alices)
    charlies = sections(charlie_staff)
    assert "Alice's private" in charlies["sessions-others"] and "Bob's own" in charlies["sessions-others"]
    assert "Alice's team_act" in charlies["sessions-shared"]


@pytest.mark.django_db
def test_the_page_offers_each_person_only_what_they_may_do(make_session, users):
    for visibility in (WATCH_ONLY, ACT_TOO):
        session = make_session(visibility)
        actions.record_event(session.pk, "tool_start", {"id": "c1", "tool": "read_file", "arguments": "{}"})
        turns.ask_question(session.pk, "c1", "read_file")
        for role, user in users.items():
            page = logged_in(user).get(f"/sessions/{session.pk}/").content.decode()
            have = EXPECTED[(visibility, role)]
            assert ('id="composer"' in page) == (have >= Access.ACT), (visibility, role)
            assert ("Allow once</button>" in page) == (have >= Access.ACT), (visibility, role)
            assert ('id="visibility"' in page) == (have >= Access.MANAGE), (visibility, role)
            assert ('id="switch-model"' in page) == (have >= Access.MANAGE), (visibility, role)
            assert ("/clear/" in page) == (have >= Access.MANAGE), (visibility, role)
            if have == Access.WATCH:
                assert "Waiting for someone who may act in this session" in page
                assert "shared with the team to watch" in page


@pytest.mark.django_db
def test_sharing_takes_a_known_choice_and_is_recorded(make_session, alice):
    session = make_session()
    response = logged_in(alice).post(f"/sessions/{session.pk}/sharing/", {"visibility": "everyone"},
                                     headers={"HX-Request": "true"})
    assert "Choose private, the team may watch, or the team may act." in response.content.decode()
    logged_in(alice).post(f"/sessions/{session.pk}/sharing/", {"visibility": WATCH_ONLY})
    session.refresh_from_db()
    assert session.visibility == WATCH_ONLY
    event = TranscriptEvent.objects.get(session=session, kind="settings")
    assert event.payload == {"visibility": WATCH_ONLY, "by": {"id": alice.pk, "username": "alice"}}


# --- the websocket asks the same rule -------------------------------------------------


def _communicator(session_id: int, user) -> WebsocketCommunicator:
    client = logged_in(user) if user is not None else Client()
    cookie = f"sessionid={client.cookies['sessionid'].value}" if user is not None else ""
    return WebsocketCommunicator(
        application, f"/ws/sessions/{session_id}/",
        # The ASGI application's origin checks read ALLOWED_HOSTS once, at import: use a
        # host the default setting allows.
        headers=[(b"host", b"127.0.0.1"), (b"origin", b"http://127.0.0.1"), (b"cookie", cookie.encode())],
    )


async def _open(communicator: WebsocketCommunicator) -> dict | None:
    """Connect; the close code when the consumer closes at once, else None."""
    connected, _ = await communicator.connect()
    assert connected
    first = await communicator.receive_output(5)
    if first["type"] == "websocket.close":
        return first["code"]
    return None


@pytest.mark.django_db(transaction=True)
def test_the_websocket_asks_the_same_rule(make_session, users, settings):

    async def opened(communicator: WebsocketCommunicator) -> int | None:
        code = await _open(communicator)
        await communicator.disconnect()
        return code

    def check(session_id: int, user) -> int | None:
        return async_to_sync(opened)(_communicator(session_id, user))

    for visibility in AgentSession.Visibility.values:
        session = make_session(visibility)
        for role, user in users.items():
            code = check(session.pk, user)
            # Not allowed to see it: the same answer as no such session (docs/live-page.md).
            assert code == (4404 if EXPECTED[(visibility, role)] == Access.NONE else None), (visibility, role)
        assert check(session.pk, None) == 4401  # nobody logged in
    assert check(999999, users["staff"]) == 4404
    assert check(2**70, users["staff"]) == 4404  # past what the database stores


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/sessions/{big}/", "/sessions/{big}/send/", "/sessions/0/"])
def test_an_id_past_what_the_database_stores_is_simply_not_found(charlie_staff, path):
    client = logged_in(charlie_staff)
    response = (client.get if path.count("/") == 3 else client.post)(path.format(big=2**70))
    assert response.status_code == 404


async def _next_message(communicator: WebsocketCommunicator) -> dict:
    """The next message that is not a who-is-watching list, or the close."""
    while True:
        output = await communicator.receive_output(5)
        if output["type"] == "websocket.close":
            return output
        message = json.loads(output["text"])
        if "presence" not in message:
            return message


@pytest.mark.django_db(transaction=True)
def test_an_open_page_follows_a_change_of_sharing(make_session, alice, bob):
    session = make_session(ACT_TOO)
    bobs = _communicator(session.pk, bob)

    async def scenario() -> None:
        assert await _open(bobs) is None
        await database_sync_to_async(actions.do_set_visibility)(session, alice, WATCH_ONLY)
        note = await _next_message(bobs)
        assert "alice shared the session with the team, to watch." in note["ops"][-1]["html"]
        # Then a reload: bob's buttons were drawn for acting.
        assert await _next_message(bobs) == {"ops": [{"op": "reload"}]}
        await database_sync_to_async(actions.do_set_visibility)(session, alice, PRIVATE)
        assert "seq" in await _next_message(bobs)
        assert await _next_message(bobs) == {"type": "websocket.close", "code": 4403}
        await bobs.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_an_open_page_is_cut_off_when_its_account_loses_the_right(make_session, bob, charlie_staff, settings):
    """No sharing event here: the heartbeat asks the rule again."""
    settings.CORRAL_PRESENCE_SECONDS = 0.2
    watched, private = make_session(WATCH_ONLY), make_session(PRIVATE)
    bobs, charlies = _communicator(watched.pk, bob), _communicator(private.pk, charlie_staff)

    async def scenario() -> None:
        assert await _open(bobs) is None and await _open(charlies) is None
        await database_sync_to_async(type(bob).objects.filter(pk=bob.pk).update)(is_active=False)
        await database_sync_to_async(type(bob).objects.filter(pk=charlie_staff.pk).update)(is_staff=False)
        # A deactivated account's login has ended: "log in again" (docs/live-page.md), as
        # at connect; a right lost otherwise: "not shared with you".
        assert await _next_message(bobs) == {"type": "websocket.close", "code": 4401}
        assert await _next_message(charlies) == {"type": "websocket.close", "code": 4403}
        await bobs.disconnect()
        await charlies.disconnect()

    async_to_sync(scenario)()


# --- who is here --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_page_shows_who_is_watching_now(make_session, alice, bob, charlie_staff, settings):
    settings.CORRAL_PRESENCE_SECONDS = 0.2
    session = make_session(WATCH_ONLY)

    async def presence(communicator) -> list[str]:
        while True:
            message = json.loads((await communicator.receive_output(5))["text"])
            if "presence" in message:
                assert message["ops"][0]["id"] == "presence"
                return message["presence"]

    alices, bobs, second_tab = (_communicator(session.pk, user) for user in (alice, bob, bob))

    async def scenario() -> None:
        assert await _open(alices) is None  # its first message: alice alone
        await bobs.connect()
        assert await presence(bobs) == ["alice", "bob"]
        assert await presence(alices) == ["alice", "bob"]
        await second_tab.connect()
        assert await presence(second_tab) == ["alice", "bob"]  # one name per person
        await second_tab.disconnect()
        await bobs.disconnect()
        # Bob's second tab changed no name: alice's page was sent nothing for it, and its
        # next list is the one without bob (docs/sharing.md).
        assert await presence(alices) == ["alice"]

        # Charlie watches through another daphne, which then dies: his row is never
        # deleted, stops counting once three heartbeats old, and alice's next heartbeat
        # drops it and says so.
        await database_sync_to_async(Watcher.objects.create)(
            session=session, user=charlie_staff, channel_name="dead-daphne!abc",
            expires_at=timezone.now() + timedelta(seconds=0.5),
        )
        await broadcast.push_presence(session.pk)  # what his consumer did on connect
        assert await presence(alices) == ["alice", "charlie"]
        assert await presence(alices) == ["alice"]
        assert not await database_sync_to_async(Watcher.objects.filter(channel_name="dead-daphne!abc").exists)()
        await alices.disconnect()
        assert not await database_sync_to_async(Watcher.objects.filter(session=session).exists)()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_presence_spans_daphne_processes_and_forgets_one_that_crashed(stack, make_session, alice, bob, charlie_staff):
    """Real processes: alice and charlie on two daphnes of their own (heartbeat 0.5 s),
    bob on the stack's. Charlie's daphne is killed with SIGKILL: it never says goodbye,
    and the others stop listing him once his entry expires."""
    session = make_session(WATCH_ONLY)
    daphnes = []
    for _ in ("b", "c"):
        port = LocalTransport().free_port()
        extra = Stack(base_url=f"http://127.0.0.1:{port}", ws_base=f"ws://127.0.0.1:{port}",
                      data_dir=stack.data_dir, env={**stack.env, "CORRAL_PRESENCE_SECONDS": "0.5"})
        extra.start_web()
        daphnes.append(extra)
    b, c = daphnes
    sockets = []
    try:
        for where, user in ((b, alice), (stack, bob), (c, charlie_staff)):
            cookie = f"sessionid={logged_in(user).cookies['sessionid'].value}"
            sockets.append(WSRecorder(where.ws_url(session.pk), cookie=cookie, origin=where.base_url))
        everyone = ["alice", "bob", "charlie"]
        for ws in sockets:
            wait_for(lambda ws=ws: ws.presence and ws.presence[-1] == everyone, 15, what="all three names")
        killed = c.procs.pop("web")
        killed.kill()
        killed.wait()
        for ws in sockets[:2]:
            wait_for(lambda ws=ws: ws.presence[-1] == ["alice", "bob"], 15, what="charlie's entry to expire")
    finally:
        for ws in sockets:
            ws.close()
        for extra in daphnes:
            extra.stop_web()


@pytest.mark.django_db
def test_a_stale_page_is_told_to_reload_when_its_token_is_refused(make_session, alice):
    session = make_session()
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    response = client.post(f"/sessions/{session.pk}/send/", {"text": "hi"}, headers={"HX-Request": "true"})
    assert response.status_code == 403 and response["HX-Retarget"] == "#flash"
    assert "This page is out of date (you logged in or out since it was loaded): reload it." in response.content.decode()
    assert not TranscriptEvent.objects.filter(session=session).exists()
