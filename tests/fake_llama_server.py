"""A stand-in for llama-server for what the real one cannot do on demand.

Used only where the real server cannot produce the behaviour at a chosen moment:
``/health`` answering 503 for a while (case C09: a multi-GB load), and ignoring SIGTERM
(case C21: seen to hang in "cleaning up before exit…"). It takes llama-server's command
line, listens where told, and serves /health, /tools and a scripted chat completion.

Behaviour from the environment of the wrapper script the tests write:
FAKE_LOADING_SECONDS (503 until then), FAKE_IGNORE_TERM=1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()
LOADING = float(os.environ.get("FAKE_LOADING_SECONDS", "0"))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the log for the server's own lines
        pass

    def _json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            if time.monotonic() - START < LOADING:
                self._json(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            else:
                self._json(200, {"status": "ok"})
        elif self.path == "/tools":
            self._json(200, [])
        else:
            self._json(200, {})


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        def on_term(*_):
            print("cleaning up before exit...", flush=True)

        signal.signal(signal.SIGTERM, on_term)
    print(f"fake llama-server listening on {host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
