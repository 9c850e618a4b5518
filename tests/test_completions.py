"""Tests for sessions_app.completions: SSE parsing, chunk → deltas, the streaming client
against a scripted HTTP server, and the tool-call assembler (docs/behaviour.md §6, §9; docs/behaviour.md C01, C02,
C04, C07, C11). No Django needed: run with ``-p no:django``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from sessions_app.completions import (
    CompletionClient,
    CompletionError,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallAssembler,
    ToolCallFragment,
    Usage,
    arguments_problem,
    iter_sse_data,
    parse_arguments,
    parse_chunk,
)

from .scripted_server import ScriptedServer, chunk, sse

# --------------------------------------------------------------------------- helpers


USAGE_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {
        "completion_tokens": 2,
        "prompt_tokens": 120,
        "total_tokens": 122,
        "prompt_tokens_details": {"cached_tokens": 100},
    },
    "timings": {
        "cache_n": 100,
        "prompt_n": 20,
        "prompt_ms": 12.5,
        "prompt_per_second": 1600.0,
        "predicted_n": 2,
        "predicted_ms": 40.0,
        "predicted_per_second": 50.0,
    },
}

EXPECTED_USAGE = Usage(
    prompt_tokens=120,
    completion_tokens=2,
    cached_tokens=100,
    prompt_n=20,
    cache_n=100,
    predicted_n=2,
    predicted_per_second=50.0,
    prompt_per_second=1600.0,
    prompt_ms=12.5,
    predicted_ms=40.0,
)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


def collect(client: CompletionClient, **kwargs: Any) -> list[Any]:
    return list(client.stream([{"role": "user", "content": "hi"}], **kwargs))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- streaming


def test_case_c11_usage_chunk_with_empty_choices_and_done_without_blank_line(
    server: ScriptedServer,
) -> None:
    server.will_answer(
        sse(chunk({"role": "assistant", "content": None})),
        sse(chunk({"content": "Hel"})),
        sse(chunk({"content": "lo"})),
        sse(chunk({}, finish_reason="stop")),
        sse(USAGE_CHUNK),
        b"data: [DONE]",  # no trailing blank line
    )
    deltas = collect(CompletionClient(server.url))
    assert deltas == [TextDelta("Hel"), TextDelta("lo"), Finish("stop"), EXPECTED_USAGE]


def test_it_sends_stream_options_and_passes_sampling_through(server: ScriptedServer) -> None:
    server.will_answer(sse(chunk({"content": "x"})), b"data: [DONE]\n\n")
    messages = [{"role": "user", "content": "hi"}]
    sampling = {"temperature": 0.2, "top_k": 40, "seed": 7, "stream": False}
    list(CompletionClient(server.url + "/").stream(messages, sampling=sampling))

    assert server.paths == ["/v1/chat/completions"]
    assert server.requests == [
        {
            "temperature": 0.2,
            "top_k": 40,
            "seed": 7,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_progress": True,
        }
    ]


@pytest.mark.parametrize(
    ("tools", "sent"),
    [
        (None, None),
        ([], None),
        ([{"type": "function", "function": {"name": "read"}}], [{"type": "function", "function": {"name": "read"}}]),
    ],
)
def test_it_sends_tools_only_when_there_are_some(
    server: ScriptedServer, tools: list[dict[str, Any]] | None, sent: list[dict[str, Any]] | None
) -> None:
    server.will_answer(b"data: [DONE]\n\n")
    collect(CompletionClient(server.url), tools=tools)
    assert server.requests[0].get("tools") == sent
    assert ("tools" in server.requests[0]) == (sent is not None)


def test_it_ends_at_end_of_stream_without_done(server: ScriptedServer) -> None:
    server.will_answer(sse(chunk({"content": "partial"})), sse(chunk({}, finish_reason="length")))
    assert collect(CompletionClient(server.url)) == [TextDelta("partial"), Finish("length")]


def test_it_yields_reasoning_before_text(server: ScriptedServer) -> None:
    server.will_answer(
        sse(chunk({"reasoning_content": "Think"})),
        sse(chunk({"reasoning_content": "ing."})),
        sse(chunk({"content": "Answer", "reasoning_content": ""})),
        b"data: [DONE]\n\n",
    )
    assert collect(CompletionClient(server.url)) == [
        ReasoningDelta("Think"),
        ReasoningDelta("ing."),
        TextDelta("Answer"),
    ]


def test_it_passes_tool_call_fragments_through_in_order(server: ScriptedServer) -> None:
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "web_search", "arguments": ""}}
    pieces = [{"index": 0, "function": {"arguments": piece}} for piece in ['{"q"', ': "llama', '"}']]
    server.will_answer(
        sse(chunk({"tool_calls": [first]})),
        *[sse(chunk({"tool_calls": [piece]})) for piece in pieces],
        sse(chunk({}, finish_reason="tool_calls")),
        b"data: [DONE]\n\n",
    )
    deltas = collect(CompletionClient(server.url))

    fragments = [delta for delta in deltas if isinstance(delta, ToolCallFragment)]
    assert [f.fragments for f in fragments] == [[first], *[[piece] for piece in pieces]]
    assert deltas[-1] == Finish("tool_calls")
    assembler = ToolCallAssembler()
    for fragment in fragments:
        assembler.feed(fragment.fragments)
    assert assembler.calls() == [ToolCall("call_a", "web_search", '{"q": "llama"}')]


def test_it_splits_lines_only_at_cr_and_lf(server: ScriptedServer) -> None:
    # llama-server writes U+2028, U+0085 and form feed unescaped inside JSON strings;
    # a line splitter built on str.splitlines() would cut the JSON apart.
    text = "a\u2028b\u0085c\x0cd é"
    payload = sse(chunk({"content": text})).replace(b"\n\n", b"\r\n\r\n")
    server.will_answer(payload[:7], 0.01, payload[7:], b"data: [DONE]\r\n\r\n")
    assert collect(CompletionClient(server.url)) == [TextDelta(text)]


def test_it_ignores_keepalive_comments(server: ScriptedServer) -> None:
    server.will_answer(b":\n\n", sse(chunk({"content": "x"})), b": ping\n\n", b"data: [DONE]\n\n")
    assert collect(CompletionClient(server.url)) == [TextDelta("x")]


def test_it_reads_a_whole_json_body(server: ScriptedServer) -> None:
    # A server that ignores "stream": true answers one chat.completion object.
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "whole"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }
    server.will_answer(json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert collect(CompletionClient(server.url)) == [
        TextDelta("whole"),
        Finish("stop"),
        Usage(prompt_tokens=5, completion_tokens=1),
    ]


# --------------------------------------------------------------------------- refusals (C07)

OVERFLOW_MESSAGE = "request (9960 tokens) exceeds the available context size (8192 tokens), try increasing it"


def test_case_c07_a_context_overflow_400_in_the_servers_words_with_counts(server: ScriptedServer) -> None:
    body = {
        "error": {
            "code": 400,
            "message": OVERFLOW_MESSAGE,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9960,
            "n_ctx": 8192,
        }
    }
    server.will_answer(json.dumps(body).encode(), status=400, headers={"Content-Type": "application/json"})
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(server.url))

    error = caught.value
    assert str(error) == OVERFLOW_MESSAGE  # counts already in the message: not repeated
    assert "HTTP 400" not in str(error)
    assert (error.status, error.n_prompt_tokens, error.n_ctx, error.error_type) == (
        400,
        9960,
        8192,
        "exceed_context_size_error",
    )


def test_case_c07_a_counts_are_added_when_the_message_lacks_them(server: ScriptedServer) -> None:
    body = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9960,
            "n_ctx": 8192,
        }
    }
    server.will_answer(json.dumps(body).encode(), status=400, headers={"Content-Type": "application/json"})
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(server.url))
    assert str(caught.value) == (
        "the request exceeds the available context size, try increasing it (request 9960 tokens, context 8192 tokens)"
    )


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (
            b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}',
            "application/json",
        ),
        (b"Context size has been exceeded.", "text/plain"),
        (b'{"message": "Context size has been exceeded."}', "application/json"),
    ],
    ids=["json", "plain-text", "top-level-message"],
)
def test_case_c07_b_500_context_exceeded_in_the_servers_words(
    server: ScriptedServer, body: bytes, content_type: str
) -> None:
    server.will_answer(body, status=500, headers={"Content-Type": content_type})
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(server.url))
    assert str(caught.value) == "Context size has been exceeded."
    assert caught.value.status == 500
    assert caught.value.n_prompt_tokens is None and caught.value.n_ctx is None


@pytest.mark.parametrize(
    "frame",
    [
        sse({"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}}),
        # Older llama-server builds: server_sent_event(sink, "error", ...) → an `error:` line.
        b'error: {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}\n\n',
        b'event: error\ndata: {"code": 500, "message": "Context size has been exceeded."}\n\n',
    ],
    ids=["data-error", "legacy-error-field", "error-event"],
)
def test_case_c07_c_error_frame_after_the_stream_started(server: ScriptedServer, frame: bytes) -> None:
    server.will_answer(sse(chunk({"content": "Sure, "})), frame, b"data: [DONE]\n\n")
    stream = CompletionClient(server.url).stream([{"role": "user", "content": "hi"}])

    assert next(stream) == TextDelta("Sure, ")
    with pytest.raises(CompletionError) as caught:
        next(stream)
    assert str(caught.value) == "Context size has been exceeded."
    assert caught.value.status == 500


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (502, b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),
        (503, b'{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}', "Loading model"),
        (404, b"", "HTTP 404"),
        (401, b'{"error": "Invalid API Key"}', "Invalid API Key"),
    ],
)
def test_it_reports_other_refusals_in_the_servers_words(
    server: ScriptedServer, status: int, body: bytes, expected: str
) -> None:
    server.will_answer(body, status=status, headers={"Content-Type": "text/plain"})
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(server.url))
    assert str(caught.value) == expected
    assert caught.value.status == status


# --------------------------------------------------------------------------- transport


def test_it_reports_connection_refused_plainly() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(url))
    assert str(caught.value).startswith(f"could not reach llama-server at {url}")
    assert caught.value.status is None


def test_it_reports_a_stream_cut_mid_reply(server: ScriptedServer) -> None:
    # Content-Length promises more than is sent, then the connection closes.
    server.will_answer(
        sse(chunk({"content": "half"})),
        headers={"Content-Type": "text/event-stream", "Content-Length": "100000"},
    )
    stream = CompletionClient(server.url).stream([{"role": "user", "content": "hi"}])
    assert next(stream) == TextDelta("half")
    with pytest.raises(CompletionError, match=r"^llama-server closed the connection mid-reply$"):
        next(stream)


def test_it_closes_the_response_when_the_generator_is_closed(server: ScriptedServer) -> None:
    server.will_answer(*[piece for _ in range(200) for piece in (sse(chunk({"content": "tok"})), 0.02)])
    stream = CompletionClient(server.url).stream([{"role": "user", "content": "hi"}])
    assert next(stream) == TextDelta("tok")

    stream.close()  # the interrupt

    assert server.client_gone.wait(5), "llama-server should see the socket close"
    assert not server.finished.is_set()
    assert next(stream, None) is None


def test_it_abandons_a_completion_that_trickles_past_the_timeout(server: ScriptedServer) -> None:
    # A 30 s trickle: the client must give up at its 0.5 s cap, long before the server is done.
    server.will_answer(*[piece for _ in range(600) for piece in (sse(chunk({"content": "."})), 0.05)])
    with pytest.raises(CompletionError) as caught:
        collect(CompletionClient(server.url, timeout=0.5))
    assert str(caught.value) == "completion took longer than 0.5 seconds; abandoned"
    assert not server.finished.is_set(), "the client waited out the whole trickle"
    assert server.client_gone.wait(30), "llama-server should see the socket close"


def test_it_abandons_a_silent_server_at_the_timeout(server: ScriptedServer) -> None:
    # The headers are 60 s away: a reply that ends at all proves the 0.5 s cap, not the server, ended it.
    server.will_answer(b"data: [DONE]\n\n", delay_headers=60.0)
    with pytest.raises(CompletionError, match=r"took longer than 0\.5 seconds; abandoned"):
        collect(CompletionClient(server.url, timeout=0.5))
    assert len(server.requests) == 1 and not server.finished.is_set(), "the client waited for the headers"


def test_it_says_30_minutes_by_default() -> None:
    assert CompletionClient("http://x")._too_slow().message == ("completion took longer than 30 minutes; abandoned")


# --------------------------------------------------------------------------- SSE table


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["data: a", "", "data: b", ""], ["a", "b"]),
        (["data: a", "data: b", ""], ["a\nb"]),
        (["data:a", ""], ["a"]),
        (["data:  two spaces", ""], [" two spaces"]),
        ([": comment", "data: a", ": again", ""], ["a"]),
        (["data: a\r\n", "\r\n", "data: [DONE]"], ["a", "[DONE]"]),
        (["data: last"], ["last"]),
        (["event: ping", "", "id: 3", "retry: 10", ""], []),
        (["\ufeffdata: bom", ""], ["bom"]),
        (["data", ""], [""]),
        ([], []),
    ],
)
def test_it_parses_sse_data(lines: list[str], expected: list[str]) -> None:
    assert list(iter_sse_data(lines)) == expected


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"data: a\n\ndata: b\n", b"\n"], ["data: a", "", "data: b", ""]),  # a burst of LF lines, split once
        ([b"data: a", b"b\n", b"\n"], ["data: ab", ""]),  # a line cut between two reads
        ([b"data: a\r", b"\ndata: b\n"], ["data: a", "data: b"]),  # a CRLF cut between two reads
        ([b"data: a\n", b"data: b\r\n", b"data: c\n"], ["data: a", "data: b", "data: c"]),  # LF, then CRLF
        ([b"x\xe2\x80", b"\xa8y\n"], ["x\u2028y"]),  # U+2028 split between reads: not a line end
        ([b"data: last"], ["data: last"]),
    ],
)
def test_it_splits_a_byte_stream_into_lines_at_cr_lf_or_crlf_only(chunks: list[bytes], expected: list[str]) -> None:
    from sessions_app.completions.sse import iter_lines

    assert list(iter_lines(chunks)) == expected


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (['error: {"code": 500, "message": "boom"}', ""], {"code": 500, "message": "boom"}),
        (["error: not json"], {"message": "not json"}),
        (["event: error", 'data: {"message": "boom"}', ""], {"message": "boom"}),
        (["event: error", 'data: {"error": {"message": "boom"}}', ""], {"message": "boom"}),
    ],
)
def test_it_turns_sse_errors_into_error_payloads(lines: list[str], error: dict[str, Any]) -> None:
    (payload,) = iter_sse_data(lines)
    assert json.loads(payload) == {"error": error}


# --------------------------------------------------------------------------- parse_chunk table


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (chunk({"role": "assistant", "content": None}), []),
        (chunk({"content": ""}), []),
        (chunk({"content": "a", "reasoning_content": "r"}), [ReasoningDelta("r"), TextDelta("a")]),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None}], "timings": {"predicted_n": 1}}, []),
        (
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": {"predicted_n": 3}},
            [Finish("stop"), Usage(predicted_n=3)],
        ),
        ({"choices": [], "timings": {"cache_n": 4, "prompt_n": 1}}, [Usage(prompt_n=1, cache_n=4)]),
        (USAGE_CHUNK, [EXPECTED_USAGE]),
        (
            {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": None}},
            [Usage(prompt_tokens=3)],
        ),
        ({"choices": []}, []),
        ({}, []),
    ],
)
def test_it_parses_chunks(data: dict[str, Any], expected: list[Any]) -> None:
    assert parse_chunk(data) == expected


@pytest.mark.parametrize(
    ("data", "message", "status"),
    [
        ({"error": {"code": 500, "message": "boom", "type": "server_error"}}, "boom", 500),
        ({"error": "plain"}, "plain", None),
        ({"error": {"code": 400}, "message": "outer"}, "outer", 400),
        ({"error": {"code": 400}}, '{"error": {"code": 400}}', 400),
    ],
)
def test_case_c07_c_parse_chunk_raises_on_error(data: dict[str, Any], message: str, status: int | None) -> None:
    with pytest.raises(CompletionError) as caught:
        parse_chunk(data)
    assert str(caught.value) == message
    assert caught.value.status == status


def test_it_gives_usage_as_a_payload_of_the_sent_fields() -> None:
    assert Usage(prompt_tokens=10, predicted_per_second=12.5).as_payload() == {
        "prompt_tokens": 10,
        "predicted_per_second": 12.5,
    }
    assert json.loads(json.dumps(EXPECTED_USAGE.as_payload())) == EXPECTED_USAGE.as_payload()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (CompletionError("boom"), "boom"),
        (
            CompletionError("too long", n_prompt_tokens=9960, n_ctx=8192),
            "too long (request 9960 tokens, context 8192 tokens)",
        ),
        (CompletionError("too long", n_ctx=8192), "too long (context 8192 tokens)"),
        (
            CompletionError("request (9960 tokens) > (8192 tokens)", n_prompt_tokens=9960, n_ctx=8192),
            "request (9960 tokens) > (8192 tokens)",
        ),
    ],
)
def test_it_words_completion_errors(error: CompletionError, expected: str) -> None:
    assert str(error) == expected


# --------------------------------------------------------------------------- assembler tables


def fn(name: str | None = None, arguments: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    return function


def assemble(*chunks: list[dict[str, Any]]) -> list[ToolCall]:
    assembler = ToolCallAssembler()
    for fragments in chunks:
        assembler.feed(fragments)
    return assembler.calls()


def test_case_c01_fragments_without_index_extend_the_newest_call() -> None:
    calls = assemble(
        [{"id": "a", "type": "function", "function": fn("read", '{"path": ')}],
        [{"function": fn(arguments='"x"}')}],
        [{"id": "b", "type": "function", "function": fn("grep", '{"q": "y"}')}],  # new id: new call
        [{"id": "b", "function": fn(arguments="")}],  # the same id again: same call
    )
    assert calls == [
        ToolCall("a", "read", '{"path": "x"}'),
        ToolCall("b", "grep", '{"q": "y"}'),
    ]


def test_case_c01_parallel_calls_as_separate_chunks_with_new_ids() -> None:
    calls = assemble(
        [{"id": "c1", "type": "function", "function": fn("web_search", '{"q": "a"}')}],
        [{"id": "c2", "type": "function", "function": fn("web_search", '{"q": "b"}')}],
        [{"id": "c3", "type": "function", "function": fn("get_info", "")}],
    )
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("c1", "web_search", '{"q": "a"}'),
        ("c2", "web_search", '{"q": "b"}'),
        ("c3", "get_info", "{}"),
    ]


def test_case_c02_id_only_in_the_first_fragment() -> None:
    pieces = ['{"qu', 'ery": "lla', 'ma.cpp"', "}"]
    calls = assemble(
        [{"index": 0, "id": "X", "type": "function", "function": fn("web_search", "")}],
        *[[{"index": 0, "function": fn(arguments=piece)}] for piece in pieces],
    )
    assert calls == [ToolCall("X", "web_search", '{"query": "llama.cpp"}')]


@pytest.mark.parametrize(
    "repeat",
    [
        {"index": 0, "id": "X", "function": fn(arguments="}")},
        {"id": "X", "function": fn(arguments="}")},
        {"index": 5, "id": "X", "function": fn(arguments="}")},
    ],
    ids=["same-index", "no-index", "other-index"],
)
def test_case_c02_a_repeated_id_is_the_same_call(repeat: dict[str, Any]) -> None:
    calls = assemble(
        [{"index": 0, "id": "X", "function": fn("web_search", '{"q": 1')}],
        [repeat],
    )
    assert calls == [ToolCall("X", "web_search", '{"q": 1}')]


@pytest.mark.parametrize("empty", ["", "   ", "\n"])
def test_case_c04_empty_arguments_are_sent_back_as_an_empty_object(empty: str) -> None:
    (call,) = assemble([{"index": 0, "id": "c", "type": "function", "function": fn("get_info", empty)}])
    assert call.arguments == "{}"
    assert call.parsed_arguments() == {}


def test_case_c04_missing_arguments_are_an_empty_object() -> None:
    (call,) = assemble([{"index": 0, "id": "c", "function": fn("get_info")}])
    assert (call.arguments, call.raw_arguments, call.parsed_arguments()) == ("{}", "", {})
    assert call.arguments_error is None  # runs, with {}


@pytest.mark.parametrize(
    ("malformed", "error"),
    [
        ('{"q"', "Expecting ':' delimiter"),
        ('{"q": NaN}', "NaN is not JSON"),
        ("[1, 2]", "it is a JSON array, not an object"),
        ('"text"', "it is a JSON string, not an object"),
        ("{'q': 1}", "Expecting property name enclosed in double quotes"),
        ('{"command": "echo harmless",\n\n"command": "rm -rf ~/victim"}', "duplicate key 'command'"),
        ('{"a": {"b": 1, "b": 2}}', "duplicate key 'b'"),
        ('{"q": "\\ud800"}', "lone surrogate"),
        ('{"path": "notes.txt"}{"command": "ls"}', "Extra data"),
    ],
)
def test_case_c04_malformed_arguments_are_an_error_never_an_empty_object(malformed: str, error: str) -> None:
    (call,) = assemble([{"index": 0, "id": "c", "function": fn("web_search", malformed)}])
    assert call.arguments_error is not None and error in call.arguments_error
    # Sent back as "{}" so llama-server can still render the history (see ToolCall); the
    # call itself is never run (agent.MALFORMED_RESULT goes to the model instead).
    assert call.arguments == "{}"
    assert call.raw_arguments == malformed
    assert arguments_problem(call.raw_arguments) == call.arguments_error


def test_case_c01_amended_unnumbered_id_less_calls_with_their_own_names_are_two_calls() -> None:
    # Neither index nor id: the second name starts a call of its own, never one call whose
    # arguments run together ('{"path":"notes.txt"}{"command":"ls"}', run as {}).
    calls = assemble(
        [{"type": "function", "function": fn("read_file", '{"path":')}],
        [{"function": fn(arguments='"notes.txt"}')}],
        [{"type": "function", "function": fn("exec_shell_command", '{"command":')}],
        [{"function": fn(arguments='"ls"}')}],
    )
    assert [(c.name, c.arguments, c.arguments_error) for c in calls] == [
        ("read_file", '{"path":"notes.txt"}', None),
        ("exec_shell_command", '{"command":"ls"}', None),
    ]
    assert calls[0].id != calls[1].id


def test_a_new_name_at_a_known_index_without_an_id_starts_a_call_of_its_own() -> None:
    # The same fault with an index: servers that number every call 0.
    calls = assemble(
        [{"index": 0, "function": fn("read_file", '{"path": "a"}')}],
        [{"index": 0, "function": fn("grep_search", '{"pattern": "b"}')}],
    )
    assert [(c.name, c.arguments) for c in calls] == [("read_file", '{"path": "a"}'), ("grep_search", '{"pattern": "b"}')]


def test_a_name_repeated_in_every_piece_stays_one_call() -> None:
    calls = assemble(
        [{"index": 0, "id": "c", "function": fn("read_file", '{"path": ')}],
        [{"index": 0, "function": fn("read_file", '"a"}')}],
        [{"function": fn("read_file", "")}],
    )
    assert [(c.name, c.arguments) for c in calls] == [("read_file", '{"path": "a"}')]


@pytest.mark.parametrize("text", [None, "", "  ", "{}", "{ }", '{"a": 1}'])
def test_parse_arguments_reads_empty_text_as_an_empty_object(text) -> None:
    decoded, error = parse_arguments(text)
    assert error is None and isinstance(decoded, dict)


def test_it_keeps_valid_arguments_byte_identical() -> None:
    text = '{ "b": 1,\n  "a": "é\\u00e9" }'
    (call,) = assemble([{"index": 0, "id": "c", "function": fn("f", text)}])
    assert call.arguments == text
    assert call.raw_arguments is None
    assert call.parsed_arguments() == {"b": 1, "a": "éé"}


def test_it_gives_a_named_call_without_id_a_fresh_stable_id() -> None:
    assembler = ToolCallAssembler()
    assembler.feed([{"index": 0, "function": fn("read", '{"path": "a"}')}])
    assembler.feed([{"index": 1, "function": fn("read", '{"path": "b"}')}])
    first, second = assembler.calls()

    for call in (first, second):
        assert call.id.startswith("call_")
        assert len(call.id) == len("call_") + 24
        assert call.id[5:].isalnum()
    assert first.id != second.id
    assert [c.id for c in assembler.calls()] == [first.id, second.id]


def test_it_drops_a_call_whose_name_never_arrived() -> None:
    calls = assemble(
        [{"index": 0, "id": "nameless", "function": fn(arguments='{"x": 1}')}],
        [{"index": 1, "id": "named", "function": fn("read", "{}")}],
    )
    assert calls == [ToolCall("named", "read", "{}")]


def test_it_orders_calls_by_their_first_fragment() -> None:
    calls = assemble(
        [{"index": 1, "id": "second", "function": fn("b", "")}],
        [{"index": 0, "id": "first", "function": fn("a", "")}],
        [{"index": 1, "function": fn(arguments='{"n": 2}')}],
        [{"index": 0, "function": fn(arguments='{"n": 1}')}],
    )
    assert calls == [ToolCall("second", "b", '{"n": 2}'), ToolCall("first", "a", '{"n": 1}')]


def test_it_concatenates_arguments_from_many_pieces() -> None:
    text = json.dumps({"path": "src/main.py", "lines": [1, 2, 3], "note": "ünïcode"})
    pieces = [{"index": 0, "function": fn(arguments=char)} for char in text]
    calls = assemble([{"index": 0, "id": "c", "function": fn("read", "")}], pieces)
    assert calls == [ToolCall("c", "read", text)]


def test_it_interleaves_parallel_indexed_calls_in_one_chunk() -> None:
    calls = assemble(
        [
            {"index": 0, "id": "a", "function": fn("read", '{"p":')},
            {"index": 1, "id": "b", "function": fn("grep", '{"q":')},
        ],
        [{"index": 1, "function": fn(arguments='"y"}')}, {"index": 0, "function": fn(arguments='"x"}')}],
    )
    assert calls == [ToolCall("a", "read", '{"p":"x"}'), ToolCall("b", "grep", '{"q":"y"}')]


def test_it_starts_a_new_call_when_an_index_is_reused_with_a_new_id() -> None:
    # Some servers number every call 0; a different id still means a different call.
    calls = assemble(
        [{"index": 0, "id": "a", "function": fn("read", '{"p": 1}')}],
        [{"index": 0, "id": "b", "function": fn("read", '{"p": 2}')}],
    )
    assert calls == [ToolCall("a", "read", '{"p": 1}'), ToolCall("b", "read", '{"p": 2}')]


def test_it_serialises_arguments_sent_as_an_object() -> None:
    (call,) = assemble([{"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}])
    assert call.parsed_arguments() == {"a": 1}


def test_it_ignores_entries_that_are_not_objects() -> None:
    assert assemble(["junk", None, {"index": 0, "id": "c", "function": fn("f", "{}")}]) == [  # type: ignore[list-item]
        ToolCall("c", "f", "{}")
    ]


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [("{}", {}), ('{"a": [1]}', {"a": [1]}), ("", {}), ("[]", {}), ("null", {}), ('{"a"', {})],
)
def test_it_parses_tool_call_arguments(arguments: str, parsed: dict[str, Any]) -> None:
    assert ToolCall("c", "f", arguments).parsed_arguments() == parsed


def test_no_http_client_builds_its_own_tls_context(monkeypatch):
    # A new TLS context loads the CA bundle: ~26 ms of CPU per turn step, /props poll or tool
    # call (docs/live-page.md "What it costs"). Every client shares tls_context().
    import ast
    import ssl

    from machines_app.llama_server import tls_context
    from sessions_app.completions import AbortableHTTP

    from .conftest import ROOT

    tls_context()
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    AbortableHTTP().close()
    assert built == []

    # Every shape of the fault: each httpx client or call in the project passes verify=.
    unshared = []
    for path in [*(ROOT / "sessions_app").rglob("*.py"), *(ROOT / "machines_app").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx"
                    and node.func.attr in {"Client", "AsyncClient", "HTTPTransport", "get", "post", "put",
                                           "delete", "request", "stream"}
                    and not any(k.arg == "verify" for k in node.keywords)):
                unshared.append(f"{path.name}:{node.lineno}")
    assert unshared == []


def test_paced_reads_gather_a_streams_chunks_into_bursts_and_call_the_hook_before_each_read():
    """AbortableHTTP(read_every=…): a real HTTP server writes 60 chunks 5 ms apart; the
    client reads them in bursts whose reads start at least read_every apart, with
    before_read called before each read — far fewer reads than chunks, every byte there,
    in order (docs/live-page.md "What it costs")."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sessions_app.completions import AbortableHTTP

    class Chunks(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(60):
                piece = f"{i};".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(0.005)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chunks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reads: list[float] = []
    http = AbortableHTTP(read_every=0.05, before_read=lambda: reads.append(time.monotonic()))
    try:
        with http.client.stream("GET", f"http://127.0.0.1:{server.server_address[1]}/") as response:
            body = b"".join(response.iter_bytes())
    finally:
        http.close()
        server.shutdown()
    assert body.decode() == "".join(f"{i};" for i in range(60))
    assert 3 <= len(reads) <= 20  # ~0.3 s of chunks read in bursts 50 ms apart, not 60 reads
    gaps = [later - earlier for earlier, later in zip(reads[1:], reads[2:], strict=False)]
    assert all(gap >= 0.045 for gap in gaps), gaps


def test_paced_reads_start_pausing_only_once_the_hook_has_something_to_show(monkeypatch):
    """AbortableHTTP's pauses start only once before_read returns anything but False: the
    reads before it (a reply's prompt being read, its first token coming) are not held
    back, so the first token is shown the moment it comes (docs/live-page.md "What it
    costs"); after it, reads are paced as before. Counted: the sleeps before each read."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sessions_app.completions import AbortableHTTP, pacing

    class Chunks(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(40):
                piece = f"{i};".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                threading.Event().wait(0.005)  # not time.sleep: the test counts those
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    sleeps: list[int] = []  # the number of the read each sleep came before
    reads = []
    real_sleep = time.sleep

    def counted_sleep(seconds):
        sleeps.append(len(reads))
        real_sleep(seconds)

    monkeypatch.setattr(pacing.time, "sleep", counted_sleep)
    shown_from = 4  # the hook has "shown" something from its 4th call on

    def before_read():
        reads.append(None)
        return len(reads) >= shown_from or False

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chunks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    http = AbortableHTTP(read_every=0.05, before_read=before_read)
    try:
        with http.client.stream("GET", f"http://127.0.0.1:{server.server_address[1]}/") as response:
            body = b"".join(response.iter_bytes())
    finally:
        http.close()
        server.shutdown()
    assert body.decode() == "".join(f"{i};" for i in range(40))
    assert len(reads) > shown_from  # ~0.2 s of chunks: more reads than the unpaced ones
    assert sleeps and min(sleeps) >= shown_from, (sleeps, len(reads))
