"""Only whole calls run (docs/behaviour.md §9; failures C01 and C04).

A call cut by the length limit or by a stream that ended without a finish reason is neither
run nor asked about; arguments that are not one JSON object (a key written twice included)
are never run as ``{}``: the model is told the parse error. Steps run in this process; the
model side is a scripted stream (a 135M model does not call tools on demand), the tools run
on the REAL llama-server the product started, in a real working directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessions_app import actions, agent
from sessions_app.models import AgentSession

from .conftest import grant_bypass
from .helpers import events_of, step, text_reply, tool_call_reply
from .scripted_server import chunk, sse

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("stop_servers_after")]

VICTIM = "victim.txt"


def cut_call_reply(name: str, partial_arguments: str, finish: str | None) -> list[bytes]:
    """A reply whose last call stops inside its arguments: ``finish_reason`` ``finish``
    (``None``: the server ends with ``[DONE]`` and never says why)."""
    head = {"index": 0, "id": "call_cut", "type": "function", "function": {"name": name, "arguments": ""}}
    pieces = [partial_arguments[i:i + 7] for i in range(0, len(partial_arguments), 7)]
    return [
        sse(chunk({"tool_calls": [head]})),
        *[sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})) for piece in pieces],
        *([sse(chunk({}, finish_reason=finish))] if finish else []),
        b"data: [DONE]\n\n",
    ]


@pytest.fixture(params=["bypass", "manual"])
def gate(request, real_session, alice):
    """The session in each gate mode: nothing below may run, nor be asked about, in either."""
    if request.param == "bypass":
        grant_bypass(alice)
        actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    return request.param


@pytest.mark.parametrize("finish", ["length", None], ids=["length", "no-finish-reason"])
def test_a_call_cut_inside_its_arguments_is_neither_run_nor_asked_about(real_session, alice, model_side, gate, finish):
    # Whole, these arguments would create the victim file: cut, they must do nothing.
    model_side.will_answer(*cut_call_reply("exec_shell_command", f'{{"command": "touch {VICTIM} && echo ', finish))
    actions.do_send_message(real_session, alice, "touch it")
    step(real_session, model_side)

    session = AgentSession.objects.get(pk=real_session.pk)
    assert not events_of(session, "question") and not events_of(session, "tool_running")
    (end,) = [e.payload for e in events_of(session, "tool_end")]
    assert end["ok"] is False
    assert end["output"] == agent.CUT_CALL_RESULT.format(tool="exec_shell_command", why=agent.CUT_CALL_WHY[finish])
    notice = events_of(session, "notice")[-1].payload["message"]
    assert notice.startswith("The reply stopped in the middle of a tool call" if finish else "The reply ended in the middle")
    if finish == "length":
        assert "max_tokens 4096" in notice
    assert events_of(session, "turn_end")[-1].payload["reason"] == "done"
    assert session.status == "idle" and not session.turn_active
    assert not (Path(session.working_dir) / VICTIM).exists()
    assert len(model_side.requests) == 1  # the model is not asked again: the person decides to go on
    # The raw text stays in the transcript for the page; the model is sent "{}" next time.
    start = events_of(session, "tool_start")[0].payload
    assert start["raw_arguments"].startswith('{"command": "touch') and start["arguments"] == "{}"


def test_the_whole_calls_of_a_cut_reply_do_not_run_either(real_session, alice, model_side, gate):
    # Two calls, the second cut: the reply is not a whole plan, so neither runs.
    first = {"index": 0, "id": "call_a", "type": "function",
             "function": {"name": "exec_shell_command", "arguments": json.dumps({"command": f"touch {VICTIM}"})}}
    second = {"index": 1, "id": "call_b", "type": "function",
              "function": {"name": "read_file", "arguments": '{"path": "no'}}
    model_side.will_answer(sse(chunk({"tool_calls": [first]})), sse(chunk({"tool_calls": [second]})),
                           sse(chunk({}, finish_reason="length")), b"data: [DONE]\n\n")
    actions.do_send_message(real_session, alice, "go")
    step(real_session, model_side)
    ends = [e.payload for e in events_of(real_session, "tool_end")]
    assert [e["ok"] for e in ends] == [False, False]
    assert not events_of(real_session, "question") and not events_of(real_session, "tool_running")
    assert not (Path(real_session.working_dir) / VICTIM).exists()


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        # The card would read the first "command"; JSON keeps the last one.
        ('{"command": "echo harmless",' + "\n" * 60 + f'"command": "touch {VICTIM}"}}', "duplicate key 'command'"),
        (f'{{"command": "touch {VICTIM}"', "Expecting ',' delimiter"),
        (f'["touch {VICTIM}"]', "it is a JSON array, not an object"),
    ],
    ids=["duplicate-key", "truncated", "array"],
)
def test_malformed_arguments_are_never_run_and_the_model_is_told_why(real_session, alice, model_side, gate, arguments, error):
    model_side.will_answer(*tool_call_reply(("exec_shell_command", arguments)))
    model_side.will_answer(*text_reply("Sorry, let me fix that."))
    actions.do_send_message(real_session, alice, "go")
    step(real_session, model_side)

    assert not events_of(real_session, "question") and not events_of(real_session, "tool_running")
    assert not (Path(real_session.working_dir) / VICTIM).exists()
    start = events_of(real_session, "tool_start")[0].payload
    assert error in start["arguments_error"] and start["raw_arguments"] == arguments and start["input"] == {}
    (end,) = [e.payload for e in events_of(real_session, "tool_end")]
    assert end["ok"] is False and error in end["output"] and end["output"].startswith(
        "This call of exec_shell_command was not run: its arguments were not valid JSON (")
    # The turn goes on: the model gets the error as the call's result and answers.
    sent = model_side.requests[1]["messages"]
    assert sent[-2]["tool_calls"][0]["function"]["arguments"] == "{}"  # llama-server must parse history
    assert sent[-1] == {"role": "tool", "tool_call_id": start["id"], "content": end["output"]}
    assert events_of(real_session, "turn_end")[-1].payload["reason"] == "done"


def test_a_malformed_call_stored_before_calls_were_refused_is_not_run_either(real_session, alice, model_side):
    # Transcripts written before arguments_error existed carry only raw_arguments.
    from sessions_app import turns
    from sessions_app.transcript import Kind

    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    model_side.will_answer(*text_reply("ok"))
    actions.do_send_message(real_session, alice, "go")
    owner = turns.step_owner(None)
    assert turns.claim_step(real_session.pk, owner) is not None
    turns.record_for_step(real_session.pk, owner, Kind.TOOL_START, {
        "id": "call_old", "tool": "exec_shell_command", "arguments": "{}",
        "raw_arguments": f'{{"command": "touch {VICTIM}"', "input": {}, "origin": "machine", "server": None,
        "writes": None, "display_name": "exec_shell_command"})
    turns.release_lease(real_session.pk, owner)
    step(real_session, model_side)
    (end,) = [e.payload for e in events_of(real_session, "tool_end")]
    assert end["ok"] is False and "not valid JSON" in end["output"]
    assert not (Path(real_session.working_dir) / VICTIM).exists()


def test_case_c01_two_unindexed_id_less_calls_each_run_with_their_own_arguments(real_session, alice, model_side):
    grant_bypass(alice)
    actions.do_set_permission_mode(real_session, alice, "bypassPermissions")
    model_side.will_answer(
        sse(chunk({"tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": '{"path":'}}]})),
        sse(chunk({"tool_calls": [{"function": {"arguments": '"notes.txt"}'}}]})),
        sse(chunk({"tool_calls": [{"type": "function", "function": {"name": "exec_shell_command",
                                                                    "arguments": '{"command":"ls"}'}}]})),
        sse(chunk({}, finish_reason="tool_calls")), b"data: [DONE]\n\n",
    )
    model_side.will_answer(*text_reply("Both done."))
    actions.do_send_message(real_session, alice, "read and list")
    step(real_session, model_side)

    starts = [e.payload for e in events_of(real_session, "tool_start")]
    assert [(s["tool"], s["input"]) for s in starts] == [
        ("read_file", {"path": "notes.txt"}), ("exec_shell_command", {"command": "ls"})]
    ends = {e.payload["id"]: e.payload for e in events_of(real_session, "tool_end")}
    assert "the sheep are in the north field" in ends[starts[0]["id"]]["output"]
    assert "notes.txt" in ends[starts[1]["id"]]["output"] and ends[starts[1]["id"]]["ok"] is True
