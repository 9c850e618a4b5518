"""The admin is for admins (docs/operations.md): in a real browser against the real stack.

Every way the admin deletes a session — its delete button, the bulk "delete selected"
action, deleting its owner, deleting its machine — stops its llama-server through the
stop task, as the page's delete does (asserted by pid: no process is left). Corral's
internals are shown, never edited; help texts show their placeholders; the transcript
reads as a conversation with the raw events one click away.

The servers are the real llama-server with the packaged SmolLM2, started by the real
Celery worker; the deleted machine is reached over real OpenSSH (tests/sshd.py).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from django.db import transaction
from django.test import Client

from machines_app.models import Machine
from machines_app.transports import LocalTransport
from sessions_app import actions
from sessions_app.models import AgentSession, McpServer, TranscriptEvent
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server

from .conftest import model_key, wait_for
from .helpers import fresh, idle_session, log_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", password="root-password-1")


@pytest.fixture
def admin_page(stack, page, root):
    """``page`` logged in as ``root``, on a daphne started for this test: the admin
    writes a LogEntry naming each change's ContentType, whose ids the web process caches,
    and every test's flush makes the content types anew under new ids."""
    stack.stop_web()
    stack.start_web()
    log_in(page, stack, "root", "root-password-1")
    return page


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: Servers a test expects a delete to stop; killed at its end if it did not (no process
#: is left behind by a failing test either).
watched: list[int] = []


@pytest.fixture(autouse=True)
def kill_what_was_not_stopped():
    yield
    while watched:
        pid = watched.pop()
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def server_pids(*sessions: AgentSession) -> list[int]:
    pids = [ServerRecord.objects.get(session=s).pid for s in sessions]
    assert all(running(pid) for pid in pids)
    watched.extend(pids)
    return pids


def wait_stopped(pids: list[int]) -> None:
    wait_for(lambda: not any(running(pid) for pid in pids), 30, what=f"llama-server {pids} to be stopped")


def confirm_delete(page) -> None:
    """Press "Yes, I'm sure" on the admin's delete confirmation page."""
    page.click("input[type=submit][value*='sure']")
    page.wait_for_selector(".messagelist .success")


def test_a_session_deleted_in_the_admin_has_its_server_stopped(stack, page, admin_page, local_machine, alice,
                                                               tmp_path):
    session = idle_session(local_machine, alice, tmp_path)
    [pid] = server_pids(session)
    page.goto(f"{stack.base_url}/admin/sessions_app/agentsession/{session.pk}/change/")
    page.click("a.deletelink")
    assert "llama-server pid" in page.inner_text("#content")  # the record that goes along is listed
    confirm_delete(page)
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    wait_stopped([pid])


def test_the_bulk_delete_action_stops_every_selected_server(stack, page, admin_page, local_machine, alice, bob,
                                                            tmp_path):
    first = idle_session(local_machine, alice, tmp_path)
    second = idle_session(local_machine, bob, tmp_path)
    kept = idle_session(local_machine, alice, tmp_path)
    pids = server_pids(first, second)
    page.goto(f"{stack.base_url}/admin/sessions_app/agentsession/")
    for session in (first, second):
        page.check(f"input[name=_selected_action][value='{session.pk}']")
    page.select_option("select[name=action]", "delete_selected")
    page.click("button[name=index]")
    confirm_delete(page)
    wait_stopped(pids)
    assert running(ServerRecord.objects.get(session=kept).pid)


def test_deleting_an_owner_stops_the_servers_of_their_sessions(stack, page, admin_page, local_machine, alice, bob,
                                                               tmp_path):
    theirs = idle_session(local_machine, bob, tmp_path)
    [pid] = server_pids(theirs)
    page.goto(f"{stack.base_url}/admin/auth/user/{bob.pk}/delete/")
    confirm_delete(page)
    assert not AgentSession.objects.filter(pk=theirs.pk).exists()
    wait_stopped([pid])


def test_deleting_a_remote_machine_stops_its_sessions_servers(stack, page, admin_page, ssh_machine, alice,
                                                              tmp_path):
    """The machine's row is gone by the time the task runs: it reaches the machine by what
    it was handed (host, port, user, key file, pinned host key)."""
    session = idle_session(ssh_machine, alice, tmp_path)
    [pid] = server_pids(session)
    page.goto(f"{stack.base_url}/admin/machines_app/machine/{ssh_machine.pk}/delete/")
    assert "Session" in page.inner_text("#content")  # the sessions that go with it are listed first
    confirm_delete(page)
    assert not Machine.objects.filter(pk=ssh_machine.pk).exists()
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    wait_stopped([pid])


def test_a_server_record_cannot_be_deleted_on_its_own(stack, page, admin_page, local_machine, alice, root,
                                                      tmp_path):
    session = idle_session(local_machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    page.goto(f"{stack.base_url}/admin/sessions_app/serverrecord/{record.pk}/change/")
    assert page.locator("a.deletelink").count() == 0
    page.goto(f"{stack.base_url}/admin/sessions_app/serverrecord/{record.pk}/delete/")
    assert "use Stop server on the session's page" in page.inner_text(".messagelist")
    page.goto(f"{stack.base_url}/admin/sessions_app/serverrecord/")
    assert page.locator("select[name=action] option[value=delete_selected]").count() == 0
    assert ServerRecord.objects.filter(pk=record.pk).exists() and running(record.pid)
    # and a hand-made POST to the delete page is refused too
    client = Client()
    client.force_login(root)
    assert client.post(f"/admin/sessions_app/serverrecord/{record.pk}/delete/", {"post": "yes"}).status_code == 403
    assert ServerRecord.objects.filter(pk=record.pk).exists()


def test_a_session_deleted_while_its_server_is_spawned_leaves_no_process(local_machine, alice, tmp_path,
                                                                         monkeypatch):
    """The delete found no record to hand over (the server was not recorded yet): the
    start that spawned it finds its session gone and stops it itself."""
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024},
    )
    spawned = []
    spawn = LocalTransport.spawn

    def spawn_then_delete(self, argv, log_path, cwd=None, **sandbox):
        proc = spawn(self, argv, log_path, cwd, **sandbox)
        spawned.append(proc.pid)
        AgentSession.objects.filter(pk=session.pk).delete()
        return proc

    monkeypatch.setattr(LocalTransport, "spawn", spawn_then_delete)
    try:
        start_server(session.pk)
    finally:
        watched.extend(spawned)
    assert spawned and not running(spawned[0])
    assert not ServerRecord.objects.exists()


@pytest.mark.parametrize("how", ["the session", "a queryset", "its owner", "its machine"])
def test_every_way_a_session_goes_hands_its_server_to_the_stop_task(local_machine, alice, tmp_path, monkeypatch,
                                                                    how):
    """In-process and fast, the rule the browser tests above prove end to end: whatever
    deletes the row, the stop task gets the process and where it runs, on commit."""
    from sessions_app import dispatch

    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
    )
    ServerRecord.objects.create(session=session, machine=local_machine, model_key=session.model_key, pid=4242,
                                start_time="77", port=40001, log_path="/dev/null")
    session_id, sent = session.pk, []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)))
    delete = {"the session": session.delete, "a queryset": AgentSession.objects.filter(pk=session.pk).delete,
              "its owner": alice.delete, "its machine": local_machine.delete}[how]
    with transaction.atomic():
        delete()
        assert sent == []  # not before the delete commits: a rolled-back delete stops nothing
    place = {"name": "local", "transport": "local", "corral_host": local_machine.corral_host, "host": "", "port": 22,
             "user": "", "private_key_sealed": "", "host_key": ""}
    # … and the removal of its llama-server logs from that machine (docs/operations.md "Disk").
    assert sent == [(dispatch.STOP_PROCESS, (place, 4242, "77", 40001, session_id)),
                    (dispatch.REMOVE_LOGS, (place, session_id))]


# --- internals are read-only, help texts show their placeholders ---------------------------------


def test_internals_are_shown_not_edited_and_a_forged_post_changes_none(stack, page, admin_page, local_machine,
                                                                      alice, root, tmp_path):
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        status="idle", lease_owner="worker@a", title="sheep",
    )
    page.goto(f"{stack.base_url}/admin/sessions_app/agentsession/")
    assert page.locator("#content-main a.addlink").count() == 0  # sessions start from the new-session form
    page.goto(f"{stack.base_url}/admin/sessions_app/agentsession/{session.pk}/change/")
    form = page.locator("#agentsession_form")
    for name in ("status", "interrupt_requested", "turn_active", "lease_owner", "lease_expires", "last_seq",
                 "model_key", "server_params", "sampling", "owner", "machine"):
        assert form.locator(f"[name={name}]").count() == 0, name
    assert "worker@a" in page.inner_text(".field-lease_owner")
    page.fill("input[name=title]", "goats")
    page.click("input[name=_save]")
    page.wait_for_selector(".messagelist .success")
    assert fresh(session).title == "goats"
    # a hand-made POST with the internals in it: taken for the title only
    client = Client()
    client.force_login(root)
    forged = {"title": "cows", "status": "running", "interrupt_requested": "on", "turn_active": "on",
              "lease_owner": "me", "last_seq": "99", "model_key": "other.gguf", "sampling": '{"seed": 1}'}
    assert client.post(f"/admin/sessions_app/agentsession/{session.pk}/change/", forged).status_code == 302
    after = fresh(session)
    assert after.title == "cows"
    assert (after.status, after.interrupt_requested, after.turn_active, after.lease_owner, after.last_seq,
            after.model_key, after.sampling) == ("idle", False, False, "worker@a", 0, session.model_key, {})


def test_help_texts_show_their_placeholders(stack, page, admin_page, local_machine):
    model = local_machine.model_files.first()
    page.goto(f"{stack.base_url}/admin/machines_app/modelfile/{model.pk}/change/")
    assert "<arch>.nextn_predict_layers > 0" in page.inner_text(".field-has_mtp")
    page.goto(f"{stack.base_url}/admin/sessions_app/mcpserver/add/")
    assert "Sent as 'Authorization: Bearer <key>'." in page.inner_text(".field-api_key")


def test_an_mcp_servers_api_key_is_written_never_shown_back(stack, page, admin_page):
    page.goto(f"{stack.base_url}/admin/sessions_app/mcpserver/add/")
    page.fill("input[name=name]", "exa")
    page.fill("input[name=url]", "https://mcp.example.org/mcp")
    page.fill("input[name=api_key]", "sk-secret-1")
    page.click("input[name=_continue]")
    page.wait_for_selector(".messagelist .success")
    assert McpServer.objects.get(name="exa").api_key == "sk-secret-1"
    assert "sk-secret-1" not in page.content()
    assert page.input_value("input[name=api_key]") == ""
    page.fill("input[name=url]", "https://mcp.example.org/v2/mcp")  # saved with the key left empty: kept
    page.click("input[name=_continue]")
    page.wait_for_selector(".messagelist .success")
    assert McpServer.objects.get(name="exa").api_key == "sk-secret-1"
    page.check("input[name=clear_api_key]")
    page.click("input[name=_continue]")
    page.wait_for_selector(".messagelist .success")
    assert McpServer.objects.get(name="exa").api_key == ""


def test_no_help_text_holds_an_unescaped_tag():
    """The kind, not the two found: every model and admin form field's help text is HTML
    to the admin, so any '<' in it must come escaped."""
    from django.apps import apps
    from django.contrib import admin

    texts = {f"{model.__name__}.{field.name}": str(field.help_text)
             for app in ("machines_app", "sessions_app") for model in apps.get_app_config(app).get_models()
             for field in model._meta.get_fields() if getattr(field, "help_text", "")}
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label in ("machines_app", "sessions_app") and getattr(model_admin, "form", None):
            for name, field in model_admin.form.base_fields.items():
                texts[f"{model_admin.form.__name__}.{name}"] = str(field.help_text)
    assert texts and not {where: text for where, text in texts.items() if "<" in text}


# --- the transcript reads as a conversation -----------------------------------------------------


def test_the_session_page_in_the_admin_reads_as_a_conversation(stack, page, admin_page, local_machine, alice,
                                                               tmp_path):
    session = idle_session(local_machine, alice, tmp_path, max_tokens=24)
    actions.do_send_message(session, alice, "Say hello to the <b>sheep</b>.")
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 120, what="a reply")
    fragments = [e.payload["text"] for e in TranscriptEvent.objects.filter(session=session, kind="assistant_text")
                 .order_by("seq")]
    assert len(fragments) > 1  # streamed: one event per fragment
    words = re.findall(r"[A-Za-z']+", "".join(fragments))
    assert words
    page.goto(f"{stack.base_url}/admin/sessions_app/agentsession/{session.pk}/change/")
    conversation = page.locator(".corral-conversation")
    assert conversation.locator(".msg.user .body").inner_text() == "Say hello to the <b>sheep</b>."
    assert conversation.locator(".msg.user b").count() == 0  # a person's text is text
    [shown] = conversation.locator(".msg.assistant").all_inner_texts()  # one message for the whole reply
    assert re.findall(r"[A-Za-z']+", shown) == words
    page.click(".field-raw_events a")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == fresh(session).last_seq
    cells = page.locator("#result_list td.field-text").all_inner_texts()
    first = next(f.strip() for f in fragments if f.strip())
    assert first in cells  # the raw fragments, each in its own row
