"""What a new team still tripped over, in a real
browser (Playwright + Debian's Chromium) against the real stack (daphne, Celery worker,
Redis) — model names, one compact header, controls that can do nothing, the admin, the
first-run checklist, and the small noise (console errors, odd words).

The real llama-server and the real GGUF files where the point is what they say (names,
the template's abilities); the stand-in (tests/fake_llama_server.py) where a reply must
come on demand. Screenshots at 1366×900 and 390×844, light and dark, are kept in
``$CORRAL_TEST_ARTEFACTS`` (default ``data/test-artefacts/``).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from machines_app import catalog
from machines_app.models import Machine, ModelFile
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import ROOT, fake_server, model_key, wait_for
from .helpers import log_in, open_menu, open_session, pick_machine, send, start_session

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]

ARTEFACTS = Path(os.environ.get("CORRAL_TEST_ARTEFACTS") or ROOT / "data" / "test-artefacts")
WIDE = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}


def shoot(page, name: str, *, schemes=("light", "dark"), full_page: bool = False) -> None:
    """Screenshots of the page as it is now, in each colour scheme, kept as artefacts."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    size = "phone" if page.viewport_size["width"] < 600 else "wide"
    for scheme in schemes:
        page.emulate_media(color_scheme=scheme)
        page.screenshot(path=str(ARTEFACTS / f"issue25-{name}-{size}-{scheme}.png"), full_page=full_page)
    page.emulate_media(color_scheme="light")


def console_errors(page) -> list[str]:
    """Every console error and uncaught page error from now on (the list fills as they come)."""
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    return errors


def header_lines(page) -> list[str]:
    return [line.strip() for line in page.inner_text(".session-head").splitlines() if line.strip()]


# --- 1 and 2: names, the header in words ---------------------------------------------------------


def test_models_are_named_as_people_say_them_and_the_header_says_what_they_are(stack, page, local_machine, alice,
                                                                              tmp_path):
    smol = local_machine.model_files.get(architecture="llama")
    gemma = local_machine.model_files.get(architecture="gemma3")
    # SmolLM2's general.name is the converter's title-casing of a checkpoint directory.
    assert smol.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert smol.display_name == "SmolLM2-135M-Instruct" and gemma.display_name == "Gemma 3 270m"
    session = start_session(alice, local_machine, tmp_path, server_params={"contextSize": 1024},
                            title="Names")
    errors = console_errors(page)
    page.set_viewport_size(WIDE)
    log_in(page, stack, "alice", "alice-password-1")
    assert "SmolLM2-135M-Instruct" in page.inner_text("#sessions-mine")
    assert "Smollm2" not in page.inner_text("#sessions-mine")

    open_session(page, stack, session)
    assert page.inner_text("#model-name") == "SmolLM2-135M-Instruct"
    details = page.locator("#model-details")
    assert not details.locator("ul").is_visible()  # folded: the header stays one line
    details.locator("summary").click()
    said = details.locator("ul").inner_text()
    assert "135M parameters, quantised as Q4_1." in said
    assert "Holds 1,024 tokens of conversation (trained on up to 8,192)." in said
    assert "Reads text only: it cannot see images." in said
    # llama-server's /props for SmolLM2's own template: no tools.
    assert "This model cannot call tools: its chat template takes none." in said
    for jargon in ("✓", "✗", "template:", "system role", "supports_"):
        assert jargon not in page.inner_text(".session-head"), jargon
    assert not [line for line in header_lines(page) if line.startswith("·")]
    shoot(page, "model-details")
    markdown = page.request.get(f"{stack.base_url}/sessions/{session.pk}/export.md").text()
    assert "SmolLM2-135M-Instruct" in markdown

    # Gemma's file has no chat template: its picker and its header say the same.
    open_menu(page)
    page.click("details.settings > summary")
    option = page.locator(f"#switch-model option[value='{gemma.key}']").inner_text()
    assert option.startswith("Gemma 3 270m") and "no chat template" in option
    page.once("dialog", lambda dialog: dialog.accept())
    page.select_option("#switch-model", gemma.key)
    page.click(".model-switch button[type=submit]")
    page.locator("#model-name", has_text="Gemma 3 270m").wait_for()
    page.locator("#model-details li", has_text="Its file has no chat template").wait_for(state="attached",
                                                                                         timeout=120_000)
    page.wait_for_selector("#status-badge[data-status=idle]", timeout=120_000)
    page.click("#session-menu > summary")  # close the menu
    page.click("#model-details summary")
    said = page.locator("#model-details ul").inner_text()
    assert "270M parameters, quantised as Q4_K_M." in said and "system prompt" not in said
    page.set_viewport_size(PHONE)
    shoot(page, "model-details-gemma")
    assert errors == []


def test_one_compact_header_controls_that_can_do_nothing_are_inactive_and_sharing_answers(
        stack, page, fake_machine, alice, tmp_path):
    machine = fake_machine([{"text": "Hello there."},
                            {"text": "A slow reply that goes on for a while " * 6, "delay": 0.3}])
    session = start_session(alice, machine, tmp_path, title="Lambing")
    errors = console_errors(page)
    page.set_viewport_size(PHONE)
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    # Started once, as it should (a refused server_ready payload looked like a lost start).
    assert TranscriptEvent.objects.filter(session=session, kind="server_ready").count() == 1
    assert not TranscriptEvent.objects.filter(session=session, kind="notice").exists()

    # An empty, idle session: nothing to stop, edit or send again.
    for control in ("#stop-button", "#regenerate-button", "#edit-last-button"):
        assert page.is_disabled(control), control
    page.press("#id_text", "Escape")
    page.locator("#composer-feedback", has_text="Nothing is running.").wait_for()
    # Everything but the conversation's own controls is in the menu, folded.
    for control in ("#visibility", "#permission-mode", "#stop-server-button", "#exports"):
        assert not page.is_visible(control), control
    shoot(page, "header-empty")

    send(page, "Hi")
    page.locator(".msg.assistant .md", has_text="Hello there.").wait_for()
    page.wait_for_selector("#status-badge[data-status=idle]")
    # On a phone the conversation starts on the first screen.
    page.evaluate("() => window.scrollTo(0, 0)")
    assert page.locator(".msg.user").first.bounding_box()["y"] < PHONE["height"] / 2
    assert not [line for line in header_lines(page) if line.startswith("·")]
    assert page.is_enabled("#regenerate-button") and page.is_enabled("#edit-last-button")
    assert page.is_disabled("#stop-button")
    shoot(page, "header-after-a-turn")

    # A sharing change answers by its control, and the note is a sentence.
    open_menu(page)
    page.select_option("#visibility", "team_watch")
    page.locator("#sharing-feedback", has_text="Saved: the team can watch this session.").wait_for()
    page.locator(".note", has_text="alice shared the session with the team, to watch.").wait_for()
    assert "visibility →" not in page.inner_text("#transcript")
    shoot(page, "menu-open")
    page.set_viewport_size(WIDE)
    shoot(page, "menu-open")
    page.click("#session-menu > summary")

    # Stop reply is live only while a reply may be under way.
    send(page, "Tell me more.")
    page.wait_for_selector(".msg.assistant.streaming", timeout=30_000)
    assert page.is_enabled("#stop-button")
    page.click("#stop-button")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_function("() => document.getElementById('stop-button').disabled")

    # Stop server, once stopped, is inactive.
    open_menu(page)
    assert page.is_enabled("#stop-server-button")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#stop-server-button")
    page.wait_for_selector("#status-badge[data-status=stopped]")
    page.wait_for_function("() => document.getElementById('stop-server-button').disabled")
    assert page.is_enabled("#restart-button")
    page.reload()
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.is_disabled("#stop-server-button") and page.is_disabled("#stop-button")
    shoot(page, "stopped")
    # Two turns and a stop: no console error (the waiting note's poll aborted one per turn).
    assert errors == []


# --- 12: small noise ------------------------------------------------------------------------------

TABLE = "| sheep | count |\n|:------|------:|\n| ewes | 12 |\n| lambs | 7 |\n\nand a few words more to come"


def test_small_noise_is_gone(stack, page, fake_machine, alice, tmp_path):
    machine = fake_machine([{"text": TABLE, "delay": 0.3}])
    session = start_session(alice, machine, tmp_path, title="Sent while loading")
    errors = console_errors(page)
    page.set_viewport_size(WIDE)
    log_in(page, stack, "alice", "alice-password-1")
    activity = page.locator("#sessions-mine td[data-label='Last activity']").first.inner_text()
    assert activity == "just now" and "0 minutes" not in page.inner_text("#sessions-mine")

    open_session(page, stack, session)
    page.fill("#id_text", "\u200b\u200d\ufeff\u2060")
    page.press("#id_text", "Enter")
    page.locator("#composer-error", has_text="only invisible characters").wait_for()
    assert not TranscriptEvent.objects.filter(session=session, kind="message_taken").exists()

    # An aligned table while it streams: alignment as a class, no style attribute for the
    # CSP to refuse (a console error each time the preview was drawn).
    send(page, "Count them in a table.")
    page.wait_for_selector(".msg.assistant.streaming .preview td.align-right", timeout=30_000)
    assert page.locator(".msg.assistant.streaming .preview [style]").count() == 0
    page.wait_for_selector(".msg.assistant:not(.streaming) .md td.align-right", timeout=30_000)

    open_menu(page)
    page.click("details.settings > summary")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#settings-panel button.danger")
    page.wait_for_url(stack.base_url + "/")
    message = page.locator(".messages li")
    assert message.inner_text() == "Deleted the session “Sent while loading”."
    # In the page's column, not at the window's edge.
    column = page.locator("main").bounding_box()
    box = message.bounding_box()
    assert box["x"] >= column["x"] and box["x"] + box["width"] <= column["x"] + column["width"] + 1
    shoot(page, "deleted")
    assert errors == []


# --- 10: the admin ---------------------------------------------------------------------------------


def damaged_gguf(directory: Path) -> None:
    """A file that starts like a GGUF but whose header no llama.cpp wrote (a truncated copy
    overwritten in place): the bytes after the magic read as version 3394441203."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "broken.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3394441203) + os.urandom(64))


def test_the_admin_speaks_corrals_language_and_reads_a_new_machines_models(stack, page, local_machine, sshd,
                                                                            real_models_dir, llama_server_bin,
                                                                            tmp_path):
    get_user_model().objects.create_superuser("root", password="root-password-1")
    damaged = tmp_path / "damaged-models"
    damaged_gguf(damaged)
    odd = Machine.objects.create(name="odd", models_dir=str(damaged), llama_server_path=llama_server_bin)
    catalog.refresh_models(odd)
    errors = console_errors(page)
    page.set_viewport_size(WIDE)
    log_in(page, stack, "root", "root-password-1")

    page.goto(stack.base_url + "/admin/")
    assert "Corral administration" in page.title() and "Django" not in page.inner_text("body")
    assert "axes" not in page.inner_text("#content-main").lower()
    shoot(page, "admin-index", schemes=("light",))

    page.goto(stack.base_url + "/admin/machines_app/modelfile/")
    table = page.locator("#result_list")
    box = table.bounding_box()
    assert box["x"] + box["width"] <= WIDE["width"], "the model-file table is cut off"
    assert page.evaluate("() => document.documentElement.scrollWidth") <= WIDE["width"]
    # Nor cut off inside its own box (Django's change list scrolls a table too wide for it).
    fits = "() => { const t = document.getElementById('result_list'); return [t.scrollWidth, t.parentElement.clientWidth]; }"
    needed, room = page.evaluate(fits)
    assert needed <= room, f"the model-file table is cut off: {needed} px in {room}"
    assert page.locator("#result_list th", has_text="can start").is_visible()
    text = table.inner_text()
    smol = local_machine.model_files.get(architecture="llama")
    assert str(smol.file_size) not in text and "MB" in text
    assert "not a GGUF file or damaged" in text and "3394441203" in text
    assert "unsupported GGUF version" not in text
    shoot(page, "admin-model-files")

    page.goto(f"{stack.base_url}/admin/machines_app/modelfile/{smol.pk}/change/")
    assert "docs/" not in page.inner_text("#content") and "§" not in page.inner_text("#content")
    assert f"{smol.file_size:,} bytes" in page.inner_text("#content")

    # The local machine: no SSH fields, no link state nothing ever checks.
    page.goto(f"{stack.base_url}/admin/machines_app/machine/{local_machine.pk}/change/")
    for field in ("#id_host", "#id_port", "#id_user", "#id_private_key", "#id_host_key"):
        assert page.locator(field).count() == 0, field
    content = page.inner_text("#content")
    assert "Link state" not in content and "Link checked" not in content
    shoot(page, "admin-local-machine", schemes=("light",))

    # An SSH machine added here has its models read at once: the picker lists them.
    page.goto(stack.base_url + "/admin/machines_app/machine/add/")
    page.fill("#id_name", "gpu-added")
    page.select_option("#id_transport", "ssh")
    page.fill("#id_host", "127.0.0.1")
    page.fill("#id_port", str(sshd.port))
    page.fill("#id_user", sshd.user)
    page.fill("#id_private_key", Path(sshd.client_key).read_text())
    page.fill("#id_models_dir", str(real_models_dir))
    page.fill("#id_llama_server_path", llama_server_bin)
    page.fill("#id_workspace_roots", "")
    page.click("input[name=_save]")
    page.locator(".messagelist", has_text="Reading the model files on gpu-added").wait_for(timeout=120_000)
    added = Machine.objects.get(name="gpu-added")
    wait_for(lambda: ModelFile.objects.filter(machine=added).count() == 2, 120, what="the new machine's models")
    page.goto(stack.base_url + "/sessions/new/")
    pick_machine(page, added)
    assert "SmolLM2-135M-Instruct" in page.inner_text("#id_model_key")
    assert "No models found" not in page.inner_text("#model-picker")
    assert errors == []


# --- 11: first run -------------------------------------------------------------------------------


def test_staff_see_a_first_run_checklist_until_it_is_done(stack, page, real_models_dir, tmp_path):
    get_user_model().objects.create_superuser("root", password="root-password-1")
    machine = Machine.objects.create(name="local", models_dir=str(real_models_dir),
                                     llama_server_path=fake_server(tmp_path), workspace_roots="")
    errors = console_errors(page)
    page.set_viewport_size(WIDE)
    log_in(page, stack, "root", "root-password-1")
    steps = page.locator("#first-run li")
    assert steps.count() == 4 and page.locator("#first-run li.done").count() == 0
    assert [s.strip() for s in page.locator("#first-run li > a").all_inner_texts()] == [
        "Add a member", "Check the machine", "Refresh the models", "Start a session"]
    shoot(page, "first-run")
    page.set_viewport_size(PHONE)
    shoot(page, "first-run")
    page.set_viewport_size(WIDE)

    # Each step, done where the checklist points.
    page.click("#first-run li[data-step=member] a")
    page.fill("#id_username", "alice")
    page.fill("#id_password1", "alice-password-1")
    page.fill("#id_password2", "alice-password-1")
    page.click("input[name=_save]")
    page.goto(stack.base_url + "/")
    page.wait_for_selector("#first-run li.done[data-step=member]")

    page.click("#first-run li[data-step=machine] a")
    page.check(f"input[name=_selected_action][value='{machine.pk}']")
    page.select_option("select[name=action]", "test_connection")
    page.click("button[name=index]")
    page.locator(".messagelist", has_text="always reachable; tools").wait_for()
    page.select_option("select[name=action]", "refresh_models")
    page.check(f"input[name=_selected_action][value='{machine.pk}']")
    page.click("button[name=index]")
    wait_for(lambda: ModelFile.objects.filter(machine=machine).exists(), 60, what="the models to be read")
    page.goto(stack.base_url + "/")
    page.wait_for_selector("#first-run li.done[data-step=machine]")
    page.wait_for_selector("#first-run li.done[data-step=models]")
    shoot(page, "first-run-half")

    start_session(get_user_model().objects.get(username="root"), machine, tmp_path,
                  key=model_key(machine, "llama"))
    page.goto(stack.base_url + "/")
    page.wait_for_selector("#sessions-mine")
    assert page.locator("#first-run").count() == 0
    # Members never see it.
    member = Client()
    member.force_login(get_user_model().objects.get(username="alice"))
    AgentSession.objects.all().delete()
    assert 'id="first-run"' not in member.get("/").content.decode()
    assert errors == []
