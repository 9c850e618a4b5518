"""Which host does what (docs/operations.md, "More hosts"), on one database: tasks on a
host's own local machine go to that host's queues, SSH machines' to the shared ones; a
host never judges, stops or reads another host's local machine; setup gives each host
its own local machine; a worker name is refused while a live worker holds it.

The real two-host run, with a second host in namespaces of its own, is
tests/test_two_hosts.py.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from machines_app.models import Machine, PendingStop
from machines_app.transports import ElsewhereError, machine_place, transport_at, transport_for
from project import queues
from sessions_app import dispatch, liveness, orphans, rounds
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.slots import forget_old_slots
from sessions_app.servers.watch import (
    LOST_START,
    check_session_server,
    link_broken,
    recover_starts,
    server_gone,
    watch_servers,
)

from .conftest import wait_for

pytestmark = pytest.mark.django_db

Status = AgentSession.Status
OTHER = "other-host-1234abcd"


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create(username="alice")


def session_on(machine: Machine, owner) -> AgentSession:
    return AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir="/tmp",
                                       status=Status.IDLE)


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, tuple, str | None]]:
    """(task, args, queue) of every task handed to the broker; queue None: by its route."""
    calls = []

    def send_task(name, args=(), queue=None, **_kwargs):
        calls.append((name, tuple(args), queue))

    monkeypatch.setattr(dispatch.current_app, "send_task", send_task)
    return calls


def test_a_local_machine_made_here_is_this_hosts_and_an_ssh_machine_belongs_to_no_host():
    local = Machine.objects.create(name="here")
    ssh = Machine.objects.create(name="gpu", transport="ssh", host="gpu.example")
    assert local.corral_host == settings.CORRAL_HOST_ID and local.owner_host == settings.CORRAL_HOST_ID
    assert ssh.owner_host == ""


def test_work_on_a_hosts_own_machine_goes_to_that_hosts_queues_and_ssh_work_to_the_shared_ones(alice, sent):
    theirs = Machine.objects.create(name="theirs", corral_host=OTHER)
    ssh = Machine.objects.create(name="gpu", transport="ssh", host="gpu.example", corral_host=OTHER)
    on_theirs, on_ssh = session_on(theirs, alice), session_on(ssh, alice)
    for task in (dispatch.RUN_TURN, dispatch.START_SERVER, dispatch.STOP_SERVER, dispatch.RESTART_SERVER,
                 dispatch.SLEEP_SERVER):
        dispatch.enqueue(task, on_theirs.pk)
        dispatch.enqueue(task, on_ssh.pk)
    dispatch.enqueue(dispatch.STOP_PROCESS, machine_place(theirs), 10, "1", 8080, on_theirs.pk)
    dispatch.enqueue(dispatch.REMOVE_SLOT, machine_place(ssh), on_ssh.pk, 1)
    dispatch.enqueue(dispatch.REFRESH_MODELS, theirs.pk)
    dispatch.enqueue(dispatch.PUSH_QUESTION, on_theirs.pk, "q1")
    expected = []
    for task, kind in ((dispatch.RUN_TURN, queues.TURNS), (dispatch.START_SERVER, queues.SERVERS),
                       (dispatch.STOP_SERVER, queues.SERVERS), (dispatch.RESTART_SERVER, queues.SERVERS),
                       (dispatch.SLEEP_SERVER, queues.SERVERS)):
        expected += [(task, (on_theirs.pk,), f"{kind}.{OTHER}"), (task, (on_ssh.pk,), None)]
    expected += [
        (dispatch.STOP_PROCESS, (machine_place(theirs), 10, "1", 8080, on_theirs.pk), f"servers.{OTHER}"),
        (dispatch.REMOVE_SLOT, (machine_place(ssh), on_ssh.pk, 1), None),
        (dispatch.REFRESH_MODELS, (theirs.pk,), f"housekeeping.{OTHER}"),
        (dispatch.PUSH_QUESTION, (on_theirs.pk, "q1"), None),  # a Web Push: any host
    ]
    assert sent == expected


def test_the_watch_never_judges_another_hosts_server_and_never_reaches_its_machine(alice, sent):
    # On host 2 the pid of host 1's server is not there and its port refuses: judged from
    # here it would be "exited by itself" while it runs on untracked.
    theirs = Machine.objects.create(name="theirs", corral_host=OTHER)
    session = session_on(theirs, alice)
    record = ServerRecord.objects.create(session=session, machine=theirs, model_key="m.gguf", pid=2 ** 22 + 7,
                                         start_time="1", port=1, log_path="/nonexistent", ready_at=timezone.now())
    watch_servers()
    watch_servers(host=settings.CORRAL_HOST_ID)
    check_session_server(session.pk)  # even asked directly
    assert ServerRecord.objects.filter(pk=record.pk).exists()
    assert AgentSession.objects.get(pk=session.pk).status == Status.IDLE
    assert link_broken(session.pk) is None and not server_gone(session.pk)
    with pytest.raises(ElsewhereError, match=f"local machine of the Corral host {OTHER}"):
        transport_for(theirs)
    with pytest.raises(ElsewhereError):
        transport_at(machine_place(theirs))
    # A stop left pending there is that host's to settle.
    PendingStop.objects.create(machine=theirs, place=machine_place(theirs), pid=record.pid, start_time="1", port=1,
                               session_id=session.pk, reason="unreachable")
    assert orphans.settle_pending_stops() == 0
    assert PendingStop.objects.get().reason == "unreachable"


def test_the_watch_of_this_hosts_own_machine_still_sees_its_dead_server(alice):
    mine = Machine.objects.create(name="mine")
    session = session_on(mine, alice)
    ServerRecord.objects.create(session=session, machine=mine, model_key="m.gguf", pid=2 ** 22 + 7, start_time="1",
                                port=1, log_path="/nonexistent", ready_at=timezone.now())
    watch_servers()  # the shared round leaves a host's own machine to that host
    assert AgentSession.objects.get(pk=session.pk).status == Status.IDLE
    watch_servers(host=settings.CORRAL_HOST_ID)
    assert AgentSession.objects.get(pk=session.pk).status == Status.EXITED


def test_setup_claims_the_unclaimed_local_machine_and_a_second_host_gets_its_own(settings):
    from machines_app.management.commands.corral_setup import ensure_local_machine

    old = Machine.objects.create(name="local", corral_host="")  # made before hosts had ids
    settings.CORRAL_LLAMA_SERVER = "/bin/true"
    settings.CORRAL_HOST_ID = "first-1"
    assert ensure_local_machine().pk == old.pk
    assert Machine.objects.get(pk=old.pk).corral_host == "first-1"
    settings.CORRAL_HOST_ID = "second-2"
    second = ensure_local_machine()
    assert (second.name, second.corral_host) == ("local-second-2", "second-2")
    assert ensure_local_machine().pk == second.pk  # every later start finds it
    settings.CORRAL_HOST_ID = "first-1"
    assert ensure_local_machine().pk == old.pk


@pytest.mark.django_db(transaction=False)
def test_a_name_held_by_a_live_worker_is_refused_and_one_left_by_a_dead_worker_is_not(monkeypatch):
    """Real Redis: a key renewed by a heartbeat is live; a key nobody renews is not."""

    monkeypatch.setattr(liveness, "BEAT_SECONDS", 0.2)
    monkeypatch.setattr(liveness, "LAPSE_SECONDS", 3.0)
    name = f"turns@routing-test-{os.getpid()}-{threading.get_ident()}"
    beat = liveness.Heartbeat(name).start()
    try:
        wait_for(lambda: liveness.worker_pid(name) == os.getpid(), 10, what="the first beat")
        assert liveness.name_in_use(name, watch=1.0) == os.getpid()
    finally:
        beat.stop()
    # Its key is still there (it lapses after 3 s) but no longer renewed: a restart.
    assert liveness.worker_pid(name) == os.getpid()
    assert liveness.name_in_use(name, watch=1.0) is None
    assert liveness.name_in_use(name + "-never", watch=0.3) is None


def test_a_worker_reading_a_shared_queue_reads_its_hosts_own_too_whatever_its_command_line():
    # A unit written before hosts had ids (`-Q turns -n turns@%h`) must not leave this
    # host's own turns waiting in turns.<host id>.
    from types import SimpleNamespace

    from celery import Celery

    from sessions_app import tasks

    app = Celery(set_as_current=False)
    app.amqp.queues.select(["turns"])
    tasks.read_this_hosts_own_queues(sender="turns@old-unit", instance=SimpleNamespace(app=app))
    assert set(app.amqp.queues.consume_from) == {"turns", f"turns.{settings.CORRAL_HOST_ID}"}
    tasks.read_this_hosts_own_queues(sender="turns@old-unit", instance=SimpleNamespace(app=app))
    assert len(app.amqp.queues.consume_from) == 2


# --- housekeeping by host: old slots, lost starts -------------------------------------------


def _old_slot(machine: Machine, owner) -> AgentSession:
    session = session_on(machine, owner)
    AgentSession.objects.filter(pk=session.pk).update(status=Status.STOPPED)
    save = SlotSave.objects.create(session=session, machine=machine, model_key="m.gguf", fingerprint="f", n_tokens=5)
    SlotSave.objects.filter(pk=save.pk).update(saved_at=timezone.now() - timedelta(days=30))
    return session


def test_old_slots_are_forgotten_by_the_host_that_reaches_them(alice, monkeypatch):
    """Issue 23: the slot clean-up ran on whichever host took it, over every machine: on
    another host's local machine it met ElsewhereError each round and left the file. The
    shared part takes the machines every host reaches; each host's own local machine is
    its own share, run by that host's housekeeping rounds (sessions_app/rounds.py)."""
    mine = _old_slot(Machine.objects.create(name="here"), alice)
    theirs = _old_slot(Machine.objects.create(name="there", corral_host=OTHER), alice)
    shared = _old_slot(Machine.objects.create(name="unclaimed", corral_host=""), alice)

    assert forget_old_slots() == [shared.pk]  # no host's own local machine
    assert forget_old_slots(host=settings.CORRAL_HOST_ID) == [mine.pk]
    assert list(SlotSave.objects.values_list("session_id", flat=True)) == [theirs.pk]  # its host's to forget

    forgotten = []
    monkeypatch.setattr(rounds.slots, "forget_old_slots", lambda host=None: forgotten.append(host))
    rounds.forget_old_slots(rounds.Share(shared=True, host=settings.CORRAL_HOST_ID, worker="w"))
    assert forgotten == [None, settings.CORRAL_HOST_ID]
    forgotten.clear()
    rounds.forget_old_slots(rounds.Share(shared=False, host=OTHER, worker="w"))
    assert forgotten == [OTHER]  # the other host's rounds, for its own machine only


def test_a_lost_start_on_a_host_that_is_down_is_not_queued_again_every_round(alice, monkeypatch):
    """Issue 23: a start lost on a host that is down was queued again at every watch (its
    host's queue only grew until it came back). It waits for its host; the others are
    started again as before, and when Redis cannot tell who is alive, every one is."""
    stale = timezone.now() - timedelta(hours=1)
    loading = []
    for machine in (Machine.objects.create(name="here"), Machine.objects.create(name="there", corral_host=OTHER),
                    Machine.objects.create(name="unclaimed", corral_host="")):
        session = session_on(machine, alice)
        AgentSession.objects.filter(pk=session.pk).update(status=Status.LOADING, last_activity_at=stale)
        loading.append(session.pk)
    here, there, unclaimed = loading
    queued = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: queued.append((task, args)) or True)

    monkeypatch.setattr(liveness, "live_hosts", lambda: {settings.CORRAL_HOST_ID})
    assert sorted(recover_starts()) == sorted([here, unclaimed])
    assert sorted(queued) == sorted([(dispatch.START_SERVER, (here,)), (dispatch.START_SERVER, (unclaimed,))])
    assert not TranscriptEvent.objects.filter(session_id=there, kind="notice").exists()
    assert TranscriptEvent.objects.get(session_id=here, kind="notice").payload["message"] == LOST_START

    queued.clear()
    AgentSession.objects.filter(pk__in=loading).update(last_activity_at=stale)  # the notice touched them
    monkeypatch.setattr(liveness, "live_hosts", lambda: None)  # Redis cannot say
    assert sorted(recover_starts()) == sorted(loading)


# --- a page's read-only questions about another host's local machine -------------------------


def test_the_owner_host_answers_only_read_only_questions_about_its_own_machine(tmp_path):
    """relay.answer, as the owner host's housekeeping worker runs it: read-only methods of
    the allow-list, with checked arguments; anything else, and any machine that is not
    this host's own, is refused in a sentence that travels back to the page."""
    from machines_app.transports import relay

    mine = machine_place(Machine(name="mine", corral_host=settings.CORRAL_HOST_ID))
    (tmp_path / "work").mkdir()
    (tmp_path / "t.jinja").write_bytes(b"{{ messages }}")
    assert relay.answer(mine, "is_dir", [str(tmp_path / "work")]) == {"ok": True}
    assert relay.answer(mine, "real_path", [str(tmp_path / "work" / "..")]) == {"ok": str(tmp_path)}
    assert relay.answer(mine, "file_info", [str(tmp_path / "t.jinja")]) == {"ok": ["file", 14]}
    head = relay.answer(mine, "read_head", [str(tmp_path / "t.jinja"), 5, 3])["ok"]
    assert relay._unbytes(head) == b"messa"
    gone = relay.answer(mine, "read_head", [str(tmp_path / "none"), 5, 0])["oserror"]
    assert gone[0] == 2 and gone[2] == str(tmp_path / "none")

    for method, args in (("remove", [str(tmp_path / "t.jinja")]), ("spawn", [["sleep", "9"], "/tmp/x"]),
                         ("_run_command", [["true"]]), ("stop", [1, "1"]), ("log_tail", ["/etc/shadow"])):
        refused = relay.answer(mine, method, args)
        assert refused == {"error": f"{method!r} is not a read-only operation a page may ask of another host",
                           "permanent": True}
    assert (tmp_path / "t.jinja").exists()
    assert "not one a page may run" in relay.answer(mine, "run_probe", [["rm", "-rf", str(tmp_path)]])["error"]
    assert "not a file a page may read" in relay.answer(mine, "read_proc", [1, "environ"])["error"]
    assert "at most" in relay.answer(mine, "read_head", ["/dev/zero", relay.MAX_READ_BYTES + 1, 0])["error"]
    assert "could not be asked that way" in relay.answer(mine, "is_dir", [])["error"]
    # A worker handed a call for a machine that is not its host's own still refuses it.
    theirs = machine_place(Machine(name="theirs", corral_host=OTHER))
    refused = relay.answer(theirs, "is_dir", ["/"])
    assert refused["error"].startswith(f"Machine 'theirs' is the local machine of the Corral host {OTHER}; "
                                       "only that host reaches it") and refused["elsewhere"]


@pytest.fixture
def other_host_worker(tmp_path):
    """A real Celery worker of another Corral host (CORRAL_HOST_ID=OTHER) on this box,
    consuming only that host's own housekeeping queue, as ``worker housekeeping`` there
    would; ``stop()`` ends it."""
    import subprocess
    import sys

    import redis

    from .conftest import ROOT, _database_url

    data = tmp_path / "other-host"
    data.mkdir()
    env = {**os.environ, "DATABASE_URL": _database_url(), "REDIS_URL": settings.REDIS_URL,
           "SECRET_KEY": settings.SECRET_KEY, "CORRAL_DATA_DIR": str(data), "CORRAL_HOST_ID": OTHER,
           "PYTHONUNBUFFERED": "1"}
    name = queues.worker_name(queues.HOUSEKEEPING, OTHER)
    # Calls an earlier run left unanswered there expire unrun; a fresh queue keeps the counts exact.
    redis.Redis.from_url(settings.REDIS_URL).delete(queues.on_host(queues.HOUSEKEEPING, OTHER))
    log = open(tmp_path / "other-host.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", queues.on_host(queues.HOUSEKEEPING, OTHER),
         "-n", name, "-P", "threads", "-c", "2", "--without-gossip", "--without-mingle", "-l", "info"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()

    proc.stop = stop  # type: ignore[attr-defined]
    proc.log = lambda: (tmp_path / "other-host.log").read_text(errors="replace")  # type: ignore[attr-defined]
    try:
        wait_for(lambda: liveness.worker_pid(name) == proc.pid, 90, what="the other host's housekeeping worker")
        yield proc
    finally:
        stop()
        log.close()


def test_a_page_checks_a_working_directory_on_another_hosts_machine_through_that_host(
        alice, other_host_worker, tmp_path, monkeypatch):
    """Before, a page on host 1 asked about host 2's local machine met ElsewhereError's
    sentence: nobody could start a session there from host 1's web. Now it is asked of that
    host's housekeeping worker (real Celery, real Redis); a host that does not answer is
    said within the bound, never waited for."""
    import time

    from machines_app import actions as machine_actions
    from machines_app import catalog
    from machines_app.models import ModelFile
    from machines_app.transports import RelayTransport, TransportError, reader_for, relay
    from machines_app.workspaces import WorkingDirRefused, check_working_dir
    from sessions_app.forms import NewSessionForm

    theirs = Machine.objects.create(name="theirs", corral_host=OTHER, workspace_roots=str(tmp_path),
                                    models_dir=str(tmp_path / "models" / ".."))
    ModelFile.objects.create(machine=theirs, key="sub/m.gguf", display_name="M", architecture="llama")
    (tmp_path / "work").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "work")
    with pytest.raises(ElsewhereError):
        transport_for(theirs)  # this process itself still may not touch it
    assert isinstance(reader_for(theirs), RelayTransport)

    def calls_run() -> int:
        return sum(1 for line in other_host_worker.log().splitlines()
                   if "machines_app.tasks.machine_call[" in line and "succeeded" in line)

    assert check_working_dir(alice, theirs, str(tmp_path / "link")) == str(tmp_path / "work")
    with pytest.raises(WorkingDirRefused, match=f"There is no directory {tmp_path}/missing on theirs"):
        check_working_dir(alice, theirs, str(tmp_path / "missing"))
    with pytest.raises(WorkingDirRefused, match=f"must be inside {tmp_path}; /etc is not"):
        check_working_dir(alice, theirs, "/etc")  # the roots are resolved there too
    # The session forms' model check (a 500 before: ElsewhereError outside its guard).
    assert catalog.model_for_session(theirs, "sub/m.gguf", reader_for).path == f"{tmp_path}/sub/m.gguf"
    with pytest.raises(ElsewhereError):
        catalog.model_for_session(theirs, "sub/m.gguf")  # a worker's start here still refuses
    # Each question ran on the other host's worker: the path's and the root's real paths,
    # then is_dir (3 + 3 + 2: /etc is refused before is_dir), then expand_path of the models
    # directory (the model's chat template file is not set).
    assert calls_run() == 9
    # The new-session form on this host, for their machine: valid, the path resolved there.
    form_data = {"machine": theirs.pk, "model_key": "sub/m.gguf", "working_dir": str(tmp_path / "link"),
                 "permission_mode": "manual", "speculative": "auto"}
    form = NewSessionForm(form_data, user=alice)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["working_dir"] == str(tmp_path / "work")
    assert machine_actions.do_test_connection(theirs).startswith(
        f"Machine 'theirs' is the local machine of the Corral host {OTHER}, which answers; tools ")
    # What acts is refused here, before anything is sent.
    with pytest.raises(ElsewhereError, match="cannot start a process there from here"):
        reader_for(theirs).spawn(["sleep", "9"], str(tmp_path / "log"))
    # The owner's own refusal comes back in its words: a call it gets for a machine that
    # is not its own (a worker on the wrong host still refuses).
    astray = RelayTransport({**machine_place(theirs), "corral_host": settings.CORRAL_HOST_ID})
    astray.host = OTHER
    with pytest.raises(ElsewhereError, match=f"local machine of the Corral host {settings.CORRAL_HOST_ID}"):
        astray.is_dir("/")

    other_host_worker.stop()
    monkeypatch.setattr(relay, "ANSWER_SECONDS", 2.0)
    silent = reader_for(theirs)
    started = time.monotonic()
    with pytest.raises(TransportError) as refused:
        check_working_dir(alice, Machine.objects.get(pk=theirs.pk), str(tmp_path / "work"))
    waited = time.monotonic() - started
    assert str(refused.value) == (f"the Corral host {OTHER} that runs machine 'theirs' did not answer within 2 s; "
                                  "is its housekeeping worker running?")
    assert not refused.value.permanent
    assert waited < 2 + 8, waited  # the bound, not a hang (generous for a loaded box)
    with pytest.raises(catalog.ModelUnavailable, match=f"the Corral host {OTHER} that runs machine 'theirs' did not"):
        catalog.model_for_session(theirs, "sub/m.gguf", reader_for)
    # The form asks once and says it on both fields: one bound waited, not two.
    sent_calls = []
    send_task = relay.current_app.send_task
    monkeypatch.setattr(relay.current_app, "send_task",
                        lambda name, **kw: sent_calls.append(name) or send_task(name, **kw))
    form = NewSessionForm(form_data, user=alice)
    assert not form.is_valid()
    assert sent_calls == [relay.MACHINE_CALL]
    assert form.errors["model_key"] == form.errors["machine"] == [str(refused.value)]
    with pytest.raises(TransportError, match="did not answer"):
        silent.is_dir("/")
    started = time.monotonic()
    with pytest.raises(TransportError, match="did not answer"):
        silent.is_dir("/")  # the same page's next question is not waited for again
    assert time.monotonic() - started < 1
