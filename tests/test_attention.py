"""Questions reach people where they are (docs/attention.md), the fast half: who a question
waits for, the inbox's cards and answers, push subscriptions, the manifest and service
worker, the attention socket, and Web Push through a push service stand-in that decrypts
what pywebpush really sends (tests/push_service.py). The browser half is
tests/test_attention_browser.py."""

from __future__ import annotations

import json
from datetime import timedelta

import http_ece
import pytest
from asgiref.sync import async_to_sync
from bs4 import BeautifulSoup
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from attention_app import push, waiting
from attention_app.models import OpenPage, PushSubscription
from machines_app.models import Machine
from project import data_dir
from project.asgi import application
from sessions_app import actions, callcard
from sessions_app.events import record_event
from sessions_app.models import AgentSession

from .push_service import Device, PushService
from .push_service import unb64url as push_service_b64

PRIVATE, WATCH_ONLY, ACT_TOO = AgentSession.Visibility.values


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def machine(db, tmp_path):
    return Machine.objects.create(name="m1", models_dir=str(tmp_path))


@pytest.fixture
def make_session(machine, alice, tmp_path):
    def make(visibility: str = PRIVATE, title: str = "Shopping list helper") -> AgentSession:
        return AgentSession.objects.create(
            owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
            title=title, visibility=visibility, turn_active=True,
        )

    return make


def ask(session: AgentSession, call_id: str, command: str) -> None:
    """A shell call recorded and asked about, as a turn step records them (turns.ask_question)."""
    arguments = json.dumps({"command": command})
    record_event(session.pk, "tool_start", {"id": call_id, "tool": "exec_shell_command", "arguments": arguments,
                                            **callcard.recorded("exec_shell_command", arguments),
                                            "origin": "machine", "display_name": "Shell"})
    record_event(session.pk, "question", {"id": call_id, "tool": "exec_shell_command",
                                          "offers": [{"scope": {"kind": "exact", "command": command}}]})
    AgentSession.objects.filter(pk=session.pk).update(status="awaiting_input")


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_a_question_waits_for_whoever_may_act_and_no_one_else(make_session, alice, bob, charlie_staff):
    private, watched, shared = make_session(PRIVATE), make_session(WATCH_ONLY), make_session(ACT_TOO)
    for session in (private, watched, shared):
        ask(session, "call_1_0", "make test")

    def keys(user) -> set[str]:
        return {w.key for w in waiting.waiting_for(user)}

    everything = {f"{s.pk}:call_1_0" for s in (private, watched, shared)}
    assert keys(alice) == everything and keys(charlie_staff) == everything
    assert keys(bob) == {f"{shared.pk}:call_1_0"}  # may only watch the second, may not see the first
    # The sentence names whose session and the call, for each reader.
    mine = next(w for w in waiting.waiting_for(alice) if w.session_id == shared.pk)
    assert mine.sentence(alice.pk) == "Your session wants to run `make test`"
    assert mine.sentence(bob.pk) == "alice's session wants to run `make test`"
    assert mine.url == f"/sessions/{shared.pk}/#tool-call_1_0"

    actions.do_answer(shared, bob, "call_1_0", "allow_once")
    assert keys(bob) == set() and keys(alice) == everything - {f"{shared.pk}:call_1_0"}
    # A member who may no longer use the machine may only watch: nothing waits for them.
    shared2 = make_session(ACT_TOO)
    ask(shared2, "call_9", "ls")
    assert f"{shared2.pk}:call_9" in keys(bob)
    shared2.machine.allowed_groups.add(Group.objects.create(name="others"))
    assert keys(bob) == set() and f"{shared2.pk}:call_9" in keys(alice) | keys(charlie_staff)


@pytest.mark.django_db
def test_the_newest_question_comes_first_and_a_summary_escapes_what_the_card_escapes(make_session, alice):
    first, second = make_session(title="First"), make_session(title="Second")
    ask(first, "a", "echo one")
    ask(second, "b", "ls /srv/\u202etxt.hs")
    found = waiting.waiting_for(alice)
    assert [w.session_title for w in found] == ["Second", "First"]
    assert found[0].summary == "run `ls /srv/\\u202etxt.hs`"
    long = waiting.summary({"tool": "exec_shell_command", "input": {"command": "x" * 500}})
    assert len(long) == waiting.SUMMARY_CHARS and long.endswith("…")
    assert waiting.summary({"tool": "write_file", "input": {"path": "notes.txt"}}) == "write notes.txt"
    assert waiting.summary({"tool": "search", "display_name": "Search the web"}) == "call Search the web"


@pytest.mark.django_db
def test_the_inbox_shows_the_sessions_card_and_its_answers_answer_the_same_question(make_session, alice, bob):
    session = make_session(ACT_TOO)
    other = make_session(ACT_TOO, title="Other")
    ask(session, "call_1_0", "make test")
    ask(other, "call_1_0", "rm -rf build")  # the same call id in another session
    page = logged_in(bob).get("/inbox/")
    assert page.status_code == 200
    soup = BeautifulSoup(page.content, "html.parser")
    entries = soup.select(".inbox-entry")
    assert [e["data-key"] for e in entries] == [f"{other.pk}:call_1_0", f"{session.pk}:call_1_0"]
    # The card is the session's: the same renderer, every section.
    card = callcard.card({"tool": "exec_shell_command", "input": {"command": "make test"}, "arguments": ""})
    shown = entries[1].select_one(".call-section.command pre.call-text").get_text()
    assert shown.strip("\n") == card.sections[0].text
    # Answer buttons post to the session's own answer view, with feedback ids unique on the page.
    buttons = entries[1].select(".question button")
    assert [b.get_text() for b in buttons] == ["Allow once", "Refuse"]  # bob may not allow "always"
    assert {b["hx-post"] for b in buttons} == {f"/sessions/{session.pk}/calls/call_1_0/answer/"}
    targets = [b["hx-target"] for e in entries for b in e.select(".question button")]
    assert len(set(targets)) == 2 and all(soup.select_one(t) is not None for t in targets)
    ids = [element["id"] for element in soup.select("[id]")]
    assert len(ids) == len(set(ids))  # two sessions' calls named alike are still two cards
    assert "(1) " not in page.content.decode() and soup.select_one("#inbox-count").get_text() == "2"
    # The owner is offered "always" too, as on the session page.
    owners = BeautifulSoup(logged_in(alice).get("/inbox/").content, "html.parser")
    assert any("Always allow" in b.get_text() for b in owners.select(".question button"))
    # Answered through the session's view: gone from the inbox.
    assert logged_in(bob).post(f"/sessions/{session.pk}/calls/call_1_0/answer/", {"answer": "refuse"},
                               HTTP_HX_REQUEST="true").status_code == 200
    again = BeautifulSoup(logged_in(bob).get("/inbox/entries/").content, "html.parser")
    assert [e["data-key"] for e in again.select(".inbox-entry")] == [f"{other.pk}:call_1_0"]


@pytest.mark.django_db
def test_a_watcher_sees_an_empty_inbox_and_may_not_answer_from_it(make_session, bob):
    session = make_session(WATCH_ONLY)
    ask(session, "c", "make test")
    soup = BeautifulSoup(logged_in(bob).get("/inbox/").content, "html.parser")
    assert soup.select(".inbox-entry") == [] and not soup.select_one("#inbox-empty").has_attr("hidden")
    assert logged_in(bob).post(f"/sessions/{session.pk}/calls/c/answer/", {"answer": "allow_once"}).status_code == 403


@pytest.mark.django_db
def test_subscriptions_are_kept_per_person_and_device_and_removable_only_by_their_owner(alice, bob):
    phone = Device("https://push.example/abc")
    client = logged_in(alice)
    ua = "Mozilla/5.0 (Linux; Android 14) AppleWebKit/537.36 Chrome/131.0 Mobile Safari/537.36"
    answer = client.post("/notifications/subscribe/", json.dumps(phone.subscription()),
                         content_type="application/json", HTTP_USER_AGENT=ua)
    assert answer.status_code == 200 and answer.json()["device"] == "Chrome on Android"
    stored = PushSubscription.objects.get()
    assert (stored.user, stored.p256dh) == (alice, phone.p256dh)
    page = BeautifulSoup(client.get("/notifications/").content, "html.parser")
    assert "Chrome on Android" in page.select_one("#devices").get_text()
    key = page.select_one("#notifications")["data-key"]
    assert key == push.application_server_key() and len(push_service_b64(key)) == 65  # an uncompressed P-256 point
    for bad in ("{}", "[]", "not json", json.dumps({"endpoint": "ftp://x", "keys": {"p256dh": "a", "auth": "b"}}),
                json.dumps({"endpoint": "https://x", "keys": {"p256dh": "", "auth": "b"}})):
        refused = client.post("/notifications/subscribe/", bad, content_type="application/json")
        assert refused.status_code == 400 and "not a push subscription" in refused.json()["error"]
    # Corral's workers would POST there: nothing inside this network, nothing in plain http.
    for inside in ("https://127.0.0.1:6379/x", "https://10.1.2.3/x", "https://[::1]/x", "https://localhost/x",
                   "https://169.254.169.254/latest", "http://push.example/x",
                   # Addresses in disguise, judged by where they lead (found by a breaker).
                   "https://2130706433:8000/admin", "https://0x7f000001/x", "https://127.1:6379/",
                   "https://0177.0.0.1/x", "https://localhost./x", "https://foo.localhost/x",
                   "https://100.64.0.1/x", "https://[::ffff:127.0.0.1]/x"):
        refused = client.post("/notifications/subscribe/", json.dumps(Device(inside).subscription()),
                              content_type="application/json")
        assert refused.status_code == 400, inside
    assert PushSubscription.objects.count() == 1
    assert logged_in(bob).post(f"/notifications/{stored.pk}/remove/").status_code == 404
    assert client.post(f"/notifications/{stored.pk}/remove/").status_code == 302
    assert not PushSubscription.objects.exists()


@pytest.mark.django_db
def test_the_manifest_and_the_service_worker_are_served_to_anyone_and_the_csp_allows_them(alice):
    anonymous = Client()
    manifest = anonymous.get("/manifest.webmanifest")
    assert manifest.status_code == 200 and manifest["Content-Type"] == "application/manifest+json"
    body = manifest.json()
    assert body["display"] == "standalone" and body["start_url"] == "/"
    assert {"192x192", "512x512"} <= {icon["sizes"] for icon in body["icons"]}
    worker = anonymous.get("/sw.js")
    assert worker.status_code == 200 and "javascript" in worker["Content-Type"]
    assert "addEventListener(\"push\"" in worker.content.decode()
    page = logged_in(alice).get("/")
    csp = page["Content-Security-Policy"]
    assert "manifest-src 'self'" in csp and "worker-src 'self'" in csp
    soup = BeautifulSoup(page.content, "html.parser")
    assert soup.select_one('link[rel="manifest"]')["href"] == "/manifest.webmanifest"
    assert soup.select_one("#inbox-link")["href"] == "/inbox/"


def test_the_vapid_key_is_made_once_private_and_kept(tmp_path):
    data_dir.prepare(tmp_path)
    path = tmp_path / data_dir.VAPID_KEY_FILE
    first = path.read_bytes()
    assert first.startswith(b"-----BEGIN PRIVATE KEY-----") and path.stat().st_mode & 0o777 == 0o600
    data_dir.prepare(tmp_path)
    assert path.read_bytes() == first


@pytest.fixture
def push_service():
    service = PushService()
    yield service
    service.close()


@pytest.mark.django_db
def test_web_push_reaches_every_device_of_whoever_may_answer_encrypted_for_each(
        make_session, alice, bob, charlie_staff, push_service):
    session = make_session(ACT_TOO)
    phone, laptop, bobs, staffs = (push_service.device(n) for n in ("alice-phone", "alice-laptop", "bob", "staff"))
    for user, device in ((alice, phone), (alice, laptop), (bob, bobs), (charlie_staff, staffs)):
        PushSubscription.objects.create(user=user, endpoint=device.endpoint, p256dh=device.p256dh,
                                        auth=device.subscription()["keys"]["auth"])
    # The staff member has a Corral page on screen: they are told there, not pushed.
    OpenPage.objects.create(channel_name="x", user=charlie_staff, visible=True,
                            expires_at=timezone.now() + timedelta(minutes=1))
    ask(session, "call_1_0", "make test")
    assert push.notify_question(session.pk, "call_1_0") == 3
    received = {r.path: r for r in push_service.wait(3)}
    key = push.application_server_key()
    for device, title in ((phone, "Your session wants to run `make test`"),
                          (laptop, "Your session wants to run `make test`"),
                          (bobs, "alice's session wants to run `make test`")):
        message = push_service.read(received[device.endpoint.removeprefix(push_service.origin)], device, key)
        assert message == {"key": f"{session.pk}:call_1_0", "session_id": session.pk, "call_id": "call_1_0",
                           "url": f"/sessions/{session.pk}/#tool-call_1_0", "title": title,
                           "body": "Shopping list helper", "tag": f"corral-question-{session.pk}:call_1_0"}
    # Another device's keys cannot read it (each message is encrypted for one subscription).
    with pytest.raises(http_ece.ECEException, match="InvalidTag"):
        http_ece.decrypt(received[phone.endpoint.removeprefix(push_service.origin)].body, private_key=laptop.key,
                         auth_secret=laptop.auth, version="aes128gcm")
    assert PushSubscription.objects.filter(last_sent_at__isnull=False).count() == 3
    # Answered: nothing more is pushed about it.
    actions.do_answer(session, alice, "call_1_0", "allow_once")
    assert push.notify_question(session.pk, "call_1_0") == 0


@pytest.mark.django_db
def test_a_subscription_the_push_service_says_is_gone_is_removed(make_session, alice, push_service):
    session = make_session()
    gone, missing, busy = (push_service.device(n) for n in ("gone", "missing", "busy"))
    for device in (gone, missing, busy):
        PushSubscription.objects.create(user=alice, endpoint=device.endpoint, p256dh=device.p256dh,
                                        auth=device.subscription()["keys"]["auth"])
    for device, status in ((gone, 410), (missing, 404), (busy, 429)):  # 429: busy now, not gone
        push_service.answer_for[device.endpoint.removeprefix(push_service.origin)] = status
    ask(session, "c", "make test")
    assert push.notify_question(session.pk, "c") == 0
    assert list(PushSubscription.objects.values_list("endpoint", flat=True)) == [busy.endpoint]


@pytest.mark.django_db(transaction=True)
def test_the_attention_socket_counts_for_its_reader_follows_answers_and_hears_visibility(make_session, alice, bob):
    session = make_session(ACT_TOO)
    client = logged_in(bob)
    socket = WebsocketCommunicator(application, "/ws/attention/", headers=[
        (b"host", b"127.0.0.1"), (b"origin", b"http://127.0.0.1"),
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())])

    async def scenario() -> None:
        connected, _ = await socket.connect()
        assert connected
        assert (await socket.receive_json_from(5))["attention"] == {"count": 0, "questions": []}
        await database_sync_to_async(ask)(session, "call_1_0", "make test")
        told = (await socket.receive_json_from(10))["attention"]
        assert told["count"] == 1 and told["questions"][0]["title"] == "alice's session wants to run `make test`"
        await socket.send_json_to({"visible": True})
        await socket.send_to(text_data="not json")  # ignored
        for _ in range(50):
            if await database_sync_to_async(OpenPage.objects.filter(user=bob, visible=True).exists)():
                break
            await database_sync_to_async(lambda: None)()
        assert await database_sync_to_async(push.has_visible_page)(bob.pk)
        await database_sync_to_async(actions.do_answer)(session, alice, "call_1_0", "refuse")
        assert (await socket.receive_json_from(10))["attention"] == {"count": 0, "questions": []}
        await socket.disconnect()
        assert not await database_sync_to_async(OpenPage.objects.filter(user=bob).exists)()

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_the_attention_socket_refuses_nobody_logged_in():
    socket = WebsocketCommunicator(application, "/ws/attention/", headers=[
        (b"host", b"127.0.0.1"), (b"origin", b"http://127.0.0.1")])

    async def scenario() -> int:
        connected, _ = await socket.connect()
        assert connected
        closed = await socket.receive_output(5)
        return closed["code"]

    assert async_to_sync(scenario)() == 4401
    assert settings.CORRAL_VAPID_SUBJECT.startswith("mailto:")
