"""What a tool is to a session (docs/behaviour.md §9): :class:`ToolEntry` (the name the model
calls, how to reach the tool), :class:`Catalogue` (the tools offered, in order),
:class:`ToolResult` (one call's answer), :class:`McpServerConfig` (an MCP server as the
caller hands it in), and the names MCP tools get (:func:`mcp_tool_name`).

Plain data: nothing here reaches a server, and nothing imports Django. The name the
model sees for an MCP tool is ``"<server>__<tool>"`` (:data:`MCP_SEPARATOR`); it is
never parsed back: :class:`ToolEntry` keeps ``server`` and ``remote_name``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Between an MCP server's name and its tool's name in the name the model sees.
#: Valid in OpenAI function names (``^[a-zA-Z0-9_-]{1,64}$``) and rare inside tool names.
MCP_SEPARATOR = "__"

#: The result of a call of a tool that is not in the catalogue (docs/behaviour.md §8); ``.format(name=...)``.
UNKNOWN_TOOL_RESULT = "There is no tool named {name}. Use only the tools listed in this request."

#: Longest function name OpenAI-style chat templates accept.
MAX_TOOL_NAME = 64

ORIGIN_MACHINE = "machine"
ORIGIN_MCP = "mcp"
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


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
