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
from sessions_app import dispatch, liveness, orphans, tasks
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
    shared round takes the machines every host reaches; each host's own local machine is
    its own share, handed to it while its housekeeping worker is alive."""
    mine = _old_slot(Machine.objects.create(name="here"), alice)
    theirs = _old_slot(Machine.objects.create(name="there", corral_host=OTHER), alice)
    shared = _old_slot(Machine.objects.create(name="unclaimed", corral_host=""), alice)

    assert forget_old_slots() == [shared.pk]  # no host's own local machine
    assert forget_old_slots(host=settings.CORRAL_HOST_ID) == [mine.pk]
    assert list(SlotSave.objects.values_list("session_id", flat=True)) == [theirs.pk]  # its host's to forget

    handed = []
    monkeypatch.setattr(liveness, "live_hosts", lambda: {OTHER, settings.CORRAL_HOST_ID})
    monkeypatch.setattr(dispatch, "enqueue_on_host", lambda task, host, *args, **kw: handed.append((task, host, kw)))
    tasks.forget_old_slots()
    assert handed == [(dispatch.FORGET_HOST_SLOTS, host, {"expires": tasks.SLOTS_TASK_EXPIRES})
                      for host in sorted({OTHER, settings.CORRAL_HOST_ID})]
    assert queues.ROUTES[dispatch.FORGET_HOST_SLOTS] == {"queue": queues.HOUSEKEEPING}


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
