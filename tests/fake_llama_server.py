"""A stand-in for llama-server for what the real one cannot do on demand.

Used only where the real server cannot produce the behaviour at a chosen moment:
``/health`` answering 503 for a while (docs/behaviour.md C09: a multi-GB load), and ignoring SIGTERM
(docs/behaviour.md C21: seen to hang in "cleaning up before exit…"). It takes llama-server's command
line, listens where told, and serves /health, /tools and a scripted chat completion.

It also stands in for the model side when a test needs the model to call a tool (a
135M model will not on demand): FAKE_SCRIPT names a JSON file holding a list of replies,
one per chat request — ``{"text": "...", "delay": 0.05}`` streams the text word by word
(``"delays": [0, 3]`` instead waits that long after each word, ``delay`` after the rest),
``{"tool_calls": [{"name": "read_file", "arguments": "{...}"}]}`` asks for calls,
``{"error": {...}, "status": 400}`` refuses the request with that body. When the
list is used up it answers "done.". Its /tools offers read_file and exec_shell_command
(and write_file and edit_file with FAKE_FILE_TOOLS=1), run for real in the x-tool-cwd directory.

Like llama-server started with ``--api-key-file``, it answers 401 to every request but
``/health`` that does not carry ``Authorization: Bearer <that key>``, so every test that
uses it also proves Corral sends the server's key.

It keeps what it was asked: ``GET /requests`` gives the chat request bodies, ``GET /asked``
every request line but those two reads (``"GET /props"``, ``"POST /slots/0?action=save"``, …).

Behaviour from the environment of the wrapper script the tests write:
FAKE_LOADING_SECONDS (503 until then), FAKE_IGNORE_TERM=1, FAKE_SCRIPT, FAKE_BUILD_INFO
(the ``build_info`` its /props reports, as llama-server does; unsaid without it, so its
servers get no slot key and save nothing), FAKE_OPENS_THINKING=1 (its ``/apply-template``
prompt ends with ``<think>``, as an R1-style template's does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from stand_in import StandInHandler, api_key_of, chunk  # tests/, the script's own directory

START = time.monotonic()
LOADING = float(os.environ.get("FAKE_LOADING_SECONDS", "0"))
SCRIPT = json.load(open(os.environ["FAKE_SCRIPT"])) if os.environ.get("FAKE_SCRIPT") else []
LOCK = threading.Lock()
REQUESTS: list[dict] = []
ASKED: list[str] = []  # "<method> <path>" of every request but the tests' own reads
BUILD_INFO = os.environ.get("FAKE_BUILD_INFO", "")

TOOLS = [
    {"display_name": "Read file", "tool": "read_file", "type": "server", "permissions": {"write": False},
     "definition": {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}},
    {"display_name": "Shell", "tool": "exec_shell_command", "type": "server", "permissions": {"write": True},
     "definition": {"type": "function", "function": {"name": "exec_shell_command", "description": "Run a command",
                    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}},
]

if os.environ.get("FAKE_FILE_TOOLS") == "1":  # llama-server's own two file tools, by their definitions
    TOOLS += [
        {"display_name": "Write file", "tool": "write_file", "type": "server", "permissions": {"write": True},
         "definition": {"type": "function", "function": {"name": "write_file", "description": "Write a file",
                        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                                        "content": {"type": "string"}}}}}},
        {"display_name": "Edit file", "tool": "edit_file", "type": "server", "permissions": {"write": True},
         "definition": {"type": "function", "function": {"name": "edit_file", "description": "Edit a file",
                        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                                        "edits": {"type": "array"}}}}}},
    ]


def run_tool(name: str, params: dict, cwd: str) -> dict:
    if name == "write_file":
        with open(os.path.join(cwd, params["path"]), "w") as f:
            f.write(params["content"])
        return {"result": "file written successfully", "path": params["path"]}
    if name == "edit_file":  # exact replacements only (llama-server also matches loosely)
        path = os.path.join(cwd, params["path"])
        with open(path) as f:
            text = f.read()
        for edit in params["edits"]:
            if text.count(edit["old_text"]) != 1:
                return {"error": f"could not find edits[].old_text in {params['path']}"}
            text = text.replace(edit["old_text"], edit["new_text"], 1)
        with open(path, "w") as f:
            f.write(text)
        return {"result": "file edited successfully", "path": params["path"]}
    if name == "read_file":
        with open(os.path.join(cwd, params["path"])) as f:
            return {"plain_text_response": f.read()}
    if name == "exec_shell_command":
        done = subprocess.run(params["command"], shell=True, cwd=cwd, capture_output=True, text=True)
        return {"plain_text_response": done.stdout + f"\n[exit code: {done.returncode}]"}
    return {"error": {"message": "File Not Found", "code": 404}}


class Handler(StandInHandler):
    def _refused(self) -> bool:
        if self.path not in ("/requests", "/asked"):
            with LOCK:
                ASKED.append(f"{self.command} {self.path}")
        return super()._refused()

    def do_GET(self):
        if self._refused():
            return
        if self.path == "/health":
            if time.monotonic() - START < LOADING:
                self._json(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            else:
                self._json(200, {"status": "ok"})
        elif self.path == "/tools":
            self._json(200, TOOLS)
        elif self.path == "/requests":
            self._json(200, REQUESTS)
        elif self.path == "/asked":
            self._json(200, ASKED)
        elif self.path == "/props":  # as llama-server reports its context size (and its build, if told)
            self._json(200, {"default_generation_settings": {"n_ctx": N_CTX}, "total_slots": 1,
                             **({"build_info": BUILD_INFO} if BUILD_INFO else {})})
        else:
            self._json(200, {})

    def do_POST(self):
        if self._refused():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        if self.path == "/tools":
            self._json(200, run_tool(body["tool"], body.get("params", {}), self.headers.get("x-tool-cwd", ".")))
            return
        if self.path == "/apply-template":
            # Like llama-server: the prompt its template renders (ChatML here); with
            # FAKE_OPENS_THINKING=1 it ends inside an opened <think>, as R1-style templates do.
            prompt = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n"
                             for m in body.get("messages", []))
            opened = "<think>\n" if os.environ.get("FAKE_OPENS_THINKING") == "1" else ""
            self._json(200, {"prompt": f"{prompt}<|im_start|>assistant\n{opened}"})
            return
        if self.path.startswith("/slots/"):
            # Like llama-server: a save of a slot it never filled writes nothing; there is
            # nothing it could restore. Never a scripted reply.
            if "action=save" in self.path:
                self._json(200, {"id_slot": 0, "filename": body.get("filename"), "n_saved": 0, "n_written": 0})
            else:
                refused = {"code": 400, "message": "Unable to restore slot", "type": "invalid_request_error"}
                self._json(400, {"error": refused})
            return
        with LOCK:
            REQUESTS.append(body)
            reply = SCRIPT.pop(0) if SCRIPT else {"text": "done."}
            if os.environ.get("FAKE_SCRIPT"):  # a restarted stand-in goes on where this one stopped
                with open(os.environ["FAKE_SCRIPT"], "w") as f:
                    json.dump(SCRIPT, f)
        if "error" in reply:  # a refusal, as llama-server words it: {"error": {...}, "status": 400}
            self._json(reply.get("status", 400), {"error": reply["error"]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            delays = reply.get("delays", [])
            for i, word in enumerate(reply.get("text", "").split(" ")) if reply.get("text") else []:
                self._event(chunk({"content": (" " if i else "") + word}))
                time.sleep(delays[i] if i < len(delays) else reply.get("delay", 0.0))
            for i, call in enumerate(reply.get("tool_calls", [])):
                self._event(chunk({"tool_calls": [{"index": i, "id": f"call_{len(REQUESTS)}_{i}", "type": "function",
                                                   "function": {"name": call["name"],
                                                                "arguments": call.get("arguments", "")}}]}))
            self._event(chunk({}, "tool_calls" if reply.get("tool_calls") else "stop"))
            self._event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                         "timings": {"prompt_n": 10, "cache_n": 0, "predicted_n": 3, "predicted_per_second": 30.0}})
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


N_CTX = 4096  # llama-server's -c, as /props reports it


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    if "-c" in argv:
        global N_CTX
        N_CTX = int(argv[argv.index("-c") + 1])
    Handler.api_key = api_key_of(argv)
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        def on_term(*_):
            print("cleaning up before exit...", flush=True)

        signal.signal(signal.SIGTERM, on_term)
    print(f"fake llama-server listening on {host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
