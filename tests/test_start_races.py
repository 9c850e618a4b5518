"""One start at a time (docs/behaviour.md §5): two start tasks for one session never spawn
two servers, and a start that was lost leaves a session that can be restarted — by a
person, or by the housekeeping rounds on their own."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from sessions_app import actions, server_state
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import StartClaim, start_server
from sessions_app.servers.watch import LOST_START

from .conftest import model_key, wait_for
from .helpers import fresh

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def servers_of(session, private_dir=None) -> list[int]:
    """Pids of every live process started with this session's key files (one per start),
    in the private directory of the Corral that started it (this test process's unless
    given: other Corrals on this machine have sessions of the same id)."""
    mark = f"{private_dir or settings.CORRAL_LOG_DIR}/session-{session.pk}-".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        # bubblewrap and its init carry the server's command line too: the server is the one
        # that is not bwrap (docs/security.md).
        sandbox = argv[0].endswith(b"bwrap")
        if state != "Z" and not sandbox and b"--api-key-file" in argv and any(mark in part for part in argv):
            found.append(int(pid))
    return found


def test_two_concurrent_starts_of_one_session_spawn_one_server(fake_machine, alice, tmp_path):
    # The stand-in answers /health 503 for 2 s, so both starts are in flight together.
    machine = fake_machine(FAKE_LOADING_SECONDS="2")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def start():
        try:
            barrier.wait()
            start_server(session.pk)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert not errors, errors
        assert fresh(session).status == "idle"
        assert len(servers_of(session)) == 1
        assert ServerRecord.objects.filter(session=session).count() == 1
        assert TranscriptEvent.objects.filter(session=session, kind="server_ready").count() == 1
        assert fresh(session).start_owner == ""  # the claim was let go
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_a_start_that_holds_the_claim_makes_a_second_one_leave(fake_machine, alice, tmp_path):
    machine = fake_machine()
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    with StartClaim(session.pk) as first:
        assert first.held and server_state.start_live(fresh(session))
        start_server(session.pk)  # a second task: finds the claim held, does nothing
        assert servers_of(session) == [] and not ServerRecord.objects.filter(session=session).exists()
        with pytest.raises(actions.SessionError, match="already starting"):
            actions.do_restart(fresh(session), alice)
    assert not server_state.start_live(fresh(session))


def test_a_lost_start_can_be_restarted_and_the_watch_starts_it_by_itself(stack, local_machine, alice, tmp_path):
    logs = stack.data_dir / "logs"  # the worker's private directory
    # A start whose task was lost with the broker: the session says loading, nobody starts it.
    session = AgentSession.objects.create(owner=alice, machine=local_machine,
                                          model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
                                          status="loading", server_params={"contextSize": 2048})
    assert not server_state.start_live(session)
    # Restart is not refused with "already starting": no start is alive.
    actions.do_restart(fresh(session), alice)
    wait_for(lambda: fresh(session).status == "idle", 120, what="the restarted server")
    assert len(servers_of(session, logs)) == 1

    # Lost again, and nobody clicks: the housekeeping rounds find it and starts it.
    actions.do_stop(fresh(session), alice)
    wait_for(lambda: fresh(session).status == "stopped" and not servers_of(session, logs), 60, what="stopped")
    AgentSession.objects.filter(pk=session.pk).update(
        status="loading", last_activity_at=timezone.now() - timedelta(minutes=5)
    )
    wait_for(lambda: fresh(session).status == "idle", 120, what="the watch to start the lost start again")
    notices = [e.payload["message"] for e in TranscriptEvent.objects.filter(session=session, kind="notice")]
    assert LOST_START in notices
    found = servers_of(session, logs)
    assert len(found) == 1, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in found]
