"""Every transition of the turn's state machine (sessions_app/turns.py), in process.

No worker, no server, no broker: the step queue is read from what the transitions hand to
:mod:`sessions_app.dispatch` (the Celery seam), and after-commit work runs through Django's
``captureOnCommitCallbacks``. The real processes prove the parts fit in test_lifecycle,
test_agent_durable and test_e2e_real; these prove the rules, in milliseconds.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from machines_app.models import Machine
from sessions_app import actions, dispatch, transcript, turns
from sessions_app.events import load_events
from sessions_app.models import AgentSession
from sessions_app.transcript import TurnEnd

from .helpers import fresh

pytestmark = pytest.mark.django_db

Status = AgentSession.Status


@pytest.fixture
def queued(monkeypatch) -> list[tuple[str, tuple]]:
    """What the transitions hand to Celery, in order."""
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)) or True)
    return sent


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create(username="alice")  # no password: no slow hashing here


@pytest.fixture
def session(alice, tmp_path) -> AgentSession:
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    return AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                       status=Status.IDLE)


def kinds(session) -> list[str]:
    return [e.kind for e in load_events(session.pk)]


def send(session, user, text, capture) -> None:
    with capture(execute=True):
        actions.do_send_message(fresh(session), user, text)


def test_a_message_on_an_idle_session_opens_a_turn_and_queues_a_step(session, alice, queued,
                                                                     django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        actions.do_send_message(session, alice, "hi")
        assert queued == []  # nothing reaches the broker before the commit
    for callback in callbacks:
        callback()
    assert queued == [(dispatch.RUN_TURN, (session.pk,))]
    assert fresh(session).turn_active
    assert kinds(session) == ["message_taken"]


def test_a_message_during_a_turn_only_waits(session, alice, queued, django_capture_on_commit_callbacks):
    send(session, alice, "first", django_capture_on_commit_callbacks)
    send(session, alice, "second", django_capture_on_commit_callbacks)
    assert kinds(session) == ["message_taken", "message_queued"]
    assert len(queued) == 1
    assert [q["text"] for q in transcript.pending_queue(load_events(session.pk))] == ["second"]


def test_one_step_holds_the_lease_a_second_copy_leaves(session, alice, queued, django_capture_on_commit_callbacks,
                                                      settings):
    send(session, alice, "hi", django_capture_on_commit_callbacks)
    assert turns.claim_step(session.pk, "one") == ""
    assert turns.claim_step(session.pk, "two") is None
    assert turns.renew_lease(session.pk, "one") and not turns.renew_lease(session.pk, "two")
    AgentSession.objects.filter(pk=session.pk).update(lease_expires=timezone.now() - timedelta(seconds=1))
    assert turns.claim_step(session.pk, "three") == "one"  # "one" died: its lease lapsed
    turns.release_lease(session.pk, "three")
    assert turns.claim_step(session.pk, "four") == ""


def test_no_step_is_claimed_without_an_open_turn(session):
    assert turns.claim_step(session.pk, "x") is None


def test_a_question_ends_the_step_and_the_answer_queues_the_next(session, alice, queued,
                                                                 django_capture_on_commit_callbacks):
    send(session, alice, "hi", django_capture_on_commit_callbacks)
    turns.ask_question(session.pk, "call_1", "exec_shell_command")
    assert fresh(session).status == Status.AWAITING_INPUT
    with django_capture_on_commit_callbacks(execute=True):
        actions.do_answer(fresh(session), alice, "call_1", "allow_once")
    assert fresh(session).status == Status.RUNNING
    assert queued[-1] == (dispatch.RUN_TURN, (session.pk,))
    assert [e.kind for e in load_events(session.pk)][-2:] == ["answered", "status"]
    with pytest.raises(actions.SessionError, match="already been answered"):
        actions.do_answer(fresh(session), alice, "call_1", "refuse")


def test_an_interrupt_of_an_unheld_turn_ends_it_and_takes_the_next_message(session, alice, queued,
                                                                          django_capture_on_commit_callbacks):
    send(session, alice, "first", django_capture_on_commit_callbacks)
    send(session, alice, "second", django_capture_on_commit_callbacks)
    turns.ask_question(session.pk, "call_1", "write_file")
    with django_capture_on_commit_callbacks(execute=True):
        actions.do_interrupt(fresh(session), alice)
    events = load_events(session.pk)
    assert transcript.open_questions(events) == []  # closed as a refusal
    refusal = next(e.payload for e in events if e.kind == "answered")
    assert refusal["answer"] == transcript.ANSWER_REFUSE and refusal["reason"] == "interrupted"
    assert [e.payload["reason"] for e in events if e.kind == "turn_end"] == ["interrupted"]
    assert [e.payload["text"] for e in events if e.kind == "message_taken"] == ["first", "second"]
    assert fresh(session).turn_active and queued[-1] == (dispatch.RUN_TURN, (session.pk,))


def test_an_interrupt_of_a_held_turn_only_raises_the_flag(session, alice, queued,
                                                          django_capture_on_commit_callbacks):
    send(session, alice, "first", django_capture_on_commit_callbacks)
    turns.claim_step(session.pk, "step")
    actions.do_interrupt(fresh(session), alice)
    assert fresh(session).interrupt_requested and fresh(session).turn_active
    assert "turn_end" not in kinds(session)  # the step ends it when it sees the flag
    assert not turns.finish_if_unheld(session.pk, TurnEnd.STOPPED)


def test_nothing_to_interrupt_is_said(session, alice):
    with pytest.raises(actions.SessionError, match="Nothing is running"):
        actions.do_interrupt(session, alice)


def test_finishing_with_an_empty_queue_makes_the_session_idle(session, alice, queued,
                                                              django_capture_on_commit_callbacks):
    send(session, alice, "hi", django_capture_on_commit_callbacks)
    AgentSession.objects.filter(pk=session.pk).update(status=Status.RUNNING)
    turns.finish_turn(session.pk, TurnEnd.DONE)
    assert not fresh(session).turn_active
    assert fresh(session).status == Status.IDLE
    assert kinds(session)[-2:] == ["turn_end", "status"]
    turns.finish_turn(session.pk, TurnEnd.DONE)  # a second finish records nothing more
    assert kinds(session).count("turn_end") == 1


def test_a_stopped_server_keeps_the_queue_until_a_restart(session, alice, queued,
                                                          django_capture_on_commit_callbacks):
    send(session, alice, "first", django_capture_on_commit_callbacks)
    send(session, alice, "second", django_capture_on_commit_callbacks)
    AgentSession.objects.filter(pk=session.pk).update(status=Status.EXITED)
    with django_capture_on_commit_callbacks(execute=True):
        assert turns.finish_if_unheld(session.pk, TurnEnd.STOPPED)
    assert not fresh(session).turn_active
    assert [e.payload["text"] for e in load_events(session.pk) if e.kind == "message_taken"] == ["first"]
    AgentSession.objects.filter(pk=session.pk).update(status=Status.IDLE)  # the server is back
    with django_capture_on_commit_callbacks(execute=True):
        turns.resume_queue(session.pk)
    assert [e.payload["text"] for e in load_events(session.pk) if e.kind == "message_taken"] == ["first", "second"]
    assert queued[-1] == (dispatch.RUN_TURN, (session.pk,))


@pytest.mark.parametrize("status", [Status.EXITED, Status.STOPPED])
def test_a_message_to_an_exited_session_is_refused(session, alice, status):
    AgentSession.objects.filter(pk=session.pk).update(status=status)
    with pytest.raises(actions.SessionError, match="not running"):
        actions.do_send_message(fresh(session), alice, "hi")


def test_recovery_finds_turns_whose_step_is_not_running(session, alice, queued, django_capture_on_commit_callbacks):
    send(session, alice, "hi", django_capture_on_commit_callbacks)
    assert turns.recoverable() == []  # just queued: give the step a moment
    AgentSession.objects.filter(pk=session.pk).update(last_activity_at=timezone.now() - timedelta(seconds=30))
    assert turns.recoverable() == [session.pk]  # the step message was lost
    turns.claim_step(session.pk, "alive")
    assert turns.recoverable() == []  # a live step holds it
    AgentSession.objects.filter(pk=session.pk).update(lease_expires=timezone.now() - timedelta(seconds=1))
    assert turns.recoverable() == [session.pk]  # its worker died


def test_a_status_change_is_recorded_once(session):
    from sessions_app.events import set_status

    assert set_status(session.pk, Status.RUNNING)
    assert not set_status(session.pk, Status.RUNNING)
    assert not set_status(session.pk, Status.UNKNOWN, only_from=(Status.IDLE,))
    assert kinds(session) == ["status"]


@pytest.mark.parametrize(
    ("kind", "payload", "problem"),
    [
        ("asistant_text", {"text": "x"}, "unknown event kind"),
        ("assistant_text", {}, "missing ['text']"),
        ("tool_end", {"id": "c", "output": "o", "ok": True, "okk": 1}, "unknown ['okk']"),
        ("status", {"state": "idle"}, "missing ['status'], unknown ['state']"),
    ],
)
def test_an_event_outside_the_vocabulary_is_refused_before_it_is_written(session, kind, payload, problem):
    from sessions_app.events import record_event
    from sessions_app.transcript import InvalidEvent

    with pytest.raises(InvalidEvent, match=re.escape(problem)):
        record_event(session.pk, kind, payload)
    assert kinds(session) == []


# --- fast takeover -------------------------------------------------------------------------


def test_a_lease_id_names_the_worker_and_its_process():
    owner = turns.step_owner("turns@host")
    token, pid, worker = owner.split(" ")
    assert re.fullmatch(r"[0-9a-f]{16}", token) and pid.isdigit() and worker == "turns@host"
    assert " " not in turns.step_owner(None)
    assert len(turns.step_owner("turns@" + "h" * 100)) == 64


@pytest.mark.parametrize(
    "owner, live, restarted, dead",
    [
        ("abc 10 turns@a", {"turns@a", "housekeeping@a"}, None, False),  # answers the ping
        ("abc 10 turns@a", {"housekeeping@a"}, None, True),  # gone from Celery's view
        ("abc 10 turns@a", {"turns@ab"}, None, True),  # another worker whose name starts alike
        ("abc 10 turns@a", None, ("turns@a", 11), True),  # the same worker, started again
        ("abc 10 turns@a", None, ("turns@a", 10), False),  # the same process
        ("abc 10 turns@a", None, ("turns@b", 11), False),  # another worker started
        ("abc 10 turns@a", None, None, False),  # nothing known
        ("0123456789abcdef", {"housekeeping@a"}, None, False),  # no worker named: only the lease lapse
        (("x" * 16 + " 10 turns@" + "h" * 60)[:64], {"turns@" + "h" * 60}, None, False),  # cut name, alive
        (("x" * 16 + " 10 turns@" + "h" * 60)[:64], None, ("turns@" + "h" * 60, 11), True),  # cut name, restarted
    ],
)
def test_which_holders_are_known_dead(owner, live, restarted, dead):
    assert turns.holder_is_dead(owner, live=live, restarted=restarted) is dead


def test_a_step_of_a_dead_worker_is_let_go_with_a_notice_and_a_live_one_is_kept(session, alice, queued,
                                                                                  django_capture_on_commit_callbacks):
    send(session, alice, "hi", django_capture_on_commit_callbacks)
    owner = "0123456789abcdef 10 turns@a"
    assert turns.claim_step(session.pk, owner) == ""

    assert turns.take_over_dead_steps(live={"turns@a"}) == []
    assert turns.take_over_dead_steps(restarted=("turns@a", 10)) == []
    assert turns.lease_held(fresh(session))

    assert turns.take_over_dead_steps(restarted=("turns@a", 11)) == [session.pk]
    assert not turns.lease_held(fresh(session))
    assert kinds(session)[-1] == "notice"
    assert load_events(session.pk)[-1].payload == {"message": turns.RESUMING_NOTICE}
    assert turns.take_over_dead_steps(restarted=("turns@a", 11)) == []  # once
    assert turns.claim_step(session.pk, "next") == owner  # the next step knows it lost a holder
    assert session.pk not in turns.recoverable()


def test_turns_waiting_for_a_worker_are_counted_in_queue_order(session, alice, tmp_path, queued,
                                                                 django_capture_on_commit_callbacks):
    others = [AgentSession.objects.create(owner=alice, machine=session.machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status=Status.IDLE) for _ in range(3)]
    first, second, third = others
    for s in (session, *others):
        send(s, alice, "hi", django_capture_on_commit_callbacks)
    assert turns.waiting_for_worker() == {session.pk: 0, first.pk: 1, second.pk: 2, third.pk: 3}

    assert turns.claim_step(session.pk, "a step") == ""  # a worker took it
    AgentSession.objects.filter(pk=first.pk).update(status=Status.AWAITING_INPUT)  # waits for a person
    AgentSession.objects.filter(pk=second.pk).update(status=Status.LOADING)  # waits for the model
    assert turns.waiting_for_worker() == {third.pk: 0}


def test_the_recovery_round_reads_the_liveness_keys_only_while_a_step_holds_a_lease(
        session, alice, queued, monkeypatch, django_capture_on_commit_callbacks):
    # With no lease held there is no step to take over: the idle stack reads nothing
    # (docs/live-page.md "What it costs"); a held lease still gets its two rounds.
    from sessions_app import rounds, tasks

    reads = []
    monkeypatch.setattr(rounds.liveness, "live_workers", lambda: reads.append(1) or {"turns@a"})
    monkeypatch.setattr(rounds, "ROUND_GAP", 0)
    monkeypatch.setattr(rounds.dispatch, "enqueue", lambda *_args: True)
    tasks.recover_turns.apply()
    assert reads == []

    send(session, alice, "hi", django_capture_on_commit_callbacks)
    assert turns.claim_step(session.pk, "0123456789abcdef 10 turns@a") == ""
    tasks.recover_turns.apply()
    assert reads == [1, 1]


def test_a_worker_is_live_while_its_key_is_written_and_gone_once_it_lapses(monkeypatch):
    """Real Redis: a heartbeat's key is seen at once and lapses LAPSE_SECONDS after its
    last write (here shortened to 0.6 s)."""
    from sessions_app import liveness

    monkeypatch.setattr(liveness, "BEAT_SECONDS", 0.2)
    monkeypatch.setattr(liveness, "LAPSE_SECONDS", 0.6)
    name = f"turns@liveness-test-{os.getpid()}"
    beat = liveness.Heartbeat(name).start()
    try:
        deadline = time.monotonic() + 5
        while name not in (liveness.live_workers() or set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert name in liveness.live_workers()
        time.sleep(1.0)  # five beats: written again and again, never lapsed
        assert name in liveness.live_workers()
    finally:
        beat.stop()
    time.sleep(0.8)
    assert name not in liveness.live_workers()


def test_the_liveness_keys_of_an_unreachable_redis_are_unknown_not_empty(settings):
    from sessions_app import liveness

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert liveness.live_workers() is None


def test_a_worker_builds_what_turns_use_when_it_starts_then_freezes_its_heap(db, monkeypatch):
    """The first turn after a start paid for the channel layer, the TLS context and a full
    collection of the start-up heap (sessions_app.tasks.warm_up, project/heap.py)."""
    from celery.signals import worker_ready
    from channels.layers import channel_layers

    from machines_app.llama_server import tls_context
    from project import heap
    from sessions_app import tasks  # noqa: F401  (connects the worker_ready receivers, as a worker's start does)

    monkeypatch.setattr(channel_layers, "backends", {})
    tls_context.cache_clear()
    frozen = []
    # This test process must not freeze its own heap: a test's garbage would outlive it.
    monkeypatch.setattr(heap, "freeze_startup_objects", lambda: frozen.append(tls_context.cache_info().currsize))

    class Consumer:
        hostname = "turns@here"

    worker_ready.send(sender=Consumer())
    assert "default" in channel_layers.backends
    assert frozen == [1]  # frozen once, after the TLS context was built


def test_freezing_the_start_up_heap_sets_aside_every_live_object_and_collects_the_rest():
    import gc

    from project import heap

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage
    del garbage
    kept = Cycle()
    kept.me = kept
    try:
        frozen = heap.freeze_startup_objects()
        # A frozen object freed by reference counting leaves the permanent generation (another
        # thread of this test process may drop one meanwhile): the count can only fall.
        assert frozen >= gc.get_freeze_count() > 0
        assert frozen > len(gc.get_objects()) // 2  # most of the heap was set aside
        assert not any(isinstance(o, Cycle) and o is not kept for o in gc.get_objects())  # the garbage went
        assert not any(o is kept for o in gc.get_objects())  # frozen objects are no collection's business
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
