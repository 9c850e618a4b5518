"""Smaller holes (docs/security.md): a chat template file that is a
secret by where it lies, or whose lines a failed start would show; images bounded in
pixels; secrets written back into admin forms; the websocket Origin's scheme."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.testing import WebsocketCommunicator
from django.test import Client
from PIL import Image, ImageFile

from machines_app.models import Machine, ModelFile
from machines_app.template_files import LEFT_OUT, secret_location, without_template_lines
from project.websocket_security import SameOriginValidator
from sessions_app import images
from sessions_app.models import AgentSession, McpServer, TranscriptEvent
from sessions_app.servers.start import start_server

from .conftest import model_key
from .sshd import keygen

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(django_user_model):
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="root-password-1"))
    return client


# --- (a) the chat template file ----------------------------------------------------------


def set_template(client, model, path):
    return client.post(f"/admin/machines_app/modelfile/{model.pk}/change/",
                       {"system_prompt": "", "chat_template": "", "chat_template_file": str(path)})


def test_a_template_file_that_is_a_secret_by_where_it_lies_is_refused(local_machine, admin, tmp_path, settings):
    model = ModelFile.objects.get(machine=local_machine, key=model_key(local_machine, "llama"))
    (tmp_path / ".ssh").mkdir()
    secrets_in_tmp = {
        ".ssh/config": "in a .ssh directory", "id_ed25519": "named like a key", "server.pem": "named like a key",
        "tls.key": "named like a key", ".env": "named like a key",
    }
    for name in secrets_in_tmp:
        (tmp_path / name).write_text("{{ messages }}")
    os.symlink("/etc/hostname", tmp_path / "innocent.jinja")  # a link is followed on the machine first
    data_dir = Path(settings.DATA_DIR)
    os.mkfifo(tmp_path / "pipe.jinja")
    (tmp_path / "big.jinja").write_text("x" * (300 * 1024))
    (tmp_path / "dir.jinja").mkdir()
    refusals = {
        "/etc/hostname": "it is under /etc",
        "/proc/self/environ": "it is under /proc",
        "/sys/kernel/hostname": "it is under /sys" if Path("/sys/kernel/hostname").exists() else "under /sys",
        "/dev/null": "it is under /dev",
        "~/.ssh/id_rsa": "in a .ssh directory",
        str(tmp_path / "innocent.jinja"): "(which leads to /etc/hostname) cannot be a chat template: it is under /etc",
        str(data_dir / "secret_key"): "Corral&#x27;s own directory",
        str(tmp_path / "pipe.jinja"): "There is no file",  # a pipe is not a file (reading it would wait for ever)
        str(tmp_path / "big.jinja"): "is larger than 256 KB",
        str(tmp_path / "dir.jinja"): "it is a directory",
        **{str(tmp_path / name): words for name, words in secrets_in_tmp.items()},
    }
    for path, words in refusals.items():
        page = set_template(admin, model, path).content.decode()
        assert words in page, (path, page[page.find("errorlist"):][:400])
        model.refresh_from_db()
        assert model.chat_template_file == ""
    fine = tmp_path / "chatml.jinja"
    fine.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert set_template(admin, model, fine).status_code == 302


def test_the_location_rule_reads_paths_not_files():
    assert secret_location("/etc/ssl/private/x.jinja")
    assert secret_location("/home/ann/.ssh/t.jinja")
    assert secret_location("/srv/keys/id_rsa")
    assert secret_location("/srv/c/data/t.jinja", private_dirs=("/srv/c/data",))
    assert secret_location("/srv/templates/chatml.jinja") is None
    assert secret_location("/etcetera/t.jinja") is None  # whole components only


def test_a_template_that_became_a_secret_is_refused_again_before_a_start(local_machine, alice, tmp_path):
    key = model_key(local_machine, "llama")
    link = tmp_path / "t.jinja"
    os.symlink("/etc/hostname", link)  # set when it was a file, a link to /etc since
    ModelFile.objects.filter(machine=local_machine, key=key).update(chat_template_file=str(link))
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=key,
                                          working_dir=str(tmp_path), status="loading")
    start_server(session.pk)
    error = TranscriptEvent.objects.filter(session=session, kind="error").last().payload["message"]
    assert "cannot be a chat template: it is under /etc" in error
    assert AgentSession.objects.get(pk=session.pk).status == "exited"


def test_log_lines_quoting_the_template_file_are_left_out():
    template = "SECRET-LINE hunter2 topsecret\n{% if %}\n}\n"
    tail = ("main: loading model\n"
            "main: chat template, chat_template: SECRET-LINE hunter2 topsecret, example_format: 'x'\n"
            "E common_chat_templates_init: error: parser: Parser Error: Expected }} (Got })\n"
            "...ER2 TOP hunter2 topsecret\u21b5{% if %}\u21b5}...\n"
            "                                 ^\n"
            "srv  init: failed to parse chat template\n"
            "error: the supplied chat template is not supported: SECRET-LINE hunter2 topsecret\n"
            "{% if %}\n"
            "}\n")
    kept = without_template_lines(tail, template)
    assert "hunter2" not in kept and "{% if %}" not in kept
    assert kept.splitlines() == [
        "main: loading model",
        "main: chat template, chat_template: (the file's text is not shown)",
        "E common_chat_templates_init: error: parser: Parser Error: Expected }} (Got })",
        LEFT_OUT,
        "srv  init: failed to parse chat template",
        "error: the supplied chat template is not supported: (the file's text is not shown)",
    ]
    assert without_template_lines(tail, None) == LEFT_OUT  # unreadable now: nothing can be told apart
    # A window cut anywhere in a line is found by any 12 characters of it in a row.
    assert without_template_lines("near: …ine hunter2 topse…", template) == LEFT_OUT


@pytest.mark.usefixtures("stop_servers_after")
def test_a_failed_start_shows_llama_servers_words_not_the_template_files_lines(local_machine, alice, tmp_path):
    key = model_key(local_machine, "llama")
    template = tmp_path / "broken.jinja"
    secret = "PASSWORD=swordfish-7f3a9c"
    template.write_text(f"{secret}\n{{% for m in messages %}}{{{{ m.content }}\n{{% endif %}}\n")
    ModelFile.objects.filter(machine=local_machine, key=key).update(chat_template_file=str(template))
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=key,
                                          working_dir=str(tmp_path), status="loading",
                                          server_params={"contextSize": 512})
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "exited"
    events = list(TranscriptEvent.objects.filter(session=session))
    shown = json.dumps([e.payload for e in events])
    # llama-server echoes the whole file after "the supplied chat template is not supported:".
    assert "swordfish" not in shown and "{% endif %}" not in shown and "m.content" not in shown
    error = next(e.payload for e in events if e.kind == "error")
    # Its own words about the template stay (its other lines are written by a logging
    # thread, and an early exit sometimes leaves them unwritten).
    assert "error: the supplied chat template is not supported: (the file's text is not shown)" in error["log"]
    assert LEFT_OUT in error["log"]


# --- (b) images bounded in pixels ---------------------------------------------------------


def png(width, height) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


def test_an_image_over_the_pixel_bound_is_refused_before_any_pixel_is_decoded(settings, monkeypatch):
    settings.CORRAL_IMAGE_MAX_PIXELS = 10_000
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.size) or real_load(self))
    with pytest.raises(images.ImageRefused) as refused:
        images.check_image(images.Upload("wide.png", png(101, 100)))
    assert str(refused.value) == "wide.png is 101×100 pixels (10,100 pixels); an image can have at most 10,000 pixels."
    assert loads == []  # refused from the header alone
    images.check_image(images.Upload("square.png", png(100, 100)))
    assert loads == [(100, 100)]  # decoded once


def test_the_default_bound_refuses_a_9000_square_png_that_is_under_the_byte_limit():
    data = png(9000, 9000)
    assert len(data) < images.max_bytes()
    with pytest.raises(images.ImageRefused, match=r"9000×9000 pixels \(81 megapixels\); an image can have at most 16.8"):
        images.check_image(images.Upload("huge.png", data))


def test_the_composer_states_the_pixel_bound():
    assert images.limits_sentence().endswith("Each at most 16.8 megapixels.")


def test_a_webp_is_made_png_once_not_at_every_request(settings, tmp_path, monkeypatch):
    settings.DATA_DIR = tmp_path
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(out, "WEBP")
    upload = images.Upload("a.webp", out.getvalue())
    ref = images.check_image(upload)
    images.store(upload, ref)
    made = []
    real = images.as_png
    monkeypatch.setattr(images, "as_png", lambda data: made.append(1) or real(data))
    first, second = images.data_uri(ref), images.data_uri(ref)
    assert first == second and first.startswith("data:image/png;base64,") and made == [1]


# --- (c) secrets never come back in a form ------------------------------------------------


def test_a_pasted_private_key_is_not_written_back_when_another_field_has_an_error(admin, tmp_path):
    keygen(tmp_path / "k")
    private_key = (tmp_path / "k").read_text()
    body = private_key.strip().splitlines()[1]
    page = admin.post("/admin/machines_app/machine/add/", {
        "name": "gpu1", "transport": "ssh", "host": "bad host", "port": 22, "user": "u", "private_key": private_key,
        "expected_fingerprint": "", "host_key": "", "models_dir": "~/models",
        "llama_server_path": "llama-server", "enabled": "on", "workspace_roots": "~",
    }).content.decode()
    assert "A host is a name or an address" in page
    assert body not in page and "PRIVATE KEY" not in page
    assert "paste it again" in page
    assert not Machine.objects.filter(name="gpu1").exists()


def test_an_mcp_servers_header_values_are_never_shown_and_kept_when_left(admin):
    server = McpServer.objects.create(name="exa", url="https://mcp.example/mcp",
                                      headers={"x-api-key": "sk-live-0123456789abcdef"})
    url = f"/admin/sessions_app/mcpserver/{server.pk}/change/"
    page = admin.get(url).content.decode()
    at = page.find("sk-live")
    assert at < 0, page[at - 600:at + 100]
    assert "sk-live-0123456789abcdef" not in page and "x-api-key" in page and "(stored, not shown)" in page
    # Another field's error: neither the stored value nor a newly typed one comes back.
    page = admin.post(url, {"name": "exa", "url": "not a url", "enabled": "on", "api_key": "",
                            "headers": json.dumps({"x-api-key": "(stored, not shown)", "x-org": "org-secret-42"})})
    page = page.content.decode()
    assert "Enter a valid URL" in page
    assert "sk-live-0123456789abcdef" not in page and "org-secret-42" not in page
    # Left as shown: kept. A new value: replaces. A new name without a value: refused in words.
    response = admin.post(url, {"name": "exa", "url": "https://mcp.example/mcp", "enabled": "on", "api_key": "",
                                "headers": json.dumps({"x-api-key": "(stored, not shown)", "x-org": "org-1"})})
    assert response.status_code == 302
    server.refresh_from_db()
    assert server.headers == {"x-api-key": "sk-live-0123456789abcdef", "x-org": "org-1"}
    page = admin.post(url, {"name": "exa", "url": "https://mcp.example/mcp", "enabled": "on", "api_key": "",
                            "headers": json.dumps({"x-new": "(stored, not shown)"})}).content.decode()
    assert "Type the value of the header x-new" in page


# --- (d) the websocket Origin's scheme ----------------------------------------------------


class Accepting(AsyncWebsocketConsumer):
    async def connect(self):
        await self.accept()


async def opening(origin: str, host: str = "corral.example:8000", scheme: str = "ws") -> bool:
    comm = WebsocketCommunicator(SameOriginValidator(Accepting.as_asgi()), "/ws/",
                                 headers=[(b"origin", origin.encode()), (b"host", host.encode())])
    comm.scope["scheme"] = scheme
    connected, _ = await comm.connect(timeout=5)
    await comm.disconnect()
    return connected


def test_the_origin_must_have_the_pages_scheme_host_and_port(settings):
    settings.CORRAL_HTTPS = False
    opens = async_to_sync(opening)
    assert opens("http://corral.example:8000")
    assert not opens("https://corral.example:8000")  # same host and port, another scheme
    assert not opens("http://corral.example:8001")
    assert not opens("http://other.example:8000")
    assert not opens("null") and not opens("")
    assert opens("http://corral.example", host="corral.example")
    assert opens("http://corral.example:80", host="corral.example")  # the default port, written out
    assert not opens("https://corral.example", host="corral.example")
    assert opens("https://corral.example", host="corral.example", scheme="wss")
    assert not opens("http://corral.example", host="corral.example", scheme="wss")


def test_behind_the_https_proxy_only_an_https_origin_opens_a_socket(settings):
    settings.CORRAL_HTTPS = True  # the proxy speaks TLS; daphne sees a plain ws socket
    opens = async_to_sync(opening)
    assert opens("https://corral.example", host="corral.example")
    assert not opens("http://corral.example", host="corral.example")
    assert not opens("http://corral.example:443", host="corral.example")
