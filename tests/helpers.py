"""Small helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import threading
from html.parser import HTMLParser

import httpx
from django.db import connection

from sessions_app import actions, agent
from sessions_app.completions import CompletionClient
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import model_key
from .scripted_server import chunk, sse


def fresh(session) -> AgentSession:
    """The session row as the database holds it now (``session`` may be stale)."""
    return AgentSession.objects.get(pk=session.pk)


def payloads(session, kind: str) -> list[dict]:
    """The payloads of ``session``'s events of ``kind``, in ``seq`` order."""
    return [e.payload for e in TranscriptEvent.objects.filter(session_id=session.pk, kind=kind).order_by("seq")]


# --- the browser (Playwright pages) ---


def log_in(page, stack, username: str, password: str) -> None:
    """Log in through the login page in Playwright's ``page`` and wait for the sessions list."""
    page.set_default_timeout(30_000)
    page.goto(stack.base_url + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(stack.base_url + "/")


def open_menu(page) -> None:
    """Open the session page's Menu (a <details>: Rename, sharing, tool calls, the server
    buttons, downloads, Settings) unless it is open already."""
    if page.get_attribute("#session-menu", "open") is None:
        page.click("#session-menu > summary")


def pick_machine(page, machine) -> None:
    """Choose ``machine`` in the new-session form and wait until htmx has drawn its model
    picker (its own Refresh button). Waiting for a model's option is not enough: the
    machine shown first may list the same model, and a model chosen in that picker is lost
    when this one replaces it (the form then went off with another model)."""
    page.select_option("#id_machine", str(machine.pk))
    page.wait_for_selector(f"#model-picker button[hx-post='/machines/{machine.pk}/refresh/']", state="attached")


def start_session(owner, machine, working_dir, *, key: str | None = None, **fields) -> AgentSession:
    """Create a session (and start its server) off the thread where Playwright runs its loop."""
    created = []

    def create() -> None:
        created.append(actions.do_create_session(
            owner, machine=machine, model_key=key or model_key(machine, "llama"), working_dir=str(working_dir),
            server_params=fields.get("server_params", {}), sampling=fields.get("sampling", {}),
            permission_mode="manual", title=fields.get("title", ""),
        ))
        connection.close()

    worker = threading.Thread(target=create)
    worker.start()
    worker.join()
    return created[0]


def open_session(page, stack, session, *, status: str = "idle") -> None:
    """Open the session page and wait for ``status`` and a live connection."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    try:
        page.wait_for_selector(f"#status-badge[data-status={status}]", timeout=120_000)
    except PlaywrightTimeout:
        # Say where the session stood (a server that never started is told in its events),
        # not only which selector was missing.
        raise AssertionError(f"session {session.pk} never showed {status!r}: {where_it_stands(session)}") from None
    page.wait_for_selector("#conn-state[data-state=live]")


def where_it_stands(session) -> str:
    """The session's status, its server record and its last events, for a failure message."""
    row = fresh(session)
    record = ServerRecord.objects.filter(session_id=session.pk).values("pid", "port", "started_at").first()
    events = TranscriptEvent.objects.filter(session_id=session.pk).order_by("-seq")[:8]
    last = "; ".join(f"{e.kind} {str(e.payload)[:160]}" for e in reversed(events))
    return f"status {row.status!r}, server {record}, last events: {last}"


def send(page, text: str) -> None:
    """Type ``text`` in the message box and press Enter."""
    page.fill("#id_text", text)
    page.press("#id_text", "Enter")


def requests_seen(session) -> list[dict]:
    """The chat requests the stand-in received (it keeps them; it wants the server's key)."""
    record = ServerRecord.objects.get(session=session)
    answer = httpx.get(f"http://127.0.0.1:{record.port}/requests",
                       headers={"Authorization": f"Bearer {record.api_key}"}, timeout=5)
    return answer.json()


# --- the scripted model side (tests/scripted_server.py) ---


def tool_call_reply(*calls: tuple[str, str]) -> list[bytes]:
    """A scripted completion asking for ``calls`` (name, JSON arguments), as SSE frames."""
    pieces = [
        sse(chunk({"tool_calls": [{"index": i, "id": f"call_{name}_{i}", "type": "function",
                                   "function": {"name": name, "arguments": args}}]}))
        for i, (name, args) in enumerate(calls)
    ]
    return [*pieces, sse(chunk({}, finish_reason="tool_calls")), b"data: [DONE]\n\n"]


def text_reply(text: str) -> list[bytes]:
    """A scripted completion answering ``text``, as SSE frames."""
    return [sse(chunk({"content": text})), sse(chunk({}, finish_reason="stop")), b"data: [DONE]\n\n"]


def step(session, model_side):
    """Run one turn step in this process against the scripted model side ``model_side``."""
    agent.run_turn_step(session.pk, client_factory=lambda _url, **kw: CompletionClient(model_side.url, **kw))


def events_of(session, *kinds):
    """``session``'s events (of ``kinds``, when given), in ``seq`` order."""
    qs = TranscriptEvent.objects.filter(session=session).order_by("seq")
    return [e for e in qs if not kinds or e.kind in kinds]


# --- a turn against the scripted server (conftest's ``server`` and ``session``) ---

#: The frame that ends a chat-completions stream.
DONE = b"data: [DONE]\n\n"


def run_message(session, user, text="hello") -> list[TranscriptEvent]:
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, text)
    agent.run_turn_step(session.pk)
    return list(TranscriptEvent.objects.filter(session=session).order_by("seq"))


def text_of(events, kind="assistant_text") -> str:
    return "".join(e.payload["text"] for e in events if e.kind == kind)


# --- the Content-Security-Policy (tests/test_csp.py) ---


class InlineCode(HTMLParser):
    """Collects what a strict CSP would block: inline <script>/<style>, on*= handlers,
    style= attributes, javascript: URLs."""

    def __init__(self, *, nonce_allowed: bool = False) -> None:
        super().__init__()
        self.found: list[str] = []
        self.nonce_allowed = nonce_allowed

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        given = dict(attrs)
        if self.nonce_allowed and given.get("nonce"):
            return  # the admin's own blocks, marked with this response's nonce
        data_block = (given.get("type") or "text/javascript").lower() not in ("text/javascript", "module")
        if tag == "script" and "src" not in given and not data_block:  # JSON data blocks never run
            self.found.append("inline <script>")
        if tag == "style":
            self.found.append("<style> block")
        for name, value in attrs:
            if name.startswith("on"):
                self.found.append(f"{name}= handler")
            if name == "style":
                self.found.append("style= attribute")
            if name in ("href", "src", "action") and (value or "").strip().lower().startswith("javascript:"):
                self.found.append(f"javascript: {name}")


# Runs before any page script, outside the page's CSP (Playwright injects it): records
# every violation the browser reports.
RECORD_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push({directive: e.effectiveDirective, blocked: e.blockedURI, sample: e.sample});
});
"""
