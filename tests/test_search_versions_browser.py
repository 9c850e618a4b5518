"""In Debian's Chromium: search over what was said, versions of a
reply, math, images and text files, progress, and every page clean under axe-core in
light and dark mode. Screenshots at 1366×900 and 390×844, both modes, are kept in
CORRAL_TEST_ARTEFACTS (default ``data/test-artefacts/``); no test may leave an error on
the browser's console.

axe-core is vendored (tests/vendor/axe-core: npm ``axe-core`` 4.11.4, MPL-2.0, its licence
beside it) and injected into each document by Playwright before the page's own scripts
(an init script: the page's Content-Security-Policy is not loosened for it).
"""

from __future__ import annotations

import re

import pytest

from sessions_app.models import TranscriptEvent

from .helpers import (
    ARTEFACTS,
    SIZES,
    check_views,
    console_errors,
    log_in,
    open_session,
    requests_seen,
    send,
    start_session,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]

def idle(page) -> None:
    page.wait_for_selector("#status-badge[data-status=idle]", timeout=120_000)


# --- 4: search -------------------------------------------------------------------------------


def test_search_finds_a_word_said_and_its_link_opens_the_message(stack, browser_page, fake_machine, alice, bob,
                                                                  tmp_path):
    page = browser_page
    machine = fake_machine([{"text": "Zebras have black and white stripes."}])
    session = start_session(alice, machine, tmp_path, title="Animals")
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    send(page, "Why are zebras striped?")
    page.locator(".msg.assistant:not(.streaming) .md", has_text="stripes").wait_for()
    idle(page)

    page.goto(stack.base_url + "/")
    page.fill("#session-search", "stripes")  # said only in the reply: no title, model or owner has it
    page.wait_for_selector("#said a")
    assert page.locator("#said mark").first.inner_text() == "stripes"
    assert page.locator("#said .said-who").first.inner_text() == "the model"
    assert page.locator("#session-tables", has_text="No sessions yet").count() == 0
    check_views(page, "search")
    page.click("#said a")
    page.wait_for_url(re.compile(rf"/sessions/{session.pk}/\?at=\d+#a-\d+$"))
    anchor = page.url.rsplit("#", 1)[1]
    page.wait_for_selector(f"#{anchor}")
    assert "stripes" in page.inner_text(f"#{anchor}")
    assert page.evaluate(f"() => document.getElementById('{anchor}').getBoundingClientRect().top") < 900

    # bob sees nothing of alice's private session.
    page.context.clear_cookies()
    log_in(page, stack, "bob", "bob-password-1")
    page.goto(stack.base_url + "/?q=stripes")
    assert page.locator("#said").count() == 0
    assert console_errors(page) == []


# --- 5 and 6: versions, math ----------------------------------------------------------------

FIRST = ("Energy is $E=mc^2$; it costs $5 and $10; `$x$` stays code.\n\n"
         "$$\n\\int_0^1 x\\,dx = \\frac{1}{2}\n$$\n\n"
         "```python\n@cache\ndef area(r: float) -> float:\n    return 3.14 * r ** 2  # circle\n```\n\nDone.")


def test_versions_show_as_one_bubble_and_math_renders_while_it_streams(stack, browser_page, fake_machine, alice,
                                                                        tmp_path):
    page = browser_page
    machine = fake_machine([{"text": FIRST, "delay": 0.25}, {"text": "Second version."},
                            {"text": "Third version, edited."}, {"text": "Going on."}])
    session = start_session(alice, machine, tmp_path)
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    assert page.locator("#versions-1").count() == 0  # nothing sent yet
    send(page, "Explain energy.")

    # Math while it streams: the server's MathML in the preview, before the reply ends.
    page.wait_for_selector(".msg.assistant.streaming .preview math", timeout=60_000)
    assert page.locator(".msg.assistant.streaming").count() == 1
    page.screenshot(path=str(ARTEFACTS / "issue25-math-streaming-desktop-light.png"), full_page=True)
    reply = page.locator(".msg.assistant:not(.streaming) .md").first
    reply.wait_for(timeout=120_000)
    idle(page)
    assert reply.locator("math").count() == 2
    assert reply.locator("math[display=block] mfrac").count() == 1
    assert "$5 and $10" in reply.inner_text() and reply.locator("code", has_text="$x$").count() == 1
    assert reply.locator("pre.highlight .nf").inner_text() == "area"
    check_views(page, "math-and-code")

    # Regenerate, then edit: one bubble, "‹ 3/3 ›".
    page.click("#regenerate-button")
    page.locator(".msg.assistant .md", has_text="Second version.").wait_for()
    idle(page)
    page.focus("#id_text")
    page.keyboard.press("ArrowUp")
    page.fill("#id_text", "Explain energy, briefly.")
    page.press("#id_text", "Enter")
    page.locator(".msg.assistant .md", has_text="Third version, edited.").wait_for()
    idle(page)
    visible_users = page.locator("#transcript .msg.user:visible")
    assert visible_users.count() == 1
    assert visible_users.locator(".version-count").inner_text() == "3/3"
    assert page.locator(".msg.assistant .md:visible").count() == 1

    # Back one: version 2 and its reply show, the others hide; every watcher follows (live op).
    visible_users.get_by_role("button", name="Show the previous version").click()
    page.locator("#transcript .msg.user:visible .version-count", has_text="2/3").wait_for()
    page.locator(".msg.assistant .md:visible", has_text="Second version.").wait_for()
    assert page.locator(".msg.assistant .md:visible").count() == 1
    check_views(page, "versions")
    page.reload()  # the first paint says the same
    page.wait_for_selector("#conn-state[data-state=live]")
    assert page.locator("#transcript .msg.user:visible .version-count").inner_text() == "2/3"
    assert page.locator(".msg.assistant .md:visible").inner_text() == "Second version."

    # The conversation goes on from the chosen version.
    send(page, "Go on.")
    page.locator(".msg.assistant .md", has_text="Going on.").wait_for()
    idle(page)
    assert requests_seen(session)[-1]["messages"][-3:] == [
        {"role": "user", "content": "Explain energy."}, {"role": "assistant", "content": "Second version."},
        {"role": "user", "content": "Go on."}]
    kinds = list(TranscriptEvent.objects.filter(session=session).values_list("kind", flat=True))
    assert kinds.count("version_chosen") == 1 and kinds.count("message_taken") == 4
    assert console_errors(page) == []


# --- 7: images and text files -----------------------------------------------------------------

DROP = """([selector, files]) => {
    const transfer = new DataTransfer();
    files.forEach(f => transfer.items.add(new File([f.text], f.name, {type: f.type})));
    const target = document.querySelector(selector);
    target.dispatchEvent(new DragEvent('dragover', {dataTransfer: transfer, bubbles: true, cancelable: true}));
    return target.dispatchEvent(new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
}"""


def test_an_image_dropped_on_a_model_without_vision_is_said_and_text_files_go_as_text(stack, browser_page,
                                                                                     fake_machine, alice, tmp_path):
    page = browser_page
    machine = fake_machine([{"text": "I read your notes."}])
    session = start_session(alice, machine, tmp_path)  # SmolLM2: no vision projector
    log_in(page, stack, "alice", "alice-password-1")
    open_session(page, stack, session)
    assert page.locator("#id_images").count() == 0

    # An image dropped where one types: said there, not lost.
    handled = page.evaluate(DROP, ["#id_text", [{"name": "cat.png", "type": "image/png", "text": "x"}]])
    assert handled is False  # the drop's default (opening the file) was prevented
    error = page.locator("#composer-error")
    error.wait_for()
    assert "cat.png was not attached: this session's model cannot take images." in error.inner_text()
    check_views(page, "image-refused", sizes={"phone": SIZES["phone"]})

    # A text file dropped (on the transcript: it goes to the composer all the same), and one
    # too large picked: the second is refused at once, in words.
    assert page.evaluate(DROP, ["#transcript", [{"name": "notes.md", "type": "text/markdown",
                                                 "text": "# Notes\n\nbuy milk"}]]) is False
    page.locator("#attached-files li", has_text="notes.md").wait_for()
    assert error.is_hidden()
    page.set_input_files("#id_files", files=[
        {"name": "notes.md", "mimeType": "text/markdown", "buffer": b"# Notes\n\nbuy milk"},
        {"name": "huge.log", "mimeType": "text/plain", "buffer": b"x" * 150_000}])
    page.locator("#composer-error", has_text="huge.log is 150 KB; a text file can be at most 100 KB.").wait_for()
    check_views(page, "text-file-refused", sizes={"desktop": SIZES["desktop"]})
    page.click("#send-button")  # sent anyway: the server refuses it in the same words
    page.locator("#attached-files li").first.wait_for(state="detached")  # the composer came back from the server
    page.locator("#composer-error", has_text="huge.log is 150 KB; a text file can be at most 100 KB.").wait_for()
    assert not TranscriptEvent.objects.filter(session=session, kind="message_taken").exists()

    page.set_input_files("#id_files", files=[{"name": "notes.md", "mimeType": "text/markdown",
                                              "buffer": b"# Notes\n\nbuy milk"}])
    send(page, "Summarise my notes.")
    page.locator("#transcript .msg.user", has_text="notes.md:").wait_for(timeout=60_000)
    page.locator(".msg.assistant .md", has_text="I read your notes.").wait_for(timeout=120_000)
    idle(page)
    bubble = page.locator("#transcript .msg.user .body").last
    sent = list(TranscriptEvent.objects.filter(session=session, kind="message_taken").values_list("payload", flat=True))
    assert len(sent) == 1 and sent[0]["text"].endswith("buy milk\n```"), sent
    assert bubble.inner_text() == "Summarise my notes.\n\nnotes.md:\n```markdown\n# Notes\n\nbuy milk\n```"
    assert requests_seen(session)[-1]["messages"][-1]["content"].endswith("```markdown\n# Notes\n\nbuy milk\n```")
    check_views(page, "text-file-sent")
    # The 413-free path: nothing on the console but what this test caused on purpose (none).
    assert console_errors(page) == []


# --- 8: progress ------------------------------------------------------------------------------

WATCH_PROGRESS = """() => {
    window.progressSeen = [];
    new MutationObserver(() => {
        const line = document.getElementById('progress');
        if (line && !line.hidden && line.textContent) window.progressSeen.push(line.textContent);
    }).observe(document.documentElement, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_reading_a_long_conversation_and_writing_the_reply_show_progress(stack, browser_page, local_machine, alice,
                                                                        tmp_path):
    page = browser_page
    session = start_session(alice, local_machine, tmp_path, sampling={"max_tokens": 24, "seed": 1})
    log_in(page, stack, "alice", "alice-password-1")
    # The one real llama-server start of this file, late in a full run: in CI it twice did
    # not show idle within 120 s (never when run alone). A longer wait, and the failure
    # message says where the session stood if it still does not.
    open_session(page, stack, session, wait_s=300)
    page.evaluate(WATCH_PROGRESS)
    long_text = " ".join(f"Fact {n}: the river near town number {n} is wide." for n in range(80)) + " Say OK."
    send(page, long_text)
    page.wait_for_selector(".msg.assistant:not(.streaming) .md", timeout=600_000)
    idle(page)
    seen = page.evaluate("() => window.progressSeen")
    reading = [s for s in seen if s.startswith("reading the conversation:")]
    writing = [s for s in seen if s.startswith("writing the reply:")]
    assert reading and all(re.fullmatch(r"reading the conversation: [\d,]+ / [\d,]+ tokens", s) for s in reading), seen
    total = int(reading[-1].split("/ ")[1].split(" ")[0].replace(",", ""))
    assert total > 800, seen
    assert writing and all(re.fullmatch(r"writing the reply: \d+ tokens?", s) for s in writing), seen
    assert page.locator("#progress").is_hidden()  # gone once the turn ended
    usage = TranscriptEvent.objects.filter(session=session, kind="usage").last().payload
    assert usage["prompt_tokens"] == total
    assert console_errors(page) == []


# --- 9: every page, both modes, axe-core ---------------------------------------------------------


def test_every_page_is_clean_under_axe_in_both_modes(stack, browser_page, fake_machine, alice, tmp_path):
    page = browser_page
    session = start_session(alice, fake_machine([{"text": "Hello **there**."}]), tmp_path, title="Checked")
    page.goto(stack.base_url + "/login/")
    check_views(page, "login")
    log_in(page, stack, "alice", "alice-password-1")
    check_views(page, "list")
    page.goto(stack.base_url + "/?q=nothing-like-this")
    page.wait_for_selector("#no-match")
    check_views(page, "list-no-match")
    page.goto(stack.base_url + "/sessions/new/")
    page.wait_for_selector("#id_machine")
    check_views(page, "new-session")
    open_session(page, stack, session)
    send(page, "Hi.")
    page.locator(".msg.assistant:not(.streaming) .md", has_text="there").wait_for()
    idle(page)
    check_views(page, "session")
    assert console_errors(page) == []
    page.goto(stack.base_url + "/sessions/999999/")  # the styled 404
    page.wait_for_selector("main")
    check_views(page, "not-found")
    assert [e for e in console_errors(page) if "404" not in e] == []  # the 404 itself is the one console line
