"""Content-Security-Policy on every page (docs/deployment.md).

Fast: the header on each kind of response, and no template carrying inline script or
style. Real: in Chromium, a script put into the page does not run, while the session
page still streams over its websocket and answers clicks through htmx, with no CSP
violation on the way.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from machines_app.models import Machine
from sessions_app.models import AgentSession

from .helpers import RECORD_VIOLATIONS, InlineCode

ROOT = Path(__file__).resolve().parent.parent


def _policy(response) -> dict[str, list[str]]:
    header = response.headers["Content-Security-Policy"]
    return {part.split()[0]: part.split()[1:] for part in header.split("; ")}


def _logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _assert_tight(response) -> None:
    policy = _policy(response)
    for directive in ("script-src", "style-src"):
        # 'self', plus the per-response nonce when a template (the admin's) used it.
        assert policy[directive][0] == "'self'" and all(v.startswith("'nonce-") for v in policy[directive][1:])
    assert policy["default-src"] == ["'none'"] and policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["base-uri"] == ["'none'"]
    header = response.headers["Content-Security-Policy"]
    assert "unsafe-inline" not in header and "unsafe-eval" not in header


@pytest.mark.django_db
def test_every_kind_of_response_carries_the_policy(alice, charlie_staff, django_user_model, tmp_path):
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle")
    admin = django_user_model.objects.create_superuser("root", password="root-password-1")
    anonymous, member, staff = Client(), _logged_in(alice), _logged_in(admin)
    responses = {
        "login page": anonymous.get("/login/"),
        "redirect to login": anonymous.get("/"),
        "session list": member.get("/"),
        "new session": member.get("/sessions/new/"),
        "session page": member.get(f"/sessions/{session.pk}/"),
        "htmx fragment": member.get(f"/sessions/models/?machine={machine.pk}", HTTP_HX_REQUEST="true"),
        "no such session": member.get("/sessions/999999/"),
        "admin without the permission": _logged_in(charlie_staff).get(f"/admin/sessions_app/agentsession/{session.pk}/change/"),
        "admin": staff.get("/admin/"),
        "admin list": staff.get("/admin/sessions_app/agentsession/"),
        "admin change form": staff.get(f"/admin/sessions_app/agentsession/{session.pk}/change/"),
        "static file": member.get("/static/corral/session.js"),
        "usage page": member.get("/usage/"),
        "usage page of everyone": staff.get("/usage/?days=30"),
    }
    for what, response in responses.items():
        assert response.status_code in (200, 302, 403, 404), what
        _assert_tight(response)
        if response["Content-Type"].startswith("text/html"):
            parser = InlineCode(nonce_allowed=True)
            parser.feed(response.content.decode())
            assert parser.found == [], what  # what the policy would block, i.e. what would break


@pytest.mark.django_db
def test_the_favicon_is_served_and_every_page_points_to_it(alice):
    """``/favicon.ico`` used to answer 404: a console error on every first visit (browsers
    ask for it on pages without a <link rel="icon">, such as the admin's)."""
    anonymous = Client()
    answer = anonymous.get("/favicon.ico", follow=True)
    assert answer.redirect_chain == [("/static/corral/favicon.svg", 301)]
    assert answer.status_code == 200 and answer["Content-Type"] == "image/svg+xml"
    icon = b"".join(answer.streaming_content)
    assert icon.startswith(b"<svg") and b"<script" not in icon
    for page in (anonymous.get("/login/"), _logged_in(alice).get("/")):
        links = re.findall(r'<link rel="icon" href="([^"]+)"', page.content.decode())
        assert links == ["/static/corral/favicon.svg"]
    assert _policy(answer)["img-src"] == ["'self'"]  # the icon is the page's own: no data: needed


def test_no_template_carries_inline_script_or_style():
    found = {}
    for template in sorted((ROOT / "templates").rglob("*.html")):
        parser = InlineCode()
        parser.feed(re.sub(r"\{#.*?#\}|\{% comment %\}.*?\{% endcomment %\}", "", template.read_text(), flags=re.S))
        if parser.found:
            found[str(template.relative_to(ROOT))] = parser.found
    assert found == {}


# --- the real browser --------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_in_the_browser_injected_script_does_not_run_and_the_session_page_still_works(
    stack, page, fake_machine, alice, tmp_path
):
    from sessions_app import actions

    from .helpers import log_in

    (tmp_path / "flock.txt").write_text("twelve sheep, one goat")
    machine = fake_machine([{"tool_calls": [{"name": "read_file", "arguments": '{"path": "flock.txt"}'}]},
                            {"text": "Twelve sheep and a goat.", "delay": 0.05}])
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

    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.add_init_script(RECORD_VIOLATIONS)
    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")  # the websocket ('self' in connect-src)

    # htmx posts the message; the stream and the question arrive over the websocket; a
    # click on an htmx button answers it; the reply streams in.
    # A message box the user made taller (its resize handle writes an inline height; a
    # browser's autofill may add style="" too): the swap after sending must not copy that
    # style attribute onto the new box, which the CSP blocks and the console reports.
    page.evaluate("document.getElementById('id_text').style.height = '140px'")
    page.fill("#id_text", "Count the flock.")
    page.press("#id_text", "Enter")
    row = page.locator(".msg.tool[data-tool=read_file]")
    row.locator("button", has_text="Allow once").click()
    row.locator(".tool-output pre", has_text="twelve sheep, one goat").wait_for()
    page.locator(".msg.assistant .md", has_text="Twelve sheep and a goat.").wait_for()
    page.wait_for_selector("#status-badge[data-status=idle]")
    assert page.evaluate("window.__csp") == []
    assert not [e for e in console_errors if "Content Security Policy" in e]
    # htmx did not inject its indicator <style> (it would have been blocked and reported).
    assert page.evaluate("document.querySelectorAll('style').length") == 0

    # What a successful HTML injection would add to the page: none of it runs.
    page.evaluate("""() => {
        const s = document.createElement("script");
        s.textContent = "window.__ran_inline = true";
        document.body.appendChild(s);
        document.getElementById("transcript").insertAdjacentHTML("beforeend",
            '<img id="bad-img" src="data:," onerror="window.__ran_handler = true">' +
            '<a id="bad-link" href="javascript:window.__ran_link = true">x</a>' +
            '<p id="bad-style" style="color: rgb(255, 0, 0)">styled</p>');
    }""")
    page.click("#bad-link")
    page.wait_for_function("window.__csp.length >= 3")
    assert page.evaluate("[window.__ran_inline, window.__ran_handler, window.__ran_link]") == [None, None, None]
    assert page.evaluate("getComputedStyle(document.getElementById('bad-style')).color") != "rgb(255, 0, 0)"
    blocked = {v["directive"] for v in page.evaluate("window.__csp")}
    assert {"script-src-elem", "script-src-attr", "style-src-attr"} <= blocked
