"""The tool catalogue of a session and the running of one tool call (docs/behaviour.md §8, §9).

Plain data in and out, no Django import. Two kinds of tools:

- **Built-ins** ("machine" tools): what ``llama-server --tools all`` offers. ``GET /tools``
  lists them, each shaped ``{"display_name": "Read file", "tool": "read_file", "type":
  "server", "permissions": {"write": false}, "uses_cwd": true, "definition": {"type":
  "function", "function": {"name", "description", "parameters"}}}``. ``POST /tools`` with
  ``{"tool": name, "params": {...}}`` and the working directory in the ``x-tool-cwd`` header
  runs one: ``{"plain_text_response": "..."}`` on success (``exec_shell_command`` output ends
  with ``"\\n\\n[exit code: N]"``), ``{"error": "cannot stat file: x"}`` (HTTP 200) when the
  tool failed, ``{"error": {"message": "File Not Found", ...}}`` (HTTP 404) for an unknown
  tool, ``{"code": 400, "message": "...", "type": "invalid_request_error"}`` for bad
  parameters, and plain JSON for some tools (``get_info`` answers ``{"os", "cwd"}``).
- **MCP tools**: the tools of every MCP server configured for the deployment (an
  admin-managed row, handed in as :class:`McpServerConfig`), reached from the backend over
  streamable HTTP with the official ``mcp`` SDK (v2). The model sees them as
  ``"<server>__<tool>"`` (:data:`MCP_SEPARATOR` is a double underscore; see
  :func:`mcp_tool_name`), so ``exa``'s ``web_search_exa`` is ``exa__web_search_exa``.
  The name is never parsed back: :class:`ToolEntry` keeps ``server`` and ``remote_name``.

Connections: every MCP operation (:func:`list_mcp_tools`, one :func:`run_tool` call) opens its
own connection, negotiates, does its one thing and closes — simple, and nothing to go stale
across model changes or worker restarts. The cost is the handshake on every call: about
50 ms against a local server; against a remote one a few round trips (a ``server/discover``
probe, and for servers of the handshake era an ``initialize`` as well, then the call and a
closing ``DELETE``). The SDK is async; each call runs in a fresh event loop
(``anyio.run``), in a worker thread when the calling thread already runs a loop, so
synchronous callers (Celery threads) and async ones alike may call these functions.

Every call gets a result (docs/behaviour.md §8): :func:`run_tool` never raises for a tool that cannot be
reached; it answers ``"The tool <name> could not be reached: <reason>."`` with ``ok=False``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from machines_app.llama_server import auth_headers, tls_context
from machines_app.transports import TransportError

from . import machine_tools

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from mcp import Client

__all__ = [
    "MCP_SEPARATOR",
    "UNKNOWN_TOOL_RESULT",
    "Catalogue",
    "McpServerConfig",
    "McpUnavailable",
    "ToolEntry",
    "ToolResult",
    "builtin_entries",
    "fetch_builtin",
    "list_mcp_tools",
    "load_catalogue",
    "mcp_tool_name",
    "run_tool",
]

#: Between an MCP server's name and its tool's name in the name the model sees.
#: Valid in OpenAI function names (``^[a-zA-Z0-9_-]{1,64}$``) and rare inside tool names.
MCP_SEPARATOR = "__"

#: The result of a call of a tool that is not in the catalogue (docs/behaviour.md §8); ``.format(name=...)``.
UNKNOWN_TOOL_RESULT = "There is no tool named {name}. Use only the tools listed in this request."

#: Longest function name OpenAI-style chat templates accept.
MAX_TOOL_NAME = 64

#: Seconds allowed to open a TCP connection (capped by the call's own timeout).
CONNECT_TIMEOUT = 10.0

#: Seconds allowed for ``GET /tools`` on llama-server.
BUILTIN_LIST_TIMEOUT = 10.0

#: Most pages of ``tools/list`` read from one MCP server (a paginator that never ends).
MAX_LIST_PAGES = 50

ORIGIN_MACHINE = "machine"
ORIGIN_MCP = "mcp"

_NAME_OK = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server reached from the backend (built by the caller from an admin-managed row).

    ``name`` prefixes its tools (``"exa"``); ``url`` is the streamable HTTP endpoint
    (``"https://mcp.exa.ai/mcp"``); ``headers`` go on every request
    (``{"Authorization": "Bearer …"}`` for an API key).
    """

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)


class McpUnavailable(Exception):
    """An MCP server did not answer. ``str()`` is a plain reason: ``"connection refused"``,
    ``"no answer within 10 seconds"``, ``"it answered HTTP 401 Unauthorized"``, …"""


@dataclass(frozen=True)
class ToolEntry:
    """One tool as the model sees it, and how to reach it.

    - ``name``: the function name the model sees and calls; built-ins as llama-server names
      them (``"read_file"``), MCP tools ``"<server>__<tool>"`` (:func:`mcp_tool_name`).
    - ``display_name``: for people (``"Read file"``; an MCP tool's title, else its name).
    - ``writes``: may change something. Built-ins: ``permissions.write`` (``True`` when the
      server does not say). MCP: not ``annotations.readOnlyHint`` (``True`` when not hinted).
    - ``origin``: ``"machine"`` (llama-server built-in) or ``"mcp"``.
    - ``server``: the MCP server's name; ``None`` for built-ins.
    - ``remote_name``: the tool's own name on its server (what ``POST /tools`` or
      ``tools/call`` is given).
    - ``definition``: the OpenAI tool definition ``{"type": "function", "function": {"name":
      <name>, "description", "parameters"}}``; a built-in's is llama-server's, untouched.
    - ``annotations``: an MCP tool's annotations as its server sent them (``{"readOnlyHint":
      true, "title": …}``, camelCase, unset ones left out); ``None`` for built-ins. Part of
      what an allowance is bound to (sessions_app/allowances.py), and what the server
      *claims*: never a reason to skip a question.
    """

    name: str
    display_name: str
    writes: bool
    origin: str
    server: str | None
    remote_name: str
    definition: dict[str, Any]
    annotations: dict[str, Any] | None = None

    def as_payload(self) -> dict[str, Any]:
        """A JSON-able dict (kept in the transcript); :meth:`from_payload` reads it back."""
        payload = {
            "name": self.name,
            "display_name": self.display_name,
            "writes": self.writes,
            "origin": self.origin,
            "server": self.server,
            "remote_name": self.remote_name,
            "definition": self.definition,
        }
        if self.annotations is not None:
            payload["annotations"] = self.annotations
        return payload

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> ToolEntry:
        """The entry :meth:`as_payload` wrote. Raises ValueError when ``d`` names no tool."""
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"not a tool entry: {d!r}")
        definition = d.get("definition")
        server = d.get("server")
        annotations = d.get("annotations")
        return cls(
            name=name,
            display_name=str(d.get("display_name") or name),
            writes=bool(d.get("writes", True)),
            origin=str(d.get("origin") or ORIGIN_MACHINE),
            server=server if isinstance(server, str) else None,
            remote_name=str(d.get("remote_name") or name),
            definition=dict(definition) if isinstance(definition, Mapping) else _definition(name, "", None),
            annotations=dict(annotations) if isinstance(annotations, Mapping) else None,
        )


@dataclass(frozen=True)
class Catalogue:
    """The tools offered to the model in one session, in order (built-ins first)."""

    entries: tuple[ToolEntry, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))

    def get(self, name: str) -> ToolEntry | None:
        """The entry the model calls ``name``, or ``None`` (then answer with
        :data:`UNKNOWN_TOOL_RESULT`)."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        return None

    def definitions(self) -> list[dict[str, Any]]:
        """The ``"tools"`` field of ``/v1/chat/completions``; ``[]`` when empty (then send no
        ``"tools"`` at all)."""
        return [entry.definition for entry in self.entries]

    def as_payload(self) -> list[dict[str, Any]]:
        """A JSON-able list of entries (:meth:`ToolEntry.as_payload`)."""
        return [entry.as_payload() for entry in self.entries]

    @classmethod
    def from_payload(cls, items: Iterable[Mapping[str, Any]] | Mapping[str, Any] | None) -> Catalogue:
        """The catalogue :meth:`as_payload` wrote (also as ``{"tools": [...]}``, the
        ``catalogue`` event's payload). Entries that name no tool are skipped."""
        if isinstance(items, Mapping):
            items = items.get("tools") or []
        entries = []
        for item in items or []:
            if not isinstance(item, Mapping):
                continue
            try:
                entries.append(ToolEntry.from_payload(item))
            except ValueError:
                continue
        return cls(tuple(entries))


@dataclass(frozen=True)
class ToolResult:
    """What one call gives back to the model: ``output`` text, and whether the tool did its job."""

    output: str
    ok: bool


# --------------------------------------------------------------------------- naming


def mcp_tool_name(server: str, tool: str) -> str:
    """The name the model sees for MCP tool ``tool`` of server ``server``: ``"<server>__<tool>"``.

    Characters outside ``[a-zA-Z0-9_-]`` become ``_``; a name over 64 characters is cut and
    ends with ``_`` and 8 hex digits of a hash of the full pair, so it stays valid and distinct.
    """
    raw = f"{_NAME_BAD_CHARS.sub('_', server) or '_'}{MCP_SEPARATOR}{_NAME_BAD_CHARS.sub('_', tool) or '_'}"
    if len(raw) <= MAX_TOOL_NAME:
        return raw
    digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:8]
    return f"{raw[: MAX_TOOL_NAME - 9]}_{digest}"


def _definition(name: str, description: str, parameters: Any) -> dict[str, Any]:
    if not isinstance(parameters, Mapping):
        parameters = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": dict(parameters)},
    }


# --------------------------------------------------------------------------- built-ins


def _builtin_entry(item: Mapping[str, Any]) -> ToolEntry | None:
    definition = item.get("definition")
    function = definition.get("function") if isinstance(definition, Mapping) else None
    function_name = function.get("name") if isinstance(function, Mapping) else None
    remote = item.get("tool") or function_name
    if not isinstance(remote, str) or not remote:
        return None
    name = function_name if isinstance(function_name, str) and function_name else remote
    if not isinstance(definition, Mapping) or not isinstance(function, Mapping):
        definition = _definition(name, str(item.get("display_name") or ""), None)
    permissions = item.get("permissions")
    writes = permissions.get("write", True) if isinstance(permissions, Mapping) else True
    return ToolEntry(
        name=name,
        display_name=str(item.get("display_name") or remote),
        writes=bool(writes),
        origin=ORIGIN_MACHINE,
        server=None,
        remote_name=remote,
        definition=dict(definition),
    )


def builtin_entries(tools_json: Iterable[Mapping[str, Any]]) -> list[ToolEntry]:
    """Entries for llama-server's built-in tools, from the ``GET /tools`` JSON list.

    The model-facing name is the definition's ``function.name`` (else ``tool``); the definition
    is kept as the server sent it. ``writes`` is ``permissions.write`` (``True`` when absent:
    be conservative). Entries that name no tool are skipped.
    """
    entries = []
    for item in tools_json:
        if isinstance(item, Mapping) and (entry := _builtin_entry(item)) is not None:
            entries.append(entry)
    return entries


def fetch_builtin(base_url: str, *, http: httpx.Client | None = None, api_key: str = "") -> list[ToolEntry]:
    """llama-server's built-in tools via ``GET {base_url}/tools`` (with the server's key);
    ``[]`` on 404 (a server started without ``--tools``, or a build without them). Accepts
    a list or ``{"tools": [...]}``. Raises ``httpx.HTTPError`` when the list cannot be read
    (a 401 for a wrong key included)."""
    url = f"{base_url.rstrip('/')}/tools"
    response = (http or httpx).get(url, headers=auth_headers(api_key), timeout=BUILTIN_LIST_TIMEOUT)
    if response.status_code == 404:
        return []
    response.raise_for_status()
    data = response.json()
    if isinstance(data, Mapping):
        data = data.get("tools") or []
    return builtin_entries(data if isinstance(data, list) else [])


def _builtin_answer(status: int, body: bytes) -> ToolResult:
    """Read a ``POST /tools`` answer: ``plain_text_response``, else the ``error`` (a string, or
    an object with ``message``), else a top-level ``message`` on an HTTP error, else the JSON
    text; a body that is not JSON is quoted as text (or ``"HTTP <status>"`` when empty)."""
    failed = status >= 400
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", errors="replace").strip()
        return ToolResult(text or f"HTTP {status}", ok=not failed)
    if isinstance(data, Mapping):
        text = data.get("plain_text_response")
        if isinstance(text, str):
            return ToolResult(text, ok=not failed)
        if "error" in data and data["error"] not in (None, "", False):
            return ToolResult(_error_message(data["error"]), ok=False)
        if failed and isinstance(data.get("message"), str) and data["message"]:
            return ToolResult(data["message"], ok=False)
    return ToolResult(json.dumps(data, ensure_ascii=False), ok=not failed)


def _error_message(error: Any) -> str:
    if isinstance(error, str):
        return error
    if isinstance(error, Mapping) and isinstance(error.get("message"), str) and error["message"]:
        return error["message"]
    return json.dumps(error, ensure_ascii=False)


def _run_builtin(
    entry: ToolEntry, arguments: dict[str, Any], base_url: str, api_key: str, cwd: str, timeout: float
) -> ToolResult:
    try:
        response = httpx.post(
            f"{base_url.rstrip('/')}/tools",
            json={"tool": entry.remote_name, "params": arguments},
            # Bytes, so a working directory outside ASCII reaches the server as UTF-8.
            headers={"x-tool-cwd": cwd.encode("utf-8"), **auth_headers(api_key)},
            timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT)),
            verify=tls_context(),
        )
    except httpx.TimeoutException:
        return _unreachable(entry, f"no answer within {_seconds(timeout)}")
    except Exception as exc:  # connection refused, server gone, a bad base URL: never raise (docs/behaviour.md §8)
        return _unreachable(entry, _reason(exc, timeout))
    return _builtin_answer(response.status_code, response.content)


# --------------------------------------------------------------------------- MCP


def _run_async[T](fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` in a fresh event loop; in a worker thread if this one runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(fn, *args)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-mcp") as pool:
        return pool.submit(anyio.run, fn, *args).result()


class _HttpStatus:
    """The last HTTP error status one MCP connection got (the SDK reports only "Server returned
    an error response"); cleared by any later success."""

    def __init__(self) -> None:
        self.last: str | None = None

    async def note(self, response: Any) -> None:
        code = response.status_code
        self.last = f"HTTP {code} {response.reason_phrase}".strip() if code >= 400 else None


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


# --------------------------------------------------------------------------- failures


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 20:
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            for leaf in _leaves(current):
                if id(leaf) not in seen:
                    yield from _chain(leaf)
        # Follow suppressed contexts too: httpcore raises its errors ``from None``.
        current = current.__cause__ or current.__context__


def _seconds(timeout: float) -> str:
    return f"{timeout:g} second" + ("" if timeout == 1 else "s")


def _reason(exc: BaseException, timeout: float, status: _HttpStatus | None = None) -> str:
    """A plain reason for a failed connection: connection refused, a timeout, the HTTP status
    the server answered, else the innermost error's own message."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, asyncio.CancelledError)] or [exc]
    causes = [cause for leaf in leaves for cause in _chain(leaf)]
    if any(isinstance(cause, ConnectionRefusedError) for cause in causes):
        return "connection refused"
    if any(isinstance(cause, socket.gaierror) for cause in causes):
        return "its host name could not be resolved"
    if any(isinstance(cause, TimeoutError) or "Timeout" in type(cause).__name__ for cause in causes):
        return f"no answer within {_seconds(timeout)}"
    if status is not None and status.last is not None:
        return f"it answered {status.last}"
    for cause in causes:
        if isinstance(cause, ConnectionResetError | BrokenPipeError):
            return "the connection was closed"
    leaf = leaves[0]
    message = str(getattr(leaf, "message", "") or leaf).strip()
    return message or type(leaf).__name__


def _unreachable(entry: ToolEntry, reason: str) -> ToolResult:
    return ToolResult(f"The tool {entry.name} could not be reached: {reason.rstrip('.')}.", ok=False)


# --------------------------------------------------------------------------- public


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
    built-ins llama-server cannot bound (:data:`machine_tools.HANDLED`: shell, read, grep)
    run through it instead, with the same names and answers (:mod:`sessions_app.machine_tools`),
    and ``cancel`` being set ends a running one within a fraction of a second, keeping what it
    printed; ``edit_file`` of a huge or binary file is answered with a sentence first.
    """
    args = dict(arguments) if isinstance(arguments, Mapping) else {}
    if entry.origin == ORIGIN_MCP:
        return _run_mcp(entry, args, mcp_servers, timeout)
    if transport is not None:
        try:
            if entry.remote_name in machine_tools.HANDLED:
                answer = machine_tools.run(entry.remote_name, args, transport, cwd, cancel)
                return ToolResult(answer.output, ok=answer.ok)
            refused = machine_tools.guard(entry.remote_name, args, transport, cwd)
        except TransportError as exc:
            return _unreachable(entry, str(exc))
        if refused is not None:
            return ToolResult(refused.output, ok=refused.ok)
    return _run_builtin(entry, args, base_url, api_key, cwd, timeout)
