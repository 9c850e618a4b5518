"""The tool catalogue and tool calls (docs/behaviour.md §8, §9) against a real llama-server and a real MCP server.

The MCP server is this file run as a script (``python tests/test_tools.py --serve-mcp PORT``):
the ``mcp`` SDK's own ``MCPServer`` over streamable HTTP on 127.0.0.1.
No database is used.
"""

import asyncio
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from sessions_app.tools import (
    MCP_SEPARATOR,
    UNKNOWN_TOOL_RESULT,
    Catalogue,
    McpServerConfig,
    McpUnavailable,
    ToolEntry,
    ToolResult,
    builtin_entries,
    fetch_builtin,
    list_mcp_tools,
    load_catalogue,
    mcp_tool_name,
    run_tool,
)

# Absolute, not relative: this file also runs as a script (``--serve-mcp``), outside the package.
from tests.processes import API_KEY_HEADER, free_port, port_open, start_mcp_server, stop_process, wait_until

OPENAI_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

#: ``GET /tools`` as this llama-server build answers it (descriptions shortened).
CAPTURED_TOOLS_JSON: list[dict] = [
    {
        "display_name": "Read file",
        "tool": "read_file",
        "type": "server",
        "permissions": {"write": False},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read the contents of a file. Optionally specify a 1-based line range.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path to the file"},
                        "start_line": {"type": "integer", "description": "First line to read, 1-based (default: 1)"},
                        "end_line": {"type": "integer", "description": "Last line to read, 1-based inclusive"},
                        "append_loc": {"type": "boolean", "description": "Prefix each line with its line number"},
                    },
                    "required": ["path"],
                },
            },
        },
    },
    {
        "display_name": "File search",
        "tool": "file_glob_search",
        "type": "server",
        "permissions": {"write": False},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "file_glob_search",
                "description": "Recursively search for files matching a glob pattern under a directory.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "include": {"type": "string"}},
                    "required": ["path"],
                },
            },
        },
    },
    {
        "display_name": "Grep search",
        "tool": "grep_search",
        "type": "server",
        "permissions": {"write": False},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "grep_search",
                "description": "Search for a pattern in files under a path.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}},
                    "required": ["path", "pattern"],
                },
            },
        },
    },
    {
        "display_name": "Execute shell command",
        "tool": "exec_shell_command",
        "type": "server",
        "permissions": {"write": True},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "exec_shell_command",
                "description": "Execute a shell command and return its output (stdout and stderr combined).",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "Shell command to execute"},
                        "timeout": {"type": "integer", "description": "Timeout in seconds (default 10, max 60)"},
                    },
                    "required": ["command"],
                },
            },
        },
    },
    {
        "display_name": "Write file",
        "tool": "write_file",
        "type": "server",
        "permissions": {"write": True},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "write_file",
                "description": "Write content to a file, creating it if it does not exist.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"],
                },
            },
        },
    },
    {
        "display_name": "Edit file",
        "tool": "edit_file",
        "type": "server",
        "permissions": {"write": True},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "edit_file",
                "description": "Edit a file using exact text replacement.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "edits": {"type": "array"}},
                    "required": ["path", "edits"],
                },
            },
        },
    },
    {
        "display_name": "Get Runtime Info",
        "tool": "get_info",
        "type": "server",
        "permissions": {"write": False},
        "uses_cwd": True,
        "definition": {
            "type": "function",
            "function": {
                "name": "get_info",
                "description": "Returns runtime info: the OS name/version and the current working directory",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    },
]


# --------------------------------------------------------------------------- helpers


def builtin(name: str, remote: str | None = None) -> ToolEntry:
    """A built-in entry as the catalogue would hold it (``remote`` may differ to test 404s)."""
    entry = {e.name: e for e in builtin_entries(CAPTURED_TOOLS_JSON)}.get(name)
    if entry is None:
        return ToolEntry(name, name, True, "machine", None, remote or name, {"type": "function", "function": {}})
    return entry


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llama(llama_server_bin, tmp_path_factory) -> Iterator[str]:
    """A real llama-server with ``--tools all`` on the SmolLM2 GGUF; yields its base URL."""
    from machines_app.demo_models import packaged_model_paths

    gguf = packaged_model_paths()["smollm2"]
    port = free_port()
    log_path = tmp_path_factory.mktemp("llama") / "llama-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                llama_server_bin,
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--tools",
                "all",
                "-np",
                "1",
                "-c",
                "1024",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"llama-server exited: {log_path.read_text(errors='replace')[-2000:]}")
        try:
            return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 120, "llama-server /health")
        yield base_url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory) -> Iterator[McpServerConfig]:
    """A real MCP server (the SDK's MCPServer, streamable HTTP) named ``calc``, with an API key header."""
    proc, port = start_mcp_server(tmp_path_factory.mktemp("mcp"))
    try:
        yield McpServerConfig(name="calc", url=f"http://127.0.0.1:{port}/mcp", headers=dict(API_KEY_HEADER))
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def calc_tools(mcp_server) -> dict[str, ToolEntry]:
    return {entry.remote_name: entry for entry in list_mcp_tools(mcp_server)}


@pytest.fixture
def closed_url() -> str:
    """A URL on a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


# --------------------------------------------------------------------------- built-in entries (tables)


@pytest.mark.parametrize(
    ("name", "display_name", "writes"),
    [
        ("read_file", "Read file", False),
        ("file_glob_search", "File search", False),
        ("grep_search", "Grep search", False),
        ("exec_shell_command", "Execute shell command", True),
        ("write_file", "Write file", True),
        ("edit_file", "Edit file", True),
        ("get_info", "Get Runtime Info", False),
    ],
)
def test_it_reads_each_builtin_from_the_tools_json(name, display_name, writes):
    entry = {e.name: e for e in builtin_entries(CAPTURED_TOOLS_JSON)}[name]
    assert entry.display_name == display_name
    assert entry.writes is writes
    assert entry.origin == "machine"
    assert entry.server is None
    assert entry.remote_name == name


def test_it_keeps_builtin_definitions_untouched_and_in_order():
    entries = builtin_entries(json.loads(json.dumps(CAPTURED_TOOLS_JSON)))
    assert [e.name for e in entries] == [item["tool"] for item in CAPTURED_TOOLS_JSON]
    assert [e.definition for e in entries] == [item["definition"] for item in CAPTURED_TOOLS_JSON]
    assert Catalogue(tuple(entries)).definitions() == [item["definition"] for item in CAPTURED_TOOLS_JSON]


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        # no permissions: assume it writes
        (
            {"tool": "mystery", "definition": {"type": "function", "function": {"name": "mystery"}}},
            ("mystery", "mystery", True),
        ),
        # no definition: a minimal one is made so the model can still be offered it
        ({"tool": "bare", "display_name": "Bare", "permissions": {"write": False}}, ("bare", "Bare", False)),
        # no tool field: the definition's name is used
        (
            {"definition": {"type": "function", "function": {"name": "fromdef"}}, "permissions": {"write": False}},
            ("fromdef", "fromdef", False),
        ),
    ],
)
def test_it_reads_incomplete_builtin_entries_conservatively(item, expected):
    (entry,) = builtin_entries([item])
    assert (entry.name, entry.display_name, entry.writes) == expected
    assert entry.definition["function"]["name"] == entry.name


def test_it_skips_builtin_entries_that_name_no_tool():
    assert builtin_entries([{}, {"display_name": "x"}, "junk", {"tool": ""}]) == []  # type: ignore[list-item]


def test_it_round_trips_entries_and_catalogues_through_json():
    mcp_entry = ToolEntry(
        name="exa__web_search_exa",
        display_name="Web search",
        writes=False,
        origin="mcp",
        server="exa",
        remote_name="web_search_exa",
        definition={
            "type": "function",
            "function": {
                "name": "exa__web_search_exa",
                "description": "Search",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    )
    catalogue = Catalogue((*builtin_entries(CAPTURED_TOOLS_JSON), mcp_entry))
    stored = json.loads(json.dumps(catalogue.as_payload()))
    again = Catalogue.from_payload(stored)
    assert again == catalogue
    assert ToolEntry.from_payload(json.loads(json.dumps(mcp_entry.as_payload()))) == mcp_entry
    assert again.get("exa__web_search_exa") == mcp_entry
    assert again.get("read_file").writes is False
    assert again.get("nope") is None


def test_it_offers_no_definitions_for_an_empty_catalogue():
    assert Catalogue(()).definitions() == []
    assert Catalogue.from_payload([]).entries == ()
    assert Catalogue.from_payload(None).entries == ()


@pytest.mark.parametrize(
    ("server", "tool", "expected"),
    [
        ("exa", "web_search_exa", "exa__web_search_exa"),
        ("my server", "do.it/now", "my_server__do_it_now"),
        ("calc", "add", "calc__add"),
    ],
)
def test_it_names_mcp_tools_with_the_server_as_prefix(server, tool, expected):
    assert MCP_SEPARATOR == "__"
    assert mcp_tool_name(server, tool) == expected


def test_it_keeps_long_mcp_tool_names_valid_and_distinct():
    a = mcp_tool_name("a-very-long-server-name-for-testing", "x" * 60 + "_one")
    b = mcp_tool_name("a-very-long-server-name-for-testing", "x" * 60 + "_two")
    import re

    assert re.match(OPENAI_NAME, a) and re.match(OPENAI_NAME, b)
    assert a != b


def test_it_formats_the_unknown_tool_sentence():
    assert UNKNOWN_TOOL_RESULT.format(name="fly") == (
        "There is no tool named fly. Use only the tools listed in this request."
    )


# --------------------------------------------------------------------------- a real llama-server


def test_it_fetches_the_builtins_of_a_real_llama_server(llama):
    entries = {e.name: e for e in fetch_builtin(llama)}
    assert {"read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file"} <= set(
        entries
    )
    assert entries["read_file"].writes is False
    assert entries["exec_shell_command"].writes is True
    assert entries["read_file"].definition["function"]["name"] == "read_file"
    assert "path" in entries["read_file"].definition["function"]["parameters"]["properties"]


def test_it_fetches_through_a_given_http_client(llama):
    with httpx.Client() as http:
        assert [e.name for e in fetch_builtin(llama, http=http)] == [e.name for e in fetch_builtin(llama)]


def test_it_reads_a_file_by_relative_path_from_the_session_cwd(llama, tmp_path):
    (tmp_path / "notes.txt").write_text("hello from file\n")
    result = run_tool(builtin("read_file"), {"path": "notes.txt"}, base_url=llama, cwd=str(tmp_path), mcp_servers={})
    assert result == ToolResult("hello from file\n", ok=True)


def test_it_runs_a_shell_command_in_the_session_cwd(llama, tmp_path):
    result = run_tool(
        builtin("exec_shell_command"), {"command": "pwd"}, base_url=llama, cwd=str(tmp_path), mcp_servers={}
    )
    assert result.ok
    assert result.output.splitlines()[0] == str(tmp_path)
    assert result.output.endswith("[exit code: 0]")


def test_it_sends_a_cwd_outside_ascii(llama, tmp_path):
    where = tmp_path / "café"
    where.mkdir()
    (where / "a.txt").write_text("accented\n")
    result = run_tool(builtin("read_file"), {"path": "a.txt"}, base_url=llama, cwd=str(where), mcp_servers={})
    assert result == ToolResult("accented\n", ok=True)


def test_it_reports_an_unknown_remote_tool_in_the_servers_words(llama, tmp_path):
    result = run_tool(builtin("no_such_tool"), {}, base_url=llama, cwd=str(tmp_path), mcp_servers={})
    assert result == ToolResult("File Not Found", ok=False)


def test_it_reports_a_tool_error_body_in_the_servers_words(llama, tmp_path):
    result = run_tool(builtin("read_file"), {"path": "missing.txt"}, base_url=llama, cwd=str(tmp_path), mcp_servers={})
    assert not result.ok
    assert "missing.txt" in result.output


def test_it_reports_bad_parameters_in_the_servers_words(llama, tmp_path):
    result = run_tool(builtin("read_file"), {}, base_url=llama, cwd=str(tmp_path), mcp_servers={})
    assert not result.ok
    assert "path" in result.output


def test_it_returns_other_json_answers_as_text(llama, tmp_path):
    result = run_tool(builtin("get_info"), {}, base_url=llama, cwd=str(tmp_path), mcp_servers={})
    assert result.ok
    assert json.loads(result.output)["cwd"] == str(tmp_path)


def test_it_writes_then_reads_back_through_builtins(llama, tmp_path):
    write = run_tool(
        builtin("write_file"),
        {"path": "sub/out.txt", "content": "written\n"},
        base_url=llama,
        cwd=str(tmp_path),
        mcp_servers={},
    )
    assert write.ok, write.output
    assert (tmp_path / "sub" / "out.txt").read_text() == "written\n"


# --------------------------------------------------------------------------- a real MCP server


def test_it_lists_mcp_tools_with_prefixed_names_and_their_schemas(calc_tools):
    assert set(calc_tools) == {"add", "shout", "boom", "whoami", "picture", "slow"}
    add = calc_tools["add"]
    assert add.name == "calc__add"
    assert add.origin == "mcp" and add.server == "calc" and add.remote_name == "add"
    assert add.writes is False  # readOnlyHint
    assert calc_tools["shout"].writes is True  # no hint: assume it writes
    assert calc_tools["shout"].display_name == "Shout"  # the tool's title
    function = add.definition["function"]
    assert add.definition["type"] == "function"
    assert function["name"] == "calc__add"
    assert function["description"] == "Add two integers."
    assert function["parameters"]["type"] == "object"
    assert function["parameters"]["properties"]["a"]["type"] == "integer"
    assert set(function["parameters"]["required"]) == {"a", "b"}


def test_it_calls_mcp_tools_and_returns_their_text(calc_tools, mcp_server):
    servers = {"calc": mcp_server}
    assert run_tool(calc_tools["add"], {"a": 2, "b": 3}, base_url="", cwd="/", mcp_servers=servers) == ToolResult(
        "5", ok=True
    )
    shout = run_tool(calc_tools["shout"], {"text": "hello"}, base_url="", cwd="/", mcp_servers=servers)
    assert shout == ToolResult("HELLO", ok=True)


def test_it_sends_the_configured_headers_to_the_mcp_server(calc_tools, mcp_server):
    result = run_tool(calc_tools["whoami"], {}, base_url="", cwd="/", mcp_servers={"calc": mcp_server})
    assert result == ToolResult(API_KEY_HEADER["Authorization"], ok=True)


def test_it_reports_an_mcp_tool_error_with_its_message(calc_tools, mcp_server):
    result = run_tool(calc_tools["boom"], {}, base_url="", cwd="/", mcp_servers={"calc": mcp_server})
    assert not result.ok
    assert "the boom tool always fails" in result.output


def test_it_reports_bad_mcp_arguments_as_a_tool_error(calc_tools, mcp_server):
    result = run_tool(calc_tools["add"], {"a": "two"}, base_url="", cwd="/", mcp_servers={"calc": mcp_server})
    assert not result.ok
    assert "could not be reached" not in result.output


def test_it_summarises_non_text_mcp_content(calc_tools, mcp_server):
    result = run_tool(calc_tools["picture"], {}, base_url="", cwd="/", mcp_servers={"calc": mcp_server})
    assert result == ToolResult("a red dot\n[image: image/png]", ok=True)


def test_it_gives_up_on_a_slow_mcp_tool_after_the_timeout(calc_tools, mcp_server):
    # The tool answers after 30 s; this sentence exists only on the timeout's path (the
    # answer, had it been waited for, would be the tool's own).
    result = run_tool(
        calc_tools["slow"], {"seconds": 30}, base_url="", cwd="/", mcp_servers={"calc": mcp_server}, timeout=1
    )
    assert result == ToolResult("The tool calc__slow could not be reached: no answer within 1 second.", ok=False)


def test_it_runs_mcp_calls_from_inside_a_running_event_loop(calc_tools, mcp_server):
    """Async callers must not hit "event loop already running"."""

    async def inside() -> ToolResult:
        return run_tool(calc_tools["add"], {"a": 1, "b": 1}, base_url="", cwd="/", mcp_servers={"calc": mcp_server})

    assert asyncio.run(inside()) == ToolResult("2", ok=True)


def test_a_local_mcp_call_is_one_short_exchange(calc_tools, mcp_server, monkeypatch):
    """Each call is its own connection: a handshake, the call and the close, every request
    answered — none waited out, none repeated. Counted, not timed (its cost is bench/'s)."""
    import httpx2

    sent: list[tuple[str, int]] = []
    real_send = httpx2.AsyncClient.send

    async def send(self, request, *args, **kwargs):
        response = await real_send(self, request, *args, **kwargs)
        sent.append((request.method, response.status_code))
        return response

    monkeypatch.setattr(httpx2.AsyncClient, "send", send)
    per_call = []
    for _ in range(5):
        before = len(sent)
        assert run_tool(calc_tools["add"], {"a": 1, "b": 2}, base_url="", cwd="/",
                        mcp_servers={"calc": mcp_server}) == ToolResult("3", ok=True)
        per_call.append(sent[before:])
    assert all(calls == per_call[0] for calls in per_call), per_call
    assert 1 <= len(per_call[0]) <= 4 and all(status < 400 for _, status in per_call[0]), per_call[0]


# --------------------------------------------------------------------------- the catalogue, and servers gone


def test_it_loads_builtins_then_mcp_tools(llama, mcp_server):
    catalogue, warnings = load_catalogue(llama, [mcp_server])
    assert warnings == []
    names = [e.name for e in catalogue.entries]
    assert names.index("read_file") < names.index("calc__add")
    assert catalogue.get("calc__shout").server == "calc"
    assert [d["function"]["name"] for d in catalogue.definitions()] == names


def test_it_leaves_out_an_mcp_server_that_does_not_answer(llama, mcp_server, closed_url):
    gone = McpServerConfig(name="exa", url=f"{closed_url}/mcp", headers={"Authorization": "Bearer k"})
    catalogue, warnings = load_catalogue(llama, [gone, mcp_server])
    assert warnings == ["MCP server 'exa' did not answer (connection refused); its tools are left out."]
    assert catalogue.get("read_file") is not None
    assert catalogue.get("calc__add") is not None
    assert not [e for e in catalogue.entries if e.server == "exa"]


def test_it_says_why_when_the_builtins_cannot_be_read(closed_url):
    catalogue, warnings = load_catalogue(closed_url, [])
    assert catalogue.entries == ()
    assert warnings == ["llama-server's own tools could not be read (connection refused); they are left out."]


def test_it_raises_a_plain_reason_for_an_mcp_server_that_does_not_answer(closed_url):
    with pytest.raises(McpUnavailable) as caught:
        list_mcp_tools(McpServerConfig(name="exa", url=f"{closed_url}/mcp"))
    assert str(caught.value) == "connection refused"


def test_it_names_the_http_status_when_an_mcp_server_refuses_the_key():
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = b'{"error": "invalid api key"}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_DELETE = do_POST  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = McpServerConfig(name="exa", url=f"http://127.0.0.1:{server.server_port}/mcp")
        with pytest.raises(McpUnavailable) as caught:
            list_mcp_tools(config)
        assert str(caught.value) == "it answered HTTP 401 Unauthorized"
        entry = ToolEntry("exa__search", "search", True, "mcp", "exa", "search", {})
        result = run_tool(entry, {}, base_url="", cwd="/", mcp_servers={"exa": config})
        assert result == ToolResult(
            "The tool exa__search could not be reached: it answered HTTP 401 Unauthorized.", False
        )
    finally:
        server.shutdown()
        server.server_close()


def test_it_reports_an_mcp_server_gone_as_unreachable(tmp_path_factory):
    proc, port = start_mcp_server(tmp_path_factory.mktemp("mcp-gone"))
    config = McpServerConfig(name="calc", url=f"http://127.0.0.1:{port}/mcp")
    try:
        add = {e.remote_name: e for e in list_mcp_tools(config)}["add"]
        assert run_tool(add, {"a": 1, "b": 2}, base_url="", cwd="/", mcp_servers={"calc": config}).output == "3"
    finally:
        stop_process(proc)
    wait_until(lambda: not port_open(port), 10, "the MCP server to close its port")
    result = run_tool(add, {"a": 1, "b": 2}, base_url="", cwd="/", mcp_servers={"calc": config})
    assert result == ToolResult("The tool calc__add could not be reached: connection refused.", ok=False)


def test_it_reports_an_mcp_server_no_longer_configured(calc_tools):
    result = run_tool(calc_tools["add"], {"a": 1, "b": 2}, base_url="", cwd="/", mcp_servers={})
    assert result == ToolResult(
        "The tool calc__add could not be reached: the MCP server 'calc' is not configured any more.", ok=False
    )


def test_it_reports_a_builtin_whose_llama_server_is_gone(closed_url, tmp_path):
    result = run_tool(builtin("read_file"), {"path": "x"}, base_url=closed_url, cwd=str(tmp_path), mcp_servers={})
    assert result == ToolResult("The tool read_file could not be reached: connection refused.", ok=False)


# --------------------------------------------------------------------------- the MCP server this file runs


def serve_mcp(port: int) -> None:
    """A small MCP server over streamable HTTP on 127.0.0.1:``port`` (blocks)."""
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.server.mcpserver.utilities.types import Image
    from mcp_types import ToolAnnotations

    server = MCPServer("calc", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool(title="Shout")
    def shout(text: str) -> str:
        """Upper-case the text."""
        return text.upper()

    @server.tool()
    def boom() -> str:
        """Always fails."""
        raise ToolError("the boom tool always fails")

    @server.tool()
    def whoami(ctx: Context) -> str:
        """The Authorization header this request came with."""
        return (ctx.headers or {}).get("authorization", "<none>")

    @server.tool(structured_output=False)
    def picture() -> list:
        """A caption and an image."""
        png = bytes.fromhex("89504e470d0a1a0a")
        return ["a red dot", Image(data=png, format="png")]

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "done"

    server.run("streamable-http", host="127.0.0.1", port=port)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve-mcp"]:
    serve_mcp(int(sys.argv[2]))
