"""The tool catalogue of a session and the running of one tool call (docs/behaviour.md §8, §9).

Plain data in and out, no Django import. Two kinds of tools:

- **Built-ins** ("machine" tools): what ``llama-server --tools all`` offers, listed with
  ``GET /tools`` and run with ``POST /tools`` (:mod:`.builtin`) — except the ones
  llama-server cannot bound (shell, read, grep), which Corral runs itself on the session's
  machine through its transport, with the same names and answers (:mod:`.machine`).
- **MCP tools**: the tools of every MCP server configured for the deployment, reached
  over streamable HTTP, one connection per operation (:mod:`.mcp`). The model sees them
  as ``"<server>__<tool>"`` (:func:`mcp_tool_name`).

Where each part lives (the public names are re-exported here, so ``tools.X`` reads the
same from anywhere):

- :mod:`.catalogue` — plain data: :class:`ToolEntry`, :class:`Catalogue`,
  :class:`ToolResult`, :class:`McpServerConfig`, :class:`McpUnavailable`, the names;
- :mod:`.builtin` — llama-server's built-ins over its HTTP API;
- :mod:`.machine` — the built-ins Corral runs on the session's machine;
- :mod:`.mcp` — MCP servers;
- :mod:`.failures` — the plain reason a tool could not be reached (private to the package);
- :mod:`.use` — the two calls the rest of Corral makes: :func:`load_catalogue` and
  :func:`run_tool`. Every call gets a result (docs/behaviour.md §8): :func:`run_tool` never
  raises for a tool that cannot be reached; it answers ``"The tool <name> could not be
  reached: <reason>."`` with ``ok=False``.
"""

from __future__ import annotations

from . import machine
from .builtin import BUILTIN_LIST_TIMEOUT, builtin_entries, fetch_builtin
from .catalogue import (
    MAX_TOOL_NAME,
    MCP_SEPARATOR,
    ORIGIN_MACHINE,
    ORIGIN_MCP,
    UNKNOWN_TOOL_RESULT,
    Catalogue,
    McpServerConfig,
    McpUnavailable,
    ToolEntry,
    ToolResult,
    mcp_tool_name,
)
from .failures import CONNECT_TIMEOUT
from .mcp import MAX_LIST_PAGES, list_mcp_tools
from .use import load_catalogue, run_tool

__all__ = [
    "BUILTIN_LIST_TIMEOUT",
    "CONNECT_TIMEOUT",
    "MAX_LIST_PAGES",
    "MAX_TOOL_NAME",
    "MCP_SEPARATOR",
    "ORIGIN_MACHINE",
    "ORIGIN_MCP",
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
    "machine",
    "mcp_tool_name",
    "run_tool",
]
