"""MCP tools (docs/behaviour.md §9): the tools of every MCP server configured for the
deployment (an admin-managed row, handed in as :class:`~.catalogue.McpServerConfig`),
reached from the backend over streamable HTTP with the official ``mcp`` SDK (v2). The
model sees them as ``"<server>__<tool>"`` (:func:`~.catalogue.mcp_tool_name`), so
``exa``'s ``web_search_exa`` is ``exa__web_search_exa``.

Connections: every MCP operation (:func:`list_mcp_tools`, one call of a tool) opens its
own connection, negotiates, does its one thing and closes — simple, and nothing to go stale
across model changes or worker restarts. The cost is the handshake on every call: about
50 ms against a local server; against a remote one a few round trips (a ``server/discover``
probe, and for servers of the handshake era an ``initialize`` as well, then the call and a
closing ``DELETE``). The SDK is async; each call runs in a fresh event loop
(``anyio.run``), in a worker thread when the calling thread already runs a loop, so
synchronous callers (Celery threads) and async ones alike may call these functions.
No Django import.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from .catalogue import ORIGIN_MCP, McpServerConfig, McpUnavailable, ToolEntry, ToolResult, _definition, mcp_tool_name
from .failures import CONNECT_TIMEOUT, _HttpStatus, _reason, _unreachable

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from mcp import Client

#: Most pages of ``tools/list`` read from one MCP server (a paginator that never ends).
MAX_LIST_PAGES = 50


def _run_async[T](fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` in a fresh event loop; in a worker thread if this one runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(fn, *args)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-mcp") as pool:
        return pool.submit(anyio.run, fn, *args).result()


@asynccontextmanager
async def _mcp_client(server: McpServerConfig, timeout: float, status: _HttpStatus) -> AsyncIterator[Client]:
    """One connected ``mcp.Client`` on ``server`` (``auto`` mode: modern ``server/discover``,
    else the ``initialize`` handshake), closed on exit."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(
        headers=dict(server.headers),
        timeout=httpx2.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT)),
        event_hooks={"response": [status.note]},
    )
    async with http:
        async with Client(streamable_http_client(server.url, http_client=http), cache=None) as client:
            yield client


def _mcp_entry(server: McpServerConfig, tool: Any) -> ToolEntry:
    name = mcp_tool_name(server.name, tool.name)
    annotations = tool.annotations
    read_only = bool(annotations is not None and annotations.read_only_hint is True)
    title = tool.title or (annotations.title if annotations is not None else None) or tool.name
    description = tool.description or tool.title or ""
    return ToolEntry(
        name=name,
        display_name=title,
        writes=not read_only,
        origin=ORIGIN_MCP,
        server=server.name,
        remote_name=tool.name,
        definition=_definition(name, description, tool.input_schema),
        annotations=annotations.model_dump(mode="json", by_alias=True, exclude_none=True) if annotations else {},
    )


async def _list_tools(server: McpServerConfig, timeout: float, status: _HttpStatus) -> list[ToolEntry]:
    entries: list[ToolEntry] = []
    with anyio.fail_after(timeout):
        async with _mcp_client(server, timeout, status) as client:
            cursor: str | None = None
            for _ in range(MAX_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                entries.extend(_mcp_entry(server, tool) for tool in page.tools)
                cursor = page.next_cursor
                if not cursor:
                    break
    return entries


def list_mcp_tools(server: McpServerConfig, *, timeout: float = 10.0) -> list[ToolEntry]:
    """The tools of one MCP server (``tools/list``, every page), named ``"<server>__<tool>"``.

    Each definition's ``parameters`` is the tool's ``inputSchema`` as the server sent it;
    ``description`` its description (else its title, else ``""``). ``timeout`` bounds the
    whole exchange. Raises :class:`McpUnavailable` with a plain reason when the server does
    not answer, or answers with an error.
    """
    status = _HttpStatus()
    try:
        return _run_async(_list_tools, server, timeout, status)
    except Exception as exc:
        raise McpUnavailable(_reason(exc, timeout, status)) from exc


def _content_text(block: Any) -> str:
    """One MCP content block as text: text as is, other kinds summarised (``[image: image/png]``)."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        return f"[{kind}: {block.mime_type}]"
    if kind == "resource_link":
        return f"[resource link: {block.name} <{block.uri}>]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if isinstance(text, str):
            return text
        return f"[resource: {resource.uri} ({resource.mime_type or 'binary'})]"
    return f"[{kind or 'content'}]"


async def _call_tool(
    entry: ToolEntry, arguments: dict[str, Any], server: McpServerConfig, timeout: float, status: _HttpStatus
) -> ToolResult:
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED

    with anyio.fail_after(timeout):
        async with _mcp_client(server, timeout, status) as client:
            try:
                result = await client.call_tool(entry.remote_name, arguments)
            except MCPError as exc:
                if status.last is not None or exc.code == CONNECTION_CLOSED:
                    raise  # the transport broke, not the tool: "could not be reached"
                return ToolResult(exc.message or str(exc), ok=False)  # the server refused, in its words
    parts = [_content_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    output = "\n".join(parts)
    if result.is_error:
        return ToolResult(output or f"The tool {entry.name} failed without saying why.", ok=False)
    return ToolResult(output, ok=True)


def _run_mcp(
    entry: ToolEntry, arguments: dict[str, Any], mcp_servers: Mapping[str, McpServerConfig], timeout: float
) -> ToolResult:
    server = mcp_servers.get(entry.server or "")
    if server is None:
        return _unreachable(entry, f"the MCP server '{entry.server}' is not configured any more")
    status = _HttpStatus()
    try:
        return _run_async(_call_tool, entry, arguments, server, timeout, status)
    except Exception as exc:
        return _unreachable(entry, _reason(exc, timeout, status))
