"""Images through the real llama-server with its vision projector (docs/behaviour.md §16).

SmolLM2 135M with a tiny projector written for it (tests/tiny_mmproj.py) in its own
directory, on the real stack: discovery pairs them, the server is started with
``--mmproj``, a message with two images is answered, and the next request reuses the
whole first exchange from the prompt cache — the image parts were sent byte for byte.
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import pytest
from django.test import Client
from PIL import Image

from sessions_app import actions, images
from sessions_app.images import Upload
from sessions_app.models import AgentSession, StoredImage, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def image_bytes(kind: str, colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buffer, kind)
    return buffer.getvalue()


def turns_ended(session: AgentSession) -> int:
    return TranscriptEvent.objects.filter(session=session, kind="turn_end").count()


def test_the_real_server_reads_images_and_keeps_them_in_its_prompt_cache(stack, smol_with_projector, alice,
                                                                         tmp_path, settings):
    # This process stores the images as another Corral host would: with a data directory
    # of its own, unlike the stack's worker, which reads them from the shared database.
    settings.DATA_DIR = tmp_path / "another-host"
    model = smol_with_projector.model_files.get()
    assert model.projector_key == "smol/mmproj-smol-tiny.gguf"
    session = actions.do_create_session(
        alice, machine=smol_with_projector, model_key=model.key, working_dir=str(tmp_path), server_params={},
        sampling={"max_tokens": 8, "seed": 7, "temperature": 0.0}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="llama-server ready")
    record = ServerRecord.objects.get(session=session)
    argv = Path(f"/proc/{record.pid}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--mmproj") + 1] == str(tmp_path / "models" / "smol" / "mmproj-smol-tiny.gguf")

    actions.do_send_message(session, alice, "What colours are these?",
                            [Upload("red.png", image_bytes("PNG", (220, 20, 20))),
                             Upload("green.jpg", image_bytes("JPEG", (20, 200, 20)))])
    wait_for(lambda: turns_ended(session) == 1, 120, what="the first reply")
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "Are you sure?")
    wait_for(lambda: turns_ended(session) == 2, 120, what="the second reply")

    events = TranscriptEvent.objects.filter(session=session).order_by("seq")
    assert not [e.payload for e in events if e.kind == "error"]
    assert [e.payload["reason"] for e in events if e.kind == "turn_end"] == ["done", "done"]
    first, second = [e.payload for e in events if e.kind == "usage"]
    # The first request held its text and exactly the images' tokens (4 a picture: the
    # tiny encoder's 2×2 patches), as the server itself counts them: not dropped, not
    # said in words ...
    server = f"http://127.0.0.1:{record.port}"
    auth = {"Authorization": f"Bearer {record.api_key}"}
    prompt = httpx.post(f"{server}/apply-template", headers=auth, timeout=30, json={
        "messages": [{"role": "user", "content": "What colours are these?"}]}).json()["prompt"]
    text_only = len(httpx.post(f"{server}/tokenize", headers=auth, timeout=30,
                               json={"content": prompt}).json()["tokens"])
    assert first["prompt_tokens"] == text_only + 2 * 4
    # ... and the second request found all of it in the prompt cache: sent byte for byte.
    assert second["cached_tokens"] >= first["prompt_tokens"]
    assert not (tmp_path / "another-host").exists() and not (stack.data_dir / "images").exists()

    # An image whose bytes are gone is not replaced silently: the request carries a note in
    # its place and the session says which image the model did not see.
    green = images.check_image(Upload("green.jpg", image_bytes("JPEG", (20, 200, 20))))
    StoredImage.objects.filter(pk=green["sha256"]).delete()
    before = TranscriptEvent.objects.filter(session=session).order_by("seq").last().seq
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "And now?")
    wait_for(lambda: turns_ended(session) == 3, 120, what="the third reply")
    third = list(TranscriptEvent.objects.filter(session=session, seq__gt=before).order_by("seq"))
    assert [e.payload["reason"] for e in third if e.kind == "turn_end"] == ["done"]
    notices = [e.payload["message"] for e in third if e.kind == "notice"]  # max_tokens 8 adds "stopped at …"
    assert notices.count(images.missing_sentence(green)) == 1, notices
    assert f"SHA-256 {green['sha256'][:12]}" in images.missing_sentence(green)
    page = Client()
    page.force_login(alice)
    assert images.missing_sentence(green) in page.get(f"/sessions/{session.pk}/").content.decode()
