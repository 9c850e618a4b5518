"""Room on a machine (docs/behaviour.md §5 "Room on a machine"): what a model needs, what a
machine has, starts that fit, sleep, wait in line or are refused, and the machines page.

Real llama-servers on this box (SmolLM2 135M, Gemma 3 270M); the machine's room is its
admin-set memory budget, so the scenario does not depend on how busy the box is. GPU
figures come from an ``nvidia-smi`` stand-in on the PATH of a real OpenSSH server.
"""

from __future__ import annotations

import time

import pytest
from django.test import Client

from machines_app import catalog, memory
from machines_app.memory import MIB, Fit, Room
from machines_app.models import MachineSample, MemoryClaim, ModelFile
from machines_app.transports import LocalTransport, ProcessId
from sessions_app import actions, room
from sessions_app.forms import NewSessionForm
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server

from .conftest import make_ssh_machine, model_key, wait_for
from .helpers import InlineCode, converse_once, fresh, payloads

SMALL = {"contextSize": 2048}


def notices(session) -> list[str]:
    return [p["message"] for p in payloads(session, "notice")]


def create(machine, user, tmp_path, arch="llama", params=SMALL) -> AgentSession:
    return actions.do_create_session(
        user, machine=machine, model_key=model_key(machine, arch), working_dir=str(tmp_path),
        server_params=dict(params), sampling={"temperature": 0, "max_tokens": 16, "seed": 1}, permission_mode="manual",
    )


def need(machine, arch="llama", params=SMALL) -> int:
    return room.need_of(machine.model_files.get(architecture=arch), params).total


# --- the figures ------------------------------------------------------------------------------


def test_meminfo_and_nvidia_smi_lines_are_read():
    assert memory.parse_meminfo("MemTotal:       16318480 kB\nMemFree: 1 kB\nMemAvailable:    8000000 kB\n") == (
        16318480 * 1024, 8000000 * 1024)
    assert memory.parse_meminfo("nothing here") == (None, None)
    gpus = memory.parse_gpus("0, 24576, 1024, 23552\n1, [N/A], [N/A], [N/A]\n2, 81920, 0, 81920\n")
    assert [(g.index, g.total // MIB, g.used // MIB, g.free // MIB) for g in gpus] == [
        (0, 24576, 1024, 23552), (2, 81920, 0, 81920)]


def test_a_start_fits_sleeps_the_fewest_least_recently_used_waits_its_turn_or_is_too_big():
    room_ = Room("its memory budget", 1000, 300)
    assert memory.plan(200, room_, []).kind == Fit.FITS
    # Needs 500: sleeping the least recently used (first) idle server frees 150, the next 100.
    fit = memory.plan(500, room_, [(7, 150), (8, 100), (9, 400)])
    assert fit.kind == Fit.AFTER_SLEEP and fit.to_sleep == (7, 8)
    assert fit.label() == "fits after sleeping 2 idle servers"
    assert memory.plan(900, room_, [(7, 150)]).kind == Fit.WAITS
    assert memory.plan(200, room_, [], ahead=2).label() == "waits for memory (2 ahead)"  # fits, but not its turn
    too_big = memory.plan(1001, room_, [(7, 900)])
    assert too_big.kind == Fit.TOO_BIG and "needs" in too_big.label()


@pytest.mark.django_db
def test_the_shapes_of_the_real_models_are_read_from_their_heads(local_machine):
    smol = local_machine.model_files.get(architecture="llama").memory_shape
    assert {k: smol[k] for k in ("n_layer", "n_head_kv", "k_dim", "v_dim")} == {
        "n_layer": 30, "n_head_kv": 3, "k_dim": 64, "v_dim": 64}
    gemma = local_machine.model_files.get(architecture="gemma3").memory_shape
    assert gemma["n_swa"] == 512 and gemma["swa_every"] == 6 and gemma["k_dim"] == 256
    # SmolLM2's cache at 2,048 tokens: K and V, 30 layers, 3 KV heads of 64, f16.
    model = local_machine.model_files.get(architecture="llama")
    assert room.need_of(model, SMALL).kv_cache == 2 * 30 * 2048 * 3 * 64 * 2
    # Gemma 3's: five layers of six keep only the window (512 + a micro-batch of 512).
    model = local_machine.model_files.get(architecture="gemma3")
    assert room.need_of(model, {"contextSize": 8192}).kv_cache == (3 * 8192 + 15 * 1024) * 1 * 512 * 2
    # A row from before shapes were kept has its shape read from the file at its next start.
    shape = model.memory_shape
    ModelFile.objects.filter(pk=model.pk).update(memory_shape={})
    model.refresh_from_db()
    assert room.shape_of(model, LocalTransport()) == shape
    assert ModelFile.objects.get(pk=model.pk).memory_shape == shape


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
@pytest.mark.parametrize(("arch", "params"), [
    ("llama", SMALL), ("llama", {}), ("gemma3", SMALL), ("gemma3", {}),
])
def test_the_estimate_is_within_a_fifth_of_a_real_servers_resident_memory(local_machine, alice, tmp_path, arch,
                                                                           params):
    session = create(local_machine, alice, tmp_path, arch, params)
    start_server(session.pk)
    assert fresh(session).status == "idle", notices(session) + [p["message"] for p in payloads(session, "error")]
    record = ServerRecord.objects.get(session=session)
    rss = LocalTransport().memory_of(ProcessId(record.pid, record.start_time))
    estimate = room.need_of(local_machine.model_files.get(architecture=arch), params)
    print(f"{arch} {params or 'trained context'}: estimate {estimate.words()}, resident {rss / MIB:.0f} MiB")
    assert abs(estimate.total - rss) <= 0.2 * rss


# --- starts that fit (real servers, the real worker and its rounds) ---------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_with_a_budget_for_two_a_third_start_sleeps_the_least_recently_used_which_later_wakes_warm(
        stack, local_machine, alice, tmp_path):
    local_machine.memory_budget_mib = int(2.5 * need(local_machine) / MIB)
    local_machine.save()
    first = create(local_machine, alice, tmp_path)
    wait_for(lambda: fresh(first).status == "idle", 180, what="the first server")
    second = create(local_machine, alice, tmp_path)
    wait_for(lambda: fresh(second).status == "idle", 180, what="the second server")
    converse_once(first, alice, "My sheep is called Dolly.", timeout=180)
    converse_once(second, alice, "Hello.", timeout=180)  # the first is now the least recently used

    third = create(local_machine, alice, tmp_path)
    wait_for(lambda: fresh(third).status == "idle", 180, what="the third server")
    assert fresh(first).status == "sleeping" and fresh(second).status == "idle"
    assert not ServerRecord.objects.filter(session=first).exists()
    assert any("to sleep to make room" in n for n in notices(third))
    assert any("Put to sleep to make room" in n for n in notices(first))
    assert ServerRecord.objects.filter(machine=local_machine).count() == 2

    converse_once(first, alice, "What is my sheep called?", timeout=180)  # wakes it: the least recently used idle one sleeps
    assert fresh(first).status == "idle"
    assert payloads(first, "server_ready")[-1].get("warm_tokens", 0) > 0
    assert fresh(second).status == "sleeping" and fresh(third).status == "idle"
    # A start's grant is released just after its session shows idle (servers.start:
    # release follows the ready wait), so it is waited for, not read at once.
    wait_for(lambda: not MemoryClaim.objects.exists(), 30, what="the grants to be released")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
def test_a_start_that_can_never_fit_is_refused_before_anything_starts_naming_the_numbers(local_machine, alice,
                                                                                        tmp_path):
    local_machine.memory_budget_mib = 64
    local_machine.save()
    session = create(local_machine, alice, tmp_path)
    start_server(session.pk)
    assert fresh(session).status == "exited"
    assert not ServerRecord.objects.exists()
    [message] = [p["message"] for p in payloads(session, "error")]
    assert f"cannot start on {local_machine.name}: it needs about" in message
    assert "weights" in message and "context of 2,048 tokens" in message
    assert f"{local_machine.name} has 64 MiB in all (its memory budget)" in message

    # The form says so before a session is made, once the machine's room is known.
    model = local_machine.model_files.get(architecture="llama")
    form = NewSessionForm({"machine": local_machine.pk, "model_key": model.key, "working_dir": str(tmp_path),
                           "permission_mode": "manual", "contextSize": 2048}, user=alice)
    assert not form.is_valid()
    assert "64 MiB in all" in form.errors["model_key"][0]
    assert "too big" in next(m for m in form.model_choices if m.key == model.key).fit.label()
    # And so does a switch to another model that cannot fit either.
    with pytest.raises(actions.SessionError, match="64 MiB in all"):
        actions.do_change_model(fresh(session), alice, model_key(local_machine, "gemma3"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_start_that_does_not_fit_waits_in_line_and_begins_when_a_session_is_stopped(stack, local_machine, alice,
                                                                                     tmp_path):
    local_machine.memory_budget_mib = int(2.5 * need(local_machine) / MIB)
    local_machine.save()
    busy = []
    for _ in range(2):
        session = create(local_machine, alice, tmp_path)
        wait_for(lambda s=session: fresh(s).status == "idle", 180, what="a server")
        busy.append(session)
    # Both are in use (a turn under way: not idle, so not put to sleep for anyone).
    AgentSession.objects.filter(pk__in=[s.pk for s in busy]).update(status="running")

    third = create(local_machine, alice, tmp_path)
    wait_for(lambda: any("Waiting for memory" in n for n in notices(third)), 120, what="the third to wait")
    fourth = create(local_machine, alice, tmp_path)
    wait_for(lambda: any("— 1 ahead" in n for n in notices(fourth)), 120, what="the fourth to wait behind it")
    assert f"Waiting for memory on {local_machine.name}" in notices(third)[-1]
    assert "its memory budget" in notices(third)[-1]
    time.sleep(8)  # a few health watches later: still waiting, nothing spawned, not taken for a lost start
    assert fresh(third).status == "loading" and fresh(fourth).status == "loading"
    assert not ServerRecord.objects.filter(session__in=[third, fourth]).exists()
    assert not [n for n in notices(third) if "start was lost" in n]

    # The machines page shows the line.
    client = Client()
    client.force_login(alice)
    page = client.get("/machines/").content.decode()
    assert page.count('class="waiter"') == 2

    AgentSession.objects.filter(pk=busy[0].pk).update(status="idle")
    actions.do_stop(fresh(busy[0]), alice)
    wait_for(lambda: fresh(third).status == "idle", 180, what="the waiting start to begin")
    # The fourth is next now; once the third is idle it is put to sleep for it (the
    # second is still busy).
    wait_for(lambda: fresh(fourth).status == "idle", 180, what="the fourth start to begin")
    assert fresh(third).status == "sleeping" and fresh(busy[1]).status == "running"
    # A start's grant is released just after its session shows idle (servers.start:
    # release follows the ready wait), so it is waited for, not read at once.
    wait_for(lambda: not MemoryClaim.objects.exists(), 30, what="the grants to be released")
    AgentSession.objects.filter(pk=busy[1].pk).update(status="idle")


# --- GPU figures over SSH ----------------------------------------------------------------------


NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi: the GPUs are in the file beside it.
case "$*" in
  *--query-gpu=*) cat "$(dirname "$0")/gpus.csv" ;;
  *--query-compute-apps=*) ;;
  *) exit 9 ;;
esac
"""


@pytest.fixture
def gpu_sshd(tmp_path_factory):
    """A real OpenSSH server whose sessions find an ``nvidia-smi`` stand-in on their PATH."""
    from .sshd import SshServer

    root = tmp_path_factory.mktemp("gpu-sshd")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    server = SshServer(root / "sshd")
    with open(server.config, "a") as config:
        config.write(f"SetEnv PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin\n")
    server.start()
    server.gpus = bin_dir / "gpus.csv"
    yield server
    server.kill()


@pytest.mark.django_db
def test_gpu_figures_come_from_nvidia_smi_over_ssh_and_the_picker_measures_against_them(
        gpu_sshd, real_models_dir, llama_server_bin, alice):
    gpu_sshd.gpus.write_text("0, 24576, 20480, 4096\n1, 24576, 1024, 23552\n")
    machine = make_ssh_machine(gpu_sshd, real_models_dir, llama_server_bin)
    catalog.refresh_models(machine)
    reading = room.read_machine(machine)
    assert [(g.index, g.free // MIB) for g in reading.gpus] == [(0, 4096), (1, 23552)]
    assert reading.ram_total and reading.ram_available
    room.sample_machine(machine)
    sample = MachineSample.objects.get(machine=machine)
    assert sample.gpus[1] == {"index": 1, "total": 24576 * MIB, "used": 1024 * MIB, "free": 23552 * MIB}

    client = Client()
    client.force_login(alice)
    page = client.get("/machines/").content.decode()
    assert "GPU 0: 20.0 GiB used, 4.0 GiB free of 24.0 GiB" in page
    assert "(GPU memory)" in page
    options = client.get(f"/sessions/models/?machine={machine.pk}").content.decode()
    assert options.count("· fits now") == 2

    # Two small cards: SmolLM2 with its trained context does not fit them at all …
    gpu_sshd.gpus.write_text("0, 100, 90, 10\n1, 100, 90, 10\n")
    room.sample_machine(machine)
    smol = machine.model_files.get(architecture="llama")
    assert "too big: needs" in client.get(f"/sessions/models/?machine={machine.pk}").content.decode()
    assert "200 MiB in all (GPU memory)" in room.never_fits(machine, smol.key, {})
    # … while a session that keeps its layers off the GPU is measured against the memory.
    assert room.never_fits(machine, smol.key, {"gpuLayers": 0}) == ""


@pytest.mark.django_db
def test_a_machine_without_nvidia_smi_has_no_gpus(ssh_machine):
    assert room.read_machine(ssh_machine).gpus == []


# --- the machines page --------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_machines_page_shows_members_their_machines_memory_servers_and_who_waits(
        local_machine, alice, bob, charlie_staff, tmp_path, monkeypatch):
    from django.contrib.auth.models import Group

    from machines_app.models import Machine
    from sessions_app import dispatch

    hidden = Machine.objects.create(name="team-only", models_dir=str(tmp_path))
    hidden.allowed_groups.add(Group.objects.create(name="team"))
    model = local_machine.model_files.get(architecture="llama")
    running = AgentSession.objects.create(owner=bob, machine=local_machine, model_key=model.key,
                                          working_dir=str(tmp_path), status="idle")
    ServerRecord.objects.create(session=running, machine=local_machine, model_key=model.key, pid=1, start_time="1",
                                port=1, log_path="x", ready_at=running.created_at)
    waiting = AgentSession.objects.create(owner=bob, machine=local_machine, model_key=model.key,
                                          working_dir=str(tmp_path), status="loading")
    MemoryClaim.objects.create(session=waiting, machine=local_machine, need=300 * MIB)
    for _ in range(3):
        room.sample_machine(local_machine)

    assert Client().get("/machines/").status_code == 302  # to the login page
    client = Client()
    client.force_login(alice)
    response = client.get("/machines/")
    page = response.content.decode()
    assert response.status_code == 200
    assert local_machine.name in page and "team-only" not in page
    assert "used" in page and "free" in page and "(memory)" in page
    assert '<polyline points="' in page  # the last hour's plot
    server = page[page.index('id="server-'):]
    assert model.display_name in server and "bob" in server and " s</td>" in server  # idle for
    assert "needs 300 MiB" in page
    assert 'action="/machines/servers/' not in page  # members get no Stop
    assert f'href="/sessions/{running.pk}/"' not in page  # bob's private session: not linked for alice
    parser = InlineCode()
    parser.feed(page)
    assert parser.found == []
    assert client.post(f"/machines/servers/{running.pk}/stop/").status_code == 403

    sent = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)) or True)
    staff = Client()
    staff.force_login(charlie_staff)
    page = staff.get("/machines/").content.decode()
    assert f'action="/machines/servers/{running.pk}/stop/"' in page and "team-only" in page
    assert staff.post(f"/machines/servers/{running.pk}/stop/").status_code == 302
    assert sent == [(dispatch.STOP_SERVER, (running.pk, {"id": charlie_staff.pk, "username": "charlie"}))]
    assert 'href="/machines/"' in client.get("/").content.decode()  # the top bar's link


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_staff_stop_a_server_from_the_machines_page_in_a_browser_without_a_csp_violation(
        stack, page, local_machine, alice, tmp_path):
    from django.contrib.auth import get_user_model

    from .helpers import RECORD_VIOLATIONS, log_in

    get_user_model().objects.create_user("staffer", password="staffer-password-1", is_staff=True)
    session = create(local_machine, alice, tmp_path)
    wait_for(lambda: fresh(session).status == "idle", 180, what="the server")
    room.sample_machines(force=True, host=local_machine.corral_host or None)
    room.sample_machines(force=True, host=local_machine.corral_host or None)

    page.add_init_script(RECORD_VIOLATIONS)
    log_in(page, stack, "staffer", "staffer-password-1")
    page.click("nav >> text=Machines")
    row = page.locator(f"#server-{session.pk}")
    assert "alice" in row.inner_text() and "idle" in row.inner_text()
    assert page.locator(f"#machine-{local_machine.pk} svg.memory-plot polyline").count() == 1
    row.locator("button", has_text="Stop").click()
    page.wait_for_selector("text=Stopping the server of")
    wait_for(lambda: fresh(session).status == "stopped" and not ServerRecord.objects.filter(session=session).exists(),
             60, what="the server to stop")
    page.reload()
    assert page.locator(f"#server-{session.pk}").count() == 0
    assert page.evaluate("window.__csp") == []


@pytest.mark.django_db
def test_the_line_is_folded_from_its_rows_and_each_waiting_start_hears_when_its_place_changes(
        local_machine, alice, tmp_path, monkeypatch):
    from sessions_app import dispatch

    sent = []
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: sent.append((task, args)) or True)
    key = model_key(local_machine, "llama")
    line = []
    for ahead in range(3):
        session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=key,
                                              working_dir=str(tmp_path), status="loading")
        MemoryClaim.objects.create(session=session, machine=local_machine, need=MIB, told_ahead=ahead)
        line.append(session)
    assert room.admit_waiting() == [line[0].pk]  # the head is handed back to the servers queue …
    assert sent == [(dispatch.START_SERVER, (line[0].pk,))]
    assert room.admit_waiting() == []  # … not again before it had time to try
    assert notices(line[2]) == []

    AgentSession.objects.filter(pk=line[0].pk).update(status="stopped")  # Stop cancels the wait
    MemoryClaim.objects.filter(session=line[1]).update(tried_at=None)
    assert room.admit_waiting() == [line[1].pk]
    assert not MemoryClaim.objects.filter(session=line[0]).exists()
    assert notices(line[2]) == [f"Waiting for memory on {local_machine.name} — 1 ahead."]
    # A start let through whose start claim is gone (its worker died) stops counting.
    MemoryClaim.objects.filter(session=line[1]).update(granted=True)
    room.admit_waiting()
    assert not MemoryClaim.objects.filter(session=line[1]).exists()
