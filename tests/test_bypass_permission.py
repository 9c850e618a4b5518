"""Turning the permission gate off is a Django permission (docs/access.md): offered only
to whom holds it, refused on a forged request, and withdrawn with the permission."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group, Permission
from django.test import Client

from machines_app.models import Machine
from sessions_app import actions, agent
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import grant_bypass, model_key
from .scripted_server import chunk, sse

pytestmark = pytest.mark.django_db

REFUSED = "You may not turn the permission gate off (run tools without asking); an admin can grant you that permission."
BYPASS_OPTION = re.compile(r'<option value="bypassPermissions"[^>]*>')


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def settings_events(session) -> list[dict]:
    return [e.payload for e in TranscriptEvent.objects.filter(session=session, kind="settings").order_by("seq")]


@pytest.fixture
def alices_session(alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    return AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                       status="idle")


def test_the_new_session_form_offers_bypass_only_to_whom_may_choose_it(local_machine, alice, bob, charlie_staff):
    def offered(user) -> bool:
        return BYPASS_OPTION.search(logged_in(user).get("/sessions/new/").content.decode()) is not None

    assert not offered(alice)
    assert offered(charlie_staff)  # staff hold it without a grant
    grant_bypass(alice)
    assert offered(alice)
    trusted = Group.objects.create(name="trusted")
    trusted.permissions.add(Permission.objects.get(codename="bypass_permissions"))
    bob.groups.add(trusted)
    assert offered(bob)  # granted through a group


def test_a_forged_new_session_post_is_refused(local_machine, alice, tmp_path):
    data = {"machine": local_machine.pk, "model_key": model_key(local_machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "bypassPermissions", "speculative": "auto"}
    response = logged_in(alice).post("/sessions/new/", data)
    assert response.status_code == 200
    assert response.context["form"].errors["permission_mode"] == [REFUSED]
    assert not AgentSession.objects.exists()
    with pytest.raises(actions.SessionError, match="You may not turn the permission gate off"):
        actions.do_create_session(alice, machine=local_machine, model_key=model_key(local_machine, "llama"),
                                  working_dir=str(tmp_path), server_params={}, sampling={},
                                  permission_mode="bypassPermissions")
    assert not AgentSession.objects.exists()


def test_the_session_page_hides_the_option_and_a_forged_switch_is_refused(alices_session, alice):
    client = logged_in(alice)
    option = BYPASS_OPTION.search(client.get(f"/sessions/{alices_session.pk}/").content.decode()).group(0)
    assert "disabled" in option and "hidden" in option
    response = client.post(f"/sessions/{alices_session.pk}/mode/", {"permission_mode": "bypassPermissions"},
                           headers={"HX-Request": "true"})
    assert REFUSED in response.content.decode()
    alices_session.refresh_from_db()
    assert alices_session.permission_mode == "manual" and settings_events(alices_session) == []
    # without htmx: a redirect with the message flashed, never a 500
    response = client.post(f"/sessions/{alices_session.pk}/mode/", {"permission_mode": "bypassPermissions"},
                           follow=True)
    assert response.status_code == 200 and REFUSED in response.content.decode()


def test_granted_the_option_is_offered_and_the_switch_works(alices_session, alice):
    grant_bypass(alice)
    client = logged_in(alice)
    option = BYPASS_OPTION.search(client.get(f"/sessions/{alices_session.pk}/").content.decode()).group(0)
    assert "disabled" not in option and "hidden" not in option
    client.post(f"/sessions/{alices_session.pk}/mode/", {"permission_mode": "bypassPermissions"},
                headers={"HX-Request": "true"})
    alices_session.refresh_from_db()
    assert alices_session.permission_mode == "bypassPermissions"
    assert settings_events(alices_session) == [{"permission_mode": "bypassPermissions", "by": {"id": alice.pk, "username": "alice"}}]


def test_staff_cannot_turn_the_gate_off_for_an_owner_who_may_not(alices_session, alice, charlie_staff):
    client = logged_in(charlie_staff)
    option = BYPASS_OPTION.search(client.get(f"/sessions/{alices_session.pk}/").content.decode()).group(0)
    assert "disabled" in option
    response = client.post(f"/sessions/{alices_session.pk}/mode/", {"permission_mode": "bypassPermissions"},
                           headers={"HX-Request": "true"})
    assert "alice, who owns this session, may not run tools without asking" in response.content.decode()
    alices_session.refresh_from_db()
    assert alices_session.permission_mode == "manual"
    grant_bypass(alice)
    actions.do_set_permission_mode(alices_session, charlie_staff, "bypassPermissions")
    assert AgentSession.objects.get(pk=alices_session.pk).permission_mode == "bypassPermissions"


def test_turning_the_gate_back_on_needs_no_permission(alices_session, alice):
    AgentSession.objects.filter(pk=alices_session.pk).update(permission_mode="bypassPermissions")
    alices_session.refresh_from_db()
    page = logged_in(alice).get(f"/sessions/{alices_session.pk}/").content.decode()
    option = BYPASS_OPTION.search(page).group(0)
    assert "selected" in option and "disabled" in option and "hidden" not in option  # the truth is shown
    actions.do_set_permission_mode(alices_session, alice, "manual")
    assert AgentSession.objects.get(pk=alices_session.pk).permission_mode == "manual"


def test_unknown_modes_are_refused(alices_session, alice):
    with pytest.raises(actions.SessionError, match="Unknown permission mode"):
        actions.do_set_permission_mode(alices_session, alice, "yolo")


# --- losing the permission: the gate comes back on ---------------------------------------------


def test_the_gate_comes_back_on_when_the_owner_loses_the_permission(alices_session, alice):
    grant_bypass(alice)
    actions.do_set_permission_mode(alices_session, alice, "bypassPermissions")
    assert actions.gate_mode(alices_session.pk) == "bypassPermissions"
    alice.user_permissions.clear()
    assert actions.gate_mode(alices_session.pk) == "manual"
    assert actions.gate_mode(alices_session.pk) == "manual"
    assert AgentSession.objects.get(pk=alices_session.pk).permission_mode == "manual"
    assert settings_events(alices_session)[1:] == [{
        "permission_mode": "manual",
        "reason": "alice may no longer run tools without asking, so the permission gate is back on."}]


def test_a_staff_owner_who_leaves_staff_gets_the_gate_back(charlie_staff, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=charlie_staff, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle", permission_mode="bypassPermissions")
    assert actions.gate_mode(session.pk) == "bypassPermissions"
    type(charlie_staff).objects.filter(pk=charlie_staff.pk).update(is_staff=False)
    assert actions.gate_mode(session.pk) == "manual"


def scripted_bypass_session(owner, model_side, tmp_path, *calls: str) -> AgentSession:
    """A bypass session of ``owner`` whose "server" is the scripted model side, about to
    receive one round of ``calls`` (tool names) for the message "go"."""
    machine = Machine.objects.create(name="scripted", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle", permission_mode="bypassPermissions")
    port = int(model_side.url.rsplit(":", 1)[1])
    ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=1, start_time="0",
                                port=port, log_path="/dev/null")
    catalogue = [{"name": name, "display_name": name, "writes": True, "origin": "machine", "server": None,
                  "remote_name": name, "definition": {"type": "function", "function": {"name": name}}}
                 for name in ("exec_shell_command", "get_info")]
    actions.record_event(session.pk, "catalogue", {"tools": catalogue})
    model_side.will_answer(
        *[sse(chunk({"tool_calls": [{"index": i, "id": f"call_{i}", "function": {"name": name, "arguments": "{}"}}]}))
          for i, name in enumerate(calls)],
        sse(chunk({}, finish_reason="tool_calls")), b"data: [DONE]\n\n",
    )
    actions.do_send_message(session, owner, "go")
    return session


def kinds_of(session) -> list[str]:
    return list(TranscriptEvent.objects.filter(session=session).order_by("seq").values_list("kind", flat=True))


def test_the_turn_loop_asks_again_once_the_permission_is_gone(alice, model_side, tmp_path):
    """Through the real turn step (the model side scripted): a call in a session left in
    bypass by an owner who lost the permission is asked about, not run."""
    session = scripted_bypass_session(alice, model_side, tmp_path, "exec_shell_command")
    agent.run_turn_step(session.pk)
    kinds = kinds_of(session)
    assert "question" in kinds and "tool_running" not in kinds
    assert kinds.index("settings") < kinds.index("question")
    assert AgentSession.objects.get(pk=session.pk).status == "awaiting_input"
    assert settings_events(session)[-1]["permission_mode"] == "manual"


def test_the_gate_is_read_before_each_call_not_once_per_round(alice, model_side, tmp_path):
    """The permission goes while the first of two calls runs: the second is asked about.
    (The tool runner is replaced so the permission can go at that exact moment.)"""
    from sessions_app.tools import ToolResult

    grant_bypass(alice)
    session = scripted_bypass_session(alice, model_side, tmp_path, "get_info", "exec_shell_command")
    ran = []

    def run_tool(entry, arguments, **kwargs):
        ran.append(entry.name)
        alice.user_permissions.clear()  # an admin takes it away meanwhile
        return ToolResult(output="ok", ok=True)

    agent.run_turn_step(session.pk, run_tool=run_tool)
    assert ran == ["get_info"]
    questions = [e.payload["tool"] for e in TranscriptEvent.objects.filter(session=session, kind="question")]
    assert questions == ["exec_shell_command"]
    assert AgentSession.objects.get(pk=session.pk).permission_mode == "manual"
