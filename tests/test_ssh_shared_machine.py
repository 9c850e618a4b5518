"""A machine a team shares, over a real OpenSSH server with its default limits
(tests/sshd.py): bursts of commands on one connection, discovery in few round trips and
only of files that changed, and no server left running that Corral meant to stop
(docs/ssh.md, docs/behaviour.md §5 "no orphans")."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from machines_app import catalog, ssh
from machines_app.discovery import discover
from machines_app.models import Machine, PendingStop
from machines_app.ssh import connection as ssh_connection
from machines_app.ssh import sftp as ssh_sftp
from machines_app.transports import (
    ProcessId,
    SSHTransport,
    TransportError,
    machine_place,
    parse_proc_stat,
    ssh_target,
    transport_for,
)
from sessions_app import orphans
from sessions_app.forms import NewSessionForm
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import restart_server, start_server
from sessions_app.servers.stop import stop_orphan, stop_server
from sessions_app.servers.watch import watch_servers

from .conftest import make_ssh_machine, model_key, wait_for
from .gguf_files import model
from .helpers import fresh, payloads
from .sshd import SshServer


def alive_here(proc: ProcessId) -> bool:
    """The "remote" machine is this one: is that process (pid and start time) still there?"""
    try:
        state, start = parse_proc_stat(Path(f"/proc/{proc.pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return False
    return start == proc.start_time and state not in ("Z", "X")


def answers(machine: Machine) -> bool:
    try:
        transport_for(machine).check()
    except TransportError:
        return False
    return True


@pytest.fixture
def own_sshd(tmp_path):
    """An sshd of the test's own (it is killed and started again, or its connection counted).
    A test that starts servers through it asks for ``stop_servers_after`` after it, so
    they are stopped while it still answers."""
    server = SshServer(tmp_path / "sshd")
    server.start()
    yield server
    server.kill()


# --- bursts -----------------------------------------------------------------------------------


def test_the_test_sshd_keeps_openssh_default_limits(own_sshd):
    config = own_sshd.config.read_text()
    assert "MaxSessions" not in config and "MaxStartups" not in config


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_forms_starts_and_refreshes_on_one_machine_all_succeed(own_sshd, tmp_path, real_models_dir,
                                                                          llama_server_bin, alice):
    """25 at once on a fresh connection: new-session forms (the real form: the model and
    the working directory checked on the machine), starts (a detached process spawned
    there as a server is, checked alive, then stopped) and refreshes (list and heads over
    SFTP). OpenSSH allows 10 sessions per connection: the rest wait for room on the same
    connection, none fails and the connection is never dropped."""
    machine = make_ssh_machine(own_sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)  # the models the forms pick from; the machine is "reachable"
    target = ssh_target(machine)
    ssh.drop_link(target)  # the burst starts on no connection at all
    key = model_key(machine, "llama")
    workdir = tmp_path / "work"
    workdir.mkdir()
    failures: list[str] = []
    spawned: list[ProcessId] = []
    go = threading.Barrier(25)

    def form(transport: SSHTransport) -> None:
        try:
            form = NewSessionForm(data={"machine": machine.pk, "model_key": key, "working_dir": str(workdir),
                                        "permission_mode": "manual", "speculative": "auto"}, user=alice)
            assert form.is_valid(), form.errors.as_text()
            assert form.cleaned_data["working_dir"] == str(workdir)
        finally:
            connection.close()  # this thread's own

    def start(transport: SSHTransport) -> None:
        proc = transport.spawn(["sleep", "60"], str(tmp_path / f"logs/sleep-{threading.get_ident()}.log"))
        spawned.append(proc)
        assert transport.process_alive(proc)
        transport.stop(proc, grace=2)

    def refresh(transport: SSHTransport) -> None:
        root = str(real_models_dir)
        files = transport.list_gguf(root)
        infos = discover(files, read_ranges=lambda ranges: transport.read_ranges(
            [(f"{root}/{key}", offset, n) for key, offset, n in ranges]))
        assert infos and all(info.error is None for info in infos)

    def one(index: int) -> None:
        transport = SSHTransport("gpu1", target)
        try:
            go.wait()
            (form, start, refresh)[index % 3](transport)
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            failures.append(f"{(form, start, refresh)[index % 3].__name__}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(25)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not failures, "\n".join(failures)
    link = ssh.link_for(target)
    assert link.active
    # The server refused sessions beyond its limit and the link learnt it (one connection
    # for the whole burst: a second would have been a second link here).
    assert link._sessions.limit is not None and 5 <= link._sessions.limit <= 10
    assert link._sessions.open == 1  # the link's SFTP session, kept open
    assert not any(alive_here(proc) for proc in spawned)
    ssh.drop_link(target)


def test_a_connection_kept_full_is_busy_not_lost(tmp_path, monkeypatch):
    """MaxSessions 1, held by a long command: the next command waits for it on the same
    connection, runs when it ends; one that waits longer than SESSION_WAIT is told the
    machine is busy, naming the limit — and the connection stays up."""
    server = SshServer(tmp_path / "sshd")
    server.config.write_text(server.config.read_text() + "MaxSessions 1\n")
    server.start()
    target = ssh.Target("127.0.0.1", server.port, server.user, Path(server.client_key).read_text(),
                        server.host_key_line)
    try:
        transport = SSHTransport("gpu1", target)
        link = ssh.link_for(target)
        held = link.start("sleep 2")
        assert link.run("echo after")[1].strip() == "after"
        # It waited for the held one: that command had ended (not only been slow) before
        # this one ran — an order, not a number of seconds a loaded box could blur.
        assert held.exit_status_ready() and held.recv_exit_status() == 0
        assert link._sessions.limit == 1
        link.release_channel(held)

        monkeypatch.setattr(ssh_connection, "SESSION_WAIT", 1.0)  # where Link looks it up
        held = link.start("sleep 4")
        with pytest.raises(TransportError, match="busy: all 1 sessions its sshd allows"):
            transport.run_probe(["true"])
        assert link.active and ssh.link_for(target) is link
        link.release_channel(held)
        assert transport.run_probe(["echo", "again"]) == "again\n"
    finally:
        ssh.drop_link(target)
        server.kill()


def test_connections_sshd_drops_before_the_handshake_are_tried_again(tmp_path):
    """Several processes of Corral connecting to one machine at the same moment meet its
    MaxStartups (here 2): sshd closes the connections beyond it before the banner. Those
    are tried again after a short pause, not reported as an unreachable machine. (Six
    targets differing only in how their pinned key is written stand for six processes:
    each has a connection of its own.)"""
    server = SshServer(tmp_path / "sshd")
    server.config.write_text(server.config.read_text() + "MaxStartups 2\n")
    server.start()
    try:
        targets = [
            ssh.Target("127.0.0.1", server.port, server.user, Path(server.client_key).read_text(),
                       server.host_key_line + "\n" * n)
            for n in range(6)
        ]
        failures: list[str] = []
        go = threading.Barrier(len(targets))

        def connect(target: ssh.Target) -> None:
            go.wait()
            try:
                assert ssh.link_for(target).run("echo ok")[1].strip() == "ok"
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(repr(exc))

        threads = [threading.Thread(target=connect, args=(t,)) for t in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert failures == []
        assert "past MaxStartups" in (server.root / "sshd.log").read_text()  # the drops happened
    finally:
        for target in targets:
            ssh.drop_link(target)
        server.kill()


# --- discovery --------------------------------------------------------------------------------


def smol_links(root: Path, count: int) -> Path:
    from machines_app.demo_models import packaged_model_paths

    source = next(p for p in packaged_model_paths().values() if "smollm2" in p.name.lower())
    root.mkdir(parents=True)
    for index in range(count):
        (root / f"smol-{index:03d}.gguf").symlink_to(source)
    return root


@pytest.mark.django_db
def test_discovery_costs_round_trips_per_batch_not_per_file(sshd, tmp_path, llama_server_bin, monkeypatch):
    """20 links to SmolLM2 (its metadata is about 1.6 MB): every SFTP request is counted.
    The heads are read in one pipelined batch, so the round trips do not grow with the
    number of files; a second refresh reads no head at all; a file whose size or time
    changed is the only one read again."""
    root = smol_links(tmp_path / "models", 20)
    model(root, "own.gguf", "Own")
    machine = make_ssh_machine(sshd, root, llama_server_bin)
    catalog._HEADS.clear()
    link = ssh.link_for(ssh_target(machine))
    opened: list[bytes] = []
    send = ssh_sftp._SFTP._async_request

    def counting(sftp, fileobj, t, *args):
        if t == ssh_sftp.CMD_OPEN:
            opened.append(bytes(args[0]))
        return send(sftp, fileobj, t, *args)

    monkeypatch.setattr(ssh_sftp._SFTP, "_async_request", counting)

    def refresh() -> tuple[int, int]:
        before = (link.sftp_counts.requests, link.sftp_counts.round_trips)
        found = catalog.refresh_models(machine)
        assert len(found) == 21 and all(not m.error for m in found)
        return link.sftp_counts.requests - before[0], link.sftp_counts.round_trips - before[1]

    requests, trips = refresh()
    assert len(opened) == 21
    # stat + directory listing + one stat per link + per file: open, reads of 255 KiB, close
    assert requests <= 6 + 20 + 21 * (2 + 2 * 1024 // 255 + 2), requests
    assert trips <= 12, trips  # was one per 32 KiB read: over 1,300 for these files

    opened.clear()
    requests, trips = refresh()
    assert opened == [] and trips <= 8 and requests <= 6 + 20

    time.sleep(1.1)  # a new modification time (SFTP gives whole seconds)
    model(root, "own.gguf", "Own again")
    refresh()
    assert [name.rsplit(b"/", 1)[-1] for name in opened] == [b"own.gguf"]
    assert catalog.models_for(machine).filter(display_name="Own again").exists()


# --- no orphans -------------------------------------------------------------------------------


def ssh_session(machine: Machine, user, workdir: Path) -> AgentSession:
    session = AgentSession.objects.create(
        owner=user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(workdir),
        server_params={"contextSize": 1024}, status="loading",
    )
    start_server(session.pk)
    assert fresh(session).status == "idle", payloads(session, "error")
    return fresh(session)


@pytest.mark.django_db
def test_a_stop_that_cannot_reach_the_machine_stays_pending_until_the_watch_finishes_it(
    own_sshd, stop_servers_after, tmp_path, real_models_dir, llama_server_bin, alice, django_user_model
):
    machine = make_ssh_machine(own_sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)
    session = ssh_session(machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    proc = ProcessId(record.pid, record.start_time)

    own_sshd.kill()
    stop_server(session.pk)
    pending = PendingStop.objects.get()
    assert (pending.pid, pending.start_time, pending.machine_id) == (record.pid, record.start_time, machine.pk)
    assert fresh(session).status == "stopped" and not ServerRecord.objects.filter(session=session).exists()
    errors = [p["message"] for p in payloads(session, "error")]
    assert any(m.startswith(f"Stop pending: {machine.name} is unreachable") for m in errors), errors
    assert alive_here(proc)  # the machine is only unreachable: its server still runs

    watch_servers()  # still unreachable: kept, tried again later
    assert PendingStop.objects.filter(pk=pending.pk).exists() and alive_here(proc)
    admin = django_user_model.objects.create_superuser("root", password="root-password-1")
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()
    assert "Stops pending" in page and f"pid {record.pid}" in page

    own_sshd.start()

    def watched() -> bool:
        watch_servers()
        return not PendingStop.objects.exists()

    wait_for(watched, 60, interval=1, what="the watch to finish the pending stop")
    assert not alive_here(proc)
    notices = [p["message"] for p in payloads(session, "notice")]
    assert any("pending stop is done" in m and str(record.pid) in m for m in notices), notices


@pytest.mark.django_db
def test_nothing_new_starts_on_a_machine_before_its_pending_stop(
    own_sshd, stop_servers_after, tmp_path, real_models_dir, llama_server_bin, alice, monkeypatch
):
    machine = make_ssh_machine(own_sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)
    session = ssh_session(machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    old = ProcessId(record.pid, record.start_time)
    own_sshd.kill()
    stop_server(session.pk)
    assert PendingStop.objects.exists()

    # While the machine is unreachable a restart starts nothing and says why.
    restart_server(session.pk)
    assert fresh(session).status == "exited" and alive_here(old)
    assert not ServerRecord.objects.filter(session=session).exists()

    own_sshd.start()
    old_alive_at_spawn: list[bool] = []
    spawn = SSHTransport.spawn

    def watching_spawn(transport, argv, *args, **kwargs):
        old_alive_at_spawn.append(alive_here(old))
        return spawn(transport, argv, *args, **kwargs)

    monkeypatch.setattr(SSHTransport, "spawn", watching_spawn)
    wait_for(lambda: answers(machine), 30, interval=1, what="sshd to answer")
    restart_server(session.pk)  # no watch in between: the start itself settles it first
    assert old_alive_at_spawn == [False]
    assert fresh(session).status == "idle" and not PendingStop.objects.exists()
    assert ServerRecord.objects.get(session=session).pid != old.pid


@pytest.mark.django_db
def test_a_deleted_sessions_server_on_a_lost_machine_is_stopped_when_it_answers(own_sshd, tmp_path,
                                                                               real_models_dir, llama_server_bin):
    """The delete path (the stop task is handed the process and where it runs), with the
    machine row deleted too: the pending stop keeps where to reach it and is finished."""
    machine = make_ssh_machine(own_sshd, real_models_dir, llama_server_bin)
    transport = transport_for(machine)
    # Any process stands in for the deleted session's server here: what is tested is
    # that it is stopped, pid and start time checked.
    proc = transport.spawn(["sleep", "300"], str(tmp_path / "sleep.log"))
    place = machine_place(machine)
    own_sshd.kill()
    stop_orphan(place, proc.pid, proc.start_time, 40123, 777)
    pending = PendingStop.objects.get()
    assert (pending.session_id, pending.machine_id, pending.place["port"]) == (777, machine.pk, own_sshd.port)
    machine.delete()
    assert PendingStop.objects.get().machine is None and alive_here(proc)
    own_sshd.start()

    def watched() -> bool:
        watch_servers()
        return not PendingStop.objects.exists()

    wait_for(watched, 60, interval=1, what="the watch to finish the pending stop")
    assert not alive_here(proc)


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_a_server_corral_has_no_record_of_is_listed_and_stoppable(
    sshd, tmp_path, real_models_dir, llama_server_bin, alice, django_user_model
):
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)
    session = ssh_session(machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    proc = ProcessId(record.pid, record.start_time)
    transport = transport_for(machine)
    found = [s for s in orphans.corral_servers(transport) if s.proc == proc]
    assert found and found[0].session_id == session.pk and found[0].port == record.port
    # Recorded: not an orphan (the list may hold servers other tests left on this box).
    assert proc not in [s.proc for s in orphans.unrecorded_servers(machine)]

    ServerRecord.objects.filter(pk=record.pk).delete()  # its record lost (a restore, a crash)
    [orphan] = [s for s in orphans.unrecorded_servers(machine) if s.proc == proc]

    admin = django_user_model.objects.create_superuser("root", password="root-password-1")
    client = Client()
    client.force_login(alice)  # not staff: no way in
    url = f"/admin/machines_app/machine/{machine.pk}/stop-unrecorded/"
    assert client.post(url, {"process": f"{proc.pid}:{proc.start_time}"}).status_code == 302
    assert alive_here(proc)
    client.force_login(admin)
    page = client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()
    assert "unrecorded-servers" in page and f'value="{proc.pid}:{proc.start_time}"' in page
    response = client.post(url, {"process": f"{proc.pid}:{proc.start_time}"}, follow=True)
    assert f"Stopped llama-server pid {proc.pid}" in response.content.decode()
    assert not alive_here(proc)
    assert orphan.session_id == session.pk


@pytest.mark.django_db
def test_only_this_installations_servers_are_recognised(ssh_machine, tmp_path):
    """Another Corral (another secret key) using the same account on the machine: its
    servers' key files carry another installation tag and are never listed, so never
    offered for Stop here."""
    transport = transport_for(ssh_machine)
    ours = orphans.key_file(transport, 901, 40001)
    theirs = ours.replace(f"-{orphans.install_tag()}.key", "-0123456789.key")
    assert theirs != ours
    stand_ins = [
        # A process whose command line reads like a server's (the shell stays, `; :` keeps
        # it from exec-ing the sleep).
        transport.spawn(["sh", "-c", "sleep 60; :", "corral", "--api-key-file", key], str(tmp_path / f"{n}.log"))
        for n, key in (("ours", ours), ("theirs", theirs))
    ]
    try:
        listed = {s.proc: s for s in orphans.unrecorded_servers(ssh_machine)}
        assert stand_ins[0] in listed and (listed[stand_ins[0]].session_id, listed[stand_ins[0]].port) == (901, 40001)
        assert stand_ins[1] not in listed
    finally:
        for proc in stand_ins:
            transport.stop(proc, grace=1)
