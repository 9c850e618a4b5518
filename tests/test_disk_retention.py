"""The disk stays bounded (docs/operations.md, "Disk").

- llama-server logs: one per start, the newest CORRAL_SERVER_LOGS_KEPT kept at each start,
  all of them deleted with the session (local and over SSH, through the transport).
- Saved slots (the prompt cache, megabytes each): deleted by housekeeping once a session
  has had no running server for CORRAL_SLOT_KEEP_HOURS; the transcript says so, and the
  next start is cold. With the real llama-server and its real slot file.
- The launcher's own output: tests/test_supervision.py
  (``test_the_launchers_output_is_kept_in_a_rotated_log_file``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from machines_app.llama_server import slot_dir, slot_file_name
from machines_app.transports import machine_place, transport_for
from sessions_app import actions, dispatch
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.logs import prune_server_logs, remove_server_logs
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.slots import SLOT_EXPIRED, forget_old_slots
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import model_key, wait_for
from .helpers import converse, fresh, idle_warm_session, payloads, restart, slot_path, stop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def _logs_of(directory: Path, session_id: int) -> list[str]:
    return sorted(p.name for p in directory.glob(f"session-{session_id}-*.log"))


def test_a_session_keeps_its_newest_server_logs_and_none_once_deleted(fake_machine, alice, tmp_path, settings,
                                                                     monkeypatch):
    settings.CORRAL_SERVER_LOGS_KEPT = 2
    settings.CORRAL_LOG_DIR = tmp_path / "logs"
    settings.CORRAL_LOG_DIR.mkdir()
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)) or True)
    machine = fake_machine()
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                          working_dir=str(tmp_path), status=AgentSession.Status.LOADING)
    other = AgentSession.objects.create(owner=alice, machine=machine, model_key=model_key(machine, "llama"),
                                        working_dir=str(tmp_path), status=AgentSession.Status.LOADING)
    start_server(other.pk)
    stop_server(other.pk)
    logs = []
    for start in range(4):
        AgentSession.objects.filter(pk=session.pk).update(status=AgentSession.Status.LOADING)
        start_server(session.pk)
        assert fresh(session).status == "idle"
        current = Path(ServerRecord.objects.get(session=session).log_path)
        logs.append(current.name)
        stop_server(session.pk)
        kept = _logs_of(settings.CORRAL_LOG_DIR, session.pk)
        assert current.name in kept and len(kept) == min(start + 1, 2), kept
        time.sleep(0.05)  # the next start's file is newer
    assert _logs_of(settings.CORRAL_LOG_DIR, session.pk) == sorted(logs[-2:])

    actions.do_delete(fresh(session), alice)
    removals = [args for task, args in sent if task == dispatch.REMOVE_LOGS]
    assert len(removals) == 1
    remove_server_logs(*removals[0])  # what the servers worker runs
    assert _logs_of(settings.CORRAL_LOG_DIR, session.pk) == []
    assert len(_logs_of(settings.CORRAL_LOG_DIR, other.pk)) == 1  # another session's log is its own


def test_server_logs_over_ssh_are_pruned_through_the_transport(ssh_machine, alice, tmp_path):
    transport = transport_for(ssh_machine)
    directory = transport.private_dir()
    transport.make_private_dir(directory)
    paths = [f"{directory}/session-990{i % 2}-{40000 + i}.log" for i in range(6)]
    for age, path in enumerate(reversed(paths)):
        transport.write_private(path, "llama-server said things\n")
        os.utime(path, (time.time() - 100 * age, time.time() - 100 * age))  # the sshd is this machine
    assert prune_server_logs(transport, 9900, 1) == 2
    names = sorted(name for name, _ in transport.list_files(directory) if name.startswith("session-990"))
    # 9900's newest (port 40004) stays; 9901's three are not its business.
    assert names == ["session-9900-40004.log", "session-9901-40001.log", "session-9901-40003.log",
                     "session-9901-40005.log"]
    remove_server_logs(machine_place(ssh_machine), 9901)
    assert sorted(n for n, _ in transport.list_files(directory) if n.startswith("session-990")) == [
        "session-9900-40004.log"]
    transport.remove(f"{directory}/session-9900-40004.log")


def test_a_saved_slot_older_than_the_setting_is_deleted_and_the_next_start_is_cold(stack, local_machine, alice,
                                                                                 tmp_path):
    """The real llama-server saves the slot when its session stops; housekeeping (the
    stack's worker, which runs the servers) deletes it once it is older than
    CORRAL_SLOT_KEEP_HOURS, says so in the transcript, and the next start reads no cache."""
    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["My sheep is called Dolly."])
    stop(session, alice)
    save = SlotSave.objects.get(session=session)
    path = slot_path(stack, session, save)
    assert path.is_file() and save.n_tokens > 0

    recent = idle_warm_session(local_machine, alice, tmp_path)
    converse(recent, alice, ["Hello."])
    stop(recent, alice)
    recent_path = slot_path(stack, recent, SlotSave.objects.get(session=recent))
    SlotSave.objects.filter(pk=save.pk).update(saved_at=timezone.now() - timedelta(hours=73))

    dispatch.enqueue("sessions_app.tasks.forget_old_slots")
    wait_for(lambda: not SlotSave.objects.filter(pk=save.pk).exists(), 60, what="the old slot deleted")
    assert not path.exists()
    notices = [p["message"] for p in payloads(session, "notice")]
    assert SLOT_EXPIRED.format(hours="72 hours") in notices, notices
    assert recent_path.is_file() and SlotSave.objects.filter(session=recent).exists()
    assert not [p for p in payloads(recent, "notice") if "prompt cache" in p["message"]]

    restart(session, alice)
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]  # cold, as the notice said
    converse(session, alice, ["What is my sheep called?"])
    assert payloads(session, "turn_end")[-1]["reason"] == "done"


def test_an_old_slot_on_an_ssh_machine_is_deleted_there(ssh_machine, alice, tmp_path):
    """The same housekeeping for a machine reached over SSH: the file goes through the
    transport; a recent slot and the slot of a session whose server runs stay."""
    transport = transport_for(ssh_machine)
    sessions, saves = [], []
    for status in ("sleeping", "stopped", "sleeping"):
        session = AgentSession.objects.create(owner=alice, machine=ssh_machine, working_dir=str(tmp_path),
                                              model_key=model_key(ssh_machine, "llama"), status=status)
        save = SlotSave.objects.create(session=session, machine=ssh_machine, model_key=session.model_key,
                                       fingerprint="f", n_tokens=10)
        directory = slot_dir(transport.private_dir(), session.pk)
        transport.make_private_dir(str(Path(directory).parent))
        transport.make_private_dir(directory)
        transport.write_private(f"{directory}/{slot_file_name(session.pk, save.pk)}", "kv cache\n")
        sessions.append(session)
        saves.append(save)
    old = timezone.now() - timedelta(hours=100)
    SlotSave.objects.filter(pk__in=[saves[0].pk, saves[1].pk]).update(saved_at=old)
    assert sorted(forget_old_slots()) == sorted([sessions[0].pk, sessions[1].pk])
    for session, save, kept in zip(sessions, saves, (False, False, True), strict=True):
        path = f"{slot_dir(transport.private_dir(), session.pk)}/{slot_file_name(session.pk, save.pk)}"
        assert transport.is_own_file(path) is kept
        assert SlotSave.objects.filter(pk=save.pk).exists() is kept
        said = TranscriptEvent.objects.filter(session=session, kind="notice").exists()
        assert said is not kept
    assert forget_old_slots() == []  # nothing twice
