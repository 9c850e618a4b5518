"""llama-server's built-in tools ("machine" tools, docs/behaviour.md §9): what
``llama-server --tools all`` offers, listed and run over its HTTP API.

``GET /tools`` lists them, each shaped ``{"display_name": "Read file", "tool": "read_file",
"type": "server", "permissions": {"write": false}, "uses_cwd": true, "definition":
{"type": "function", "function": {"name", "description", "parameters"}}}``. ``POST
/tools`` with ``{"tool": name, "params": {...}}`` and the working directory in the
``x-tool-cwd`` header runs one: ``{"plain_text_response": "..."}`` on success
(``exec_shell_command`` output ends with ``"\\n\\n[exit code: N]"``), ``{"error": "cannot
stat file: x"}`` (HTTP 200) when the tool failed, ``{"error": {"message": "File Not
Found", ...}}`` (HTTP 404) for an unknown tool, ``{"code": 400, "message": "...", "type":
"invalid_request_error"}`` for bad parameters, and plain JSON for some tools
(``get_info`` answers ``{"os", "cwd"}``).

The built-ins llama-server cannot bound run on the session's machine instead
(:mod:`.machine`); :func:`~.use.run_tool` chooses. No Django import.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from machines_app.llama_server import auth_headers, tls_context

from .catalogue import ORIGIN_MACHINE, ToolEntry, ToolResult, _definition
from .failures import CONNECT_TIMEOUT, _reason, _seconds, _unreachable

#: Seconds allowed for ``GET /tools`` on llama-server.
BUILTIN_LIST_TIMEOUT = 10.0


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
