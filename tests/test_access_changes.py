"""Access changes apply at once (docs/access.md, "When access changes").

An account turned off, a password changed, a group a machine requires left, a machine
disabled: within 2 s the person's open pages close or drop to watching (real websockets
against the running stack), their next click is refused with a sentence, no tool runs on
their behalf (steps in this process, the stand-in llama-server asking for a shell call
and running it for real), and no sleeping server of theirs is woken. And *act* on a shared session
lets only people who may use its machine act: the others watch.
"""

from __future__ import annotations

import html
import threading

import httpx
import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.test import Client

from machines_app.models import Machine
from project.middleware import LOGGED_OUT_SENTENCE
from sessions_app import actions, agent, transcript
from sessions_app.models import Access, AgentSession, TranscriptEvent
from sessions_app.servers.records import server_endpoint
from sessions_app.servers.start import start_server

from .conftest import WSRecorder, grant_bypass, model_key, wait_for
from .helpers import log_in, payloads

pytestmark = pytest.mark.django_db(transaction=True)

#: The bound docs/access.md gives ("within a second or two"): an open page hears of the change within
#: this many seconds.
WITHIN = 2.0
HTMX = {"HX-Request": "true"}


@pytest.fixture
def shepherds(db):
    return Group.objects.create(name="shepherds")


@pytest.fixture
def pen(shepherds, tmp_path):
    """A machine limited to the shepherds (no server runs on it in these tests)."""
    machine = Machine.objects.create(name="pen", models_dir=str(tmp_path), workspace_roots="")
    machine.allowed_groups.add(shepherds)
    return machine


def in_group(user, group):
    user.groups.add(group)
    return user


def session_on(machine, owner, tmp_path, **fields) -> AgentSession:
    fields = {"status": "idle", "title": "Flock", **fields}
    return AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                       **fields)


def login_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def client_with(cookie: str) -> Client:
    """A browser holding the login ``cookie`` (the same login as the open page's)."""
    client = Client()
    client.cookies["sessionid"] = cookie
    return client


def turn_off(user, machine, group):
    user.is_active = False
    user.save()


def new_password(user, machine, group):
    user.set_password("a-new-password-9")
    user.save()


def leave_group(user, machine, group):
    user.groups.remove(group)


def disable(user, machine, group):
    machine.enabled = False
    machine.save()


CHANGES = {"deactivated": turn_off, "password": new_password, "group": leave_group, "machine": disable}


def reloaded(ws: WSRecorder) -> bool:
    return any(op.get("op") == "reload" for message in ws.tails for op in message.get("ops", []))


@pytest.mark.parametrize("whose", ["own", "shared"])
@pytest.mark.parametrize("change", CHANGES)
def test_an_open_page_hears_of_the_change_within_2_s_and_the_next_click_is_refused(
    stack, alice, bob, shepherds, pen, tmp_path, change, whose
):
    in_group(bob, shepherds)
    in_group(alice, shepherds)
    owner = bob if whose == "own" else alice
    session = session_on(pen, owner, tmp_path, visibility=AgentSession.Visibility.TEAM_ACT)
    cookie = login_cookie(bob)
    ws = WSRecorder(stack.ws_url(session.pk), cookie=f"sessionid={cookie}", origin=stack.base_url)
    try:
        wait_for(lambda: ws.presence, 10, what="the page's socket to join its groups")
        assert ws.close_code is None and not reloaded(ws)

        CHANGES[change](bob, pen, shepherds)
        if change in ("deactivated", "password"):
            # The login ended: the page is told so (4401, "Log in again").
            wait_for(lambda: ws.close_code is not None, WITHIN, interval=0.02, what="the socket to close")
            assert ws.close_code == 4401
            sentence = LOGGED_OUT_SENTENCE
        else:
            # Still allowed to read it: the page reloads into the watcher's view.
            wait_for(lambda: reloaded(ws), WITHIN, interval=0.02, what="the page to be told to reload")
            sentence = "You can watch this session but no longer act in it: "
    finally:
        ws.close()

    browser = client_with(cookie)
    for path, data in ((f"/sessions/{session.pk}/send/", {"text": "still here?"}),
                       (f"/sessions/{session.pk}/interrupt/", {})):
        response = browser.post(path, data, headers=HTMX)
        assert response.status_code == 403, path
        assert sentence in html.unescape(response.content.decode())
    assert not TranscriptEvent.objects.filter(session=session, kind__in=["message_taken", "message_queued"]).exists()


def test_a_machine_change_reaches_every_page_on_that_machine(stack, alice, bob, shepherds, pen, tmp_path):
    in_group(alice, shepherds)
    session = session_on(pen, alice, tmp_path, visibility=AgentSession.Visibility.TEAM_ACT)
    # bob, outside the group, watches; the machine opening to everyone lets him act.
    ws = WSRecorder(stack.ws_url(session.pk), cookie=f"sessionid={login_cookie(bob)}", origin=stack.base_url)
    try:
        wait_for(lambda: ws.presence, 10, what="the page's socket to join its groups")
        pen.allowed_groups.clear()
        wait_for(lambda: reloaded(ws), WITHIN, interval=0.02, what="the page to be told to reload")
        assert ws.close_code is None
    finally:
        ws.close()


# --- act on a shared session needs the machine ------------------------------------------------


def test_act_shared_on_a_group_only_machine_lets_someone_outside_the_group_only_watch(alice, bob, shepherds, pen,
                                                                                      tmp_path):
    in_group(alice, shepherds)
    session = session_on(pen, alice, tmp_path, visibility=AgentSession.Visibility.TEAM_ACT)
    assert session.access_for(bob) == Access.WATCH and session.shared_access(bob) == Access.ACT
    browser = Client()
    browser.force_login(bob)
    page = html.unescape(browser.get(f"/sessions/{session.pk}/").content.decode())
    assert 'id="composer-wrap"' not in page
    assert "You can follow this session but no longer act in it: Machine 'pen' is limited to some groups" in page
    for path, data in ((f"/sessions/{session.pk}/send/", {"text": "let me in"}),
                       (f"/sessions/{session.pk}/calls/c1/answer/", {"answer": transcript.ANSWER_ALLOW_ONCE})):
        response = browser.post(path, data, headers=HTMX)
        assert response.status_code == 403
        assert "limited to some groups and you are not in them" in html.unescape(response.content.decode())
    in_group(bob, shepherds)
    assert AgentSession.objects.get(pk=session.pk).access_for(bob) == Access.ACT


# --- no wake ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["group", "machine"])
def test_a_sleeping_server_is_not_woken_for_someone_who_may_no_longer_use_its_machine(alice, shepherds, pen,
                                                                                     tmp_path, change):
    in_group(alice, shepherds)
    session = session_on(pen, alice, tmp_path, status="sleeping")
    CHANGES[change](alice, pen, shepherds)
    browser = Client()
    browser.force_login(alice)
    for path, data in ((f"/sessions/{session.pk}/send/", {"text": "wake up"}),
                       (f"/sessions/{session.pk}/regenerate/", {})):
        response = browser.post(path, data, headers=HTMX)
        assert response.status_code == 403
        assert "no longer act in it" in html.unescape(response.content.decode())
    # The action itself refuses too, whoever calls it.
    with pytest.raises(actions.SessionError, match="pen"):
        actions.do_send_message(session, alice, "wake up")
    session.refresh_from_db()
    assert session.status == "sleeping" and not session.turn_active
    assert not TranscriptEvent.objects.filter(session=session).exists()


# --- no tool run --------------------------------------------------------------------------------------
# The stand-in llama-server (tests/fake_llama_server.py) asks for the call on cue and runs
# exec_shell_command for real in the working directory; the steps run in this process.

TOUCH = [{"tool_calls": [{"name": "exec_shell_command", "arguments": '{"command": "touch ran.txt"}'}]},
         {"text": "Done."}]


@pytest.fixture
def shared_session(fake_machine, alice, bob, shepherds, tmp_path, steps_run_here, stop_servers_after):
    """alice's session on a machine limited to the shepherds (alice and bob), shared to
    act, its server up, asking before each call; the model side will ask to touch ran.txt."""
    machine = fake_machine(TOUCH)
    machine.allowed_groups.add(shepherds)
    in_group(alice, shepherds)
    in_group(bob, shepherds)
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading", visibility=AgentSession.Visibility.TEAM_ACT,
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    return session


def model_requests(session) -> int:
    """How many chat requests the stand-in was sent."""
    server = server_endpoint(AgentSession.objects.get(pk=session.pk))
    return len(httpx.get(server.url + "/requests", headers={"Authorization": f"Bearer {server.api_key}"}).json())


def test_a_call_allowed_by_someone_who_then_left_the_group_is_not_run(shared_session, alice, bob, shepherds,
                                                                       tmp_path):
    session = shared_session
    actions.do_send_message(session, alice, "Touch ran.txt.")
    agent.run_turn_step(session.pk)
    call_id = payloads(session, "question")[0]["id"]
    actions.do_answer(session, bob, call_id, transcript.ANSWER_ALLOW_ONCE)
    bob.groups.remove(shepherds)
    agent.run_turn_step(session.pk)

    assert not (tmp_path / "ran.txt").exists()
    assert not payloads(session, "tool_running")
    end = payloads(session, "tool_end")[0]
    machine = session.machine.name
    assert end["ok"] is False
    assert end["output"].startswith(f"Not run: bob is no longer in the groups machine '{machine}' is limited to")
    assert payloads(session, "error")[-1]["message"].startswith("The turn stopped: bob is no longer in the groups")
    assert payloads(session, "turn_end")[-1]["reason"] == "error"
    assert model_requests(session) == 1  # the model was not asked again on bob's behalf


def test_a_turn_whose_author_was_turned_off_stops_before_the_model_or_a_tool(shared_session, alice, bob, tmp_path):
    session = shared_session
    grant_bypass(alice)
    actions.do_set_permission_mode(session, alice, "bypassPermissions")  # nothing would ask first
    actions.do_send_message(session, bob, "Touch ran.txt.")  # taken; the worker has not run it yet
    bob.is_active = False
    bob.save()
    agent.run_turn_step(session.pk)

    assert not (tmp_path / "ran.txt").exists() and model_requests(session) == 0
    assert payloads(session, "error")[-1]["message"].startswith("The turn stopped: bob's account is turned off")
    assert payloads(session, "turn_end")[-1]["reason"] == "error"


# --- what the person sees ------------------------------------------------------------------------------


def in_a_thread(change) -> None:
    """Run ``change`` (ORM writes) off Playwright's event loop thread, as an admin would."""
    def run() -> None:
        try:
            change()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)


def test_the_page_drops_to_watching_then_says_it_is_logged_out(stack, page, alice, shepherds, pen, tmp_path):
    in_group(alice, shepherds)
    session = session_on(pen, alice, tmp_path)
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.locator("#composer-wrap").count() == 1

    # Out of the machine's group: the page reloads into the watcher's view and says why.
    in_a_thread(lambda: alice.groups.remove(shepherds))
    note = page.wait_for_selector("#sharing-note", timeout=WITHIN * 1000 + 5000)  # the push, then the reload
    assert note.inner_text().startswith("You can follow this session but no longer act in it: Machine 'pen'")
    assert page.locator("#composer-wrap").count() == 0
    page.wait_for_selector("#conn-state[data-state=live]")

    # Turned off: the page stops following and offers to log in again.
    def turn_off_alice() -> None:
        alice.is_active = False
        alice.save()

    in_a_thread(turn_off_alice)
    logged_out = page.wait_for_selector('#conn-closed [data-close-code="4401"]', state="visible",
                                        timeout=WITHIN * 1000)
    assert "You are logged out" in logged_out.inner_text()


# --- which changes tell which sockets (in-process, no stack) ------------------------------------------------


@pytest.fixture
def pushed(monkeypatch):
    """The groups told to ask again, in order (broadcast.push_access_changed replaced)."""
    from sessions_app.live import broadcast

    groups: list[str] = []
    monkeypatch.setattr(broadcast, "push_access_changed", groups.append)
    return groups


def test_every_way_an_account_or_machine_changes_tells_its_sockets(pushed, alice, bob, shepherds, pen):
    from django.utils import timezone

    pushed.clear()  # the fixtures' own setting up
    bob.last_login = timezone.now()
    bob.save(update_fields=["last_login"])  # every login does this: nothing to tell
    bob.first_name = "Bob"
    bob.save()  # nor a name
    assert pushed == []

    shepherds.user_set.add(alice, bob)  # from the group's side
    assert sorted(pushed) == [f"user-{alice.pk}", f"user-{bob.pk}"]
    pushed.clear()
    bob.groups.clear()
    assert pushed == [f"user-{bob.pk}"]
    pushed.clear()
    bob.is_staff = True
    bob.save()
    assert pushed == [f"user-{bob.pk}"]
    pushed.clear()

    shepherds.machines.remove(pen)  # the machine's groups, from the group's side
    assert pushed == [f"machine-{pen.pk}"]
    pushed.clear()
    pen.allowed_groups.add(shepherds)
    pen.name = "pen-2"
    pen.save()  # a rename changes nobody's access
    assert pushed == [f"machine-{pen.pk}"]
    pushed.clear()

    shepherds.delete()  # its members and its machines lose it, with no m2m signal
    assert sorted(pushed) == [f"machine-{pen.pk}", f"user-{alice.pk}"]
