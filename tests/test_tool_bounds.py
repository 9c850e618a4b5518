"""Built-in tools cannot take the server down or hold a turn; tool results are bounded
(docs/behaviour.md §9, C47).

Turns are driven as in tests/test_agent_loop.py: the REAL llama-server started by the
product, the model side scripted, ``step(...)`` in this process. Stop reply is tested with
the step in a thread of its own (``transaction=True``). The MCP server with a 30 MB answer
is tests/bulk_mcp.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection

from machines_app.transports import ProcessId, transport_for
from sessions_app import actions, agent, tool_results
from sessions_app.completions import CompletionClient
from sessions_app.models import AgentSession, McpServer, TranscriptEvent
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.records import server_endpoint
from sessions_app.servers.start import start_server
from sessions_app.tools import machine as machine_tools

from .bulk_mcp import BIG_MCP_BYTES
from .conftest import ROOT, grant_bypass, model_key, wait_for
from .helpers import events_of, fresh, step, text_reply, tool_call_reply
from .processes import free_port, port_open, stop_process, wait_until


def bypass_session(alice, machine, workdir: Path, **fields) -> AgentSession:
    grant_bypass(alice)
    values = {"server_params": {"contextSize": 1024}, **fields}
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(workdir),
        status="loading", permission_mode="bypassPermissions", **values,
    )
    start_server(session.pk)
    assert fresh(session).status == "idle", [e.payload for e in events_of(session, "error")]
    return session


def server_answers(session) -> bool:
    record = ServerRecord.objects.get(session=session)
    alive = transport_for(record.machine).process_alive(ProcessId(record.pid, record.start_time))
    endpoint = server_endpoint(fresh(session))
    health = httpx.get(f"{endpoint.url}/health", headers={"Authorization": f"Bearer {endpoint.api_key}"}, timeout=5)
    return alive and health.status_code == 200


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def ends(session) -> list[dict]:
    return [e.payload for e in events_of(session, "tool_end")]


#: Seconds a step or a call here may take before the test calls it hung: a guard, not a
#: speed bound (speed is bench/'s). Far above what they take on a loaded box, and far below
#: the waits they must not make (a 300 s command, llama-server's 900 s, C47).
HANG_GUARD = 60


@pytest.fixture
def workdir(tmp_path) -> Path:
    (tmp_path / "notes.txt").write_text("the sheep are in the north field\n")
    subprocess.run(["truncate", "-s", "2G", str(tmp_path / "weights.gguf")], check=True)
    return tmp_path


# --- the pure parts ------------------------------------------------------------------------------


def test_it_cuts_a_long_result_keeping_its_start_and_end_with_a_note():
    text = "a" * 30_000 + "[exit code: 0]"
    cut, total = tool_results.cap(text, 10_000)
    assert total == len(text)
    assert cut.startswith("a" * 7_500) and cut.endswith("[exit code: 0]")
    assert f"{len(text) - 10_000:,} of this result's {len(text):,} characters" in cut
    assert "read_file with start_line/end_line" in cut and len(cut) < 10_000 + len(tool_results.CUT_NOTE) + 40
    assert tool_results.cap("short", 10_000) == ("short", None)


@pytest.mark.parametrize(("pattern", "path", "matches"), [
    ("**", "a/b/c.py", True),
    ("*.py", "a/b/c.py", True),  # no '/': the base name at any depth
    ("*.py", "a/b/c.txt", False),
    ("b/*.py", "a/b/c.py", True),  # anchored with **/
    ("/b/*.py", "a/b/c.py", False),
    ("src/**/*.cpp", "src/x/y/z.cpp", True),
    ("**/test_?.py", "t/test_1.py", True),
    ("*.[ch]", "x/main.c", True),
])
def test_include_and_exclude_globs_match_as_llama_server_matches_them(pattern, path, matches):
    assert machine_tools.path_glob_match(pattern, path) is matches


# --- on the real llama-server of a local session -------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_grep_over_a_folder_with_a_2gb_file_answers_within_its_bound_with_the_server_alive(
        local_machine, alice, workdir, model_side):
    session = bypass_session(alice, local_machine, workdir)
    model_side.will_answer(*tool_call_reply(("grep_search", '{"path": ".", "pattern": "sheep"}')))
    model_side.will_answer(*text_reply("In the north field."))
    actions.do_send_message(session, alice, "Where are the sheep?")
    step(fresh(session), model_side)
    end, = ends(session)  # the 2 GB file was skipped by its size, unread (said below)
    assert end["ok"] and "notes.txt:the sheep are in the north field" in end["output"]
    assert "Total matches: 1" in end["output"] and "skipped 1 file over 16 MiB: weights.gguf" in end["output"]
    assert server_answers(session) and fresh(session).status == "idle"


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_read_file_of_a_huge_or_binary_file_answers_a_sentence(local_machine, alice, workdir, model_side):
    with open(workdir / "huge.log", "w") as f:
        f.write("".join(f"line {i}\n" for i in range(1, 3_000_001)))  # about 30 MB of text
    session = bypass_session(alice, local_machine, workdir)
    model_side.will_answer(*tool_call_reply(
        ("read_file", '{"path": "weights.gguf"}'),
        ("read_file", '{"path": "weights.gguf", "start_line": 1, "end_line": 3}'),
        ("read_file", '{"path": "huge.log"}'),
        ("read_file", '{"path": "huge.log", "start_line": 2, "end_line": 3, "append_loc": true}'),
        ("edit_file", '{"path": "weights.gguf", "edits": [{"old_text": "a", "new_text": "b"}]}'),
    ))
    model_side.will_answer(*text_reply("ok"))
    actions.do_send_message(session, alice, "read them")
    step(fresh(session), model_side)
    binary, binary_range, huge, part, edit = ends(session)  # each a sentence, not the file (below)
    assert binary == binary_range | {"id": binary["id"]}
    assert "weights.gguf is a binary file (2147483648 bytes)" in binary["output"] and not binary["ok"]
    assert huge["output"].startswith("file too large (") and "Use start_line/end_line" in huge["output"]
    assert part == {"id": part["id"], "output": "2\u2192line 2\n3\u2192line 3\n", "ok": True}
    assert "too large to edit" in edit["output"]
    assert server_answers(session)


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_a_backgrounded_child_never_holds_the_call_and_the_timeout_ends_the_whole_group(
        local_machine, alice, workdir, model_side):
    session = bypass_session(alice, local_machine, workdir)
    model_side.will_answer(*tool_call_reply(
        ("exec_shell_command", '{"command": "sleep 900 &"}'),
        ("exec_shell_command", '{"command": "(sleep 4; touch late.txt) & echo started; sleep 300", "timeout": 2}'),
    ))
    model_side.will_answer(*text_reply("done"))
    actions.do_send_message(session, alice, "run them")
    started = time.monotonic()
    step(fresh(session), model_side)
    # Only a guard against a hang: far above the step's own seconds, far below the 900 s
    # (llama-server's own, C47) and 300 s the calls would hold it if the child held the call
    # or the timeout did not end it. The outputs below say which path each call took.
    assert time.monotonic() - started < HANG_GUARD
    background, timed_out = ends(session)
    assert background["ok"] and background["output"].endswith("[exit code: 0]")
    assert "started" in timed_out["output"] and timed_out["output"].endswith("[exit due to timed out]")
    # The timeout killed the group, not only sh: the child never gets to write its file.
    # (Its pid is not checked: it runs in the sandbox's own PID namespace.)
    time.sleep(max(0.0, started + 9 - time.monotonic()))
    assert not (Path(session.working_dir) / "late.txt").exists()
    assert server_answers(session)


@pytest.mark.django_db(transaction=True)  # the step runs in a thread of its own, on its own connection
@pytest.mark.usefixtures("stop_servers_after")
def test_stop_reply_ends_a_running_tool_within_a_second_keeping_what_it_printed(
        local_machine, alice, workdir, model_side, steps_run_here):
    session = bypass_session(alice, local_machine, workdir)
    model_side.will_answer(*tool_call_reply(("exec_shell_command", '{"command": "echo before; sleep 300; '
                                                                   'touch after.txt", "timeout": 600}')))
    model_side.will_answer(*text_reply("never asked"))
    actions.do_send_message(session, alice, "wait a while")

    def run_step() -> None:
        try:
            agent.run_turn_step(session.pk, client_factory=lambda _url, **kw: CompletionClient(model_side.url, **kw))
        finally:
            connection.close()

    thread = threading.Thread(target=run_step)
    thread.start()
    try:
        wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="tool_running").exists(), 30,
                 what="the call to run")
        time.sleep(1)  # it printed "before" and sleeps
        actions.do_interrupt(fresh(session), alice)
        # A guard only: the call sleeps 300 s, so a tool_end at all means Stop ended it.
        wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="tool_end").exists(), HANG_GUARD,
                 interval=0.02, what="the call to end")
    finally:
        thread.join(30)
    assert not thread.is_alive()
    end, = ends(session)
    assert end["output"].startswith("before\n") and "[stopped: Stop reply]" in end["output"] and not end["ok"]
    assert not (workdir / "after.txt").exists(), "the command ran on past the Stop"
    assert events_of(session, "turn_end")[-1].payload["reason"] == "interrupted"
    assert len(model_side.requests) == 1  # the model was not asked again
    assert server_answers(session)


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_a_call_whose_server_died_says_so_and_is_not_run_again(local_machine, alice, workdir, model_side):
    session = bypass_session(alice, local_machine, workdir)
    record = ServerRecord.objects.get(session=session)
    transport_for(local_machine).send_signal(ProcessId(record.pid, record.start_time), 9)
    wait_until(lambda: not transport_for(local_machine).process_alive(ProcessId(record.pid, record.start_time)), 10,
               "the server to die")
    model_side.will_answer(*tool_call_reply(("write_file", '{"path": "x.txt", "content": "hi"}')))
    actions.do_send_message(session, alice, "write it")
    step(fresh(session), model_side)
    end, = ends(session)
    assert end == {"id": end["id"], "output": agent.SERVER_LOST_RESULT, "ok": False}
    assert fresh(session).status == "exited" and not fresh(session).turn_active
    assert events_of(session, "turn_end")[-1].payload["reason"] == "error"
    step(fresh(session), model_side)
    assert len(ends(session)) == 1 and not (workdir / "x.txt").exists()


# --- results are bounded -------------------------------------------------------------------------


@pytest.fixture
def bulk_mcp(tmp_path):
    """A real MCP server whose ``big`` tool answers ``BIG_MCP_BYTES`` of text."""
    port = free_port()
    log = open(tmp_path / "mcp.log", "wb")  # noqa: SIM115 - the child keeps writing to it
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "bulk_mcp.py"), str(port)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_until(lambda: port_open(port), 30, "the MCP server to listen")
    McpServer.objects.create(name="bulk", url=f"http://127.0.0.1:{port}/mcp")
    yield
    stop_process(proc)


# Committed rows: the real completions take longer than the step's interrupt poll, whose
# thread reads the session on a connection of its own.
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after", "bulk_mcp")
def test_a_30mb_mcp_result_is_capped_before_it_is_stored_and_sent_and_clear_gets_past_an_overflow(
        local_machine, alice, workdir, model_side, steps_run_here):
    session = bypass_session(alice, local_machine, workdir, sampling={"max_tokens": 4},
                             server_params={"contextSize": 4096})
    model_side.will_answer(*tool_call_reply(("bulk__big", "{}")))
    model_side.will_answer(*text_reply("That is a lot."))
    actions.do_send_message(session, alice, "fetch it all")
    step(fresh(session), model_side)
    limit = settings.CORRAL_TOOL_RESULT_MAX_CHARS
    end, = ends(session)
    assert end["ok"] and end["full_chars"] == BIG_MCP_BYTES
    assert len(end["output"]) <= limit + len(tool_results.CUT_NOTE) + 40
    assert f"{BIG_MCP_BYTES:,} characters" in end["output"]
    sent = model_side.requests[1]["messages"][-1]
    assert sent["role"] == "tool" and sent["content"] == end["output"]  # the page and the model see one cut
    stored = TranscriptEvent.objects.get(session=session, kind="tool_end")
    assert len(str(stored.payload)) < limit * 2

    # The capped result still fills this context: the real server refuses the next request…
    actions.do_send_message(fresh(session), alice, "and now?")
    agent.run_turn_step(session.pk)
    error = events_of(session, "error")[-1].payload
    assert error.get("context_exceeded") is True, error
    # …and after Clear the session goes on.
    actions.do_clear(fresh(session), alice)
    actions.do_send_message(fresh(session), alice, "Say hi.")
    agent.run_turn_step(session.pk)
    assert events_of(session, "turn_end")[-1].payload["reason"] == "done", [(e.kind, e.payload) for e in events_of(session)][-5:]
    assert events_of(session, "usage")[-1].payload.get("prompt_tokens", 0) < 4096


# --- the same tools over SSH ---------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_over_ssh_the_timeout_ends_the_group_a_background_child_never_holds_and_reads_are_bounded(
        ssh_machine, alice, workdir, model_side):
    session = bypass_session(alice, ssh_machine, workdir)
    model_side.will_answer(*tool_call_reply(
        ("exec_shell_command", '{"command": "sleep 900 &"}'),
        ("exec_shell_command", '{"command": "(sleep 4; touch late.txt) & echo started; sleep 300", "timeout": 2}'),
        ("read_file", '{"path": "weights.gguf", "end_line": 2}'),
        ("read_file", '{"path": "notes.txt"}'),
        ("grep_search", '{"path": ".", "pattern": "north"}'),
    ))
    model_side.will_answer(*text_reply("done"))
    actions.do_send_message(session, alice, "run them there")
    started = time.monotonic()
    step(fresh(session), model_side)
    assert time.monotonic() - started < HANG_GUARD  # a guard only, as in the local test above
    background, timed_out, binary, notes, grep = ends(session)
    assert background["ok"] and background["output"].endswith("[exit code: 0]")
    assert "started" in timed_out["output"] and timed_out["output"].endswith("[exit due to timed out]")
    child = int(timed_out["output"].split("child ", 1)[1].split()[0])
    wait_until(lambda: not pid_alive(child), 3, "the remote child to end")  # the test sshd is this machine
    assert "weights.gguf is a binary file (2147483648 bytes)" in binary["output"]
    assert notes["output"] == "the sheep are in the north field\n"
    assert "notes.txt:the sheep are in the north field" in grep["output"] and "weights.gguf" in grep["output"]
    assert server_answers(session)


@pytest.mark.django_db
def test_over_ssh_the_tools_themselves_are_bounded(ssh_machine, workdir):
    """The same tools through the SSH transport alone (no server needed): the timeout ends the
    group, a background child never holds the call, Stop ends a call keeping its output, and
    binary or huge reads answer a sentence."""
    transport = transport_for(ssh_machine)
    cwd = str(workdir)
    started = time.monotonic()
    background = machine_tools.run("exec_shell_command", {"command": "sleep 900 &"}, transport, cwd)
    timed_out = machine_tools.run(
        "exec_shell_command", {"command": "sleep 300 & echo child $!; echo started; sleep 300", "timeout": 2},
        transport, cwd)
    assert time.monotonic() - started < HANG_GUARD  # a guard only: the calls would hold 900 s and 300 s
    assert background.ok and background.output.endswith("[exit code: 0]")
    assert "started" in timed_out.output and timed_out.output.endswith("[exit due to timed out]")
    child = int(timed_out.output.split("child ", 1)[1].split()[0])
    wait_until(lambda: not pid_alive(child), 3, "the remote child to end")  # the test sshd is this machine

    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    stopped = machine_tools.run("exec_shell_command", {"command": "echo before; sleep 300; touch after.txt"},
                                transport, cwd, cancel)
    assert stopped.output.startswith("before\n") and "[stopped: Stop reply]" in stopped.output
    assert not (workdir / "after.txt").exists(), "the command ran on past the Stop"

    binary = machine_tools.run("read_file", {"path": "weights.gguf", "end_line": 2}, transport, cwd)
    assert "weights.gguf is a binary file (2147483648 bytes)" in binary.output
    assert machine_tools.run("read_file", {"path": "notes.txt"}, transport, cwd).output == (
        "the sheep are in the north field\n")
    grep = machine_tools.run("grep_search", {"path": ".", "pattern": "north"}, transport, cwd)
    assert "notes.txt:the sheep are in the north field" in grep.output and "weights.gguf" in grep.output
