"""What the stand-in llama-servers share: tests/fake_llama_server.py (scripted replies, for
the tests) and bench/rate_server.py (tokens at a fixed rate, for the benches).

Both take llama-server's command line and answer like it where Corral looks: JSON
bodies, ``text/event-stream`` chat completions, and 401 to every request but
``/health`` that does not carry ``Authorization: Bearer <the --api-key-file key>``.
No state and no environment read here: each stand-in keeps its own.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def api_key_of(argv: list[str]) -> str:
    """The key llama-server would read from ``--api-key-file`` in ``argv``; '' without one."""
    if "--api-key-file" not in argv:
        return ""
    with open(argv[argv.index("--api-key-file") + 1]) as f:
        return f.read().strip()


def chunk(delta: dict, finish: str | None = None) -> dict:
    """One streamed chat completion chunk, as llama-server sends it."""
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class StandInHandler(BaseHTTPRequestHandler):
    """A request handler with llama-server's key check and JSON and SSE replies. A
    stand-in sets ``api_key`` (from :func:`api_key_of`) before it serves."""

    api_key = ""

    def log_message(self, *args):  # keep the log for the server's own lines
        pass

    def _json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        """Answer 401 as llama-server does to a request without the key; True when it did."""
        if self.api_key and self.path != "/health" and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._json(401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
            return True
        return False

    def _event(self, obj) -> None:
        """One server-sent event (``data: <json>``), sent at once."""
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()
