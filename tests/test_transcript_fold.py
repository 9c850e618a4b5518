"""Tests for the transcript folds (docs/behaviour.md §7, §8, §10): the sessions_app/transcript package.

Pure functions over events; no database, no Django.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from sessions_app.transcript import (
    EMPTY_ARGUMENTS,
    UNFINISHED_TOOL_RESULT,
    Event,
    allowances,
    build_messages,
    open_questions,
    open_turn,
    pending_calls,
    pending_queue,
)


def script(*steps: tuple[str, dict[str, Any]]) -> list[Event]:
    """Events numbered 1.. from (kind, payload) pairs."""
    return [
        Event(seq, kind, payload) for seq, (kind, payload) in enumerate(steps, start=1)
    ]


def user(text: str, queued_id: str | None = None) -> tuple[str, dict[str, Any]]:
    return ("message_taken", {"text": text, "queued_id": queued_id, "author": "ann"})


def say(text: str) -> tuple[str, dict[str, Any]]:
    return ("assistant_text", {"text": text})


def start(
    call_id: str, tool: str, arguments: str | None = '{"path": "."}'
) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {"id": call_id, "tool": tool, "input": {}}
    if arguments is not None:
        payload["arguments"] = arguments
    return ("tool_start", payload)


def end(call_id: str, output: str) -> tuple[str, dict[str, Any]]:
    return ("tool_end", {"id": call_id, "output": output})


def turn_end(reason: str = "done") -> tuple[str, dict[str, Any]]:
    return ("turn_end", {"reason": reason})


def other(kind: str, **payload: Any) -> tuple[str, dict[str, Any]]:
    return (kind, payload)


def call(call_id: str, tool: str, arguments: str = '{"path": "."}') -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": tool, "arguments": arguments},
    }


def tool_msg(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def asst(content: str, *calls: dict[str, Any]) -> dict[str, Any]:
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": list(calls)}
    return {"role": "assistant", "content": content}


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# --- build_messages

FOLD_CASES: list[tuple[str, list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]] = [
    ("empty transcript", [], []),
    ("user message", [user("hi")], [u("hi")]),
    (
        "deltas merge into one assistant message",
        [user("hi"), say("Hel"), say("lo"), say(" there")],
        [u("hi"), asst("Hello there")],
    ),
    (
        "user message closes the assistant message",
        [user("a"), say("x"), turn_end(), user("b"), say("y")],
        [u("a"), asst("x"), u("b"), asst("y")],
    ),
    (
        "reasoning, usage, status, errors are not conversation",
        [
            user("a"),
            other("status", status="running"),
            other("reasoning", text="hmm"),
            say("x"),
            other("usage", prompt_tokens=5),
            other("error", message="boom"),
            say("y"),
            other("settings", permission_mode="manual"),
            turn_end(),
        ],
        [u("a"), asst("xy")],
    ),
    (
        "text before a call is the content of the calling message",
        [user("a"), say("Let me look."), start("c1", "ls"), end("c1", "f.txt")],
        [u("a"), asst("Let me look.", call("c1", "ls")), tool_msg("c1", "f.txt")],
    ),
    (
        "text after tool results opens a new assistant message",
        [
            user("a"),
            say("one"),
            start("c1", "ls"),
            end("c1", "out"),
            say("two"),
            say("!"),
        ],
        [u("a"), asst("one", call("c1", "ls")), tool_msg("c1", "out"), asst("two!")],
    ),
    (
        "parallel calls with results in reverse order are paired by id",
        [
            user("a"),
            start("c1", "ls", '{"path": "a"}'),
            start("c2", "cat", '{"path": "b"}'),
            end("c2", "B"),
            end("c1", "A"),
        ],
        [
            u("a"),
            asst(
                "",
                call("c1", "ls", '{"path": "a"}'),
                call("c2", "cat", '{"path": "b"}'),
            ),
            tool_msg("c1", "A"),
            tool_msg("c2", "B"),
        ],
    ),
    (
        "question/answered between starts do not break the run of calls",
        [
            user("a"),
            start("c1", "ls"),
            other("question", id="c1", tool="ls"),
            other("usage", prompt_tokens=1),
            start("c2", "ls"),
            other("answered", id="c1", tool="ls", answer="allow_once", by="ann"),
            end("c1", "A"),
            end("c2", "B"),
        ],
        [
            u("a"),
            asst("", call("c1", "ls"), call("c2", "ls")),
            tool_msg("c1", "A"),
            tool_msg("c2", "B"),
        ],
    ),
    (
        "a tool_end ends the run: the next start is a new calling message",
        [
            user("a"),
            start("c1", "ls"),
            end("c1", "A"),
            start("c2", "cat"),
            end("c2", "B"),
        ],
        [
            u("a"),
            asst("", call("c1", "ls")),
            tool_msg("c1", "A"),
            asst("", call("c2", "cat")),
            tool_msg("c2", "B"),
        ],
    ),
    (
        "missing result gets the sentence and the call is kept",
        [
            user("a"),
            start("c1", "ls"),
            start("c2", "cat"),
            end("c2", "B"),
            other("interrupted"),
            turn_end("interrupted"),
        ],
        [
            u("a"),
            asst("", call("c1", "ls"), call("c2", "cat")),
            tool_msg("c1", UNFINISHED_TOOL_RESULT),
            tool_msg("c2", "B"),
        ],
    ),
    (
        "missing result before the next user message",
        [user("a"), start("c1", "ls"), turn_end("error"), user("b")],
        [
            u("a"),
            asst("", call("c1", "ls")),
            tool_msg("c1", UNFINISHED_TOOL_RESULT),
            u("b"),
        ],
    ),
    (
        "empty and missing arguments are sent as {}",
        [
            user("a"),
            start("c1", "ls", ""),
            start("c2", "pwd", None),
            end("c1", "A"),
            end("c2", "B"),
        ],
        [
            u("a"),
            asst("", call("c1", "ls", EMPTY_ARGUMENTS), call("c2", "pwd", "{}")),
            tool_msg("c1", "A"),
            tool_msg("c2", "B"),
        ],
    ),
    (
        "arguments are sent back exactly as stored",
        [user("a"), start("c1", "ls", '{ "b":1,"a" : [2] }'), end("c1", "A")],
        [
            u("a"),
            asst("", call("c1", "ls", '{ "b":1,"a" : [2] }')),
            tool_msg("c1", "A"),
        ],
    ),
    (
        "interrupted reply keeps the partial text",
        [user("a"), say("I was abou"), other("interrupted"), turn_end("interrupted")],
        [u("a"), asst("I was abou")],
    ),
    (
        "assistant message with no text and no calls is omitted; the next message joins the unanswered one",
        [user("a"), say(""), other("error", message="x"), turn_end("error"), user("b")],
        [u("a\n\nb")],
    ),
    # Never two user messages in a row, whatever left the turn without a reply.
    (
        "a failed turn (HTTP 400) then a message: joined",
        [user("hi"), other("error", message="context overflow"), turn_end("error"), user("second")],
        [u("hi\n\nsecond")],
    ),
    (
        "interrupted before the first token, then a message: joined",
        [user("hi"), other("interrupted", by="ann"), turn_end("interrupted"), user("again")],
        [u("hi\n\nagain")],
    ),
    (
        "an empty reply, then a message: joined",
        [user("hi"), other("notice", message="The model returned an empty reply."), other("usage", seed=1),
         turn_end(), user("hello?")],
        [u("hi\n\nhello?")],
    ),
    (
        "a reasoning-only reply, then a message: joined (reasoning is never reply text)",
        [user("hi"), other("reasoning", text="hmm"), turn_end(), user("well?")],
        [u("hi\n\nwell?")],
    ),
    (
        "three unanswered in a row, then a reply: one user message, then the reply",
        [user("a"), turn_end("error"), user("b"), turn_end("error"), user("c"), say("ok"), turn_end()],
        [u("a\n\nb\n\nc"), asst("ok")],
    ),
    (
        "after a cleared marker an unanswered message before it is not joined",
        [user("a"), turn_end("error"), other("cleared"), user("b")],
        [u("b")],
    ),
    (
        "a tool result then a message (interrupted before the answer): no join",
        [user("a"), start("c1", "read_file"), end("c1", "x"), turn_end("interrupted"), user("b")],
        [u("a"), asst("", call("c1", "read_file")), tool_msg("c1", "x"), u("b")],
    ),
    (
        "queue events are not conversation; taken message is",
        [
            user("a"),
            other("message_queued", id="q1", text="later", author="ann"),
            other("message_queued", id="q2", text="never", author="ann"),
            other("message_dropped", id="q2"),
            say("x"),
            turn_end(),
            user("later", queued_id="q1"),
        ],
        [u("a"), asst("x"), u("later")],
    ),
    (
        "only events after the last cleared count (two clears)",
        [
            user("one"),
            say("1"),
            turn_end(),
            other("cleared"),
            user("two"),
            say("2"),
            turn_end(),
            other("cleared"),
            user("three"),
            say("3"),
        ],
        [u("three"), asst("3")],
    ),
    (
        "cleared as the last event gives an empty conversation",
        [user("one"), say("1"), turn_end(), other("cleared")],
        [],
    ),
    (
        "a late tool_end after the turn ended does not rewrite the batch",
        [user("a"), start("c1", "ls"), turn_end("interrupted"), end("c1", "late")],
        [u("a"), asst("", call("c1", "ls")), tool_msg("c1", UNFINISHED_TOOL_RESULT)],
    ),
    (
        "a stray or repeated tool_end is ignored",
        [
            user("a"),
            start("c1", "ls"),
            end("zz", "stray"),
            end("c1", "A"),
            end("c1", "again"),
        ],
        [u("a"), asst("", call("c1", "ls")), tool_msg("c1", "A")],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected"),
    [pytest.param(steps, expected, id=name) for name, steps, expected in FOLD_CASES],
)
def test_it_folds_events_into_messages(
    steps: list[tuple[str, dict[str, Any]]], expected: list[dict[str, Any]]
) -> None:
    assert build_messages(script(*steps)) == expected


def test_it_puts_the_system_prompt_first() -> None:
    events = script(user("hi"), say("yo"))
    assert build_messages(events, system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        u("hi"),
        asst("yo"),
    ]
    assert build_messages([], system_prompt="") == [{"role": "system", "content": ""}]


def test_it_reads_events_in_seq_order() -> None:
    events = script(user("a"), say("x"), say("y"))
    assert build_messages(list(reversed(events))) == build_messages(events)


def test_it_does_not_mutate_the_events() -> None:
    events = script(user("a"), start("c1", "ls", ""), end("c1", "A"))
    before = [(e.seq, e.kind, json.dumps(e.payload)) for e in events]
    build_messages(events)
    assert [(e.seq, e.kind, json.dumps(e.payload)) for e in events] == before


@dataclass
class FakeRow:
    """Stands in for a Django model instance: just the attributes the folds read."""

    seq: int
    kind: str
    payload: dict[str, Any]
    id: int = 0


def test_it_duck_types_model_instances() -> None:
    rows = [
        FakeRow(e.seq, e.kind, e.payload, id=100 + e.seq)
        for e in script(user("a"), say("b"))
    ]
    assert build_messages(rows) == [u("a"), asst("b")]


# --- C05


C05_CASES = [
    ("only tool calls", [user("a"), start("c1", "ls"), end("c1", "A")]),
    ("tool call without result", [user("a"), start("c1", "ls")]),
    (
        "empty user text and empty tool output",
        [user(""), start("c1", "ls", ""), end("c1", "")],
    ),
    (
        "None text and None output",
        [
            ("message_taken", {"text": None}),
            start("c1", "x"),
            ("tool_end", {"id": "c1", "output": None}),
        ],
    ),
    (
        "missing payload fields",
        [
            ("message_taken", {}),
            ("tool_start", {"id": "c1"}),
            ("tool_end", {"id": "c1"}),
        ],
    ),
]


@pytest.mark.parametrize(("steps"), [pytest.param(s, id=n) for n, s in C05_CASES])
def test_case_c05_content_is_always_a_string(
    steps: list[tuple[str, dict[str, Any]]],
) -> None:
    messages = build_messages(script(*steps), system_prompt="sys")
    for message in messages:
        assert "content" in message
        assert isinstance(message["content"], str)
        for tc in message.get("tool_calls", []):
            assert isinstance(tc["function"]["arguments"], str)
            assert tc["function"]["arguments"] != ""
    dumped = json.dumps(messages)
    assert '"content": null' not in dumped
    assert "None" not in dumped
    assert "null" not in dumped


def test_case_c05_tool_only_message_has_empty_string_content() -> None:
    messages = build_messages(script(user("a"), start("c1", "ls"), end("c1", "A")))
    assert messages[1] == asst("", call("c1", "ls"))
    assert messages[1]["content"] == ""


# --- stability


LONG_SCRIPT: list[tuple[str, dict[str, Any]]] = [
    other("settings", permission_mode="manual", model_key="qwen"),
    user("list the files"),
    other("status", status="running"),
    other("reasoning", text="I should call ls"),
    say("Let me "),
    say("look."),
    start("c1", "ls", '{"path": "."}'),
    start("c2", "read_file", '{"path": "README"}'),
    other("question", id="c1", tool="ls"),
    other("answered", id="c1", tool="ls", answer="allow_always", by="ann"),
    end("c2", "# Readme"),
    end("c1", "README\nsrc"),
    other("usage", prompt_tokens=100),
    say("There are "),
    say("two entries."),
    other("message_queued", id="q1", text="and src?", author="ann"),
    turn_end(),
    user("and src?", queued_id="q1"),
    start("c3", "ls", ""),
    turn_end("interrupted"),
    user("go on"),
    say("Sure: "),
    start("c4", "ls", '{"path": "src"}'),
    end("c4", "main.py"),
    start("c5", "read_file", '{"path": "src/main.py"}'),
    end("c5", "print(1)"),
    say("It prints 1."),
    turn_end(),
    other("settings", model_key="gemma"),
    user("thanks"),
    say("You're welcome"),
    turn_end(),
]


def _turn_boundaries(events: list[Event]) -> list[int]:
    """Prefix lengths k such that events[:k] ends right after a turn_end."""
    return [i + 1 for i, e in enumerate(events) if e.kind == "turn_end"]


def test_it_renders_earlier_turns_byte_identically() -> None:
    events = script(*LONG_SCRIPT)
    full = build_messages(events, system_prompt="sys")
    full_dumped = json.dumps(full)
    boundaries = _turn_boundaries(events)
    assert len(boundaries) == 4
    for k in boundaries:
        prefix = build_messages(events[:k], system_prompt="sys")
        assert full[: len(prefix)] == prefix
        # Serialised byte-for-byte as the start of the longer conversation's JSON list.
        assert full_dumped.startswith(json.dumps(prefix)[:-1])
        assert [json.dumps(m) for m in full[: len(prefix)]] == [
            json.dumps(m) for m in prefix
        ]


def test_it_renders_earlier_turns_identically_at_every_later_cut() -> None:
    # Stronger: once a turn has ended, no later event (even mid-turn) changes it.
    events = script(*LONG_SCRIPT)
    for k in _turn_boundaries(events):
        prefix = [json.dumps(m) for m in build_messages(events[:k])]
        for j in range(k, len(events) + 1):
            later = [json.dumps(m) for m in build_messages(events[:j])]
            assert later[: len(prefix)] == prefix, (k, j)


def test_it_folds_the_long_script_as_expected() -> None:
    assert build_messages(script(*LONG_SCRIPT)) == [
        u("list the files"),
        asst(
            "Let me look.",
            call("c1", "ls"),
            call("c2", "read_file", '{"path": "README"}'),
        ),
        tool_msg("c1", "README\nsrc"),
        tool_msg("c2", "# Readme"),
        asst("There are two entries."),
        u("and src?"),
        asst("", call("c3", "ls", "{}")),
        tool_msg("c3", UNFINISHED_TOOL_RESULT),
        u("go on"),
        asst("Sure: ", call("c4", "ls", '{"path": "src"}')),
        tool_msg("c4", "main.py"),
        asst("", call("c5", "read_file", '{"path": "src/main.py"}')),
        tool_msg("c5", "print(1)"),
        asst("It prints 1."),
        u("thanks"),
        asst("You're welcome"),
    ]


def test_it_serialises_with_a_fixed_key_order() -> None:
    events = script(user("a"), say("t"), start("c1", "ls"), end("c1", "A"), say("done"))
    messages = build_messages(events, system_prompt="s")
    assert [list(m) for m in messages] == [
        ["role", "content"],
        ["role", "content"],
        ["role", "content", "tool_calls"],
        ["role", "tool_call_id", "content"],
        ["role", "content"],
    ]
    assert list(messages[2]["tool_calls"][0]) == ["id", "type", "function"]
    assert list(messages[2]["tool_calls"][0]["function"]) == ["name", "arguments"]
    # Payload key order (e.g. jsonb reordering keys) does not leak into the output.
    shuffled = [
        Event(e.seq, e.kind, dict(reversed(list(e.payload.items())))) for e in events
    ]
    assert json.dumps(build_messages(shuffled, system_prompt="s")) == json.dumps(
        messages
    )
    assert json.dumps(build_messages(events, system_prompt="s")) == json.dumps(messages)


# --- other folds


EXACT_LS = {"kind": "exact", "command": "ls"}
PREFIX_GIT = {"kind": "prefix", "words": ["git"]}

ALLOWED_CASES = [
    ("none", [], []),
    (
        "allow_always with a scope only",
        [
            other("answered", id="1", tool="exec_shell_command", answer="allow_always", scope=EXACT_LS, by="a"),
            other("answered", id="2", tool="exec_shell_command", answer="allow_once", by="a"),
            other("answered", id="3", tool="cat", answer="refuse", by="a"),
            # Written before scopes ("the whole tool"): grants nothing, so it is asked again.
            other("answered", id="4", tool="ls", answer="allow_always", by="a"),
        ],
        [("exec_shell_command", EXACT_LS)],
    ),
    (
        "survives cleared",
        [
            other("answered", id="1", tool="exec_shell_command", answer="allow_always", scope=EXACT_LS, by="a"),
            other("cleared"),
            other("cleared"),
            other("answered", id="2", tool="exec_shell_command", answer="allow_always", scope=PREFIX_GIT, by="b"),
        ],
        [("exec_shell_command", EXACT_LS), ("exec_shell_command", PREFIX_GIT)],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected"), [pytest.param(s, e, id=n) for n, s, e in ALLOWED_CASES]
)
def test_it_folds_allowances(
    steps: list[tuple[str, dict[str, Any]]], expected: list[tuple[str, dict]]
) -> None:
    assert [(a["tool"], a["scope"]) for a in allowances(script(*steps))] == expected


def q(qid: str, text: str) -> tuple[str, dict[str, Any]]:
    return ("message_queued", {"id": qid, "text": text, "author": "ann"})


QUEUE_CASES = [
    ("empty", [], []),
    ("queued stays pending", [user("a"), q("q1", "x")], ["q1"]),
    (
        "dropped leaves",
        [user("a"), q("q1", "x"), q("q2", "y"), other("message_dropped", id="q1")],
        ["q2"],
    ),
    (
        "taken leaves, order kept",
        [
            user("a"),
            q("q1", "x"),
            q("q2", "y"),
            q("q3", "z"),
            turn_end(),
            user("x", queued_id="q1"),
        ],
        ["q2", "q3"],
    ),
    (
        "drop and take together empty it; unrelated user message does not",
        [
            user("a"),
            q("q1", "x"),
            q("q2", "y"),
            other("message_dropped", id="q2"),
            turn_end(),
            user("direct"),
            user("x", "q1"),
        ],
        [],
    ),
    (
        "cleared does not empty the queue",
        [user("a"), q("q1", "x"), other("cleared")],
        ["q1"],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected_ids"), [pytest.param(s, e, id=n) for n, s, e in QUEUE_CASES]
)
def test_it_folds_the_pending_queue(
    steps: list[tuple[str, dict[str, Any]]], expected_ids: list[str]
) -> None:
    queue = pending_queue(script(*steps))
    assert [item["id"] for item in queue] == expected_ids


def test_it_returns_queue_payloads() -> None:
    events = script(user("a"), q("q1", "hello"))
    assert pending_queue(events) == [{"id": "q1", "text": "hello", "author": "ann"}]
    pending_queue(events)[0]["text"] = "changed"
    assert events[1].payload["text"] == "hello"


OPEN_TURN_CASES = [
    ("nothing", [], False),
    ("taken, not ended", [user("a"), say("x")], True),
    ("ended", [user("a"), say("x"), turn_end()], False),
    ("next turn taken", [user("a"), turn_end(), user("b", "q1")], True),
    ("queued only", [user("a"), turn_end(), q("q1", "x")], False),
]


@pytest.mark.parametrize(
    ("steps", "expected"), [pytest.param(s, e, id=n) for n, s, e in OPEN_TURN_CASES]
)
def test_it_folds_open_turn(
    steps: list[tuple[str, dict[str, Any]]], expected: bool
) -> None:
    assert open_turn(script(*steps)) is expected


PENDING_CALL_CASES = [
    ("no turn", [], []),
    ("ended turn", [user("a"), start("c1", "ls"), turn_end("interrupted")], []),
    (
        "all outstanding",
        [user("a"), start("c1", "ls"), start("c2", "cat")],
        ["c1", "c2"],
    ),
    (
        "one returned",
        [user("a"), start("c1", "ls"), start("c2", "cat"), end("c2", "B")],
        ["c1"],
    ),
    ("all returned", [user("a"), start("c1", "ls"), end("c1", "A")], []),
    (
        "earlier turn's unfinished call is not pending",
        [user("a"), start("c0", "ls"), turn_end("error"), user("b"), start("c1", "ls")],
        ["c1"],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected_ids"),
    [pytest.param(s, e, id=n) for n, s, e in PENDING_CALL_CASES],
)
def test_it_folds_pending_calls(
    steps: list[tuple[str, dict[str, Any]]], expected_ids: list[str]
) -> None:
    assert [c["id"] for c in pending_calls(script(*steps))] == expected_ids


def test_it_returns_pending_call_payloads() -> None:
    events = script(user("a"), start("c1", "ls", '{"x": 1}'))
    assert pending_calls(events) == [
        {"id": "c1", "tool": "ls", "input": {}, "arguments": '{"x": 1}'}
    ]


OPEN_QUESTION_CASES = [
    ("none", [], []),
    ("open", [other("question", id="c1", tool="ls")], ["c1"]),
    (
        "answered closes",
        [
            other("question", id="c1", tool="ls"),
            other("question", id="c2", tool="rm"),
            other("answered", id="c1", tool="ls", answer="refuse", by="system"),
        ],
        ["c2"],
    ),
]


@pytest.mark.parametrize(
    ("steps", "expected_ids"),
    [pytest.param(s, e, id=n) for n, s, e in OPEN_QUESTION_CASES],
)
def test_it_folds_open_questions(
    steps: list[tuple[str, dict[str, Any]]], expected_ids: list[str]
) -> None:
    assert [qq["id"] for qq in open_questions(script(*steps))] == expected_ids


def test_it_accepts_generators() -> None:
    steps = [
        user("a"),
        say("b"),
        other("answered", id="1", tool="ls", answer="allow_always", scope={"kind": "tool"}, by="a"),
    ]
    assert build_messages(e for e in script(*steps)) == [u("a"), asst("b")]
    assert [a["tool"] for a in allowances(e for e in script(*steps))] == ["ls"]
    assert open_turn(e for e in script(*steps)) is True


# --- a step that died mid-reply is never answered twice

@pytest.mark.parametrize(
    ("steps", "cut_off"),
    [
        pytest.param([user("a"), say("hal")], True, id="text streamed, nothing closed it"),
        pytest.param([user("a"), other("reasoning", text="hm")], True, id="reasoning streamed, nothing closed it"),
        pytest.param([user("a"), say("x"), other("usage", seed=1)], False, id="usage closed the completion"),
        pytest.param([user("a"), say("x"), other("error", message="e")], False, id="an error closed it"),
        pytest.param([user("a"), say("x"), start("c1", "read_file")], False, id="the reply asked for a call"),
        pytest.param([user("a"), say("x"), start("c1", "t"), end("c1", "o"), say("y")], True, id="second round cut"),
        pytest.param([user("a"), say("x"), other("status", status="running")], True, id="status is not a step"),
        pytest.param([user("a")], False, id="nothing streamed yet: safe to ask again"),
        pytest.param([user("a"), say("x"), turn_end()], False, id="no open turn"),
        pytest.param([], False, id="empty"),
    ],
)
def test_it_tells_a_reply_cut_off_by_a_dead_step(steps, cut_off) -> None:
    from sessions_app.transcript import reply_cut_off

    assert reply_cut_off(script(*steps)) is cut_off
