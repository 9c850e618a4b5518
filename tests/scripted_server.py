"""A scripted llama-server chat endpoint for tests of what the real server cannot do on
demand: a malformed stream, a context overflow in each of its shapes, a cut connection.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def sse(payload: dict[str, Any] | str) -> bytes:
    """One SSE event as llama-server writes it: ``data: <json>`` and a blank line."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


@dataclass
class Script:
    """What the scripted llama-server answers: status, headers, then body pieces.

    A ``float`` in ``body`` is a pause in seconds between pieces.
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    body: list[bytes | float] = field(default_factory=list)
    delay_headers: float = 0.0


class ScriptedServer:
    """A real HTTP server on 127.0.0.1 serving one :class:`Script` per POST, in order."""

    def __init__(self) -> None:
        self.scripts: list[Script] = []
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.authorizations: list[str | None] = []  # the Authorization header of each POST
        self.client_gone = threading.Event()
        self.finished = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                outer.requests.append(json.loads(self.rfile.read(length)))
                outer.paths.append(self.path)
                outer.authorizations.append(self.headers.get("Authorization"))
                script = outer.scripts.pop(0) if outer.scripts else Script(status=404)
                time.sleep(script.delay_headers)
                try:
                    self.send_response(script.status)
                    for name, value in script.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    for piece in script.body:
                        if isinstance(piece, float):
                            time.sleep(piece)
                        else:
                            self.wfile.write(piece)
                            self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    outer.client_gone.set()
                    return
                outer.finished.set()

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def will_answer(self, *pieces: bytes | float, **kwargs: Any) -> None:
        self.scripts.append(Script(body=list(pieces), **kwargs))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


