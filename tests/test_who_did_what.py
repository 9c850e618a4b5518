"""Every user action in a transcript names who did it; the page and the admin show it
(docs/sharing.md)."""

from __future__ import annotations

import pytest
from django.test import Client

from machines_app.models import Machine, ModelFile
from sessions_app import actions, dispatch, transcript, turns
from sessions_app.live.items import render_item
from sessions_app.live.transcript_view import TranscriptView, build_items
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.stop import stop_server
from sessions_app.transcript import Event

from .helpers import ALICE


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """The named users are made for every test here; Django's real hasher takes about a
    second each on a busy machine, and no test here checks a password."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

@pytest.fixture
def session(db, alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    ModelFile.objects.create(machine=machine, key="other.gguf", display_name="Other model", has_chat_template=True)
    return AgentSession.objects.create(
        owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
        visibility=AgentSession.Visibility.TEAM_ACT,
    )


def last(session, kind: str) -> dict:
    return TranscriptEvent.objects.filter(session=session, kind=kind).latest("seq").payload


def me(user) -> dict:
    return {"id": user.pk, "username": user.get_username()}


@pytest.mark.django_db
def test_every_user_action_records_who_did_it(session, alice, bob, monkeypatch):
    actions.do_send_message(session, bob, "count the sheep")
    assert last(session, "message_taken")["by"] == me(bob)
    actions.do_send_message(session, alice, "then the goats")
    alices = last(session, "message_queued")
    assert alices["by"] == me(alice)
    turns.ask_question(session.pk, "c1", "read_file")
    actions.do_answer(session, bob, "c1", "allow_once")
    assert last(session, "answered")["by"] == me(bob)
    actions.do_send_message(session, bob, "and the cows")
    actions.do_drop_queued(session, bob, last(session, "message_queued")["id"])
    assert last(session, "message_dropped")["by"] == me(bob)
    AgentSession.objects.filter(pk=session.pk).update(lease_owner="", lease_expires=None)
    actions.do_interrupt(session, bob)
    assert last(session, "interrupted")["by"] == me(bob)
    # The interrupt ended the turn and took alice's queued message: still hers.
    assert last(session, "message_taken") == {"text": "then the goats", "queued_id": alices["id"], "by": me(alice)}
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False)
    actions.do_clear(session, alice)
    assert last(session, "cleared")["by"] == me(alice)
    AgentSession.objects.filter(pk=session.pk).update(permission_mode="bypassPermissions")
    actions.do_set_permission_mode(session, alice, "manual")
    assert last(session, "settings") == {"permission_mode": "manual", "by": me(alice)}
    actions.do_update_settings(session, alice, title="Flock count", sampling={"top_k": 40}, server_params={})
    assert last(session, "settings") == {"title": "Flock count", "sampling": {"top_k": 40}, "by": me(alice)}
    actions.do_set_visibility(session, alice, AgentSession.Visibility.TEAM_WATCH)
    assert last(session, "settings") == {"visibility": "team_watch", "by": me(alice)}
    AgentSession.objects.filter(pk=session.pk).update(status="idle")
    actions.do_change_model(session, alice, "other.gguf")
    assert last(session, "settings") == {"model_key": "other.gguf", "model": "Other model", "takes_images": False,
                                        "by": me(alice)}
    AgentSession.objects.filter(pk=session.pk).update(status="exited")
    actions.do_restart(session, alice)
    assert last(session, "status") == {"status": "loading", "by": me(alice)}
    stops = []
    AgentSession.objects.filter(pk=session.pk).update(status="idle")
    # The stop runs in a worker: catch the task's arguments and do what it does.
    monkeypatch.setattr(dispatch, "enqueue",
                        lambda task, *args: stops.append(args) if task == dispatch.STOP_SERVER else True)
    actions.do_stop(session, bob)
    assert stops == [(session.pk, me(bob))]
    stop_server(session.pk, by=stops[0][1])
    assert last(session, "server_stopped") == {"reason": "stopped", "by": me(bob)}
    # What nobody did names nobody: the end of the interrupted turn.
    assert transcript.actor(TranscriptEvent.objects.get(session=session, kind="turn_end").payload) is None


@pytest.mark.parametrize(
    ("payload", "who"),
    [
        ({"by": {"id": 3, "username": "bob"}}, {"id": 3, "username": "bob"}),
        ({"by": "bob"}, {"id": None, "username": "bob"}),  # answers, interrupts, clears before ids
        ({"author": "ann", "text": "hi"}, {"id": None, "username": "ann"}),  # messages before ids
        ({"by": "", "reason": "interrupted"}, None),  # a question closed by an interrupt
        ({"reason": "stop"}, None),
        ({"by": None}, None),
        ({"by": 7}, None),
        ({"by": {"id": 3}}, None),
        ({"by": {"id": 3, "username": ""}}, None),
        ({"by": {"id": "3", "username": "bob"}}, {"id": None, "username": "bob"}),
        ({"by": {"id": True, "username": "bob"}}, {"id": None, "username": "bob"}),
        ({"by": ["bob"]}, None),
        ("not a payload", None),
        (None, None),
    ],
)
def test_the_fold_reads_who_from_new_and_old_events(payload, who):
    assert transcript.actor(payload) == who


def test_old_events_fold_to_the_same_conversation_and_queue():
    old = [
        Event(1, "message_taken", {"text": "hi", "queued_id": None, "author": "ann"}),
        Event(2, "message_queued", {"id": "q1", "text": "later", "author": "ann"}),
        Event(3, "interrupted", {"by": "ann"}),
    ]
    new = [
        Event(1, "message_taken", {"text": "hi", "queued_id": None, "by": {"id": 1, "username": "ann"}}),
        Event(2, "message_queued", {"id": "q1", "text": "later", "by": {"id": 1, "username": "ann"}}),
        Event(3, "interrupted", {"by": {"id": 1, "username": "ann"}}),
    ]
    assert transcript.build_messages(old) == transcript.build_messages(new) == [{"role": "user", "content": "hi"}]
    assert [q["id"] for q in transcript.pending_queue(old)] == [q["id"] for q in transcript.pending_queue(new)]


BOB = {"id": 2, "username": "bob"}
HOSTILE = {"id": 9, "username": "<b>mallory</b>"}
STORY = [
    Event(1, "message_taken", {"text": "count", "queued_id": None, "by": BOB}),
    Event(2, "tool_start", {"id": "c1", "tool": "read_file", "arguments": "{}"}),
    Event(3, "question", {"id": "c1", "tool": "read_file"}),
    Event(4, "answered", {"id": "c1", "tool": "read_file", "answer": "allow_once", "by": ALICE}),
    Event(5, "tool_end", {"id": "c1", "output": "twelve"}),
    Event(6, "assistant_text", {"text": "Twelve."}),
    Event(7, "interrupted", {"by": BOB}),
    Event(8, "turn_end", {"reason": "interrupted"}),
    Event(9, "cleared", {"by": ALICE}),
    Event(10, "settings", {"title": "Flock", "by": BOB}),
    Event(11, "settings", {"visibility": "team_act", "by": ALICE}),
    Event(12, "message_taken", {"text": "old one", "queued_id": None, "author": "ann"}),
    Event(13, "interrupted", {"by": "ann"}),
    Event(14, "message_taken", {"text": "x", "queued_id": None, "by": HOSTILE}),
    Event(15, "server_stopped", {"reason": "stopped", "by": ALICE}),
    Event(16, "server_stopped", {"reason": "stopped"}),
    Event(17, "status", {"status": "loading", "by": BOB}),  # bob's Restart
    Event(18, "server_stopped", {"reason": "restart"}),
    Event(19, "status", {"status": "loading"}),  # a first start or a model change: no note
    Event(20, "status", {"status": "loading", "by": ALICE, "reason": "wake"}),  # her message woke it
]
SENTENCES = [
    '<div class="who">bob</div>', "Allowed once by alice", "Interrupted by bob.", "cleared by alice",
    "bob changed settings: title → Flock", "alice shared the session with the team, to watch and act.",
    '<div class="who">ann</div>', "Interrupted by ann.", '<div class="who">&lt;b&gt;mallory&lt;/b&gt;</div>',
    "llama-server stopped by alice.", "llama-server stopped.</div>", "llama-server restarted by bob.",
    "llama-server stopped for the restart.", "llama-server woken by a message from alice.",
]


def test_the_page_names_who_did_it_on_first_paint_and_live_alike():
    first_paint = "".join(render_item(item) for item in build_items(STORY, session_id=1))
    seen: list[Event] = []
    renderer = TranscriptView(1, call_events=lambda call_id, before: [e for e in seen if e.payload.get("id") == call_id])
    live = []
    for event in STORY:
        live.extend(op.get("html", "") for op in renderer.feed(event))
        seen.append(event)
    live_html = "".join(live)
    for sentence in SENTENCES:
        assert sentence in first_paint, sentence
        assert sentence in live_html, sentence
    assert "<b>mallory" not in first_paint + live_html
    assert first_paint.count("restarted by") == live_html.count("restarted by") == 1


@pytest.mark.django_db
def test_the_admins_transcript_view_names_who_did_it(session, bob, charlie_staff):
    from django.contrib.auth.models import Permission

    charlie_staff.user_permissions.add(Permission.objects.get(codename="view_transcriptevent"))
    actions.do_send_message(session, bob, "count the sheep")
    client = Client()
    client.force_login(charlie_staff)
    page = client.get(f"/admin/sessions_app/transcriptevent/?session__id__exact={session.pk}").content.decode()
    assert '<th scope="col" class="column-by">' in page and '<td class="field-by">bob</td>' in page
    event = TranscriptEvent.objects.get(session=session, kind="message_taken")
    detail = client.get(f"/admin/sessions_app/transcriptevent/{event.pk}/change/").content.decode()
    assert '<div class="readonly">bob</div>' in detail


@pytest.mark.django_db
def test_the_admin_shows_sharing_but_leaves_changing_it_to_the_page(session, charlie_staff):
    from django.contrib.auth.models import Permission

    charlie_staff.user_permissions.add(*Permission.objects.filter(codename__in=["view_agentsession",
                                                                                "change_agentsession"]))
    client = Client()
    client.force_login(charlie_staff)
    page = client.get(f"/admin/sessions_app/agentsession/{session.pk}/change/").content.decode()
    assert '<div class="readonly">The team may act</div>' in page and 'name="visibility"' not in page
