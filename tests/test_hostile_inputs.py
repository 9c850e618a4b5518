"""Hostile probes against import, attention, machines, search, metrics,
versions, TeX and text files. Each test states what must hold; a failing one is a finding."""

from __future__ import annotations

import json
import time
from html import unescape

import pytest
from bs4 import BeautifulSoup
from django.test import Client

from attention_app.views import endpoint_refusal
from machines_app.models import Machine
from sessions_app import rules, transcript
from sessions_app.events import load_events, record_event
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import model_key

PRIVATE, WATCH_ONLY, ACT_TOO = AgentSession.Visibility.values


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _file(*lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


MSG = {"seq": 1, "kind": "message_taken", "payload": {"text": "hi", "queued_id": None}}


def _import_form(machine, tmp_path, content: bytes) -> dict:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return {"machine": machine.pk, "model_key": model_key(machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto",
            "transcript": SimpleUploadedFile("s.jsonl", content, content_type="application/x-ndjson")}


def _refusal(client, machine, tmp_path, content) -> str:
    """POST the import; the page (200) with the transcript field's error, or AssertionError."""
    try:
        response = client.post("/sessions/new/", _import_form(machine, tmp_path, content))
    except Exception as exc:  # the test client re-raises a view's exception: a 500 in production
        raise AssertionError(f"the import raised {type(exc).__name__} (a 500), not a refusal naming the line") from exc
    assert response.status_code == 200, response.status_code
    return unescape(response.content.decode())


# --- 1. import ---------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize("depth", [5000, 200_000])
def test_import_deeply_nested_json_line_is_refused_naming_the_line(alice, fake_machine, tmp_path, settings, depth):
    settings.DATA_DIR = str(tmp_path / "data")
    nested = "[" * depth + "]" * depth
    page = _refusal(logged_in(alice), fake_machine(), tmp_path, _file(MSG, nested))
    assert "Line 2" in page
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_nesting_just_under_the_parser_limit_inside_a_dict_field(alice, fake_machine, tmp_path, settings):
    """A tool_start ``input`` nested ~950 deep loads; storing or drawing it must not 500."""
    settings.DATA_DIR = str(tmp_path / "data")
    deep = "{\"a\":" * 950 + "1" + "}" * 950
    start = ('{"seq": 2, "kind": "tool_start", "payload": {"id": "c1", "tool": "read_file", "arguments": "{}", '
             '"input": ' + deep + "}}")
    client = logged_in(alice)
    try:
        response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(MSG, start)))
    except RecursionError as exc:
        raise AssertionError("a 950-deep object in a payload raised RecursionError (500)") from exc
    assert response.status_code in (200, 302)
    if response.status_code == 302:
        session = AgentSession.objects.get(owner=alice)
        assert client.get(f"/sessions/{session.pk}/").status_code == 200
        assert client.get(f"/sessions/{session.pk}/export.jsonl").status_code == 200


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize("line", [
    {**MSG, "payload": {"text": "a\u0000b", "queued_id": None}},           # jsonb refuses \\u0000
    {**MSG, "payload": {"text": "bell\u0007 and esc \u001b[31m", "queued_id": None}},  # a person may not send these
], ids=["NUL", "C0 controls"])
def test_import_text_a_person_could_not_send_is_refused(alice, fake_machine, tmp_path, settings, line):
    """PostgreSQL's jsonb cannot store NUL (a DataError, a 500 there); a message typed here
    refuses control characters (rules._refuse_controls). An import must refuse them, or
    store them as a message sent here would be (events.storable turns NUL into U+FFFD)."""
    settings.DATA_DIR = str(tmp_path / "data")
    client = logged_in(alice)
    response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(line)))
    if response.status_code == 200:
        assert "Line 1" in unescape(response.content.decode()) and not AgentSession.objects.exists()
        return
    session = AgentSession.objects.get(owner=alice)
    texts = [e.payload["text"] for e in load_events(session.pk) if e.kind == "message_taken"]
    for text in texts:
        rules._refuse_controls(text, "The imported message")  # what a person's own message must pass


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_nan_and_infinity_are_refused(alice, fake_machine, tmp_path, settings):
    """``NaN`` is not JSON (RFC 8259); Python reads it, PostgreSQL's jsonb refuses it (500)."""
    settings.DATA_DIR = str(tmp_path / "data")
    line = '{"seq": 2, "kind": "usage", "payload": {"predicted_per_second": NaN, "prompt_per_second": Infinity}}'
    page = _refusal(logged_in(alice), fake_machine(), tmp_path, _file(MSG, line))
    assert "Line 2" in page and not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_a_huge_token_count_cannot_break_metrics_for_everyone(alice, charlie_staff, fake_machine, tmp_path,
                                                                     settings):
    """Any member imports usage with counts beyond 64 bits; /metrics must still answer."""
    settings.DATA_DIR = str(tmp_path / "data")
    lines = [MSG, {"seq": 2, "kind": "usage", "payload": {"prompt_tokens": 10 ** 30, "completion_tokens": 2 ** 63}},
             {"seq": 3, "kind": "usage", "payload": {"prompt_tokens": 2 ** 62, "completion_tokens": 2 ** 62}},
             {"seq": 4, "kind": "usage", "payload": {"prompt_tokens": 2 ** 62, "completion_tokens": 2 ** 62}}]
    response = logged_in(alice).post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(*lines)))
    imported = response.status_code == 302
    try:
        scrape = logged_in(charlie_staff).get("/metrics")
    except Exception as exc:
        raise AssertionError(f"/metrics raised {type(exc).__name__} after an import (imported: {imported})") from exc
    assert scrape.status_code == 200


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_does_not_count_in_metrics_as_turns_that_ran_here(alice, charlie_staff, fake_machine, tmp_path,
                                                                 settings):
    """1000 turn_end events with made-up reasons: no new label per reason, no turns counted."""
    settings.DATA_DIR = str(tmp_path / "data")
    lines = [MSG]
    for n in range(1000):
        lines.append({"seq": len(lines) + 1, "kind": "turn_end", "payload": {"reason": f"reason-{n}"}})
    assert logged_in(alice).post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(*lines))).status_code == 302
    body = logged_in(charlie_staff).get("/metrics").content.decode()
    assert "reason-999" not in body, "imported events add metric labels (cardinality set by any member)"


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize(("lines", "said"), [
    ([MSG, {"seq": 2, "kind": "version_chosen", "payload": {"seq": 3, "by": "x"}}, {**MSG, "seq": 3}],
     "Line 2: the version chosen (seq 3)"),
    ([MSG, {"seq": 2, "kind": "assistant_text", "payload": {"text": "x"}},
      {"seq": 3, "kind": "version_chosen", "payload": {"seq": 2, "by": "x"}}], "Line 3: the version chosen (seq 2)"),
    ([MSG, {"seq": 2, "kind": "allowance_revoked", "payload": {"seq": 1, "tool": "t", "scope": {"kind": "x"}, "by": "x"}}],
     "Line 2: the allowance revoked (seq 1)"),
    ([MSG, {"seq": 2, "kind": "message_taken", "payload": {"text": "x", "queued_id": None, "replaces": 2}}],
     "Line 2: replaces names seq 2"),
    ([MSG, {"seq": 2, "kind": "version_chosen", "payload": {"seq": True, "by": "x"}}], "Line 2"),
    ([{**MSG, "seq": 0}], "Line 1: seq must be 1 or more"),
    ([MSG, {**MSG, "seq": 1}], "Line 2: seq 1 does not follow seq 1"),
    ([MSG, {**MSG, "seq": True}], "Line 2"),
    ([{**MSG, "seq": True}, {**MSG, "seq": 2}], "Line 1"),
    ([MSG, {"seq": 2, "kind": "imported", "payload": {"events": "x", "first_seq": 1}}], "Line 2"),
], ids=["version forward", "version of a reply", "revoke of a message", "replaces itself", "version seq true",
        "seq 0", "seq repeated", "seq true after 1", "seq true first", "imported of wrong shape"])
def test_import_references_pointing_forward_or_at_the_wrong_kind_are_refused(alice, fake_machine, tmp_path,
                                                                             settings, lines, said):
    settings.DATA_DIR = str(tmp_path / "data")
    page = _refusal(logged_in(alice), fake_machine(), tmp_path, _file(*lines))
    assert said in page
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize("content", [
    b"seq,kind,payload\n1,message_taken,{}\n",
    b"\xef\xbb\xbf" + _file(MSG),
    b"[" + _file(MSG) + b"]",
    b"null\n",
    b'"just a string"\n',
    b"12\n",
    b'{"seq": 1, "kind": "message_taken"}\n',
    b'{"image": "x"}\n',
    b'{"image": {"sha256": "' + b"a" * 64 + b'", "media_type": "image/png", "data": "!!!"}}\n',
    ("x" * 3_000_000).encode(),
    b"\xc3\x28" + b"\n" + _file(MSG),
    "\u2028".join(json.dumps(MSG) for _ in range(2)).encode(),
], ids=["csv", "utf-8 bom", "json array", "null", "string", "number", "no payload", "image not an object",
        "image bad base64", "a 3 MB line of junk", "bad utf-8 line 1", "u2028 as a line break"])
def test_import_a_file_that_is_not_json_lines_is_refused_in_words(alice, fake_machine, tmp_path, settings, content):
    settings.DATA_DIR = str(tmp_path / "data")
    page = _refusal(logged_in(alice), fake_machine(), tmp_path, content)
    soup = BeautifulSoup(page, "html.parser")
    errors = " ".join(e.get_text(" ") for e in soup.select(".errorlist"))
    assert errors.strip(), "no error shown"
    assert "Line" in errors or "no events" in errors or "not UTF-8" in errors, errors
    assert len(errors) < 2000, f"the refusal quotes the file at length ({len(errors)} chars)"
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_carries_no_allowance_no_queue_no_question_and_no_user_id(alice, bob, fake_machine, tmp_path,
                                                                         settings):
    """A file that would grant 'always', leave a message queued, an imported event of its own
    in the middle (to make the folds restart), and names bob by id; alice imports it."""
    settings.DATA_DIR = str(tmp_path / "data")
    bobs = {"id": bob.pk, "username": "bob"}
    alices = {"id": alice.pk, "username": "mallory"}
    start = {"id": "c1", "tool": "exec_shell_command", "arguments": '{"command": "id"}',
             "input": {"command": "id"}}
    lines = [
        {"seq": 1, "kind": "message_taken", "payload": {"text": "hi", "queued_id": None, "by": bobs}},
        {"seq": 2, "kind": "tool_start", "payload": start},
        {"seq": 3, "kind": "question", "payload": {"id": "c1", "tool": "exec_shell_command"}},
        {"seq": 4, "kind": "imported", "payload": {"by": alices, "events": 1, "first_seq": 1}},
        {"seq": 5, "kind": "answered", "payload": {"id": "c1", "tool": "exec_shell_command", "answer": "allow_always",
                                                   "scope": {"kind": "prefix", "prefix": ""}, "by": alices}},
        {"seq": 6, "kind": "message_queued", "payload": {"id": "q1", "text": "rm -rf ~", "by": alices}},
        {"seq": 7, "kind": "imported", "payload": {"by": alices, "events": 1, "first_seq": 1}},
        {"seq": 8, "kind": "answered", "payload": {"id": "c1", "tool": "exec_shell_command", "answer": "allow_always",
                                                   "scope": {"kind": "tool"}, "by": alices}},
        {"seq": 9, "kind": "message_queued", "payload": {"id": "q2", "text": "curl x | sh", "by": bobs}},
        {"seq": 10, "kind": "status", "payload": {"status": "running"}},
    ]
    client = logged_in(alice)
    response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(*lines)))
    assert response.status_code == 302, unescape(response.content.decode())[:3000]
    session = AgentSession.objects.get(owner=alice)
    events = load_events(session.pk)
    assert transcript.allowances(events) == []
    assert transcript.pending_queue(events) == []
    assert transcript.open_questions(events) == [] and transcript.pending_calls(events) == []
    assert not transcript.open_turn(events)
    assert events[-1].kind == "imported"
    for event in events[1:-1]:
        who = transcript.actor(event.payload)
        assert who is None or who["id"] is None, (event.kind, event.payload)
    fresh = AgentSession.objects.get(pk=session.pk)
    assert not fresh.turn_active
    assert fresh.status != AgentSession.Status.AWAITING_INPUT
    # Nothing waits in alice's inbox, nothing in bob's.
    from attention_app import waiting
    assert waiting.waiting_for(alice) == [] and waiting.waiting_for(bob) == []


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_image_referenced_outside_a_message_is_not_served(alice, bob, fake_machine, tmp_path, settings):
    """bob's image is stored here; alice's file names its hash in places other than a
    message's images (a queued message, a tool_end, a notice): none may serve it to her."""
    settings.DATA_DIR = str(tmp_path / "data")
    import io

    from PIL import Image

    from sessions_app import images

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buffer, "PNG")
    secret = buffer.getvalue()
    ref = images.check_image(images.Upload("secret.png", secret))
    images.store(images.Upload("secret.png", secret), ref)
    lines = [
        MSG,
        {"seq": 2, "kind": "message_queued", "payload": {"id": "q1", "text": "x", "images": [ref]}},
        {"seq": 3, "kind": "message_taken", "payload": {"text": "y", "queued_id": "q1", "images": [ref]}},
    ]
    client = logged_in(alice)
    response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(*lines)))
    assert response.status_code in (200, 302)
    for session in AgentSession.objects.filter(owner=alice):
        assert client.get(f"/sessions/{session.pk}/images/{ref['sha256']}.png").status_code == 404


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_nothing_runs_after_import(alice, fake_machine, tmp_path, settings, monkeypatch,
                                          django_capture_on_commit_callbacks):
    """The import enqueues a server start at most: never a turn step, and no turn is open."""
    settings.DATA_DIR = str(tmp_path / "data")
    from sessions_app import dispatch

    sent = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append(task) or True)
    lines = [MSG, {"seq": 2, "kind": "message_queued", "payload": {"id": "q1", "text": "run id"}}]
    with django_capture_on_commit_callbacks(execute=True):
        response = logged_in(alice).post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(*lines)))
    assert response.status_code == 302
    assert all("turn" not in str(task).lower() for task in sent), sent
    session = AgentSession.objects.get(owner=alice)
    assert not session.turn_active
    assert transcript.pending_queue(load_events(session.pk)) == []


# --- 2. attention -------------------------------------------------------------------------------


@pytest.fixture
def plain_machine(db, tmp_path):
    return Machine.objects.create(name="m1", models_dir=str(tmp_path))


def _session(owner, machine, visibility=PRIVATE, title="Secret plans"):
    return AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir="/tmp",
                                       status="awaiting_input", title=title, visibility=visibility, turn_active=True)


def _ask(session, call_id, command):
    from sessions_app import callcard

    arguments = json.dumps({"command": command})
    record_event(session.pk, "tool_start", {"id": call_id, "tool": "exec_shell_command", "arguments": arguments,
                                            **callcard.recorded("exec_shell_command", arguments),
                                            "origin": "machine", "display_name": "Shell"})
    record_event(session.pk, "question", {"id": call_id, "tool": "exec_shell_command",
                                          "offers": [{"scope": {"kind": "exact", "command": command}}]})


@pytest.mark.django_db
@pytest.mark.parametrize("visibility", [PRIVATE, WATCH_ONLY])
def test_attention_bob_cannot_see_or_answer_alices_question(alice, bob, plain_machine, visibility):
    session = _session(alice, plain_machine, visibility)
    _ask(session, "call_secret", "cat /home/alice/TOPSECRET-token")
    client = logged_in(bob)
    for url in ("/inbox/", "/inbox/entries/", "/notifications/", "/"):
        body = client.get(url).content.decode()
        assert "TOPSECRET" not in body, url
    for answer in ("allow_once", "allow_always", "refuse"):
        response = client.post(f"/sessions/{session.pk}/calls/call_secret/answer/", {"answer": answer},
                               HTTP_HX_REQUEST="true")
        assert response.status_code in (403, 404)
        assert "TOPSECRET" not in response.content.decode()
    assert not TranscriptEvent.objects.filter(session=session, kind="answered").exists()


@pytest.mark.parametrize("endpoint", [
    "https://127.0.0.1/x", "https://[::1]/x", "https://localhost/x", "https://10.0.0.5/x", "http://push.example.com/x",
    "https://[::ffff:127.0.0.1]/x", "https://[::ffff:7f00:1]/x", "https://0.0.0.0/x", "https://[::]/x",
    "https://2130706433/x", "https://0x7f000001/x", "https://127.1/x", "https://0177.0.0.1/x", "https://017700000001/x",
    "https://localhost./x", "https://LOCALHOST/x", "https://foo.localhost/x", "https://169.254.169.254/x",
    "https://[fe80::1%25eth0]/x", "https://100.64.0.1/x", "https://[fd00::1]/x", "https://user@127.0.0.1/x",
    # Names that resolve to 127.0.0.1 (127.0.0.1.nip.io, localtest.me) are refused by the same
    # resolution, but this box has no DNS: not probed here.
])
def test_push_endpoint_pointing_inside_is_refused(endpoint):
    assert endpoint_refusal(endpoint), f"{endpoint} accepted"


# --- 3. machines page ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_machines_stop_is_refused_to_non_staff_and_to_a_forged_cross_site_post(alice, bob, charlie_staff,
                                                                              plain_machine, monkeypatch):
    from sessions_app import dispatch

    sent = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)) or True)
    session = _session(alice, plain_machine)
    assert logged_in(bob).post(f"/machines/servers/{session.pk}/stop/").status_code in (403, 404)
    assert logged_in(alice).post(f"/machines/servers/{session.pk}/stop/").status_code in (403, 404)
    forged = Client(enforce_csrf_checks=True)
    forged.force_login(charlie_staff)
    assert forged.post(f"/machines/servers/{session.pk}/stop/").status_code == 403
    assert forged.get(f"/machines/servers/{session.pk}/stop/").status_code == 405
    admin = Client(enforce_csrf_checks=True)
    admin.force_login(charlie_staff)
    assert admin.post(f"/admin/machines_app/machine/{plain_machine.pk}/stop-unrecorded/",
                      {"process": f"{__import__('os').getpid()}:1"}).status_code == 403
    assert sent == []


@pytest.mark.django_db
def test_machines_stop_unrecorded_never_stops_a_process_that_is_not_a_corral_server(charlie_staff, plain_machine):
    """A crafted POST naming this test's own pid (and its real start time) stops nothing."""
    import os

    from machines_app.transports import LocalTransport

    me = os.getpid()
    start = LocalTransport()._stat(me)[1]
    client = logged_in(charlie_staff)
    response = client.post(f"/admin/machines_app/machine/{plain_machine.pk}/stop-unrecorded/",
                           {"process": f"{me}:{start}"})
    assert response.status_code in (302, 403)
    # Still alive (we are running).
    os.kill(me, 0)


@pytest.mark.django_db
def test_machines_page_does_not_name_private_sessions_of_others(alice, bob, plain_machine):
    from sessions_app.servers.models import ServerRecord

    session = _session(alice, plain_machine, title="TOPSECRET project")
    ServerRecord.objects.create(session=session, machine=plain_machine, model_key="m.gguf", pid=1, start_time="1",
                                port=1, log_path="/dev/null", api_key="k")
    body = logged_in(bob).get("/machines/").content.decode()
    assert "TOPSECRET" not in body
    assert f"/sessions/{session.pk}/" not in body


# --- 4. search -------------------------------------------------------------------------------------


def _say(session, text):
    record_event(session.pk, "message_taken", {"text": text, "queued_id": None})
    record_event(session.pk, "assistant_text", {"text": "reply " + text})
    record_event(session.pk, "turn_end", {"reason": "done"})


@pytest.mark.django_db
def test_search_finds_nothing_of_a_private_or_unshared_session(alice, bob, plain_machine):
    private = _session(alice, plain_machine, PRIVATE)
    shared = _session(alice, plain_machine, WATCH_ONLY)
    _say(private, "zebracorn private")
    _say(shared, "zebracorn shared")
    client = logged_in(bob)
    text = BeautifulSoup(client.get("/", {"q": "zebracorn"}).content, "html.parser").get_text()
    assert "zebracorn shared" in text
    assert "zebracorn private" not in text
    AgentSession.objects.filter(pk=shared.pk).update(visibility=PRIVATE)  # the share revoked
    text = BeautifulSoup(client.get("/", {"q": "zebracorn"}).content, "html.parser").get_text()
    assert "zebracorn shared" not in text, "a revoked share's passage is still found"


@pytest.mark.django_db
@pytest.mark.parametrize("query", [
    '"', '""', "'", 'text:zebra', 'zebra*', '*', 'NEAR(zebra corn)', 'zebra AND', 'OR', 'NOT zebra', '^zebra',
    '(zebra', 'zebra)', '-zebra', '+', '{text}: zebra', 'session_id:1', 'rowid:1', '\x00', '\ud800' if False else '\u0000zebra',
    "zebra " * 200, "a" * 5000, "é" * 300, "🦓" * 100, "<script>alert(1)</script>",
])
def test_search_syntax_and_long_queries_never_500(alice, plain_machine, query):
    session = _session(alice, plain_machine)
    _say(session, "zebra corn")
    response = logged_in(alice).get("/", {"q": query})
    assert response.status_code == 200
    assert "<script>alert(1)" not in response.content.decode()


@pytest.mark.django_db
def test_search_indexing_a_long_streamed_reply_is_not_quadratic(alice, plain_machine):
    """A reply streamed as 3000 fragments (a ~12 KB answer): the first search after it
    must not take seconds (each fragment rewrites the whole passage and its FTS row)."""
    session = _session(alice, plain_machine)
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from sessions_app.events import append, locked

    with transaction.atomic():
        locked_session = locked(session.pk)
        append(locked_session, "message_taken", {"text": "tell me", "queued_id": None})
        for n in range(3000):
            append(locked_session, "assistant_text", {"text": f"w{n % 10} "})
    from search_app.search import find

    # One write for the passage, not one per fragment (speed is bench/'s, not a timed test).
    with CaptureQueriesContext(connection) as queries:
        found = find(AgentSession.objects.visible_to(alice), "w3")
    assert found
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len(writes) < 10, f"{len(writes)} UPDATEs to index one 3000-fragment reply"


# --- 5. metrics ------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("token", [""])  # a blank CORRAL_METRICS_TOKEN is read as unset (project/env.py)
@pytest.mark.parametrize("header", ["", "Bearer ", "Bearer  ", "Bearer    ", "bearer ", "Bearer", " "])
def test_metrics_blank_token_never_opens(settings, token, header):
    settings.CORRAL_METRICS_TOKEN = token
    response = Client().get("/metrics", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401, (token, header)


@pytest.mark.django_db
def test_metrics_token_variants(settings, alice):
    settings.CORRAL_METRICS_TOKEN = "s3cret"
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200
    for header in ("Bearer s3cret ", "Bearer S3CRET", "Basic s3cret", "s3cret", "Bearer s3cre", "Bearer s3cretX"):
        assert Client().get("/metrics", HTTP_AUTHORIZATION=header).status_code == 401, header
    assert Client().get("/metrics", {"token": "s3cret"}).status_code == 401
    assert logged_in(alice).get("/metrics").status_code == 401  # a member, not staff


@pytest.mark.django_db
def test_metrics_scrape_cost_on_many_events(settings, alice, plain_machine):
    """20,000 streamed fragments in the last hour: one scrape stays well under a second or two."""
    settings.CORRAL_METRICS_TOKEN = "t"
    session = _session(alice, plain_machine)
    TranscriptEvent.objects.bulk_create([
        TranscriptEvent(session=session, seq=n + 1, kind="assistant_text" if n % 50 else "message_taken",
                        payload={"text": "x" * 20} if n % 50 else {"text": "q", "queued_id": None})
        for n in range(20_000)
    ])
    # Speed is for bench/, not a timed assertion: the scrape answers, its counts right.
    body = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    assert 'corral_sessions{status="idle"}' in body or "corral_sessions{" in body


# --- 6. versions -------------------------------------------------------------------------------------


def _versions_session(owner, machine, visibility=PRIVATE):
    session = _session(owner, machine, visibility)
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False, status="idle")
    record_event(session.pk, "message_taken", {"text": "a poem", "queued_id": None})
    record_event(session.pk, "assistant_text", {"text": "Roses."})
    record_event(session.pk, "turn_end", {"reason": "done"})
    first = session.__class__.objects.get(pk=session.pk).last_seq - 2
    record_event(session.pk, "message_taken", {"text": "a poem", "queued_id": None, "replaces": first})
    record_event(session.pk, "assistant_text", {"text": "Violets."})
    record_event(session.pk, "turn_end", {"reason": "done"})
    return AgentSession.objects.get(pk=session.pk), first


@pytest.mark.django_db
def test_versions_watcher_stranger_and_other_sessions_seq(alice, bob, plain_machine):
    watched, first = _versions_session(alice, plain_machine, WATCH_ONLY)
    private, private_first = _versions_session(alice, plain_machine, PRIVATE)
    mine, _ = _versions_session(bob, plain_machine, PRIVATE)
    client = logged_in(bob)
    assert client.post(f"/sessions/{watched.pk}/version/", {"seq": first}).status_code == 403
    assert client.post(f"/sessions/{private.pk}/version/", {"seq": private_first}).status_code in (403, 404)
    # Odd seqs posted to bob's own session: refused, nothing recorded (seqs are per session,
    # so "another session's message" cannot even be named).
    for seq in (str(10 ** 30), "-1", "1e3", "\u0663", "", " 1", "0x1", "99"):
        client.post(f"/sessions/{mine.pk}/version/", {"seq": seq})
    assert not TranscriptEvent.objects.filter(kind="version_chosen").exists()


@pytest.mark.django_db
def test_versions_choice_refused_while_a_turn_runs_and_before_a_clear(alice, plain_machine):
    session, first = _versions_session(alice, plain_machine)
    client = logged_in(alice)
    AgentSession.objects.filter(pk=session.pk).update(turn_active=True)
    client.post(f"/sessions/{session.pk}/version/", {"seq": first})
    assert not TranscriptEvent.objects.filter(kind="version_chosen").exists()
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False)
    record_event(session.pk, "cleared", {"by": "alice"})
    client.post(f"/sessions/{session.pk}/version/", {"seq": first})
    assert not TranscriptEvent.objects.filter(kind="version_chosen").exists()


# --- 7. TeX and the sanitiser -------------------------------------------------------------------------

XSS = [
    r"$\href{javascript:alert(1)}{x}$",
    r"$\href{https://evil.example}{x}$",
    r"$\style{background:url(javascript:alert(1))}{x}$",
    r"$\class{x}{y}$",
    r"$\text{<img src=x onerror=alert(1)>}$",
    r"$\text{</mtext><mglyph><style><img src=x onerror=alert(1)>}$",
    r"$\mathrm{<script>alert(1)</script>}$",
    r"$\text{&lt;img src=x onerror=alert(1)&gt;}$",
    r"$\operatorname{<a href=javascript:alert(1)>x</a>}$",
    r"$$\begin{array}{c} \text{<iframe srcdoc=x>} \end{array}$$",
    r"$\mathcolor{red}{x}$",
    r"$\unicode{x3c}script\unicode{x3e}$",
    "$\\text{\"><svg onload=alert(1)>}$",
    r"$\xlink:href{javascript:alert(1)}$",
    r"$\maction{x}$",
    r"$\annotation-xml{<img src=x onerror=alert(1)>}$",
    "<math><annotation-xml encoding=\"text/html\"><img src=x onerror=alert(1)></annotation-xml></math>",
    "<math><mi xlink:href=\"javascript:alert(1)\">x</mi></math>",
    "<math><maction actiontype=\"statusline\" href=\"javascript:alert(1)\">x</maction></math>",
]


def _reparse_dangerous(html: str) -> list[str]:
    """What a browser would find after parsing ``html`` (html.parser)."""
    soup = BeautifulSoup(html, "html.parser")
    bad = []
    for element in soup.find_all(True):
        if element.name in ("script", "img", "iframe", "svg", "style", "object", "embed", "mglyph",
                            "annotation-xml", "maction", "form", "input", "link", "meta", "base"):
            bad.append(element.name)
        for attribute, value in element.attrs.items():
            text = " ".join(value) if isinstance(value, list) else str(value)
            if attribute.lower().startswith("on") or "href" in attribute.lower() and element.name != "a" \
                    or attribute.lower() in ("style", "src", "srcdoc", "formaction") or "javascript:" in text.lower():
                bad.append(f"{element.name}[{attribute}={text!r}]")
    return bad


@pytest.mark.parametrize("text", XSS)
def test_tex_mathml_carries_no_script_no_link_no_style(text):
    from sessions_app.live.markdown import formula_html, render_markdown, reply_formulas

    html = render_markdown(text)
    assert _reparse_dangerous(html) == [], html
    for tex, display in reply_formulas(text):
        out = formula_html(tex, display)
        assert _reparse_dangerous(out) == [], out


@pytest.mark.parametrize("text", [
    "$" + "\\frac{" * 600 + "x" + "}{y}" * 600 + "$",
    "$" + "{" * 2000 + "x" + "}" * 2000 + "$",
    "$" + "\\sqrt{" * 700 + "x" + "}" * 700 + "$",
    "$" + "x^" * 1999 + "x$",
    "$" + "\\left(" * 800 + "x" + "\\right)" * 800 + "$",
    "$$\\begin{matrix}" + "a&" * 1990 + "a\\end{matrix}$$",
    " ".join(f"$x_{{{n}}}^{{{n}}}$" for n in range(3000)),
    "$$\n" + "x\n" * 20000,
    "\n".join("> $$" for _ in range(5000)),
    "$a " * 30000,
    ("$" + "\\\\" * 5000) * 10,
])
def test_tex_pathological_formulas_render_fast(text):
    """Each input ends: rendered, its formulas listed, none raising. How fast is bench/'s
    to measure; the bound here is only a guard against a blowup — far above what these take
    on a loaded box (a few seconds at most), far below what super-linear work on inputs of
    tens of thousands of characters would take (many minutes)."""
    from sessions_app.live.markdown import render_markdown, reply_formulas

    started = time.monotonic()
    assert render_markdown(text)
    assert isinstance(reply_formulas(text), list)
    took = time.monotonic() - started
    assert took < BLOWUP_GUARD, f"{took:.1f}s"


#: Seconds past which rendering one pathological input counts as a blowup (a guard, not a
#: speed bound; see test_tex_pathological_formulas_render_fast).
BLOWUP_GUARD = 60.0


# --- 8. text-file attachments --------------------------------------------------------------------


@pytest.fixture
def send_session(alice, plain_machine, monkeypatch):
    from sessions_app import dispatch

    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: True)
    session = _session(alice, plain_machine)
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False, status="idle")
    return AgentSession.objects.get(pk=session.pk)


def _send(client, session, files, text="see attached"):
    from django.core.files.uploadedfile import SimpleUploadedFile

    uploads = [SimpleUploadedFile(name, data, content_type="text/plain") for name, data in files]
    return client.post(f"/sessions/{session.pk}/send/", {"text": text, "files": uploads}, HTTP_HX_REQUEST="true")


def _sent_texts(session):
    return [e.payload["text"] for e in TranscriptEvent.objects.filter(session=session,
                                                                       kind__in=["message_taken", "message_queued"])]


@pytest.mark.django_db
def test_text_files_each_under_the_limit_but_too_long_together_are_refused_naming_them(alice, send_session, settings):
    """The composer says 'up to 100 KB each': three of 90 KB are too long together."""
    client = logged_in(alice)
    each = settings.CORRAL_TEXT_FILE_MAX_BYTES - 10_000
    response = _send(client, send_session, [(f"f{n}.log", b"a" * each) for n in range(3)])
    # Three files of 90 KB are more than a message may be: refused naming them and the limit
    # (the composer says "… characters in all with the message").
    page = unescape(response.content.decode())
    assert not _sent_texts(send_session)
    assert "f0.log, f1.log, f2.log" in page and "at most 200,000" in page, page[-600:]


@pytest.mark.django_db
def test_text_files_a_log_with_c1_controls_is_refused_naming_the_file_or_cleaned(alice, send_session):
    client = logged_in(alice)
    response = _send(client, send_session, [("build.log", "line one\u0085line two\u009b31m\n".encode())])
    page = unescape(response.content.decode())
    texts = _sent_texts(send_session)
    assert texts or "build.log" in page, page[-600:]


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "data"), [
    ("../../etc/passwd", b"x"),
    ("..\\..\\win.ini", b"x"),
    ("<img src=x onerror=alert(1)>.txt", b"x"),
    ("a\u202etxt.sh", b"x"),
    ("bin.dat", bytes(range(256))),
    ("big.txt", b"a" * 100_001),
    ("utf16.txt", "hello".encode("utf-16")),
    ("nul.txt", b"a\x00b"),
])
def test_text_files_hostile_names_and_contents(alice, send_session, name, data):
    client = logged_in(alice)
    response = _send(client, send_session, [(name, data)])
    assert response.status_code == 200
    page = response.content.decode()
    assert "<img src=x" not in page
    for text in _sent_texts(send_session):
        assert "/etc/" not in text.split("\n", 3)[2] if text.count("\n") > 2 else True
        assert "../" not in text and "..\\" not in text.split(":\n")[0]
        assert "\x00" not in text
    detail = client.get(f"/sessions/{send_session.pk}/").content.decode()
    assert "<img src=x onerror" not in detail



@pytest.mark.django_db
def test_push_subscribe_view_stores_a_loopback_endpoint_in_disguise(alice):
    """End to end: the subscribe view keeps an endpoint that getaddrinfo resolves to 127.0.0.1."""
    import socket

    client = logged_in(alice)
    stored = []
    for endpoint in ("https://2130706433:8000/admin", "https://127.1:6379/", "https://localhost.:5432/"):
        body = json.dumps({"endpoint": endpoint, "keys": {"p256dh": "BPk", "auth": "x"}})
        if client.post("/notifications/subscribe/", body, content_type="application/json").status_code == 200:
            host = endpoint.split("//")[1].split(":")[0]
            try:
                resolved = socket.getaddrinfo(host, 443)[0][4][0]
            except OSError:
                resolved = "?"
            stored.append(f"{endpoint} -> {resolved}")
    assert stored == [], f"kept, and Corral's worker would POST to: {stored}"


@pytest.mark.django_db(transaction=True)
def test_attention_socket_never_names_a_private_question_to_another_member(alice, bob, db):
    from asgiref.sync import async_to_sync
    from channels.db import database_sync_to_async
    from channels.testing import WebsocketCommunicator

    from project.asgi import application

    machine = Machine.objects.create(name="ws-m", models_dir="/tmp")
    private = _session(alice, machine, PRIVATE)
    watched = _session(alice, machine, WATCH_ONLY)
    client = logged_in(bob)
    socket = WebsocketCommunicator(application, "/ws/attention/", headers=[
        (b"host", b"127.0.0.1"), (b"origin", b"http://127.0.0.1"),
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())])

    async def scenario() -> list:
        connected, _ = await socket.connect()
        assert connected
        frames = [await socket.receive_json_from(5)]
        await database_sync_to_async(_ask)(private, "c1", "cat TOPSECRET")
        await database_sync_to_async(_ask)(watched, "c2", "cat TOPSECRET2")
        for _ in range(10):
            if await socket.receive_nothing(1.5):
                break
            frames.append(await socket.receive_json_from(2))
        await socket.disconnect()
        return frames

    frames = async_to_sync(scenario)()
    assert "TOPSECRET" not in json.dumps(frames)
    assert all(f.get("attention", {}).get("count", 0) == 0 for f in frames)


_START = {"id": "c1", "tool": "exec_shell_command", "arguments": '{"command": "ls"}', "input": {"command": "ls"}}
_ODD = [7, "x", [1], {"a": 1}, None, [{"kind": 5}], True, -1]


def _fuzz_cases():
    cases = []
    for key in ("arguments_error", "display_name", "duplicate_keys", "file_before", "origin", "server", "writes"):
        for value in _ODD:
            cases.append((f"tool_start.{key}={value!r}", [{"seq": 2, "kind": "tool_start", "payload": {**_START, key: value}}]))
    for value in ({"command": 5}, {"command": ["rm", "-rf"]}, {"path": []}, {"command": "x" * 300_000}, {}):
        cases.append((f"tool_start.input={str(value)[:30]}", [{"seq": 2, "kind": "tool_start", "payload": {**_START, "input": value}}]))
    for key in ("changed", "claims", "offers"):
        for value in _ODD + [[{"scope": 5}], [{"scope": {"kind": "prefix", "prefix": 5}}]]:
            cases.append((f"question.{key}={value!r}", [{"seq": 2, "kind": "tool_start", "payload": _START},
                                                      {"seq": 3, "kind": "question", "payload": {"id": "c1", "tool": "t", key: value}}]))
    for scope in ({"kind": 5}, {"kind": "exact", "command": 5}, {}, {"kind": "mcp", "server": [], "remote_name": {}},
                  {"kind": "path", "path": None}):
        for answer in ("allow_always", "allow_once", "weird"):
            cases.append((f"answered.scope={scope}/{answer}", [
                {"seq": 2, "kind": "tool_start", "payload": _START},
                {"seq": 3, "kind": "answered", "payload": {"id": "c1", "tool": "t", "answer": answer, "scope": scope,
                                                           "reason": 5}}]))
    for key, values in (("sampling", [{"temperature": "hot"}, {"temperature": [1]}, {"x": {"y": []}}]),
                        ("server_params", [{"contextSize": "x"}, {"a": None}]),
                        ("permission_mode", ["bypass", "<b>x</b>"]), ("visibility", ["team_act", "public"]),
                        ("model", ["<script>alert(1)</script>"]), ("takes_images", [True]),
                        ("title", ["<img src=x onerror=alert(1)>", "x" * 10_000])):
        for value in values:
            cases.append((f"settings.{key}={str(value)[:20]}", [{"seq": 2, "kind": "settings", "payload": {key: value}}]))
    for key in ("draft_n", "draft_n_accepted"):
        for value in _ODD:
            cases.append((f"usage.{key}={value!r}", [{"seq": 2, "kind": "usage", "payload": {key: value}}]))
    for value in ({"x": []}, {"temperature": "x"}):
        cases.append((f"usage.sampling={value}", [{"seq": 2, "kind": "usage", "payload": {"sampling": value,
                                                                                           "sampling_from": value}}]))
    for value in _ODD:
        cases.append((f"server_ready.model_facts={value!r}", [{"seq": 2, "kind": "server_ready",
                                                              "payload": {"model": "M", "model_key": "k", "model_facts": value}}]))
        cases.append((f"status.reason={value!r}", [{"seq": 2, "kind": "status", "payload": {"status": "idle", "reason": value}}]))
    for tools in ([1, "x"], [{"name": 5}], [{"name": "t", "parameters": []}]):
        cases.append((f"catalogue.tools={tools}", [{"seq": 2, "kind": "catalogue", "payload": {"tools": tools}}]))
    cases.append(("error.log=list", [{"seq": 2, "kind": "error", "payload": {"message": "m", "log": "x" * 1_000_000}}]))
    cases.append(("status weird", [{"seq": 2, "kind": "status", "payload": {"status": "<script>"}}]))
    cases.append(("turn_end weird", [{"seq": 2, "kind": "turn_end", "payload": {"reason": "<script>"}}]))
    return cases


_CASES = _fuzz_cases()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
@pytest.mark.parametrize("events", [c[1] for c in _CASES], ids=[c[0] for c in _CASES])
def test_import_odd_values_in_unchecked_keys_never_break_a_page(alice, bob, fake_machine, tmp_path, settings, events):
    """An import is refused naming the line, or every page of the imported session draws."""
    settings.DATA_DIR = str(tmp_path / "data")
    client = logged_in(alice)
    try:
        response = client.post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(MSG, *events)))
    except Exception as exc:
        raise AssertionError(f"the import raised {type(exc).__name__}: {exc}") from exc
    if response.status_code == 200:
        assert "Line " in unescape(response.content.decode())
        return
    session = AgentSession.objects.get(owner=alice)
    assert session.visibility == PRIVATE and session.permission_mode == "manual"
    for url in (f"/sessions/{session.pk}/", f"/sessions/{session.pk}/export.md", f"/sessions/{session.pk}/export.jsonl",
                "/inbox/", "/?q=hi", "/machines/"):
        try:
            page = client.get(url)
        except Exception as exc:
            raise AssertionError(f"GET {url} raised {type(exc).__name__}: {exc}") from exc
        assert page.status_code == 200, url
        if url.endswith("/"):
            assert "<script>alert" not in page.content.decode() and "<img src=x" not in page.content.decode(), url
    assert logged_in(bob).get(f"/sessions/{session.pk}/").status_code in (403, 404)


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_with_the_gate_off_needs_the_bypass_permission(alice, fake_machine, tmp_path, settings):
    settings.DATA_DIR = str(tmp_path / "data")
    form = _import_form(fake_machine(), tmp_path, _file(MSG))
    form["permission_mode"] = "bypass"
    logged_in(alice).post("/sessions/new/", form)
    assert not AgentSession.objects.filter(permission_mode="bypass").exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("steps_run_here")
def test_import_a_message_longer_than_a_person_may_send_is_refused(alice, fake_machine, tmp_path, settings):
    """rules.MAX_MESSAGE_CHARS (200,000) bounds what a person sends; an import carrying a
    5,000,000-character message is sent whole with every later request of the session."""
    settings.DATA_DIR = str(tmp_path / "data")
    line = {**MSG, "payload": {"text": "y" * 5_000_000, "queued_id": None}}
    response = logged_in(alice).post("/sessions/new/", _import_form(fake_machine(), tmp_path, _file(line)))
    assert response.status_code == 200 and "Line 1" in unescape(response.content.decode())


@pytest.mark.django_db
def test_metrics_scrape_does_not_read_whole_payloads(settings, alice, plain_machine):
    """The latency figures need only kinds and times, yet every message's whole payload in
    the last hour is read at each scrape: 300 messages of 150,000 characters (45 MB)."""
    settings.CORRAL_METRICS_TOKEN = "t"
    session = _session(alice, plain_machine)
    big = "z" * 150_000
    TranscriptEvent.objects.bulk_create([
        TranscriptEvent(session=session, seq=n + 1, kind="message_taken", payload={"text": big, "queued_id": None})
        for n in range(300)
    ])
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").status_code == 200
    # The payload column may be read only through a key (``payload -> 'reason'``), never whole.
    whole = [q["sql"] for q in queries.captured_queries
             if re.search(r'"payload"(?!\s*(->|#>))', q["sql"]) and "transcriptevent" in q["sql"]]
    assert not whole, whole
    assert not any(big in q["sql"] for q in queries.captured_queries)
