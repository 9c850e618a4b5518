"""Server-Sent Events: the lines of a ``text/event-stream`` body, and the data payload of
each event (docs/behaviour.md §6, C11). Pure text handling; no Django import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["iter_lines", "iter_sse_data"]

_EOL = re.compile(rb"\r\n|\r|\n")


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data payload of each Server-Sent Event, in order.

    ``lines`` are the lines of a ``text/event-stream`` body, with or without their line
    terminator. ``data:`` lines accumulate (one leading space stripped; several joined with
    ``"\\n"``); a blank line ends the event; lines starting with ``:`` are comments
    (llama-server's keep-alive pings); ``id``/``retry``/other fields are ignored. The last
    event is flushed at end of input even without a trailing blank line (C11: ``[DONE]``
    may arrive that way). Events without data yield nothing.

    Errors are turned into ``{"error": ...}`` payloads so :func:`parse_chunk` raises on
    them whatever their framing: older llama-server builds send a mid-stream error as an
    ``error: {...}`` line (not ``data:``), and ``event: error`` events carry the error in
    their data.
    """
    data: list[str] = []
    error: list[str] = []
    event = ""
    first = True
    for raw in lines:
        line = raw.rstrip("\r\n")
        if first:
            line = line.removeprefix("\ufeff")
            first = False
        if not line:
            payload = _dispatch(event, data, error)
            if payload is not None:
                yield payload
            data, error, event = [], [], ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "error":
            error.append(value)
        elif name == "event":
            event = value
    payload = _dispatch(event, data, error)
    if payload is not None:
        yield payload


def _dispatch(event: str, data: list[str], error: list[str]) -> str | None:
    if error:
        return _as_error_payload("\n".join(error))
    if not data:
        return None
    payload = "\n".join(data)
    return _as_error_payload(payload) if event == "error" else payload


def _as_error_payload(text: str) -> str:
    """``text`` as a chunk with a top-level ``error``, unless it already is one."""
    try:
        decoded: Any = json.loads(text)
    except ValueError:
        return json.dumps({"error": {"message": text}})
    if isinstance(decoded, Mapping) and "error" in decoded:
        return text
    return json.dumps({"error": decoded})


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Split a byte stream into lines at CR, LF or CRLF only (the SSE line terminators).

    Splitting bytes before decoding is safe for UTF-8 and avoids ``str.splitlines()``
    (used by ``httpx.Response.iter_lines``), which also breaks at U+2028, U+0085 and
    form feeds — characters llama-server writes unescaped inside JSON strings.
    """
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        if b"\r" not in buffer:
            # The usual stream (llama-server ends its lines with LF alone): one split per
            # read of a burst, not one regular-expression search per line.
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
            continue
        start = 0
        while (match := _EOL.search(buffer, start)) is not None:
            if match.group() == b"\r" and match.end() == len(buffer):
                break  # maybe the first half of a CRLF split across chunks
            yield buffer[start : match.start()].decode("utf-8", "replace")
            start = match.end()
        buffer = buffer[start:]
    if buffer:
        yield buffer.removesuffix(b"\r").decode("utf-8", "replace")
