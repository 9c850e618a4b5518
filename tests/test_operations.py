"""Corral keeps running: a step whose worker restarted is taken over within seconds, and
housekeeping runs on time while every turn thread streams (real worker, daphne, Redis,
the stand-in llama-server)."""

from __future__ import annotations

import os
import signal

import pytest
from django.test import Client

from machines_app.models import Machine
from project import queues
from sessions_app import actions, agent, liveness, turns
from sessions_app.events import record_event
from sessions_app.live import broadcast
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord

from .conftest import WSRecorder, model_key, wait_for
from .helpers import payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def start_session(machine, user, tmp_path) -> AgentSession:
    session = actions.do_create_session(
        user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    return AgentSession.objects.get(pk=session.pk)


#: Seconds of the lease under test, and the most a takeover may take (a hang guard, far
#: below the lease: the liveness key, not the lease lapsing, is what hands the step over).
LONG_LEASE = 600
TAKEOVER_WITHIN = 120


@pytest.fixture
def long_leases(stack):
    """The stack's worker with a 600 s lease (ten times production's 60 s): a takeover seen
    within 120 s (a guard against a hang, generous for a loaded box) cannot be the lease
    lapsing, so no test here needs a tight time bound."""
    stack.stop_worker()
    stack.env["CORRAL_LEASE_SECONDS"] = str(LONG_LEASE)
    stack.start_worker()
    yield stack
    stack.stop_worker(sig=signal.SIGKILL)
    stack.env["CORRAL_LEASE_SECONDS"] = "3"
    stack.start_worker()


def test_a_step_whose_worker_restarted_is_taken_over_within_seconds(long_leases, fake_machine, alice, tmp_path):
    stack = long_leases
    machine = fake_machine([{"text": " ".join(f"word{i}" for i in range(80)), "delay": 0.25}, {"text": "Back."}])
    session = start_session(machine, alice, tmp_path)
    actions.do_send_message(session, alice, "talk slowly")
    wait_for(lambda: len(payloads(session, "assistant_text")) >= 3, 20, what="the stream to start")
    owner = AgentSession.objects.get(pk=session.pk).lease_owner
    assert owner.split(" ")[2] in liveness.live_workers()

    stack.stop_worker(sig=signal.SIGKILL)
    assert turns.lease_held(AgentSession.objects.get(pk=session.pk))  # the whole lease to go
    stack.start_worker()  # returns once the new worker consumes
    wait_for(lambda: payloads(session, "turn_end"), TAKEOVER_WITHIN, what="the takeover (not the lease)")
    assert {"message": turns.RESUMING_NOTICE} in payloads(session, "notice")
    assert payloads(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
    assert [p["reason"] for p in payloads(session, "turn_end")] == ["interrupted"]
    assert AgentSession.objects.get(pk=session.pk).status == "idle"


def test_a_step_whose_worker_died_for_good_is_taken_over_by_another(long_leases, fake_machine, alice, tmp_path):
    """A turns worker killed outright that never comes back (no restart under its name):
    its liveness key lapses, recovery takes its step over (the notice says so), and the
    turn ends truthfully on another worker — well before the lease would lapse."""
    stack = long_leases
    stack.stop_worker()
    stack.start_worker(queue_names=(queues.SERVERS, queues.HOUSEKEEPING))  # its rounds: recovery
    stack.start_worker(queue_names=(queues.TURNS,), name="doomed")
    try:
        machine = fake_machine([{"text": " ".join(f"word{i}" for i in range(200)), "delay": 0.25}, {"text": "Back."}])
        session = start_session(machine, alice, tmp_path)
        actions.do_send_message(session, alice, "talk slowly")
        wait_for(lambda: len(payloads(session, "assistant_text")) >= 3, 20, what="the stream to start")
        assert "doomed@" in AgentSession.objects.get(pk=session.pk).lease_owner
        stack.stop_worker(sig=signal.SIGKILL, name="doomed")
        stack.start_worker(queue_names=(queues.TURNS,), name="other")
        wait_for(lambda: payloads(session, "turn_end"), TAKEOVER_WITHIN, what="the takeover (not the lease)")
        assert {"message": turns.RESUMING_NOTICE} in payloads(session, "notice")
        assert payloads(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
        assert [p["reason"] for p in payloads(session, "turn_end")] == ["interrupted"]
    finally:
        stack.stop_worker(name="other")
        stack.stop_worker(name="doomed")


def test_a_full_turn_pool_never_delays_health_checks_and_waiting_sessions_show_their_place(
    stack, fake_machine, alice, tmp_path
):
    """Production's layout in small: a turns worker of 4 threads, another worker (with
    the housekeeping rounds) for servers and housekeeping. Ten turns stream at once."""
    stack.stop_worker()
    stack.start_worker(concurrency=4, queue_names=(queues.TURNS,), name="turns")
    stack.start_worker(concurrency=4, queue_names=(queues.SERVERS, queues.HOUSEKEEPING))
    try:
        reply = {"text": " ".join(f"word{i}" for i in range(60)), "delay": 0.25}
        sessions = [start_session(fake_machine([reply]), alice, tmp_path) for _ in range(10)]
        for session in sessions:
            actions.do_send_message(session, alice, "talk slowly")
        waiting = wait_for(lambda: len(w := turns.waiting_for_worker()) == 6 and w, 30, what="4 streaming, 6 waiting")
        assert sorted(waiting.values()) == [0, 1, 2, 3, 4, 5]
        assert sum(turns.lease_held(AgentSession.objects.get(pk=s.pk)) for s in sessions) == 4

        client = Client()
        client.force_login(alice)
        listing = client.get("/").content.decode()
        assert listing.count("waiting for a worker (") == 6 and "waiting for a worker (5 ahead)" in listing
        last = next(pk for pk, ahead in waiting.items() if ahead == 5)
        assert "waiting for a worker (5 ahead)" in client.get(f"/sessions/{last}/").content.decode()
        assert "waiting for a worker (5 ahead)" in client.get(f"/sessions/{last}/waiting/").content.decode()

        # Every turn thread is busy: the health watch still sees a server die, as usual.
        os.kill(ServerRecord.objects.get(session_id=last).pid, signal.SIGKILL)
        wait_for(lambda: AgentSession.objects.get(pk=last).status == "exited", 5, interval=0.05, what="exited in 5 s")
        assert sum(turns.lease_held(AgentSession.objects.get(pk=s.pk)) for s in sessions) == 4  # still streaming

        # The queue drains: every turn ends, the waiting note goes away.
        wait_for(lambda: all(payloads(s, "turn_end") for s in sessions), 120, interval=0.5, what="every turn to end")
        assert turns.waiting_for_worker() == {}
        assert "waiting for a worker (" not in client.get(f"/sessions/{last}/waiting/").content.decode()
    finally:
        stack.stop_worker(name="turns")
        stack.stop_worker()
        stack.start_worker()


def test_a_daphne_that_died_leaves_the_group_at_once_and_a_live_one_gets_the_events(stack, alice, tmp_path):
    """A daphne killed outright never runs its consumers' disconnect. Its subscriptions
    belong to its Redis connection, which closes with the process: the group loses it at
    once, and the next daphne's page gets every event."""
    from .helpers import members

    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status=AgentSession.Status.IDLE)
    client = Client()
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    group = broadcast.group_name(session.pk)
    dead = live = None
    try:
        dead = WSRecorder(stack.ws_url(session.pk), cookie=cookie, origin=stack.base_url)
        wait_for(lambda: members(group) == 1, 10, what="the first socket to join")
        stack.procs.pop("web").kill()  # SIGKILL: no disconnect runs
        wait_for(lambda: members(group) == 0, 5, interval=0.05, what="the dead daphne to leave the group")
        stack.start_web()
        live = WSRecorder(stack.ws_url(session.pk), cookie=cookie, origin=stack.base_url)
        wait_for(lambda: members(group) == 1, 10, what="the second socket to join")
        record_event(session.pk, "notice", {"message": "still here"})
        wait_for(lambda: any(m["ops"] for m in live.messages), 10, what="the live socket to get the event")
        assert members(group) == 1
    finally:
        for recorder in (dead, live):
            if recorder is not None:
                recorder.close()


@pytest.mark.parametrize(("turn_active", "status", "polls"), [
    (False, "idle", False),  # nothing open: an idle page asks nothing
    (True, "idle", True),  # a turn queued for a worker
    (True, "running", True),  # running now, and may wait again after a tool call
    (True, "awaiting_input", False),  # a question waits for a person, not for a worker
])
def test_the_waiting_note_polls_only_while_its_turn_may_wait_for_a_worker(
        local_machine, alice, tmp_path, turn_active, status, polls):
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status=status, turn_active=turn_active)
    client = Client()
    client.force_login(alice)
    note = client.get(f"/sessions/{session.pk}/waiting/").content.decode()
    page = client.get(f"/sessions/{session.pk}/").content.decode()
    assert ("every 3s" in note) is polls
    assert ('hx-trigger="every 3s, refresh"' in page) is polls  # the first paint says the same
    assert ('hx-trigger="refresh"' in page) is not polls  # else it waits for session.js to ask
