"""Text files (the server side) attach to any model as text, with a size
limit and a refusal in words; an image for a model that cannot take images is refused in
words. The browser side (paste, drop) is tests/test_search_versions_browser.py."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, override_settings

from sessions_app import text_files
from sessions_app.events import load_events
from sessions_app.images import Upload
from sessions_app.models import AgentSession


def test_a_file_becomes_a_fenced_block_named_and_fenced_longer_than_its_backticks():
    text = text_files.attach("Why does this fail?", [Upload("app.py", b"print('hi')\r\n"),
                                                     Upload("notes.md", b"```\nnested\n```\n")])
    assert text == ("Why does this fail?\n\napp.py:\n```python\nprint('hi')\n```\n\n"
                    "notes.md:\n````markdown\n```\nnested\n```\n````")


def test_a_log_keeps_its_lines_and_its_colour_codes_become_replacement_characters():
    text = text_files.attach("", [Upload("build.log", "\ufeffok\x1b[31m red\x07\tdone\n".encode())])
    assert text == "build.log:\n```text\nok\ufffd[31m red\ufffd\tdone\n```"


@override_settings(CORRAL_TEXT_FILE_MAX_BYTES=1000)
@pytest.mark.parametrize(("upload", "said"), [
    (Upload("big.log", b"", 2_300_000), "big.log is 2.3 MB; a text file can be at most 1 KB."),
    (Upload("photo.bin", b"\x89PNG\r\n\x1a\n\x00\x00"), "photo.bin is not a text file"),
    (Upload("latin1.txt", "café".encode("latin-1")), "latin1.txt is not a text file"),
])
def test_a_file_too_large_or_not_text_is_refused_naming_it(upload, said):
    with pytest.raises(text_files.TextFileRefused, match=said.replace(".", r"\.")):
        text_files.attach("x", [upload])


@pytest.mark.django_db
@override_settings(CORRAL_TEXT_FILE_MAX_BYTES=1000)
def test_the_composer_sends_text_files_to_a_model_without_vision_and_says_why_when_it_cannot(alice, tmp_path,
                                                                                               monkeypatch):
    from machines_app.models import Machine
    from sessions_app import dispatch

    machine = Machine.objects.create(name="m", models_dir=str(tmp_path), llama_server_path="/bin/true")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status=AgentSession.Status.IDLE)
    monkeypatch.setattr(dispatch, "enqueue", lambda task, *args: True)  # no worker: the message stays taken
    client = Client()
    client.force_login(alice)
    url = f"/sessions/{session.pk}/send/"
    answer = client.post(url, {"text": "", "files": SimpleUploadedFile("main.rs", b"fn main() {}\n")})
    assert answer.status_code == 200 and 'id="composer-error" hidden' in answer.content.decode()
    said = [e.payload["text"] for e in load_events(session.pk) if e.kind in ("message_taken", "message_queued")]
    assert said == ["main.rs:\n```rust\nfn main() {}\n```"]
    refused = client.post(url, {"text": "look", "files": SimpleUploadedFile("huge.txt", b"x" * 5000)}).content.decode()
    assert "huge.txt is 5 KB; a text file can be at most 1 KB." in refused
    image = client.post(url, {"text": "look", "images": SimpleUploadedFile("a.png", b"\x89PNG")}).content.decode()
    assert "cannot take images" in image
    page = client.get(f"/sessions/{session.pk}/").content.decode()
    assert 'id="id_files"' in page and 'id="id_images"' not in page and "This model cannot take images." in page
