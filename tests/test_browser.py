"""A person in a real browser (Playwright + Debian's Chromium).

Log in, start a session on SmolLM2 from the form, send a message, watch the reply stream
in, reload and find it still there.
"""

from __future__ import annotations

import re
import threading

import pytest
from django.db import connection

from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import wait_for
from .helpers import log_in, open_menu, pick_machine

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def words(text: str) -> list[str]:
    """The words of a text, Markdown punctuation and list numbers aside."""
    return re.findall(r"[A-Za-z']+", text)


def test_it_streams_a_reply_in_the_browser_and_keeps_it_after_reload(stack, page, local_machine, alice, tmp_path):
    log_in(page, stack, "alice", "alice-password-1")

    page.goto(stack.base_url + "/sessions/new/")
    option = page.locator("#id_model_key option", has_text="SmolLM2")
    page.select_option("#id_model_key", value=option.first.get_attribute("value"))
    page.fill("#id_working_dir", str(tmp_path))
    page.fill("#id_max_tokens", "120")
    page.fill("#id_contextSize", "2048")
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    session = AgentSession.objects.get(owner=alice)

    page.wait_for_selector("#status-badge[data-status=idle]", timeout=120_000)
    page.wait_for_selector("#conn-state[data-state=live]")
    page.fill("#id_text", "Write two sentences about sheep.")
    page.press("#id_text", "Enter")

    # While the turn runs, text appears in the streaming block before the turn ends.
    seen_while_streaming = page.wait_for_function(
        """() => {
            const el = document.querySelector('.msg.assistant.streaming .raw');
            return el && el.textContent.trim() ? el.textContent : null;
        }""",
        timeout=60_000,
        polling=20,
    ).json_value()
    assert seen_while_streaming.strip()
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 120, what="turn end")
    page.wait_for_selector(".msg.assistant:not(.streaming) .md")
    page.wait_for_selector("#status-badge[data-status=idle]")
    reply = "".join(
        e.payload["text"] for e in TranscriptEvent.objects.filter(session=session, kind="assistant_text").order_by("seq")
    )
    live_text = page.inner_text(".msg.assistant .md")
    assert words(live_text) and words(live_text) == words(reply)
    assert page.locator(".msg.user", has_text="Write two sentences about sheep.").count() == 1

    page.reload()
    page.wait_for_selector(".msg.assistant .md")
    assert words(page.inner_text(".msg.assistant .md")) == words(reply)
    assert page.locator(".msg.user").count() == 1
    page.screenshot(path=str(stack.data_dir / "browser-after-reload.png"))


def test_a_tool_question_is_answered_with_a_click_and_the_output_appears_in_the_row(
    stack, page, fake_machine, alice, tmp_path
):
    """A tool call asked, approved and run from the page (the model side is the stand-in: a 135M
    model will not call tools)."""
    from sessions_app import actions

    (tmp_path / "flock.txt").write_text("twelve sheep, one goat")
    machine = fake_machine([{"tool_calls": [{"name": "read_file", "arguments": '{"path": "flock.txt"}'}]},
                            {"text": "Twelve sheep and a goat."}])
    created = []

    def create() -> None:  # off the thread where Playwright runs its event loop
        created.append(actions.do_create_session(
            alice, machine=machine, model_key=machine.model_files.first().key, working_dir=str(tmp_path),
            server_params={}, sampling={}, permission_mode="manual",
        ))
        connection.close()

    worker = threading.Thread(target=create)
    worker.start()
    worker.join()
    session = created[0]
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.locator("#tool-list summary", has_text="Tools the model may call (2)").wait_for()  # live, no reload
    page.wait_for_selector("#conn-state[data-state=live]")
    page.fill("#id_text", "Count the flock.")
    page.press("#id_text", "Enter")
    row = page.locator(".msg.tool[data-tool=read_file]")
    row.locator("button", has_text="Allow once").wait_for()
    page.wait_for_selector("#status-badge[data-status=awaiting_input]")
    row.locator("button", has_text="Allow once").click()
    row.locator(".tool-output pre", has_text="twelve sheep, one goat").wait_for()
    assert row.locator(".question").count() == 0
    assert "Allowed once by alice" in row.inner_text()
    page.wait_for_selector(".msg.assistant .md", state="attached")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.screenshot(path=str(stack.data_dir / "browser-tool-row.png"))


def test_queue_withdraw_interrupt_and_switch_model_from_the_page(stack, page, fake_machine, alice, tmp_path):
    """Queue, withdraw, interrupt and a model switch from the page (the model side is the
    stand-in, streaming slowly)."""
    from sessions_app.servers.models import ServerRecord

    slow = " ".join(f"baa{i}" for i in range(80))
    machine = fake_machine([{"text": slow, "delay": 0.2}, {"text": "Hello from the other model."}])
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(stack.base_url + "/sessions/new/")
    pick_machine(page, machine)
    page.wait_for_selector("#id_model_key option >> text=Smollm2", state="attached")
    page.select_option("#id_model_key", machine.model_files.get(architecture="llama").key)
    page.fill("#id_working_dir", str(tmp_path))
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")
    session = AgentSession.objects.get(owner=alice)

    page.fill("#id_text", "Count sheep slowly.")
    page.press("#id_text", "Enter")
    page.wait_for_selector(".msg.assistant.streaming .raw:not(:empty)", state="attached")  # shown as its preview
    page.fill("#id_text", "Then count goats.")
    page.press("#id_text", "Enter")
    bubble = page.locator(".msg.user.pending", has_text="Then count goats.")
    bubble.wait_for()
    bubble.locator("button", has_text="Withdraw").click()
    bubble.wait_for(state="detached")

    page.click("#stop-button")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector(".msg.assistant:not(.streaming) .md")
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 10, what="turn end")
    assert TranscriptEvent.objects.get(session=session, kind="turn_end").payload["reason"] == "interrupted"
    assert not TranscriptEvent.objects.filter(session=session, kind="message_taken", payload__text="Then count goats.")

    old_pid = ServerRecord.objects.get(session=session).pid
    open_menu(page)
    page.click("details.settings summary")
    page.select_option("#switch-model", machine.model_files.get(architecture="gemma3").key)
    page.once("dialog", lambda dialog: dialog.accept())  # the prompt-cache warning
    page.click(".model-switch button[type=submit]")
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).model_key.startswith("gemma"), 10, what="the switch")
    page.wait_for_selector("#status-badge[data-status=idle]")
    wait_for(lambda: ServerRecord.objects.filter(session=session).exclude(pid=old_pid).exists(), 30, what="new server")
    page.locator("#model-name", has_text="Gemma 3 270m").wait_for()  # the header follows the switch live

    page.fill("#id_text", "Hello?")
    page.press("#id_text", "Enter")
    page.locator(".msg.assistant .md", has_text="Hello from the other model.").wait_for()
    page.screenshot(path=str(stack.data_dir / "browser-lifecycle.png"))


def test_a_page_reconnecting_mid_reply_shows_the_stored_text_once_and_the_tail_after_it(
        stack, page, fake_machine, alice, tmp_path):
    """docs/live-page.md: between stored fragments a reply's text shows in its block's
    tail; a page whose socket drops mid-reply empties its tails, catches up from its last
    seq and shows every stored fragment once (C17). The model side is the stand-in: a
    slow, steady reply to drop the socket in the middle of."""
    from sessions_app import actions

    from .conftest import model_key

    reply = " ".join(f"w{i}" for i in range(80))
    machine = fake_machine([{"text": reply, "delay": 0.08}])
    session = actions.do_create_session(alice, machine=machine, model_key=model_key(machine, "llama"),
                                        working_dir=str(tmp_path), server_params={}, sampling={},
                                        permission_mode="manual")
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    # Keep a handle on the page's sockets, to drop one the way a network would.
    page.add_init_script("""(() => {
        const Native = window.WebSocket;
        window.__sockets = [];
        window.WebSocket = function (...args) { const s = new Native(...args); window.__sockets.push(s); return s; };
        window.WebSocket.prototype = Native.prototype;
    })()""")
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "count slowly")

    page.wait_for_function("() => { const t = document.querySelector('.msg.assistant.streaming .raw .tail');"
                           " return t && t.textContent.length > 0; }", timeout=30_000)
    # The session's socket (every page also keeps an attention socket: docs/attention.md).
    page.evaluate("() => window.__sockets.filter(s => s.url.includes('/ws/sessions/')).pop().close()")
    page.wait_for_function("() => { const s = window.__sockets.filter(s => s.url.includes('/ws/sessions/'));"
                           " return s.length === 2 && s[1].readyState === 1; }")
    page.wait_for_selector("#conn-state[data-state=live]")

    def stored_up_to(seq: int) -> str:
        connection.close()  # a fresh read of what the worker committed
        return "".join(e.payload["text"] for e in TranscriptEvent.objects.filter(
            session=session, kind="assistant_text", seq__lte=seq).order_by("seq"))

    checks = 0
    while checks < 5 and not TranscriptEvent.objects.filter(session=session, kind="turn_end").exists():
        shown = page.evaluate("""() => {
            const raw = document.querySelector('.msg.assistant.streaming .raw');
            if (!raw) return null;
            const tail = raw.querySelector('.tail');
            return {seq: Number(document.getElementById('session').dataset.lastSeq),
                    all: raw.textContent, tail: tail ? tail.textContent : ''};
        }""")
        if shown is None:
            break
        stored = stored_up_to(shown["seq"])
        assert shown["all"] == stored + shown["tail"]  # the stored text once, the tail after it
        assert reply.startswith(shown["all"])
        checks += 1
        page.wait_for_timeout(300)
    assert checks >= 2, "the reply ended before the page could be checked mid-reply"
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 60, what="the end")
    page.wait_for_function(f"() => document.querySelector('#a-{TranscriptEvent.objects.filter(session=session, kind='assistant_text').order_by('seq').first().seq} .md')")
    assert words(page.inner_text(".msg.assistant")) == words(reply)
