"""Attacks on attached images (docs/behaviour.md §16): files whose header is sound but whose
pixels are missing, and headers that promise a decompression bomb, in every format Corral
takes. A refused file is named in a sentence; one the real llama-server cannot decode
never reaches a transcript, where it would go with, and fail, every later request."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest
from PIL import Image

from sessions_app import actions, images
from sessions_app.images import ImageRefused, Upload
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import wait_for

CUT = "is damaged or cut short: its pixels cannot be read."
BOMB = "has too many pixels to be taken as an image."


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, rows: int, *, depth: int = 8, colour: int = 2) -> bytes:
    """A PNG whose header says width × height and whose (well-formed, properly ended) zlib
    stream holds only ``rows`` rows: every CRC right, so Pillow's verify() passes it."""
    row = 1 + -(-(width * depth * {0: 1, 2: 3}[colour]) // 8)
    raw = b"".join(bytes([0]) + bytes((x * 7 + y) % 256 for x in range(row - 1)) for y in range(rows))
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def saved(mode: str, kind: str = "PNG", size=(33, 17), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, kind, **options)
    return buffer.getvalue()


def jpeg_scan() -> bytes:
    """A JPEG with a long scan (a gradient), so a cut lands in the pixel data, past the header."""
    buffer = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").save(buffer, "JPEG")
    return buffer.getvalue()


def with_size(data: bytes, kind: str, width: int, height: int) -> bytes:
    """``data`` with the dimensions in its header changed, the pixel data left as it was."""
    data = bytearray(data)
    if kind == "GIF":
        data[6:10] = struct.pack("<HH", width, height)  # the logical screen …
        at = data.index(b"\x2c")
        data[at + 5:at + 9] = struct.pack("<HH", width, height)  # … and the frame
    else:  # JPEG: the SOF0 marker's height, then width
        at = data.index(b"\xff\xc0")
        data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("data", [
    png(64, 64, 2), png(64, 64, 63), png(4000, 4000, 2, depth=1, colour=0), png(33, 17, 1, depth=16, colour=0),
    with_size(saved("P", "GIF", (4, 4)), "GIF", 4000, 4000),
    jpeg_scan()[: len(jpeg_scan()) // 2],
], ids=["png-2-of-64-rows", "png-63-of-64-rows", "png-4000x4000-1bit", "png-16bit", "gif", "jpeg"])
def test_a_file_whose_pixels_are_missing_is_refused_naming_it(data):
    with pytest.raises(ImageRefused) as refused:
        images.check_image(Upload("holiday.png", data))
    assert str(refused.value) == f"holiday.png {CUT}"


@pytest.mark.parametrize("data", [
    png(20000, 20000, 1, depth=1, colour=0), png(10000, 10000, 1, depth=1, colour=0),
    with_size(saved("P", "GIF", (4, 4)), "GIF", 65535, 65535),
    with_size(saved("RGB", "JPEG", (4, 4)), "JPEG", 65000, 65000),
], ids=["png-400M", "png-100M", "gif", "jpeg"])
def test_a_header_promising_a_decompression_bomb_is_refused_before_decoding(data):
    assert len(data) < 1000
    with pytest.raises(ImageRefused, match=BOMB):
        images.check_image(Upload("bomb.png", data))


@pytest.mark.parametrize(("mode", "kind", "options"), [
    ("1", "PNG", {}), ("P", "PNG", {"bits": 1}), ("P", "PNG", {"bits": 4}), ("L", "PNG", {}), ("LA", "PNG", {}),
    ("RGB", "PNG", {}), ("RGBA", "PNG", {}), ("I;16", "PNG", {}), ("RGB", "PNG", {"optimize": True}),
    ("RGB", "JPEG", {"progressive": True}), ("RGBA", "WEBP", {}), ("P", "GIF", {}),
])
def test_whole_images_of_every_pixel_layout_are_still_taken(mode, kind, options):
    for size in ((1, 1), (33, 17), (300, 7)):
        data = saved(mode, kind, size, **options)
        assert images.check_image(Upload("fine", data))["size"] == len(data)
    assert images.check_image(Upload("whole", png(64, 64, 64)))["media_type"] == "image/png"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_the_real_server_cannot_read_a_png_cut_short_so_corral_refuses_it_at_send(stack, smol_with_projector,  # noqa: F811
                                                                                   alice, tmp_path, settings):
    settings.DATA_DIR = stack.data_dir
    model = smol_with_projector.model_files.get()
    session = actions.do_create_session(
        alice, machine=smol_with_projector, model_key=model.key, working_dir=str(tmp_path), server_params={},
        sampling={"max_tokens": 4, "seed": 7, "temperature": 0.0}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="llama-server ready")
    record = ServerRecord.objects.get(session=session)

    def ask(data: bytes) -> httpx.Response:
        uri = "data:image/png;base64," + base64.b64encode(data).decode()
        return httpx.post(f"http://127.0.0.1:{record.port}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {record.api_key}"},
                          json={"max_tokens": 2, "messages": [{"role": "user", "content": [
                              {"type": "text", "text": "What is this?"},
                              {"type": "image_url", "image_url": {"url": uri}}]}]})

    # The premise, from the real part: the whole image is read, the cut one is refused.
    assert ask(png(64, 64, 64)).status_code == 200
    assert ask(png(64, 64, 2)).status_code >= 400

    with pytest.raises(actions.SessionError, match=f"cut.png {CUT}"):
        actions.do_send_message(session, alice, "What is this?", [Upload("cut.png", png(64, 64, 2))])
    assert not TranscriptEvent.objects.filter(session=session, kind__in=["message_taken", "message_queued"]).exists()
    # The session goes on, and a whole image is answered.
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "And this?",
                            [Upload("whole.png", png(64, 64, 64))])
    wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").exists(), 120, what="a reply")
    assert TranscriptEvent.objects.get(session=session, kind="turn_end").payload["reason"] == "done"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_webp_image_reaches_the_real_server_as_png_and_is_answered_turn_after_turn(stack, smol_with_projector,  # noqa: F811
                                                                                       alice, tmp_path, settings):
    """llama-server's loader (stb_image) reads no WebP: sent as it is, the image failed its
    own turn and every later one (HTTP 400 "Failed to load image or audio file")."""
    settings.DATA_DIR = stack.data_dir
    model = smol_with_projector.model_files.get()
    session = actions.do_create_session(
        alice, machine=smol_with_projector, model_key=model.key, working_dir=str(tmp_path), server_params={},
        sampling={"max_tokens": 4, "seed": 7, "temperature": 0.0}, permission_mode="manual",
    )
    wait_for(lambda: AgentSession.objects.get(pk=session.pk).status == "idle", 120, what="llama-server ready")
    webp = saved("RGBA", "WEBP", (40, 30))
    for n, (text, attached) in enumerate([("What is this?", [Upload("blue.webp", webp)]), ("Sure?", [])], 1):
        actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, text, attached)
        wait_for(lambda n=n: TranscriptEvent.objects.filter(session=session, kind="turn_end").count() == n, 120,
                 what=f"reply {n}")
    events = TranscriptEvent.objects.filter(session=session).order_by("seq")
    assert not [e.payload for e in events if e.kind == "error"]
    assert [e.payload["reason"] for e in events if e.kind == "turn_end"] == ["done", "done"]
    first = next(e.payload for e in events if e.kind == "message_taken")
    assert first["images"][0]["media_type"] == "image/webp"  # stored and shown as it came
    usage = [e.payload for e in events if e.kind == "usage"]
    assert usage[1]["cached_tokens"] >= usage[0]["prompt_tokens"]  # the PNG sent again byte for byte
