"""The session page's words, starts and replies, the parts a test can prove without a
browser: status words, plain
settings lines, the start-failure sentence, the context checks, the max_tokens default
in the forms, rename, send again (the fold and the action), the context gauge, the
styled 404/403 and the session list's search.

The browser side of the same items is tests/test_page_browser.py.
"""

from __future__ import annotations

import pytest
from django.test import Client

from machines_app.llama_server import START_FAILURES, ServerStartError, explain_start_failure
from sessions_app import actions, transcript
from sessions_app.events import load_events, record_event
from sessions_app.forms import NewSessionForm, SessionSettingsForm
from sessions_app.live.header import context_size, render_status
from sessions_app.live.items import OWNER, Viewer, render_item
from sessions_app.live.sentences import settings_text
from sessions_app.live.transcript_view import TranscriptView, build_items
from sessions_app.models import AgentSession
from sessions_app.servers.stop import stop_server
from sessions_app.transcript import Event, build_messages

from .conftest import model_key
from .helpers import fresh

Status = AgentSession.Status


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def session(local_machine, alice, tmp_path):
    return AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        status=Status.IDLE,
    )


# --- stopped is not exited; one map of status words ------------------------------


@pytest.mark.django_db
def test_a_server_a_person_stops_is_stopped_not_exited(session, alice):
    stop_server(session.pk, by=actions.by(alice))
    assert fresh(session).status == Status.STOPPED
    assert fresh(session).server_down
    with pytest.raises(actions.SessionError, match="not running"):
        actions.do_send_message(fresh(session), alice, "hello?")


def test_the_badge_says_stopped_and_waiting_for_an_answer_in_words():
    assert ">stopped</span>" in render_status("stopped") and 'data-status="stopped"' in render_status("stopped")
    assert ">exited</span>" in render_status("exited")
    assert ">waiting for an answer</span>" in render_status("awaiting_input")
    assert ">sleeping</span>" in render_status("sleeping")  # a status this map does not know yet shows as itself


@pytest.mark.django_db
def test_a_stopped_sessions_composer_is_disabled_with_a_restart_button(session, alice, bob):
    AgentSession.objects.filter(pk=session.pk).update(status=Status.STOPPED, visibility="team_act")
    page = client_for(alice).get(f"/sessions/{session.pk}/").content.decode()
    composer = page[page.index('id="composer"'):]
    assert 'id="id_text"' in composer and "required disabled" in composer
    assert 'id="send-button" disabled' in composer
    assert 'id="composer-down" role="status">' in composer and "Restart server" in composer
    # One who may act but not restart is told whom to ask.
    page = client_for(bob).get(f"/sessions/{session.pk}/").content.decode()
    assert "composer-restart" not in page and "Ask alice, who owns this session, to restart it." in page
    AgentSession.objects.filter(pk=session.pk).update(status=Status.IDLE)
    page = client_for(alice).get(f"/sessions/{session.pk}/").content.decode()
    assert 'id="composer-down" role="status" hidden' in page and "required disabled" not in page


@pytest.mark.django_db
def test_feedback_goes_beside_the_control_that_was_clicked(session, alice):
    client = client_for(alice)
    answer = client.post(f"/sessions/{session.pk}/interrupt/", headers={"HX-Request": "true",
                                                                        "HX-Target": "composer-feedback"})
    assert "Nothing is running." in answer.content.decode()
    page = client.get(f"/sessions/{session.pk}/").content.decode()
    assert f'hx-post="/sessions/{session.pk}/interrupt/" hx-target="#composer-feedback"' in page
    assert f'hx-post="/sessions/{session.pk}/stop/" hx-target="#controls-feedback"' in page
    assert "Stop reply" in page and "Stop server" in page


@pytest.mark.django_db
def test_a_refusal_goes_to_the_feedback_line_of_the_control(session, bob):
    AgentSession.objects.filter(pk=session.pk).update(visibility="team_watch")
    answer = client_for(bob).post(f"/sessions/{session.pk}/interrupt/",
                                  headers={"HX-Request": "true", "HX-Target": "composer-feedback"})
    assert answer.status_code == 403 and answer["HX-Retarget"] == "#composer-feedback"


# --- plain words in the transcript -------------------------------------------------


@pytest.mark.django_db
def test_the_first_line_of_a_session_says_how_it_started_in_plain_words(local_machine, alice, tmp_path):
    created = actions.do_create_session(
        alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    first = load_events(created.pk)[0]
    line = build_items([first], created.pk)[0]["text"]
    name = local_machine.model_files.get(architecture="llama").display_name
    assert line == (f"Started by alice with {name} — tool calls: ask before each tool call; server: defaults; "
                    "sampling: defaults.")
    assert "model_key" not in line and "permission_mode" not in line and "server_params" not in line


def test_settings_changes_read_as_words():
    alice = {"id": 1, "username": "alice"}
    assert settings_text({"server_params": {"contextSize": 2048}, "by": alice}) == (
        "alice changed settings: server → context size 2048")
    assert settings_text({"permission_mode": "bypassPermissions", "by": alice}) == (
        "alice changed settings: tool calls → run tools without asking")
    assert settings_text({"permission_mode": "manual", "reason": "The gate is back on."}) == (
        "Settings: tool calls → ask before each tool call The gate is back on.")


# --- a failed start leads with one plain sentence, the log folded below ---------------


@pytest.mark.parametrize(("log", "expected"), [
    ("error: invalid argument: --bogus", "refused one of its settings (error: invalid argument: --bogus)"),
    ("couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080", "could not listen on its port"),
    ("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 99 GiB", "ran out of memory"),
    ("gguf_init_from_file: failed to open GGUF file\nexiting due to model loading error", "could not load the model"),
])
def test_a_failed_start_is_explained_from_the_servers_own_words(log, expected):
    error = ServerStartError("llama-server exited while starting", log)
    assert expected in error.sentence and "\n" not in error.sentence
    assert error.log_tail == log and "It last said:" in str(error)


def test_a_start_failure_the_table_does_not_know_keeps_its_headline():
    assert explain_start_failure("llama-server exited while starting", "something new").startswith(
        "llama-server exited while starting. Look at its last words below")
    assert "a very large model may need longer" in explain_start_failure(
        "llama-server did not become ready within 300 s", "")
    assert all(phrase == phrase.lower() for phrases, _ in START_FAILURES for phrase in phrases)


def test_the_error_row_shows_the_sentence_and_folds_the_log():
    events = [Event(1, "error", {"message": "llama-server could not load the model file.", "log": "line 1\nline 2"})]
    html = render_item(build_items(events, 3)[0])
    assert html.index("could not load the model file") < html.index("<details class=\"log\">")
    assert "<summary>What llama-server said</summary><pre>line 1\nline 2</pre>" in html


# --- context size within the trained length; max_tokens default in the forms -----------


@pytest.mark.django_db
def test_a_context_size_above_the_models_trained_length_is_refused_in_the_form(local_machine, alice, tmp_path):
    model = local_machine.model_files.get(architecture="llama")
    assert model.context_length
    data = {"machine": local_machine.pk, "model_key": model.key, "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto"}
    form = NewSessionForm({**data, "contextSize": model.context_length + 1}, user=alice)
    assert not form.is_valid()
    assert form.errors["contextSize"] == [
        f"{model.display_name} was trained with a context of {model.context_length:,} tokens: choose at most "
        f"{model.context_length:,} (or leave it empty)."]
    assert NewSessionForm({**data, "contextSize": model.context_length}, user=alice).is_valid()
    assert NewSessionForm(data, user=alice).is_valid()


@pytest.mark.django_db
def test_the_settings_form_and_a_model_switch_keep_the_context_within_the_trained_length(session, alice):
    small = session.machine.model_files.get(architecture="llama")
    big = session.machine.model_files.get(architecture="gemma3")
    assert big.context_length > small.context_length
    form = SessionSettingsForm({"speculative": "auto", "contextSize": small.context_length + 1}, session=session)
    assert not form.is_valid() and "was trained with a context of" in form.errors["contextSize"][0]
    AgentSession.objects.filter(pk=session.pk).update(
        model_key=big.key, server_params={"contextSize": big.context_length})
    with pytest.raises(actions.SessionError, match="in Settings before switching to it"):
        actions.do_change_model(fresh(session), alice, small.key)
    assert fresh(session).model_key == big.key


@pytest.mark.django_db
def test_the_forms_show_the_max_tokens_default(local_machine, alice, session, settings):
    settings.CORRAL_DEFAULT_MAX_TOKENS = 777
    page = client_for(alice).get("/sessions/new/").content.decode()
    assert 'placeholder="777 (default)"' in page and "Empty: 777, this deployment&#x27;s default." in page
    page = client_for(alice).get(f"/sessions/{session.pk}/").content.decode()
    assert 'placeholder="777 (default)"' in page


@pytest.mark.django_db
def test_a_context_overflow_offers_clear_to_whom_may_clear():
    events = [Event(1, "error", {"message": "request (9960 tokens) exceeds the available context size (8192 tokens)",
                                 "context_exceeded": True})]
    owner = "".join(render_item(item) for item in build_items(events, 5, OWNER))
    assert 'hx-post="/sessions/5/clear/"' in owner and "Clear the conversation" in owner
    watcher = "".join(render_item(item) for item in build_items(events, 5, Viewer(2, actions.Access.ACT)))
    assert "Clear the conversation" not in watcher and "The session's owner can clear it" in watcher


# --- the context gauge ----------------------------------------------------------------


def gauge_ops(events, view):
    return [op["html"] for e in events for op in view.feed(e) if op.get("id") == "context-gauge"]


def test_the_gauge_follows_usage_and_clear_live_as_on_first_paint():
    events = [
        Event(1, "server_ready", {"model_key": "m", "model": "M", "n_ctx": 2048}),
        Event(2, "message_taken", {"text": "hi", "queued_id": None}),
        Event(3, "usage", {"prompt_tokens": 500, "completion_tokens": 12}),
        Event(4, "turn_end", {"reason": "done"}),
    ]
    view = TranscriptView(1)
    live = gauge_ops(events, view)
    assert "context 512 / 2048 tokens (25%)" in live[-1] and 'max="2048" value="512"' in live[-1]
    first_paint = TranscriptView(1)
    first_paint.prime(events)
    assert first_paint.gauge() == view.gauge() == {"used": 512, "n_ctx": 2048, "percent": 25, "high": 1638}
    assert "context 0 / 2048 tokens (0%)" in gauge_ops([Event(5, "cleared", {"by": None})], view)[-1]


def test_the_gauge_knows_n_ctx_from_the_session_until_a_server_says():
    view = TranscriptView(1, n_ctx=1024)
    assert "context 100 / 1024" in gauge_ops([Event(1, "usage", {"prompt_tokens": 90, "completion_tokens": 10})],
                                            view)[-1]


@pytest.mark.parametrize(
    ("ready", "session_context", "n_ctx"),
    [
        ({"model_key": "m", "model": "M", "n_ctx": 2048}, 1024, 2048),  # the server said
        ({"model_key": "m", "model": "M"}, 1024, 1024),  # it did not (GET /props unanswered)
        (None, 1024, 1024),  # no server yet
        (None, None, None),  # llama-server's own default: unknown until it says
    ],
)
def test_the_gauge_s_context_size_is_the_last_server_ready_s_else_the_session_s(ready, session_context, n_ctx):
    assert context_size(ready, session_context) == n_ctx


# --- rename, live -----------------------------------------------------------------------


@pytest.mark.django_db
def test_rename_updates_the_heading_of_every_page_through_its_event(session, alice):
    answer = client_for(alice).post(f"/sessions/{session.pk}/rename/", {"title": "  Flock\ncount  "},
                                    headers={"HX-Request": "true"})
    assert answer.status_code == 200 and fresh(session).title == "Flock count"
    event = load_events(session.pk)[-1]
    ops = TranscriptView(session.pk).feed(event)
    assert {"op": "replace", "id": "session-title", "html": '<h1 id="session-title">Flock count</h1>\n'} in ops
    assert {"op": "value", "id": "id_title", "value": "Flock count"} in ops  # Settings' own title field
    with pytest.raises(actions.SessionError, match="at most 200 characters"):
        actions.do_rename(fresh(session), alice, "x" * 201)
    actions.do_rename(fresh(session), alice, "")
    ops = TranscriptView(session.pk).feed(load_events(session.pk)[-1])
    assert f'<h1 id="session-title">Session {session.pk}</h1>' in ops[0]["html"]


# --- regenerate and edit are new events; the fold drops the replaced reply -----------------


def taken(seq, text, **extra):
    return Event(seq, "message_taken", {"text": text, "queued_id": None, **extra})


def test_send_again_drops_the_replaced_reply_from_the_request_and_keeps_the_rest_byte_identical():
    events = [
        taken(1, "first"), Event(2, "assistant_text", {"text": "One."}), Event(3, "turn_end", {"reason": "done"}),
        taken(4, "second"), Event(5, "assistant_text", {"text": "Bad answer."}), Event(6, "turn_end", {"reason": "done"}),
        taken(7, "second", replaces=4), Event(8, "assistant_text", {"text": "Better."}),
        Event(9, "turn_end", {"reason": "done"}),
        taken(10, "second, but shorter", replaces=7, edited=True),
    ]
    assert build_messages(events) == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "One."},
        {"role": "user", "content": "second, but shorter"},
    ]
    assert build_messages(events[:6])[:2] == build_messages(events)[:2]
    assert transcript.last_message(events) == {"seq": 10, "text": "second, but shorter"}
    # The history keeps every reply and says which message was sent again.
    items = build_items(events)
    assert [i["text"] for i in items if i["type"] == "assistant"] == ["One.", "Bad answer.", "Better."]
    assert [i["again"] for i in items if i["type"] == "user"] == ["", "", "sent again", "edited and sent again"]


def test_send_again_after_a_failed_turn_restores_the_joined_message():
    events = [
        taken(1, "hi"), Event(2, "error", {"message": "x"}), Event(3, "turn_end", {"reason": "error"}),
        taken(4, "second"), Event(5, "assistant_text", {"text": "Ok."}), Event(6, "turn_end", {"reason": "done"}),
        taken(7, "second again", replaces=4, edited=True),
    ]
    assert build_messages(events) == [{"role": "user", "content": "hi\n\nsecond again"}]


def test_a_message_sent_again_across_a_clear_is_an_ordinary_message():
    events = [taken(1, "old"), Event(2, "turn_end", {"reason": "done"}), Event(3, "cleared", {"by": None}),
              taken(4, "new", replaces=1)]
    assert build_messages(events) == [{"role": "user", "content": "new"}]
    assert transcript.last_message(events[:3]) is None


@pytest.mark.django_db
def test_send_again_is_refused_while_a_turn_runs_without_a_message_or_a_server(session, alice,
                                                                                  django_capture_on_commit_callbacks):
    with pytest.raises(actions.SessionError, match="no message to send again"):
        actions.do_send_again(session, alice)
    with django_capture_on_commit_callbacks():
        actions.do_send_message(session, alice, "count the sheep")
    with pytest.raises(actions.SessionError, match="Wait for the reply to finish"):
        actions.do_send_again(fresh(session), alice, "count the goats")
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False)
    record_event(session.pk, "turn_end", {"reason": "done"})
    with django_capture_on_commit_callbacks():
        actions.do_send_again(fresh(session), alice, "count the goats")
    again = load_events(session.pk)[-1].payload
    assert again["text"] == "count the goats" and again["edited"] is True and again["by"]["username"] == "alice"
    first = next(e for e in load_events(session.pk) if e.kind == "message_taken")
    assert again["replaces"] == first.seq and fresh(session).turn_active
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False, status=Status.STOPPED)
    with pytest.raises(actions.SessionError, match="not running"):
        actions.do_send_again(fresh(session), alice)


@pytest.mark.django_db
def test_the_composer_sends_an_edit_as_a_replacement(session, alice, django_capture_on_commit_callbacks):
    client = client_for(alice)
    with django_capture_on_commit_callbacks():
        client.post(f"/sessions/{session.pk}/send/", {"text": "hello"}, headers={"HX-Request": "true"})
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False)
    record_event(session.pk, "turn_end", {"reason": "done"})
    with django_capture_on_commit_callbacks():
        client.post(f"/sessions/{session.pk}/send/", {"text": "hello there", "edit": "last"},
                    headers={"HX-Request": "true"})
    messages = [e.payload for e in load_events(session.pk) if e.kind == "message_taken"]
    assert [m["text"] for m in messages] == ["hello", "hello there"] and messages[1]["edited"] is True


# --- a styled 404/403 with a way back; the list's search ---------------------------------


@pytest.mark.django_db
def test_not_found_and_not_allowed_pages_are_styled_with_a_way_back(session, alice, bob, settings):
    settings.DEBUG = False
    missing = client_for(alice).get("/sessions/987654/")
    page = missing.content.decode()
    assert missing.status_code == 404 and 'id="not-found"' in page and "corral.css" in page
    assert '<a class="button primary" href="/">Back to the sessions</a>' in page
    AgentSession.objects.filter(pk=session.pk).update(visibility="team_watch")
    refused = client_for(bob).post(f"/sessions/{session.pk}/clear/")
    page = refused.content.decode()
    assert refused.status_code == 403 and 'id="not-allowed"' in page and "Back to the sessions" in page


@pytest.mark.django_db
def test_the_session_list_searches_and_filters(local_machine, alice, tmp_path):
    def make(title, status):
        return AgentSession.objects.create(owner=alice, machine=local_machine, model_key="x.gguf",
                                           working_dir=str(tmp_path), title=title, status=status)

    make("Sheep census", Status.IDLE)
    make("Goat census", Status.STOPPED)
    make("Weather", Status.AWAITING_INPUT)
    client = client_for(alice)

    def titles(query: str) -> list[str]:
        page = client.get("/" + query).content.decode()
        return sorted(t for t in ("Sheep census", "Goat census", "Weather") if f">{t}</a>" in page)

    assert titles("") == ["Goat census", "Sheep census", "Weather"]
    assert titles("?q=CENSUS") == ["Goat census", "Sheep census"]
    assert titles("?q=census+goat") == ["Goat census"]
    assert titles("?q=local") == ["Goat census", "Sheep census", "Weather"]  # the machine's name
    assert titles("?show=down") == ["Goat census"]
    assert titles("?show=answer") == ["Weather"]
    assert titles("?q=nothing-like-it") == []
    assert "No session matches." in client.get("/?q=nothing-like-it").content.decode()
