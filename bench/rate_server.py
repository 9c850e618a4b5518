"""A stand-in llama-server that streams tokens at a fixed rate, so the model's own CPU is
out of the picture and a bench measures what Corral itself carries (bench/many_sessions.py,
and the second session of bench/run.py).

It takes llama-server's command line (``--host``, ``--port``, ``--api-key-file``), answers
only requests carrying that key (like llama-server), serves ``/health`` (200), ``/tools``
(none) and ``POST /v1/chat/completions`` as a stream of ``max_tokens`` tokens (default
200) at ``RATE_TOKENS_PER_SECOND`` (environment, default 50) tokens a second, each sent
on its own schedule (token ``i`` at start + i / rate, not "sleep after each"), so a slow
reader never slows the writer down. Every token's text is ``"<i>@<wall-clock ms>␠"``:
its index, for checking order and loss, and the moment it was written, for measuring the
delay to whoever receives it on the same machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import ThreadingHTTPServer

from _setup import ROOT  # bench/ is the script's own directory

sys.path.insert(0, str(ROOT))
from tests.stand_in import StandInHandler, api_key_of, chunk  # noqa: E402  (the tests' stand-in shares it)

RATE = float(os.environ.get("RATE_TOKENS_PER_SECOND", "50"))


class Handler(StandInHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self._refused():
            return
        self._json(200, {"status": "ok"} if self.path == "/health" else [] if self.path == "/tools" else {})

    def do_POST(self):
        if self._refused():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        if not self.path.startswith("/v1/chat/completions"):
            self._json(404, {"error": {"code": 404, "message": "Not Found"}})
            return
        tokens = int(body.get("max_tokens") or 200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        start = time.monotonic()
        try:
            for i in range(tokens):
                wait = start + i / RATE - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._event(chunk({"content": f"{i}@{time.time() * 1000:.1f} "}))
            self._event(chunk({}, "length"))
            elapsed = max(time.monotonic() - start, 1e-6)
            self._event({"choices": [],
                         "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": tokens + 10},
                         "timings": {"prompt_n": 10, "cache_n": 0, "predicted_n": tokens,
                                     "predicted_per_second": tokens / elapsed}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    Handler.api_key = api_key_of(argv)
    print(f"rate stand-in listening on {host}:{port}, {RATE} tokens/s", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
