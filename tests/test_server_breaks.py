"""The servers package attacked where its steps meet (docs/behaviour.md §5): a Stop
pressed while the start still loads, two Restarts at once, a recorded pid that another
process took since, and a slot saved for a session deleted meanwhile."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest
from django.db import connection
from django.utils import timezone

from machines_app.transports import LocalTransport
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.slots import save_before_stop
from sessions_app.servers.start import restart_server, start_server
from sessions_app.servers.stop import sleep_server, stop_server
from sessions_app.servers.watch import check_server

from .conftest import model_key, wait_for
from .helpers import fresh
from .test_start_races import servers_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def in_threads(*targets):
    errors: list[BaseException] = []

    def run(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    return threads, errors


def test_stop_pressed_while_the_start_still_loads_leaves_it_stopped_and_nothing_running(fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_LOADING_SECONDS="4")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    threads, errors = in_threads(lambda: start_server(session.pk))
    try:
        wait_for(lambda: ServerRecord.objects.filter(session=session).exists(), 30, what="the record")
        stop_server(session.pk)
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert fresh(session).status == "stopped"
        assert servers_of(session) == [] and not ServerRecord.objects.filter(session=session).exists()
        kinds = list(TranscriptEvent.objects.filter(session=session).order_by("seq").values_list("kind", flat=True))
        assert "server_ready" not in kinds and "error" not in kinds, kinds
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_two_restarts_at_once_leave_one_server_and_the_session_idle(fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_LOADING_SECONDS="1")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    try:
        start_server(session.pk)
        assert fresh(session).status == "idle"
        threads, errors = in_threads(lambda: restart_server(session.pk), lambda: restart_server(session.pk))
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert fresh(session).status == "idle"
        assert len(servers_of(session)) == 1 and ServerRecord.objects.filter(session=session).count() == 1
        assert not TranscriptEvent.objects.filter(session=session, kind="error").exists()
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_a_recorded_pid_another_process_took_is_exited_and_that_process_is_left_alone(fake_machine, alice,
                                                                                       tmp_path):
    machine = fake_machine()
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="idle")
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        # The record's pid is the stranger's; its start time is the (gone) server's.
        record = ServerRecord.objects.create(session=session, machine=machine, model_key=session.model_key,
                                             pid=stranger.pid, start_time="1", port=1, api_key="k",
                                             log_path=str(tmp_path / "none.log"), ready_at=timezone.now())
        check_server(ServerRecord.objects.select_related("machine", "session").get(pk=record.pk))
        assert fresh(session).status == "exited"
        assert stranger.poll() is None
        # And a Stop of such a record signals nobody either.
        ServerRecord.objects.create(session=session, machine=machine, model_key=session.model_key,
                                    pid=stranger.pid, start_time="1", port=1, api_key="k",
                                    log_path=str(tmp_path / "none.log"))
        stop_server(session.pk)
        assert stranger.poll() is None and fresh(session).status == "stopped"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_slot_save_for_a_session_deleted_meanwhile_saves_nothing_and_does_not_fail(fake_machine, alice, tmp_path):
    machine = fake_machine()
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="idle")
    record = ServerRecord.objects.create(session=session, machine=machine, model_key=session.model_key, pid=1,
                                         start_time="1", port=1, api_key="k", log_path=str(tmp_path / "none.log"),
                                         ready_at=timezone.now(), slot_key="k" * 16)
    record = ServerRecord.objects.select_related("machine").get(pk=record.pk)
    AgentSession.objects.filter(pk=session.pk).delete()  # the stop had read its record first
    save_before_stop(record, LocalTransport())
    assert not SlotSave.objects.exists()


def test_a_session_deleted_while_its_stop_waits_out_the_grace_ends_the_stop_quietly(fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_IGNORE_TERM="1")  # the stop waits the whole grace, then SIGKILL
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    try:
        start_server(session.pk)
        assert fresh(session).status == "idle"
        threads, errors = in_threads(lambda: stop_server(session.pk))
        wait_for(lambda: ServerRecord.objects.filter(session=session, stopping=True).exists(), 30, what="stopping")
        AgentSession.objects.filter(pk=session.pk).delete()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert servers_of(session) == []
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_an_idle_stop_for_a_session_deleted_since_the_watch_found_it_does_nothing(alice, local_machine, tmp_path):
    session = AgentSession.objects.create(owner=alice, machine=local_machine, working_dir=str(tmp_path),
                                          model_key=model_key(local_machine, "llama"), status="idle")
    AgentSession.objects.filter(pk=session.pk).delete()
    assert sleep_server(session.pk) is False


def test_a_server_whose_worker_died_before_recording_it_is_stopped_by_the_next_start(fake_machine, alice, tmp_path):
    from machines_app import catalog
    from machines_app.transports import transport_for
    from sessions_app.servers import start

    machine = fake_machine()
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    try:
        # What a worker killed between the spawn and the record leaves: the process, no row.
        # (A stand-in for the kill: _spawn's own steps up to the launch, then nothing.)
        transport = transport_for(machine)
        model = catalog.model_for_session(machine, session.model_key)
        port = transport.free_port()
        spec = start._spec(session, transport, model, port, start.key_path_for(session, transport, port))
        start._launch(session, transport, model, spec, start.log_path_for(session, transport, port))
        lost = wait_for(lambda: servers_of(session), 30, what="the lost server")
        start_server(session.pk)  # the watch's recovery, or a Restart
        assert fresh(session).status == "idle"
        assert len(servers_of(session)) == 1 and not set(lost) & set(servers_of(session))
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_a_session_deleted_while_its_server_loads_leaves_nothing_running(fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_LOADING_SECONDS="4")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    threads, errors = in_threads(lambda: start_server(session.pk))
    try:
        wait_for(lambda: servers_of(session) and ServerRecord.objects.filter(session=session).exists(), 30,
                 what="the loading server")
        AgentSession.objects.filter(pk=session.pk).delete()  # no stop worker here: the start must notice
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert servers_of(session) == []
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)


def test_stop_pressed_twice_at_once_stops_once_and_says_so_once(fake_machine, alice, tmp_path):
    machine = fake_machine(FAKE_IGNORE_TERM="1")  # the first stop waits out the grace
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status="loading")
    try:
        start_server(session.pk)
        threads, errors = in_threads(lambda: stop_server(session.pk), lambda: stop_server(session.pk))
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert fresh(session).status == "stopped" and servers_of(session) == []
        assert TranscriptEvent.objects.filter(session=session, kind="server_stopped").count() == 1
    finally:
        for pid in servers_of(session):
            os.kill(pid, 9)
