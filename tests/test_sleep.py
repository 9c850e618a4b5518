"""Idle servers sleep (docs/behaviour.md §4 ``sleeping``, §5 "sleep"; failure C45): after its
machine's idle time a session's llama-server is stopped through the Stop path (its slot
saved first), the session shows ``sleeping``, and the next message starts it again with
its prompt cache restored. Real llama-server, real worker and its rounds, a real browser."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from sessions_app import actions
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.stop import sleep_server

from .conftest import wait_for
from .helpers import converse_once, fresh, idle_seeded_session, log_in, payloads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def alive(pid: int) -> bool:
    try:
        return "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def test_an_idle_server_sleeps_after_the_machines_idle_time_and_a_message_wakes_it(stack, local_machine, alice,
                                                                                   tmp_path):
    session = idle_seeded_session(local_machine, alice, tmp_path)
    converse_once(session, alice, "My sheep is called Dolly.")
    pid = ServerRecord.objects.get(session=session).pid
    local_machine.idle_stop_seconds = 3
    local_machine.save()

    wait_for(lambda: fresh(session).status == "sleeping", 60, what="the idle server to sleep")
    wait_for(lambda: not ServerRecord.objects.filter(session=session).exists() and not alive(pid), 30,
             what="the process to be gone")
    stopped = payloads(session, "server_stopped")[-1]
    assert stopped["reason"] == "idle" and "by" not in stopped
    assert SlotSave.objects.get(session=session).n_tokens > 0
    assert fresh(session).status == "sleeping"  # not "exited", and it stays so

    local_machine.idle_stop_seconds = None
    local_machine.save()
    converse_once(session, alice, "What is my sheep called?")
    assert fresh(session).status == "idle"
    assert payloads(session, "server_ready")[-1].get("warm_tokens") > 0
    assert payloads(session, "turn_end")[-1]["reason"] == "done"
    assert "".join(p["text"] for p in payloads(session, "assistant_text")).strip()


def test_case_c45_messages_during_an_idle_stop_wait_for_it_and_are_all_answered(stack, local_machine, alice,
                                                                             tmp_path):
    session = idle_seeded_session(local_machine, alice, tmp_path)
    converse_once(session, alice, "Hello.")
    record = ServerRecord.objects.get(session=session)
    # Hold the stop at its slot save: the server is frozen, so the save waits for it.
    os.kill(record.pid, signal.SIGSTOP)
    sleeper = threading.Thread(target=lambda: (sleep_server(session.pk), connection.close()))
    sleeper.start()
    try:
        wait_for(lambda: fresh(session).status == "sleeping", 10, what="the idle stop to begin")
        time.sleep(1)  # a message 1 s into the idle stop …
        actions.do_send_message(fresh(session), alice, "First, during the stop.")
        for n in range(5):  # … then five more
            actions.do_send_message(fresh(session), alice, f"Message {n + 2}.")
        assert fresh(session).status == "loading"
        time.sleep(2)
        # The start waits for the stop: still the one frozen server, no second one.
        assert ServerRecord.objects.filter(session=session).count() == 1
        assert ServerRecord.objects.get(session=session).pid == record.pid
    finally:
        os.kill(record.pid, signal.SIGCONT)
        sleeper.join(60)
    wait_for(lambda: len(payloads(session, "turn_end")) == 7 and not fresh(session).turn_active, 240,
             what="every message to be answered")
    assert [p["reason"] for p in payloads(session, "turn_end")] == ["done"] * 7
    taken = [p["text"] for p in payloads(session, "message_taken")]
    assert taken[1:] == ["First, during the stop."] + [f"Message {n + 2}." for n in range(5)]
    assert payloads(session, "server_ready")[-1].get("warm_tokens", 0) > 0
    new = ServerRecord.objects.get(session=session)
    assert new.pid != record.pid and not new.stopping and not alive(record.pid)
    assert fresh(session).status == "idle"


def test_staff_put_idle_servers_to_sleep_from_the_machine_page_and_a_message_wakes_one(stack, page, local_machine,
                                                                                       alice, tmp_path):
    """Browser: the machine's page lists its running servers with their memory; the "stop
    all idle" action puts them to sleep; the session page says sleeping; sending a message
    from the page starts the server again and the reply comes."""
    staff = get_user_model().objects.create_user("staffer", password="staffer-password-1", is_staff=True,
                                                 is_superuser=True)
    session = idle_seeded_session(local_machine, alice, tmp_path)
    AgentSession.objects.filter(pk=session.pk).update(owner=staff)
    log_in(page, stack, "staffer", "staffer-password-1")

    page.goto(f"{stack.base_url}/admin/machines_app/machine/{local_machine.pk}/change/")
    table = page.locator("table.running-servers")
    assert session.display_title in table.inner_text()
    rss = table.locator("td.rss").first.inner_text()
    assert rss.endswith("MiB") and int(rss.split()[0]) > 0

    page.goto(f"{stack.base_url}/admin/machines_app/machine/")
    page.check(f"input[name=_selected_action][value='{local_machine.pk}']")
    page.select_option("select[name=action]", "stop_idle_servers")
    page.click("button[name=index]")
    page.wait_for_selector("text=putting 1 idle server(s) to sleep")

    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=sleeping]", timeout=60_000)
    page.wait_for_selector("#conn-state[data-state=live]")
    assert not ServerRecord.objects.filter(session=session).exists()
    page.fill("#id_text", "Say hello.")
    page.press("#id_text", "Enter")
    page.wait_for_selector("#status-badge[data-status=idle]", timeout=120_000)
    wait_for(lambda: payloads(session, "turn_end") and not fresh(session).turn_active, 120, what="the reply")
    page.wait_for_function("() => document.querySelector('.msg.assistant .raw, .msg.assistant')?.textContent.trim()")
    assert payloads(session, "server_stopped")[-1]["by"]["username"] == "staffer"
    # The message woke the server: the note says so, not that someone restarted it.
    page.locator(".note", has_text="llama-server woken by a message from staffer.").wait_for()
    assert page.locator(".note", has_text="restarted by").count() == 0


# --- the memory the machine page shows -------------------------------------------------------


def own_process():
    from machines_app.transports import ProcessId, parse_proc_stat

    return ProcessId(os.getpid(), parse_proc_stat(open(f"/proc/{os.getpid()}/stat").read())[1])


def test_the_memory_of_a_process_is_read_locally_and_over_ssh_and_no_gpu_says_none(ssh_machine):
    from machines_app.transports import LocalTransport, transport_for

    for transport in (LocalTransport(), transport_for(ssh_machine)):
        rss = transport.memory_of(own_process())
        assert rss is not None and rss > 10 * 1024 * 1024  # this Python process holds Django
        # This machine has no nvidia-smi: "no GPU figures", not "no GPU memory used".
        assert transport.gpu_memory() is None
    gone = own_process().__class__(own_process().pid, "1")  # another start time: not this process
    assert LocalTransport().memory_of(gone) is None


def test_gpu_memory_is_read_from_nvidia_smi_per_process():
    """nvidia-smi cannot be had here without a GPU: its output (the documented CSV of
    --query-compute-apps=pid,used_memory --format=csv,noheader,nounits, MiB) is given."""
    from machines_app.transports import LocalTransport

    class WithGpu(LocalTransport):
        def run_probe(self, argv):
            assert argv[:2] == ["nvidia-smi", "--query-compute-apps=pid,used_memory"]
            return "4242, 1536\n4242, 512\n77, 100\n[Not Supported], 3\n"

    assert WithGpu().gpu_memory() == {4242: 2048 * 1024 * 1024, 77: 100 * 1024 * 1024}
