"""Corral keeps running: a step whose worker restarted is taken over within seconds, and
housekeeping runs on time while every turn thread streams (real worker, daphne, Redis,
the stand-in llama-server)."""

from __future__ import annotations

import signal

import pytest

from project.celery import app
from sessions_app import actions, agent, turns
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def start_session(machine, user, tmp_path) -> AgentSession:
    session = actions.do_create_session(
        user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={}, sampling={}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 30, what="idle")
    return AgentSession.objects.get(pk=session.pk)


def payloads(session, kind):
    return [e.payload for e in TranscriptEvent.objects.filter(session=session, kind=kind).order_by("seq")]


@pytest.fixture
def long_leases(stack):
    """The stack's worker with the production lease (60 s): a takeover seen within 10 s
    cannot be the lease lapsing."""
    stack.stop_worker()
    stack.env["CORRAL_LEASE_SECONDS"] = "60"
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
    assert owner.split(" ")[2] in {name for reply in app.control.ping(timeout=1) for name in reply}

    stack.stop_worker(sig=signal.SIGKILL)
    assert turns.lease_held(AgentSession.objects.get(pk=session.pk))  # 60 s to go
    stack.start_worker()  # returns once the new worker answers a ping
    wait_for(lambda: payloads(session, "turn_end"), 10, what="the takeover (not the 60 s lease)")
    assert {"message": turns.RESUMING_NOTICE} in payloads(session, "notice")
    assert payloads(session, "error")[-1]["message"] == agent.WORKER_LOST_REPLY
    assert [p["reason"] for p in payloads(session, "turn_end")] == ["interrupted"]
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
