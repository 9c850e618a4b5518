"""The agent loop and the permission gate (docs/behaviour.md §6.5, §7, §8, §9).

Steps run in this process so each stage can be checked; the model side is scripted (a
135M model will not call a tool on demand) while tools run on the REAL llama-server
started by the product (`POST /tools` with `x-tool-cwd`).
"""

from __future__ import annotations

import pytest

from sessions_app import actions, agent
from sessions_app.models import AgentSession
from sessions_app.servers.start import start_server

from .conftest import grant_bypass, model_key
from .helpers import events_of, step, text_reply, tool_call_reply

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("stop_servers_after")]


def test_it_reads_the_catalogue_from_the_real_server_and_runs_a_call_in_the_working_dir(real_session, alice, model_side):
    catalogue = events_of(real_session, "catalogue")[-1].payload["tools"]
    names = {entry["name"] for entry in catalogue}
    assert {"read_file", "exec_shell_command", "write_file", "edit_file", "grep_search"} <= names
    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    model_side.will_answer(*tool_call_reply(("read_file", '{"path": "notes.txt"}')))
    model_side.will_answer(*text_reply("The sheep are in the north field."))
    actions.do_send_message(real_session, alice, "Where are the sheep? Read notes.txt.")
    step(real_session, model_side)

    end = events_of(real_session, "tool_end")[0].payload
    assert "the sheep are in the north field" in end["output"] and end["ok"] is True  # relative path → x-tool-cwd
    start = events_of(real_session, "tool_start")[0].payload
    assert start["origin"] == "machine" and start["input"] == {"path": "notes.txt"}
    second = model_side.requests[1]["messages"]
    assert second[-2]["role"] == "assistant" and second[-2]["content"] == ""  # docs/behaviour.md C05
    assert second[-2]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"path": "notes.txt"}'}
    assert second[-1] == {"role": "tool", "tool_call_id": start["id"], "content": end["output"]}
    assert [d["function"]["name"] for d in model_side.requests[0]["tools"]] == [e["name"] for e in catalogue]
    assert events_of(real_session, "turn_end")[0].payload["reason"] == "done"


def test_it_asks_in_manual_mode_and_runs_after_allow_once(real_session, alice, bob, model_side):
    model_side.will_answer(*tool_call_reply(("exec_shell_command", '{"command": "pwd"}')))
    model_side.will_answer(*text_reply("Done."))
    actions.do_send_message(real_session, alice, "Where am I?")
    step(real_session, model_side)

    session = AgentSession.objects.get(pk=real_session.pk)
    assert session.status == "awaiting_input" and session.turn_active and not session.lease_owner  # no worker holds it
    question = events_of(session, "question")[0].payload
    assert question["tool"] == "exec_shell_command"
    assert not events_of(session, "tool_end") and len(model_side.requests) == 1

    actions.do_answer(session, alice, question["id"], "allow_once")
    with pytest.raises(actions.SessionError, match="already been answered"):
        actions.do_answer(session, alice, question["id"], "refuse")  # the first answer wins
    step(session, model_side)
    output = events_of(session, "tool_end")[0].payload["output"]
    assert output.startswith(session.working_dir)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"


def test_it_returns_the_refusal_sentence_to_the_model(real_session, alice, model_side):
    model_side.will_answer(*tool_call_reply(("write_file", '{"path": "x.txt", "content": "boo"}')))
    model_side.will_answer(*text_reply("Understood."))
    actions.do_send_message(real_session, alice, "Write x.txt")
    step(real_session, model_side)
    question = events_of(real_session, "question")[0].payload
    actions.do_answer(real_session, alice, question["id"], "refuse")
    step(real_session, model_side)
    assert not (real_session.working_dir and __import__("pathlib").Path(real_session.working_dir, "x.txt").exists())
    tool_message = model_side.requests[1]["messages"][-1]
    assert tool_message["content"] == agent.REFUSED_RESULT.format(tool="write_file")


def test_it_stops_asking_after_always_allow_also_in_a_new_worker(real_session, alice, model_side):
    model_side.will_answer(*tool_call_reply(("read_file", '{"path": "notes.txt"}')))
    model_side.will_answer(*text_reply("ok"))
    actions.do_send_message(real_session, alice, "read it")
    step(real_session, model_side)
    question = events_of(real_session, "question")[0].payload
    assert question["offers"] == [{"scope": {"kind": "path", "path": "notes.txt"}}]
    actions.do_answer(real_session, alice, question["id"], "allow_always", "0")  # reads of notes.txt
    step(real_session, model_side)
    # A later turn, run by a fresh step (as after a worker restart): the allowance is
    # folded from the transcript, not remembered by anything.
    model_side.will_answer(*tool_call_reply(("read_file", '{"path": "notes.txt"}'), ("exec_shell_command", '{"command": "true"}')))
    model_side.will_answer(*text_reply("ok again"))
    actions.do_send_message(real_session, alice, "read it again")
    step(real_session, model_side)
    questions = [e.payload["tool"] for e in events_of(real_session, "question")]
    assert questions == ["read_file", "exec_shell_command"]  # read_file not asked again
    assert len(events_of(real_session, "tool_end")) == 2  # first read + second read; shell waits


def test_it_answers_unknown_tools_and_keeps_the_turn_going(real_session, alice, model_side):
    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    model_side.will_answer(*tool_call_reply(("launch_rockets", "{}")))
    model_side.will_answer(*text_reply("Sorry."))
    actions.do_send_message(real_session, alice, "go")
    step(real_session, model_side)
    assert "There is no tool named launch_rockets" in events_of(real_session, "tool_end")[0].payload["output"]
    assert events_of(real_session, "turn_end")[0].payload["reason"] == "done"


def test_interrupt_while_a_question_is_open_closes_it_as_a_refusal(real_session, alice, model_side):
    model_side.will_answer(*tool_call_reply(("exec_shell_command", '{"command": "ls"}')))
    actions.do_send_message(real_session, alice, "list")
    step(real_session, model_side)
    actions.do_interrupt(AgentSession.objects.get(pk=real_session.pk), alice)
    answered = events_of(real_session, "answered")[0].payload
    assert answered["answer"] == "refuse" and answered["reason"] == "interrupted"
    session = AgentSession.objects.get(pk=real_session.pk)
    assert not session.turn_active and session.status == "idle"
    assert events_of(real_session, "turn_end")[0].payload["reason"] == "interrupted"


def test_it_stops_after_32_rounds_and_says_so(real_session, alice, model_side):
    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    for _ in range(agent.MAX_ROUNDS + 1):
        model_side.will_answer(*tool_call_reply(("get_info", "")))
    actions.do_send_message(real_session, alice, "loop forever")
    step(real_session, model_side)
    assert len(model_side.requests) == agent.MAX_ROUNDS
    assert len(events_of(real_session, "tool_end")) == agent.MAX_ROUNDS
    assert events_of(real_session, "error")[-1].payload["message"].startswith("Stopped after 32 tool calls in one turn")
    assert events_of(real_session, "turn_end")[0].payload["reason"] == "limit"
    # docs/behaviour.md C04: empty arguments ran as {} and went back to the model as "{}"
    assert model_side.requests[1]["messages"][-2]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_it_gives_a_fresh_id_to_a_call_id_seen_before(real_session, alice, model_side):
    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    model_side.will_answer(*tool_call_reply(("get_info", "{}")))
    model_side.will_answer(*tool_call_reply(("get_info", "{}")))  # same id "call_get_info_0" again
    model_side.will_answer(*text_reply("fine"))
    actions.do_send_message(real_session, alice, "twice")
    step(real_session, model_side)
    ids = [e.payload["id"] for e in events_of(real_session, "tool_start")]
    assert len(ids) == 2 and len(set(ids)) == 2
    ends = [e.payload["id"] for e in events_of(real_session, "tool_end")]
    assert ends == ids


@pytest.fixture
def calc_mcp(tmp_path):
    """A real MCP server (the mcp SDK's, streamable HTTP) configured for the deployment."""
    from sessions_app.models import McpServer

    from .processes import API_KEY_HEADER, start_mcp_server, stop_process

    proc, port = start_mcp_server(tmp_path)
    (header, value), = API_KEY_HEADER.items()
    McpServer.objects.create(name="calc", url=f"http://127.0.0.1:{port}/mcp", headers={header: value})
    yield
    stop_process(proc)


@pytest.mark.usefixtures("calc_mcp")
def test_it_calls_a_tool_of_a_real_mcp_server_from_the_backend(local_machine, alice, tmp_path, model_side):
    grant_bypass(alice)
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading", permission_mode="bypassPermissions",
    )
    start_server(session.pk)
    names = {entry["name"] for entry in events_of(session, "catalogue")[-1].payload["tools"]}
    assert {"calc__add", "read_file"} <= names
    model_side.will_answer(*tool_call_reply(("calc__add", '{"a": 20, "b": 22}')))
    model_side.will_answer(*text_reply("42"))
    actions.do_send_message(session, alice, "add 20 and 22")
    step(session, model_side)
    start = events_of(session, "tool_start")[0].payload
    assert start["origin"] == "mcp" and start["server"] == "calc"
    end = events_of(session, "tool_end")[0].payload
    assert end["ok"] is True and end["output"].strip() == "42"


def test_an_unreachable_mcp_server_is_reported_and_the_session_still_starts(local_machine, alice, tmp_path):
    from machines_app.transports import LocalTransport
    from sessions_app.models import McpServer

    McpServer.objects.create(name="gone", url=f"http://127.0.0.1:{LocalTransport().free_port()}/mcp")
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    errors = [e.payload["message"] for e in events_of(session, "error")]
    assert any("MCP server 'gone'" in message for message in errors), errors
    assert "read_file" in {entry["name"] for entry in events_of(session, "catalogue")[-1].payload["tools"]}


def test_the_page_lists_each_tool_with_where_it_runs_and_whether_it_writes(real_session, alice):
    from django.test import Client

    client = Client()
    client.force_login(alice)
    page = client.get(f"/sessions/{real_session.pk}/").content.decode()
    listing = page[page.index('id="tool-list"'):]
    row = listing[listing.index("<code>exec_shell_command</code>"):]
    row = row[: row.index("</tr>")]
    assert "(the model's machine)" in row and "writes" in row
    row = listing[listing.index("<code>read_file</code>"):]
    assert "read-only" in row[: row.index("</tr>")]
