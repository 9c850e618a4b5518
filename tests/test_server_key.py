"""The permission gate cannot be walked around through llama-server itself.

Every session's llama-server is started with a random key of its own (``--api-key-file``)
and answers 401 to anyone without it — another local process, or a web page on another
origin posting ``text/plain`` with ``mode: "no-cors"``. Corral sends the key on every request;
the key never appears on a command line, in the server's log, in a page or in the admin.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from django.db import connection
from django.test import Client

from machines_app.llama_server import Endpoint, ServerSpec, build_argv
from sessions_app import actions
from sessions_app.models import TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]

SHELL = {"tool": "exec_shell_command", "params": {"command": "id"}}


def idle_session(machine, user, tmp_path):
    session = actions.do_create_session(
        user, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 2048}, sampling={"temperature": 0, "max_tokens": 8}, permission_mode="manual",
    )
    wait_for(lambda: type(session).objects.get(pk=session.pk).status == "idle", 120, what="idle")
    return session


def test_the_key_goes_in_a_file_never_on_the_command_line():
    argv = build_argv(ServerSpec(binary="llama-server", model_path="/m.gguf", port=1, params={},
                                 api_key_file="/data/logs/session-1.key"))
    assert argv[argv.index("--api-key-file") + 1] == "/data/logs/session-1.key"
    assert "--api-key" not in argv


def test_a_real_server_answers_only_corral(stack, local_machine, alice, tmp_path):
    session = idle_session(local_machine, alice, tmp_path)
    record = ServerRecord.objects.get(session=session)
    key = record.api_key
    assert len(key) >= 40
    base = f"http://127.0.0.1:{record.port}"

    # Anyone else: refused, whatever the endpoint and whatever the content type.
    assert httpx.post(f"{base}/tools", json=SHELL).status_code == 401
    assert httpx.post(f"{base}/tools", content=b'{"tool":"exec_shell_command","params":{"command":"id"}}',
                      headers={"Content-Type": "text/plain"}).status_code == 401
    assert httpx.post(f"{base}/tools", json=SHELL, headers={"Authorization": "Bearer wrong"}).status_code == 401
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 401
    assert httpx.get(f"{base}/tools").status_code == 401
    assert httpx.get(f"{base}/props").status_code == 401

    # The holder of the key gets in (so the 401s above are the key's doing).
    assert httpx.get(f"{base}/props", headers={"Authorization": f"Bearer {key}"}).status_code == 200

    # Corral itself sent the key: the built-in tools were listed and a message is answered.
    catalogue = TranscriptEvent.objects.filter(session=session, kind="catalogue").last().payload["tools"]
    assert "exec_shell_command" in {t["name"] for t in catalogue}
    actions.do_send_message(type(session).objects.get(pk=session.pk), alice, "Say hi.")
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 120, what="a reply")
    assert not TranscriptEvent.objects.filter(session=session, kind="error").exists()
    assert TranscriptEvent.objects.filter(session=session, kind="assistant_text").exists()

    # The key is nowhere to be read: not in ps, not in the log, not left on disk, not in pages.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert key not in ps
    assert key.encode() not in Path(f"/proc/{record.pid}/cmdline").read_bytes()
    assert key not in Path(record.log_path).read_text(errors="replace")
    assert not list(Path(record.log_path).parent.glob("*.key")), "the key file outlived the start"
    owner = Client()
    owner.force_login(alice)
    assert key not in owner.get(f"/sessions/{session.pk}/").content.decode()
    admin = Client()
    admin.force_login(type(alice).objects.create_superuser("root", password="root-password-1"))
    assert key not in admin.get(f"/admin/sessions_app/serverrecord/{record.pk}/change/").content.decode()
    assert key not in repr(Endpoint(base, key))  # nor in a traceback's locals


def test_a_page_on_another_origin_cannot_run_a_tool(stack, page, local_machine, alice, tmp_path):
    """The attack this guards against: any page the user opens posts text/plain, no-cors, to the
    session's server. It must not run the command."""
    created = []

    def create() -> None:  # off the thread where Playwright runs its event loop
        created.append(idle_session(local_machine, alice, tmp_path))
        connection.close()

    worker = threading.Thread(target=create)
    worker.start()
    worker.join()
    session = created[0]
    record = ServerRecord.objects.get(session=session)
    marker = tmp_path / "pwned"
    command = f"touch {marker}"
    attack = f"""<!doctype html><title>waiting</title><script>
      fetch("http://127.0.0.1:{record.port}/tools", {{
        method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
        body: JSON.stringify({{tool: "exec_shell_command", params: {{command: {command!r}}}}}),
      }}).then(() => document.title = "sent", (e) => document.title = "failed: " + e);
    </script>""".encode()

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(attack)

        def log_message(self, *args):
            pass

    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
        page.wait_for_function("document.title !== 'waiting'", timeout=20_000)
        assert page.title() == "sent"  # the request reached the server (an opaque answer)…
        # …and the server refused it: nothing ran.
        assert not marker.exists()
        # Control: the same command with the key does run, so the check above can fail.
        answer = httpx.post(f"http://127.0.0.1:{record.port}/tools",
                            json={"tool": "exec_shell_command", "params": {"command": command}},
                            headers={"Authorization": f"Bearer {record.api_key}", "x-tool-cwd": str(tmp_path)})
        assert answer.status_code == 200 and marker.exists()
    finally:
        evil.shutdown()
