"""Images end to end (docs/behaviour.md §16): the real stack (daphne, websockets, a Celery
worker), two real browsers, and the stand-in llama-server, which records every request.

No vision model fits in this repository's test kit, so the model side is the stand-in:
it takes llama-server's command line (so the ``--mmproj`` Corral gives it is read from
the process itself) and records the chat requests, whose shape is what is proven here.
Alice picks one image and pastes another; Bob, watching, sees both thumbnails arrive
live, fetched through the session; the request carries both as ``image_url`` parts of
the exact bytes; the next request (with a dropped image) repeats that message byte for
byte.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
from pathlib import Path

import httpx
import pytest
from django.db import connection
from gguf import GGUFWriter
from PIL import Image
from playwright.sync_api import expect

from machines_app import catalog
from machines_app.models import Machine
from sessions_app.images import as_png
from sessions_app.models import StoredImage, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import fake_server, wait_for
from .helpers import log_in, open_menu

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def image_bytes(kind: str, colour: tuple[int, int, int], size=(24, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, kind)
    return buffer.getvalue()


def data_uri(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def vision_machine(db, tmp_path):
    """The real SmolLM2 with a vision projector beside it, and the real Gemma in a directory
    of its own without one; the stand-in serves."""
    from machines_app.demo_models import packaged_model_paths

    paths = packaged_model_paths()
    models = tmp_path / "vision-models"
    for directory, source in (("smol", paths["smollm2"]), ("gemma", paths["gemma3"])):
        (models / directory).mkdir(parents=True)
        (models / directory / source.name).symlink_to(source)
    writer = GGUFWriter(str(models / "smol" / "mmproj-smol-f16.gguf"), "clip")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    machine = Machine.objects.create(name="vision", models_dir=str(models),
                                     llama_server_path=fake_server(tmp_path), workspace_roots="")
    catalog.refresh_models(machine)
    return machine


def in_thread(call):
    """Run an action off the thread where Playwright runs its event loop."""
    out = []

    def run() -> None:
        out.append(call())
        connection.close()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out[0]


PASTE = """([selector, kind, name, b64, eventName]) => {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type: kind}));
  const target = document.querySelector(selector);
  const event = eventName === "paste"
    ? new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true})
    : new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true});
  target.dispatchEvent(event);
  return event.defaultPrevented;
}"""


def test_images_reach_the_model_and_every_watcher(stack, page, vision_machine, alice, bob, tmp_path):
    from sessions_app import actions

    key = vision_machine.model_files.get(architecture="llama").key
    assert vision_machine.model_files.get(key=key).projector_key == "smol/mmproj-smol-f16.gguf"
    session = in_thread(lambda: actions.do_create_session(
        alice, machine=vision_machine, model_key=key, working_dir=str(tmp_path), server_params={}, sampling={},
        permission_mode="manual", title="Pictures"))
    in_thread(lambda: actions.do_set_visibility(session, alice, "team_watch"))

    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")
    expect(page.locator(".attach-limits")).to_contain_text("Up to 8 images (PNG, JPEG, WebP or GIF), 10 MB each.")

    # The server was started with the projector beside the model.
    record = ServerRecord.objects.get(session=session)
    argv = Path(f"/proc/{record.pid}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--mmproj") + 1] == str(Path(vision_machine.models_dir) / "smol" / "mmproj-smol-f16.gguf")

    bobs = page.context.browser.new_context().new_page()
    log_in(bobs, stack, "bob", "bob-password-1")
    bobs.goto(f"{stack.base_url}/sessions/{session.pk}/")
    bobs.wait_for_selector("#conn-state[data-state=live]")
    assert bobs.locator("#composer").count() == 0  # watching only

    # Over the size limit: said at once, and refused by the server in the same words if
    # sent anyway; the text stays in the box.
    huge = image_bytes("PNG", (1, 2, 3)) + b"\0" * 10_500_000
    page.set_input_files("#id_images", files=[{"name": "huge.png", "mimeType": "image/png", "buffer": huge}])
    too_big = f"huge.png is {len(huge) / 1e6:.1f} MB; an image can be at most 10 MB."
    expect(page.locator("#composer-error")).to_have_text(too_big)
    page.fill("#id_text", "Look at this")
    page.press("#id_text", "Enter")
    expect(page.locator("#attached li")).to_have_count(0)  # the composer came back from the server
    expect(page.locator("#composer-error")).to_have_text(too_big)
    expect(page.locator("#id_text")).to_have_value("Look at this")
    assert not TranscriptEvent.objects.filter(session=session, kind="message_taken").exists()
    page.fill("#id_text", "")

    red, green = image_bytes("PNG", (220, 20, 20)), image_bytes("GIF", (20, 200, 20))
    page.set_input_files("#id_images", files=[{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    pasted = page.evaluate(PASTE, ["#id_text", "image/gif", "green.gif", base64.b64encode(green).decode(), "paste"])
    assert pasted  # taken as an image, not pasted as text
    expect(page.locator("#attached li")).to_have_count(2)
    expect(page.locator("#attached li").nth(1)).to_contain_text("green.gif")
    page.fill("#id_text", "Which colours?")
    page.press("#id_text", "Enter")

    # Bob sees both thumbnails arrive live, loaded through the session's image URL.
    message = bobs.locator(".msg.user", has_text="Which colours?")
    expect(message.locator("img.thumb")).to_have_count(2)
    bobs.wait_for_function("""() => {
      const thumbs = document.querySelectorAll('.msg.user img.thumb');
      return thumbs.length === 2 && [...thumbs].every(t => t.complete && t.naturalWidth === 24);
    }""")
    expect(page.locator(".msg.user img.thumb")).to_have_count(2)
    page.locator(".msg.assistant .md", has_text="done.").wait_for()
    # Each stored once under its hash, in the database every host reads, and the refused
    # huge file not at all.
    stored = dict(StoredImage.objects.values_list("sha256", "media_type"))
    assert stored[hashlib.sha256(red).hexdigest()] == "image/png"
    assert stored[hashlib.sha256(green).hexdigest()] == "image/gif"
    assert hashlib.sha256(huge).hexdigest() not in stored

    # The request: text, then the two images as data URIs of exactly the bytes sent.
    def requests() -> list[dict]:
        response = httpx.get(f"http://127.0.0.1:{record.port}/requests",
                             headers={"Authorization": f"Bearer {record.api_key}"})
        return response.json()

    first = requests()[-1]["messages"]
    assert first[-1] == {"role": "user", "content": [
        {"type": "text", "text": "Which colours?"},
        {"type": "image_url", "image_url": {"url": data_uri("image/png", red)}},
        {"type": "image_url", "image_url": {"url": data_uri("image/gif", green)}},
    ]}

    # A dropped image goes the same way; the earlier message is sent again byte for byte.
    blue = image_bytes("WEBP", (20, 20, 220))
    dropped = page.evaluate(PASTE, ["#id_text", "image/webp", "blue.webp", base64.b64encode(blue).decode(), "drop"])
    assert dropped
    expect(page.locator("#attached li")).to_have_count(1)
    page.fill("#id_text", "And this one?")
    page.press("#id_text", "Enter")
    expect(bobs.locator(".msg.user", has_text="And this one?").locator("img.thumb")).to_have_count(1)
    wait_for(lambda: len(requests()) >= 2, 30, what="the second request")
    second = requests()[-1]["messages"]
    assert json.dumps(second[: len(first)]) == json.dumps(first)
    # llama-server cannot read WebP: the request carries its pixels as PNG (images.as_png).
    assert second[-1]["content"][-1] == {"type": "image_url", "image_url": {"url": data_uri("image/png", as_png(blue))}}
    taken = TranscriptEvent.objects.filter(session=session, kind="message_taken").order_by("seq")
    assert [len(e.payload["images"]) for e in taken] == [2, 1]
    bobs.screenshot(path=str(stack.data_dir / "browser-images-bob.png"))


def test_a_model_switch_offers_or_withdraws_attachments_on_every_open_page(stack, page, vision_machine, alice, bob,
                                                                          tmp_path):
    from sessions_app import actions

    smol = vision_machine.model_files.get(architecture="llama")
    gemma = vision_machine.model_files.exclude(pk=smol.pk).get()
    assert smol.projector_key and not gemma.projector_key
    session = in_thread(lambda: actions.do_create_session(
        alice, machine=vision_machine, model_key=smol.key, working_dir=str(tmp_path), server_params={},
        sampling={}, permission_mode="manual", title="Switching"))
    in_thread(lambda: actions.do_set_visibility(session, alice, "team_act"))

    log_in(page, stack, "alice", "alice-password-1")
    page.goto(f"{stack.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#status-badge[data-status=idle]")
    page.wait_for_selector("#conn-state[data-state=live]")
    bobs = page.context.browser.new_context().new_page()
    log_in(bobs, stack, "bob", "bob-password-1")
    bobs.goto(f"{stack.base_url}/sessions/{session.pk}/")
    bobs.wait_for_selector("#conn-state[data-state=live]")
    for someone in (page, bobs):
        expect(someone.locator("#composer #id_images")).to_have_count(1)

    page.on("dialog", lambda dialog: dialog.accept())
    open_menu(page)
    page.click("details.settings > summary")
    page.select_option("#switch-model", gemma.key)
    page.click(".model-switch button[type=submit]")
    for someone in (page, bobs):
        expect(someone.locator("#composer #attach")).to_have_count(1)
        expect(someone.locator("#composer #id_images")).to_have_count(0)
    page.wait_for_selector("#status-badge[data-status=idle]")

    page.select_option("#switch-model", smol.key)
    page.click(".model-switch button[type=submit]")
    for someone in (page, bobs):
        expect(someone.locator("#composer #id_images")).to_have_count(1)
