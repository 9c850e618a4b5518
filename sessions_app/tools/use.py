"""The two calls the rest of Corral makes (docs/behaviour.md §8, §9): :func:`load_catalogue`,
a session's tools (llama-server's built-ins, then every MCP server's), and
:func:`run_tool`, one call of one tool, sent to wherever the tool lives — llama-server
(:mod:`.builtin`), the session's machine (:mod:`.machine`) or an MCP server (:mod:`.mcp`).

Every call gets a result (docs/behaviour.md §8): :func:`run_tool` never raises for a tool
that cannot be reached; it answers ``"The tool <name> could not be reached: <reason>."``
with ``ok=False``. No Django import.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from machines_app.transports import TransportError

from .builtin import BUILTIN_LIST_TIMEOUT, _run_builtin, fetch_builtin
from .catalogue import MCP_SEPARATOR, ORIGIN_MCP, Catalogue, McpServerConfig, McpUnavailable, ToolEntry, ToolResult
from .failures import _reason, _seconds, _unreachable
from .machine import HANDLED as RUN_ON_MACHINE
from .machine import guard as guard_on_machine
from .machine import run as run_on_machine
from .mcp import _run_mcp, list_mcp_tools


def load_catalogue(
    base_url: str, mcp_servers: list[McpServerConfig], *, api_key: str = ""
) -> tuple[Catalogue, list[str]]:
    """The session's catalogue: llama-server's built-ins (read with the server's
    ``api_key``), then every MCP server's tools.

    Never raises. Returns ``(catalogue, warnings)``; each warning is a sentence for the
    transcript (docs/behaviour.md §9), e.g. ``"MCP server 'exa' did not answer (connection refused); its
    tools are left out."``. Built-ins that cannot be read are left out the same way. MCP
    servers are asked at the same time (one thread each, :func:`list_mcp_tools`). A server
    whose name holds :data:`MCP_SEPARATOR` is not asked (its tools' names could be read two
    ways); tools that would get the same name are all left out, each server named in the
    warning, so a call can never reach a tool other than the one its name meant.
    """
    warnings: list[str] = []
    entries: list[ToolEntry] = []
    try:
        entries.extend(fetch_builtin(base_url, api_key=api_key))
    except (httpx.HTTPError, ValueError) as exc:
        reason = (
            f"no answer within {_seconds(BUILTIN_LIST_TIMEOUT)}" if isinstance(exc, httpx.TimeoutException) else None
        )
        warnings.append(
            f"llama-server's own tools could not be read ({reason or _reason(exc, BUILTIN_LIST_TIMEOUT)}); "
            "they are left out."
        )
    askable = []
    for server in mcp_servers:
        if MCP_SEPARATOR in server.name:
            warnings.append(f"MCP server '{server.name}' has '{MCP_SEPARATOR}' in its name, which separates a "
                            "server's name from its tools' names; rename it. Its tools are left out.")
        else:
            askable.append(server)
    if askable:
        with ThreadPoolExecutor(max_workers=len(askable), thread_name_prefix="corral-mcp-list") as pool:
            futures = [pool.submit(list_mcp_tools, server) for server in askable]
            for server, future in zip(askable, futures, strict=True):
                try:
                    listed = future.result()
                except McpUnavailable as exc:
                    warnings.append(f"MCP server '{server.name}' did not answer ({exc}); its tools are left out.")
                    continue
                except Exception as exc:  # a bug must not stop the session from starting
                    warnings.append(f"MCP server '{server.name}' could not be read ({exc}); its tools are left out.")
                    continue
                entries.extend(listed)
    by_name: dict[str, list[ToolEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    for name, same in by_name.items():
        if len(same) > 1:
            owners = ", ".join(_owner(entry) for entry in same)
            warnings.append(f"{len(same)} tools would be called {name} ({owners}); they are all left out, "
                            "since a call by that name could reach either.")
    entries = [entry for entry in entries if len(by_name[entry.name]) == 1]
    return Catalogue(tuple(entries)), warnings


def _owner(entry: ToolEntry) -> str:
    if entry.origin == ORIGIN_MCP:
        return f"{entry.remote_name!r} of MCP server '{entry.server}'"
    return f"llama-server's {entry.remote_name!r}"


def run_tool(
    entry: ToolEntry,
    arguments: Mapping[str, Any],
    *,
    base_url: str,
    cwd: str,
    mcp_servers: Mapping[str, McpServerConfig],
    timeout: float = 600.0,
    api_key: str = "",
    transport: Any = None,
    cancel: threading.Event | None = None,
) -> ToolResult:
    """Run one call of ``entry`` with ``arguments`` (a JSON object; anything else runs as ``{}``).

    Built-in: ``POST {base_url}/tools`` ``{"tool": remote_name, "params": arguments}`` with
    the server's ``api_key`` and ``x-tool-cwd: cwd`` (a relative path in the arguments is read from ``cwd``). The answer's
    ``plain_text_response`` → ``ok=True``; an ``error`` (or, on an HTTP error, ``message``) →
    that text with ``ok=False``; any other JSON → its text.

    MCP: ``tools/call`` on ``mcp_servers[entry.server]`` over a fresh connection. Text content
    is joined with newlines, other content summarised (``[image: image/png]``), structured
    content used when there is no content; ``isError`` → ``ok=False``; a JSON-RPC error the
    server answers with → its message, ``ok=False``.

    Never raises for a tool that cannot be reached (connection refused, timeout after
    ``timeout`` seconds, server gone, HTTP error, MCP server no longer configured): the result
    is ``"The tool <name> could not be reached: <reason>."`` with ``ok=False`` (docs/behaviour.md §8).

    With the session machine's ``transport`` (a machines_app.transports.Transport), the
    built-ins llama-server cannot bound (:data:`.machine.HANDLED`: shell, read, grep)
    run through it instead, with the same names and answers (:mod:`.machine`),
    and ``cancel`` being set ends a running one within a fraction of a second, keeping what it
    printed; ``edit_file`` of a huge or binary file is answered with a sentence first.
    """
    args = dict(arguments) if isinstance(arguments, Mapping) else {}
    if entry.origin == ORIGIN_MCP:
        return _run_mcp(entry, args, mcp_servers, timeout)
    if transport is not None:
        try:
            if entry.remote_name in RUN_ON_MACHINE:
                answer = run_on_machine(entry.remote_name, args, transport, cwd, cancel)
                return ToolResult(answer.output, ok=answer.ok)
            refused = guard_on_machine(entry.remote_name, args, transport, cwd)
        except TransportError as exc:
            return _unreachable(entry, str(exc))
        if refused is not None:
            return ToolResult(refused.output, ok=refused.ok)
    return _run_builtin(entry, args, base_url, api_key, cwd, timeout)
