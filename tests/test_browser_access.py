"""The team's trust rules in a real browser against the real stack (docs/access.md):
working directories and workspace roots, machines per group, and the gate-off permission.

Chromium (Playwright) drives daphne; sessions start through the Celery worker. The model
side is the stand-in llama-server where a tool call is needed (a 135M model will not call
a tool on demand).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from machines_app.models import Machine
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import grant_bypass, wait_for
from .helpers import log_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def open_form(page, stack, machine) -> None:
    page.goto(f"{stack.base_url}/sessions/new/?machine={machine.pk}")
    page.wait_for_selector("#id_model_key option", state="attached")


def forge_option(page, select: str, value: str) -> None:
    """What a hand-made POST sends: the first option of ``select`` now carries ``value``."""
    page.evaluate("([s, v]) => { const o = document.querySelector(s + ' option'); o.value = v; o.selected = true; }",
                  [select, value])


def test_working_directories_are_checked_on_the_machine_and_kept_in_its_roots(stack, page, fake_machine, alice,
                                                                               tmp_path):
    tmp = tmp_path.resolve()
    (tmp / "root" / "project").mkdir(parents=True)
    (tmp / "outside").mkdir()
    (tmp / "root" / "escape").symlink_to(tmp / "outside")
    machine = fake_machine()
    other = fake_machine()
    Machine.objects.filter(pk=machine.pk).update(workspace_roots=f"{tmp}/root")
    Machine.objects.filter(pk=other.pk).update(workspace_roots="/srv/elsewhere\n~")
    log_in(page, stack, "alice", "alice-password-1")
    open_form(page, stack, machine)
    # The form says where she may work, and follows the machine picked.
    roots = page.locator("#workspace-roots")
    roots.filter(has_text=f"On {machine.name} you may work inside {tmp}/root.").wait_for()
    page.select_option("#id_machine", str(other.pk))
    roots.filter(has_text=f"On {other.name} you may work inside /srv/elsewhere, ~.").wait_for()
    page.select_option("#id_machine", str(machine.pk))
    roots.filter(has_text=f"On {machine.name} you may work inside {tmp}/root.").wait_for()

    for typed, said in [
        ("..", "'..' is not an absolute path. Give the working directory as an absolute path on"),
        ("../../etc", "'../../etc' is not an absolute path."),
        (f"{tmp}/root/escape",
         f"your working directory must be inside {tmp}/root; {tmp}/root/escape leads to {tmp}/outside, which is not."),
        ("/etc", f"must be inside {tmp}/root; /etc is not."),
    ]:
        page.fill("#id_working_dir", typed)
        page.click("#new-session button[type=submit]")
        page.locator(".errorlist", has_text=said).wait_for()
        assert "/sessions/new/" in page.url
    assert not AgentSession.objects.exists()

    page.fill("#id_working_dir", f"{tmp}/root/project/../project")
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    session = AgentSession.objects.get(owner=alice)
    assert session.working_dir == f"{tmp}/root/project"
    page.locator("code", has_text=f"{tmp}/root/project").first.wait_for()  # the real path is what is shown
    page.wait_for_selector("#status-badge[data-status=idle]")


def test_a_machine_limited_to_a_group_is_hidden_and_a_forged_post_refused(stack, page, fake_machine, alice, bob,
                                                                         tmp_path):
    open_machine = fake_machine()
    gpu = fake_machine()
    Machine.objects.filter(pk__in=[open_machine.pk, gpu.pk]).update(workspace_roots="")
    Machine.objects.filter(pk=gpu.pk).update(name="gpu-box")
    shepherds = Group.objects.create(name="shepherds")
    gpu.allowed_groups.add(shepherds)
    alice.groups.add(shepherds)

    log_in(page, stack, "bob", "bob-password-1")
    open_form(page, stack, open_machine)
    assert page.locator("#id_machine option", has_text="gpu-box").count() == 0
    assert "gpu-box" not in page.content()
    models = page.evaluate(f"fetch('/sessions/models/?machine={gpu.pk}').then(r => r.text())")
    assert "No models found" in models and "Smollm2" not in models
    page.fill("#id_working_dir", str(tmp_path))
    forge_option(page, "#id_machine", str(gpu.pk))
    page.click("#new-session button[type=submit]")
    page.locator(".errorlist", has_text="There is no such machine, or it is not open to you.").wait_for()
    assert not AgentSession.objects.exists()

    page.context.clear_cookies()
    log_in(page, stack, "alice", "alice-password-1")
    open_form(page, stack, open_machine)
    page.select_option("#id_machine", str(gpu.pk))  # htmx loads the picker for it
    page.wait_for_selector(f"#model-picker button[hx-post='/machines/{gpu.pk}/refresh/']", state="attached")
    page.fill("#id_working_dir", str(tmp_path))
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    assert AgentSession.objects.get(owner=alice).machine_id == gpu.pk


def test_bypass_needs_the_permission_and_goes_away_with_it(stack, page, fake_machine, alice, tmp_path):
    machine = fake_machine([{"tool_calls": [{"name": "exec_shell_command", "arguments": '{"command": "ls"}'}]},
                            {"text": "Listed."}])
    log_in(page, stack, "alice", "alice-password-1")
    open_form(page, stack, machine)
    assert page.locator("#id_permission_mode option[value=bypassPermissions]").count() == 0
    page.fill("#id_working_dir", str(tmp_path))
    forge_option(page, "#id_permission_mode", "bypassPermissions")
    page.click("#new-session button[type=submit]")
    page.locator(".errorlist", has_text="You may not turn the permission gate off").wait_for()
    assert not AgentSession.objects.exists()

    grant_bypass(alice)
    open_form(page, stack, machine)
    page.fill("#id_working_dir", str(tmp_path))
    page.select_option("#id_permission_mode", "bypassPermissions")
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    session = AgentSession.objects.get(owner=alice)
    assert session.permission_mode == "bypassPermissions"
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.input_value("#permission-mode") == "bypassPermissions"

    alice.user_permissions.clear()  # an admin takes the permission away
    page.fill("#id_text", "List the files.")
    page.press("#id_text", "Enter")
    row = page.locator(".msg.tool[data-tool=exec_shell_command]")
    row.locator("button", has_text="Allow once").wait_for()  # asked, not run
    page.wait_for_selector("#status-badge[data-status=awaiting_input]")
    page.locator(".transcript", has_text="the permission gate is back on").wait_for()
    wait_for(lambda: page.input_value("#permission-mode") == "manual", 10, what="the select to follow")
    assert not TranscriptEvent.objects.filter(session=session, kind="tool_running").exists()
    assert AgentSession.objects.get(pk=session.pk).permission_mode == "manual"

    page.reload()  # a fresh page: the option is no longer offered, and a forged switch is refused
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.locator("#permission-mode option[value=bypassPermissions]").is_hidden()
    answer = page.evaluate(
        """() => fetch(document.querySelector('#permission-mode').form.getAttribute('hx-post'), {
               method: 'POST', headers: {'HX-Request': 'true', 'Content-Type': 'application/x-www-form-urlencoded',
               'X-CSRFToken': JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRFToken']},
               body: 'permission_mode=bypassPermissions'}).then(r => r.text())"""
    )
    assert "You may not turn the permission gate off" in answer
    assert AgentSession.objects.get(pk=session.pk).permission_mode == "manual"


def test_a_page_whose_login_ended_elsewhere_stops_polling_and_never_shows_the_login_page_inside(
        stack, page, fake_machine, alice, tmp_path):
    """Logging out in another tab closes the page's socket for good (4401); the waiting
    note's every-3-s poll went on, followed the redirect to the login page and swapped the
    whole login page into the session page's status row."""
    from sessions_app.models import AgentSession

    machine = fake_machine([{"text": "hello"}])
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status=AgentSession.Status.IDLE)
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.locator("#waiting-note").count() == 1
    other = page.context.new_page()
    other.goto(stack.base_url + "/")
    other.click("text=Log out")
    other.wait_for_url("**/login/**")
    page.wait_for_selector("#conn-state[data-state=closed]")
    assert page.locator("#waiting-note").count() == 0
    page.wait_for_timeout(4000)  # more than one poll period
    assert page.locator("#id_username").count() == 0  # no login form pasted into the page
