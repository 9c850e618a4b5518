"""How a call that cannot reach its tool is answered (docs/behaviour.md §8: every call gets a
result): :func:`_reason` turns a failed connection into a plain reason (connection
refused, a timeout, the HTTP status the server answered, …) and :func:`_unreachable`
makes of it the answer ``"The tool <name> could not be reached: <reason>."``, ``ok=False``.

Shared by the built-ins (:mod:`.builtin`), the MCP servers (:mod:`.mcp`) and
:func:`~.use.load_catalogue`; private to the package. No Django import.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

from .catalogue import ToolEntry, ToolResult

#: Seconds allowed to open a TCP connection (capped by the call's own timeout).
CONNECT_TIMEOUT = 10.0


class _HttpStatus:
    """The last HTTP error status one MCP connection got (the SDK reports only "Server returned
    an error response"); cleared by any later success."""

    def __init__(self) -> None:
        self.last: str | None = None

    async def note(self, response: Any) -> None:
        code = response.status_code
        self.last = f"HTTP {code} {response.reason_phrase}".strip() if code >= 400 else None


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
