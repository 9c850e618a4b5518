"""Questions reach people where they are (docs/attention.md), in a real browser (Playwright +
Debian's Chromium, notifications granted through the browser context's permissions) against
the real stack: another tab's title and icon count a question and a system notification
names it; the inbox and the session page answer the same question and each follows the
other live; Web Push end to end through a push service stand-in (tests/push_service.py);
the service worker's push handler (DevTools ``ServiceWorker.deliverPushMessage``); the app
passes Chromium's installability checks; and a long session opens at its end and follows
the conversation (docs/live-page.md). Screenshots go to ``$CORRAL_TEST_ARTEFACTS`` (default
``data/test-artefacts/``).

The model side is the stand-in (tests/fake_llama_server.py): a 135M model will not ask for a
tool call on demand.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from django.db import connection

from attention_app.models import PushSubscription
from sessions_app import actions
from sessions_app.events import record_event
from sessions_app.models import AgentSession

from .conftest import CHROMIUM, ROOT, wait_for
from .helpers import log_in, open_session, send, start_session
from .push_service import PushService, b64url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]

ARTEFACTS = Path(os.environ.get("CORRAL_TEST_ARTEFACTS") or ROOT / "data" / "test-artefacts")


def shell(command: str) -> dict:
    return {"tool_calls": [{"name": "exec_shell_command", "arguments": json.dumps({"command": command})}]}


def in_thread(work) -> object:
    """Run ORM work off the thread where Playwright runs its loop (as start_session does)."""
    out = []

    def run() -> None:
        try:
            out.append(work())
        finally:
            connection.close()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out[0] if out else None


@pytest.fixture
def profiles(monkeypatch, stack, tmp_path):
    """``open(name, width, height)`` → a browser profile of its own (a persistent context:
    Chromium installs no app from an incognito one) in which Corral may show notifications,
    as a person would allow it."""
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    opened = []
    with sync_playwright() as p:
        def open_profile(name: str = "alice", width: int = 1366, height: int = 900):
            context = p.chromium.launch_persistent_context(
                str(tmp_path / f"profile-{name}"), executable_path=CHROMIUM, viewport={"width": width, "height": height},
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"],
            )
            context.grant_permissions(["notifications"], origin=stack.base_url)
            context.set_default_timeout(30_000)
            opened.append(context)
            return context

        yield open_profile
        for context in opened:
            context.close()


@pytest.fixture
def context(profiles):
    return profiles()


@pytest.fixture
def push_service():
    service = PushService()
    yield service
    service.close()


def worker_ready(page) -> None:
    """Wait until the service worker controls the origin (registered by attention.js)."""
    page.evaluate("navigator.serviceWorker.ready.then(() => true)")


def notifications(page) -> list[dict]:
    return page.evaluate("""navigator.serviceWorker.ready.then(r => r.getNotifications()).then(ns =>
        ns.map(n => ({title: n.title, body: n.body, tag: n.tag, url: n.data && n.data.url})))""")


def poll(page, predicate, what: str, timeout: float = 30.0):
    """``wait_for`` for what the browser does on its own: between two tries Playwright is
    called (its sync API hands events over and lets the browser's work through only then)."""

    def tried():
        page.wait_for_timeout(200)
        return predicate()

    return wait_for(tried, timeout, what=what)


def opt_in(page, stack) -> None:
    page.goto(stack.base_url + "/notifications/")
    page.check("#notify-switch")
    page.wait_for_function("() => localStorage.getItem('corral.notify') === 'on'")


def test_a_question_in_another_session_counts_in_every_tab_and_is_a_notification(stack, context, fake_machine,
                                                                                alice, tmp_path):
    session = start_session(alice, fake_machine([shell("make test")]), tmp_path, title="Shopping list helper")
    other = context.new_page()
    log_in(other, stack, "alice", "alice-password-1")
    opt_in(other, stack)
    other.goto(stack.base_url + "/")  # the session list: any Corral page
    worker_ready(other)
    assert not other.title().startswith("(") and other.locator("#inbox-count").is_hidden()
    icon = other.locator('link[rel="icon"]')
    assert icon.get_attribute("href").endswith("/favicon.svg")

    asking = context.new_page()
    open_session(asking, stack, session)
    send(asking, "Run the tests.")
    asking.locator("[id='tool-call_1_0'] button", has_text="Refuse").wait_for()

    other.wait_for_function("() => document.title.startsWith('(1) ')")
    assert other.title() == "(1) Sessions — Corral"
    assert other.locator('link[rel="icon"]').get_attribute("href").endswith("/favicon-alert.svg")
    assert other.locator("#inbox-count").inner_text() == "1"
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    other.screenshot(path=str(ARTEFACTS / "attention-other-tab.png"))
    shown = poll(other, lambda: notifications(other), "the notification")
    assert shown == [{"title": "Your session wants to run `make test`", "body": "Shopping list helper",
                      "tag": f"corral-question-{session.pk}:call_1_0", "url": f"/sessions/{session.pk}/#tool-call_1_0"}]
    # The notification's link opens the card, in view.
    other.goto(stack.base_url + shown[0]["url"])
    card = other.locator("[id='tool-call_1_0']")
    card.locator("button", has_text="Allow once").wait_for()
    assert other.evaluate("""() => { const r = document.getElementById('tool-call_1_0').getBoundingClientRect();
        return r.top < innerHeight && r.bottom > 0; }""")
    # Answered: every tab's count and badge go.
    card.locator("button", has_text="Refuse").click()
    asking.wait_for_function("() => !document.title.startsWith('(')")
    other.wait_for_function("() => !document.title.startsWith('(')")
    assert other.locator('link[rel="icon"]').get_attribute("href").endswith("/favicon.svg")


def test_the_inbox_and_the_session_page_answer_the_same_question_and_follow_each_other(stack, context, profiles,
                                                                                      fake_machine, alice, bob,
                                                                                      tmp_path):
    machine = fake_machine([shell("make test"), shell("make clean"), {"text": "Both done."}])
    session = start_session(alice, machine, tmp_path, title="Build helper")
    in_thread(lambda: actions.do_set_visibility(AgentSession.objects.get(pk=session.pk), alice,
                                                AgentSession.Visibility.TEAM_ACT))
    page = context.new_page()
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    send(page, "Build it, then clean up.")
    page.locator("[id='tool-call_1_0'] button", has_text="Refuse").wait_for()

    # bob, who may act in the shared session, answers from his inbox in another browser profile.
    inbox = profiles("bob", 390, 844).new_page()
    log_in(inbox, stack, "bob", "bob-password-1")
    inbox.goto(stack.base_url + "/inbox/")
    entry = inbox.locator(f".inbox-entry[data-key='{session.pk}:call_1_0']")
    assert "make test" in entry.locator(".call-section.command").inner_text()
    assert "alice's session" in entry.inner_text() and inbox.locator("#inbox-count").inner_text() == "1"
    inbox.screenshot(path=str(ARTEFACTS / "inbox-390x844.png"), full_page=True)
    entry.locator("button", has_text="Allow once").click()
    # Gone from the inbox, and the session page shows the answer live.
    entry.wait_for(state="detached")
    page.locator("[id='tool-call_1_0'] .answer", has_text="Allowed once by bob").wait_for()
    assert page.locator("[id='question-call_1_0']").count() == 0

    # The next call's question reaches the inbox live; answered on the session page, it leaves the inbox.
    second = inbox.locator(f".inbox-entry[data-key='{session.pk}:call_2_0']")
    second.wait_for()
    assert "make clean" in second.locator(".call-section.command").inner_text()
    page.locator("[id='tool-call_2_0'] button", has_text="Refuse").click()
    second.wait_for(state="detached")
    inbox.locator("#inbox-empty").wait_for(state="visible")
    inbox.wait_for_function("() => !document.title.startsWith('(')")


def test_web_push_end_to_end_and_a_gone_subscription_is_removed(stack, fake_machine, alice, tmp_path, push_service):
    """No page of alice's is open: the question is pushed to her device by the real worker,
    encrypted for it (RFC 8291) and signed with the key made at setup (RFC 8292)."""
    machine = fake_machine([shell("make test"), shell("make clean"), {"text": "Both done."}])
    session = start_session(alice, machine, tmp_path, title="Shopping list helper")
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="the server")
    phone = push_service.device("alices-phone")
    in_thread(lambda: PushSubscription.objects.create(user=alice, endpoint=phone.endpoint, p256dh=phone.p256dh,
                                                      auth=b64url(phone.auth), device="Chrome on Android"))
    in_thread(lambda: actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "Build it."))
    request = push_service.wait(1, 120)[0]
    from cryptography.hazmat.primitives import serialization
    from py_vapid import Vapid

    vapid = Vapid.from_pem((stack.data_dir / "vapid_private.pem").read_bytes())
    key = b64url(vapid.public_key.public_bytes(serialization.Encoding.X962,
                                               serialization.PublicFormat.UncompressedPoint))
    message = push_service.read(request, phone, key)
    assert message["title"] == "Your session wants to run `make test`"
    assert message["url"] == f"/sessions/{session.pk}/#tool-call_1_0" and message["body"] == "Shopping list helper"

    # The push service says the subscription is gone at the next question: Corral forgets it.
    push_service.answers = [410]
    in_thread(lambda: actions.do_answer(AgentSession.objects.get(pk=session.pk), alice, "call_1_0", "refuse"))
    push_service.wait(2, 120)
    wait_for(lambda: not PushSubscription.objects.filter(user=alice).exists(), 30, what="the subscription to go")


def test_the_service_worker_shows_a_pushed_message_and_the_app_is_installable(stack, context, alice):
    page = context.new_page()
    log_in(page, stack, "alice", "alice-password-1")
    worker_ready(page)
    cdp = context.new_cdp_session(page)
    # Chromium's own installability checks: the manifest, its icons, the service worker.
    # (Asked again for a while: the checks wait for the worker and the icons, fetched after the page.)
    said: list = []

    def installable() -> bool:
        said[:] = cdp.send("Page.getInstallabilityErrors")["installabilityErrors"]
        return not said

    try:
        wait_for(installable, 30, what="no installability errors")
    except AssertionError:
        raise AssertionError(f"Chromium says the app is not installable: {said}") from None
    manifest = cdp.send("Page.getAppManifest")
    assert manifest["url"] == stack.base_url + "/manifest.webmanifest" and not manifest["errors"]

    registrations: list[dict] = []
    cdp.on("ServiceWorker.workerRegistrationUpdated", lambda e: registrations.extend(e["registrations"]))
    cdp.send("ServiceWorker.enable")

    def registered():
        page.wait_for_timeout(100)  # Playwright's sync API hands events over only while it is called
        return next((r for r in registrations if r["scopeURL"] == stack.base_url + "/"), None)

    ours = wait_for(registered, 30, what=f"the service worker's registration (seen: {registrations})")
    message = {"title": "bob's session wants to run `make deploy`", "body": "Release", "url": "/sessions/7/#tool-c1",
               "tag": "corral-question-7:c1"}
    cdp.send("ServiceWorker.deliverPushMessage", {"origin": stack.base_url, "registrationId": ours["registrationId"],
                                                  "data": json.dumps(message)})
    shown = poll(page, lambda: notifications(page), "the pushed notification")
    assert shown == [{"title": message["title"], "body": "Release", "tag": message["tag"], "url": message["url"]}]
    # A click on it (the worker's notificationclick, dispatched as the browser would) takes a
    # tab already on that page to the card named in the message, and closes the notification.
    tab = context.new_page()
    tab.goto(stack.base_url + "/inbox/")
    worker = next(w for w in context.service_workers if w.url == stack.base_url + "/sw.js")
    worker.evaluate("""async url => {
        await self.registration.showNotification("to click", {tag: "click", data: {url}});
        const [shown] = await self.registration.getNotifications({tag: "click"});
        self.dispatchEvent(new NotificationEvent("notificationclick", {notification: shown}));
    }""", "/inbox/?from=notification")
    tab.wait_for_url(stack.base_url + "/inbox/?from=notification")
    poll(page, lambda: [n["tag"] for n in notifications(page)] == [message["tag"]], "the clicked one to close")
    # The app shell is cached; a transcript never is.
    cached = page.evaluate("caches.open('corral-shell-v1').then(c => c.keys()).then(ks => ks.map(k => k.url))")
    assert stack.base_url + "/static/corral/offline.html" in cached
    assert not any("/sessions/" in url for url in cached)


def long_session(alice, machine, tmp_path, turns: int = 150) -> AgentSession:
    """A session with ``turns`` × (a message and its reply): 300 messages."""
    session = start_session(alice, machine, tmp_path, title="Long one")
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="the server")

    def fill() -> None:
        for n in range(turns):
            record_event(session.pk, "message_taken", {"text": f"Question number {n}?", "queued_id": None,
                                                       "by": {"id": alice.pk, "username": "alice"}})
            record_event(session.pk, "assistant_text", {"text": f"Answer number {n}.\n\n" + "Some words. " * 20})
            record_event(session.pk, "turn_end", {"reason": "done"})

    in_thread(fill)
    return session


def in_view(page, selector: str) -> bool:
    return page.evaluate("""s => { const el = document.querySelector(s); const r = el.getBoundingClientRect();
        return r.height > 0 && r.top >= -1 && r.bottom <= innerHeight + 1; }""", selector)


def last_message_in_view(page) -> bool:
    return page.evaluate("""() => { const all = document.querySelectorAll('#transcript .msg');
        const r = all[all.length - 1].getBoundingClientRect(); return r.bottom > 0 && r.bottom <= innerHeight + 1; }""")


def at_bottom(page) -> bool:
    return page.evaluate("innerHeight + scrollY >= document.documentElement.scrollHeight - 2")


@pytest.mark.parametrize("width,height", [(1366, 900), (390, 844)])
def test_a_long_session_opens_at_its_last_message_with_the_message_box_in_view(stack, context, fake_machine, alice,
                                                                               tmp_path, width, height):
    session = long_session(alice, fake_machine([]), tmp_path)
    page = context.new_page()
    page.set_viewport_size({"width": width, "height": height})
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    page.wait_for_load_state("load")
    assert "Answer number 149." in page.locator("#transcript .msg").last.inner_text()
    assert last_message_in_view(page) and in_view(page, "#id_text") and in_view(page, "#send-button")
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"long-session-{width}x{height}.png"))


def test_the_page_follows_new_text_at_the_bottom_and_offers_new_messages_when_scrolled_up(stack, context,
                                                                                          fake_machine, alice,
                                                                                          tmp_path):
    machine = fake_machine([{"text": "First reply " * 60, "delay": 0.02}, {"text": "Second reply " * 60}])
    session = long_session(alice, machine, tmp_path, turns=30)
    page = context.new_page()
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    assert at_bottom(page)
    # At the bottom: the reply, streamed, keeps the page at the bottom.
    send(page, "Go on.")
    page.locator("#transcript .msg.assistant", has_text="First reply").last.wait_for()
    page.wait_for_function("() => !document.querySelector('#transcript .msg.streaming')")
    page.wait_for_timeout(300)
    assert at_bottom(page) and page.locator("#new-messages").is_hidden()

    # Scrolled up: the page stays where the reader is, and offers the new messages.
    page.mouse.wheel(0, -3000)
    page.wait_for_function("() => scrollY < document.documentElement.scrollHeight - innerHeight - 500")
    where = page.evaluate("scrollY")
    in_thread(lambda: actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "And again."))
    page.locator("#new-messages").wait_for(state="visible")
    page.locator("#transcript .msg.assistant", has_text="Second reply").last.wait_for(state="attached")
    assert abs(page.evaluate("scrollY") - where) < 2
    page.screenshot(path=str(ARTEFACTS / "new-messages-button.png"))
    page.click("#new-messages")
    page.wait_for_function("() => innerHeight + scrollY >= document.documentElement.scrollHeight - 2")
    assert page.locator("#new-messages").is_hidden() and last_message_in_view(page)

    # Earlier turns loaded above are not new messages.
    page.evaluate("window.scrollTo(0, 0)")
    before = page.locator("#transcript .msg").count()
    page.click("text=Show earlier turns")
    page.wait_for_function(f"() => document.querySelectorAll('#transcript .msg').length > {before}")
    page.wait_for_timeout(300)
    assert page.locator("#new-messages").is_hidden()
