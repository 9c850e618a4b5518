"""Images a user message carries (docs/behaviour.md §16): checked by their content, stored
once in the database by content hash (:class:`sessions_app.models.StoredImage`), read back
for requests and for the page — on every Corral host alike.

An image is shared by every message (of any session) that attached the same bytes; it is
deleted when no transcript event refers to it any more (:func:`forget_unreferenced`: when
its last session is deleted, and by the housekeeping sweep). Bytes that no longer hash to
their SHA-256 count as missing. A missing image is never replaced silently: the request
carries a note in its place and the session says which image the model did not see
(:func:`missing_sentence`).

Who may fetch an image is not decided here: the view serves one only through a session
that references it (:func:`sessions_app.views.session_image`, docs/security.md).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import warnings
import zlib
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from PIL import Image, UnidentifiedImageError

from .models import StoredImage, TranscriptEvent
from .transcript import ImageRef, image_refs

#: Pillow's format name → (media type, file extension). SVG is not an image here: it is a
#: document that can carry script, so it is refused like any other non-raster file.
FORMATS = {
    "PNG": ("image/png", "png"),
    "JPEG": ("image/jpeg", "jpg"),
    "WEBP": ("image/webp", "webp"),
    "GIF": ("image/gif", "gif"),
}
EXTENSIONS = dict(FORMATS.values())  # media type → extension
ACCEPT = ",".join(EXTENSIONS)  # the file picker's ``accept``
KINDS = "PNG, JPEG, WebP or GIF"


class ImageRefused(Exception):
    """An upload that is not an image Corral takes; the message says why, naming the file."""


@dataclass(frozen=True)
class Upload:
    """One attached file as the browser sent it: its name (for messages only), its bytes
    and its size in bytes (``None``: ``len(data)``; a file too large is not read at all)."""

    name: str
    data: bytes
    size: int | None = None

    @property
    def length(self) -> int:
        return len(self.data) if self.size is None else self.size


def max_bytes() -> int:
    """``CORRAL_IMAGE_MAX_BYTES``: the largest image a message may carry."""
    return settings.CORRAL_IMAGE_MAX_BYTES


def max_count() -> int:
    """``CORRAL_IMAGE_MAX_COUNT``: how many images one message may carry."""
    return settings.CORRAL_IMAGE_MAX_COUNT


def max_pixels() -> int:
    """``CORRAL_IMAGE_MAX_PIXELS``: the most pixels (width × height) an image may have."""
    return settings.CORRAL_IMAGE_MAX_PIXELS


def megapixels(pixels: int) -> str:
    """A pixel count as people read it: ``16.8 megapixels``, ``81 megapixels``; below a
    tenth of a megapixel, ``10,000 pixels``."""
    if pixels < 100_000:
        return f"{pixels:,} pixels"
    return f"{pixels / 1_000_000:.1f}".removesuffix(".0") + " megapixels"


def megabytes(size: int) -> str:
    """A size as people read it: ``10 MB``, ``1.5 MB``, ``300 KB``."""
    if size >= 1_000_000:
        return f"{size / 1_000_000:.1f}".removesuffix(".0") + " MB"
    return f"{max(1, round(size / 1000))} KB"


def limits_sentence() -> str:
    """The composer's line about what may be attached."""
    return (f"Up to {max_count()} images ({KINDS}), {megabytes(max_bytes())} each. "
            f"Each at most {megapixels(max_pixels())}.")


def check_image(upload: Upload) -> ImageRef:
    """The reference of ``upload`` if it is an image Corral takes; raises
    :class:`ImageRefused` with a sentence naming the file otherwise.

    Taken: PNG, JPEG, WebP and GIF, judged by the bytes (Pillow reads and verifies them,
    then decodes every pixel of the first frame — what llama-server's image loader reads),
    never by the name or the type the browser claimed, at most :func:`max_bytes` long and
    at most :func:`max_pixels` pixels, as its header says — read before any pixel is
    decoded, so a file over the bound costs no decoding at all. A file whose header is
    sound but whose pixel data is cut short or damaged is refused too: the image goes with
    every later request of the session, so one the server cannot decode would fail them
    all. Its pixels are decoded once, here.
    """
    name = upload.name or "The attached file"
    if upload.length > max_bytes():
        raise ImageRefused(f"{name} is {megabytes(upload.length)}; an image can be at most {megabytes(max_bytes())}.")
    if not upload.data:
        raise ImageRefused(f"{name} is empty.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(upload.data)) as image:
                kind = image.format
                width, height = image.size
                if kind in FORMATS and width * height > max_pixels():
                    raise ImageRefused(
                        f"{name} is {width}×{height} pixels ({megapixels(width * height)}); an image can have at "
                        f"most {megapixels(max_pixels())}."
                    )
                image.verify()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageRefused(f"{name} has too many pixels to be taken as an image.") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
        kind = None
    if kind not in FORMATS:
        raise ImageRefused(f"{name} is not a {KINDS} image.")
    try:
        # verify() checks the structure (chunk CRCs, markers) without decoding; a header
        # that promises 9000×9000 pixels over a few bytes of data passes it. Decoding is
        # bounded by the pixel limit checked above.
        with Image.open(io.BytesIO(upload.data)) as image:
            image.load()
            whole = kind != "PNG" or _png_data_complete(upload.data, image.size)
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error, Image.DecompressionBombError):
        whole = False
    if not whole:
        raise ImageRefused(f"{name} is damaged or cut short: its pixels cannot be read.")
    media_type, _ = FORMATS[kind]
    return {"sha256": hashlib.sha256(upload.data).hexdigest(), "media_type": media_type, "size": len(upload.data)}


#: PNG colour type → samples a pixel (greyscale, RGB, palette, grey + alpha, RGBA).
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: Adam7's passes as (x start, y start, x step, y step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_data_complete(data: bytes, size: tuple[int, int]) -> bool:
    """Whether the IDAT stream of a PNG holds every row its header promises. Pillow fills
    the rows of a stream that ends early with black and says nothing; llama-server's
    loader (stb_image) refuses the file ("not enough pixels"), so such a file would fail
    every request that carries it. Counts the inflated bytes without keeping them."""
    width, height = size
    depth, colour, interlace = data[24], data[25], data[28]  # IHDR, right after the signature
    bits = depth * _PNG_SAMPLES[colour]
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    needed = 0
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            needed += rows * (1 + -(-(columns * bits) // 8))  # a filter byte, then the row
    inflate, got, offset = zlib.decompressobj(), 0, 8
    while offset + 8 <= len(data) and got < needed:
        length, kind = int.from_bytes(data[offset:offset + 4], "big"), data[offset + 4:offset + 8]
        chunk = data[offset + 8:offset + 8 + length]
        offset += 12 + length
        if kind == b"IDAT":
            while chunk and got < needed:
                got += len(inflate.decompress(chunk, 1 << 20))
                chunk = inflate.unconsumed_tail
    return got >= needed


def store(upload: Upload, ref: ImageRef) -> None:
    """Keep the bytes of a checked image, once, in the database (:class:`StoredImage`, by
    SHA-256): a row already holding them is left alone; a row whose bytes no longer hash
    to its name is replaced. Call it in the transaction that records the message carrying
    the image: the row is locked until then, so :func:`forget_unreferenced` cannot delete
    it between the two. Raises ``DatabaseError`` when the database refuses the write."""
    with transaction.atomic():  # a savepoint inside the caller's; locking needs one anyway
        rows = StoredImage.objects.select_for_update().filter(sha256=ref["sha256"])
        kept = rows.values_list("data", flat=True).first()
        if kept is not None and hashlib.sha256(bytes(kept)).hexdigest() == ref["sha256"]:
            return
        StoredImage.objects.update_or_create(
            sha256=ref["sha256"],
            defaults={"media_type": ref["media_type"], "data": upload.data, "size": len(upload.data),
                      "server_png": None},
        )


def read(ref: ImageRef) -> bytes | None:
    """The stored bytes of ``ref``, or None when no row holds them (deleted, or never
    stored on this installation) or they no longer hash to its SHA-256."""
    data = StoredImage.objects.filter(sha256=ref["sha256"]).values_list("data", flat=True).first()
    if data is None:
        return None
    data = bytes(data)  # PostgreSQL gives a memoryview
    return data if hashlib.sha256(data).hexdigest() == ref["sha256"] else None


def stored(hashes: set[str]) -> set[str]:
    """Which of ``hashes`` have a stored image (one query; the bytes are not read)."""
    return set(StoredImage.objects.filter(sha256__in=hashes).values_list("sha256", flat=True)) if hashes else set()


def missing_sentence(ref: ImageRef) -> str:
    """What a session says of an image its message carries whose bytes are gone: which
    image (kind, size, the start of its SHA-256), and that the model did not see it."""
    return (f"The model did not see an image attached to an earlier message ({_kind(ref)}, {megabytes(ref['size'])}, "
            f"SHA-256 {ref['sha256'][:12]}…): it is no longer stored in Corral (it was deleted), so the request "
            "carried a note in its place.")


def _kind(ref: ImageRef) -> str:
    return ref["media_type"].removeprefix("image/").upper()


def referred_hashes(session_id: int) -> set[str]:
    """The SHA-256 of every image an event of the session names (its messages, sent or
    queued): what may become unreferenced when the session goes."""
    found: set[str] = set()
    for payload in TranscriptEvent.objects.filter(session_id=session_id, payload__icontains="sha256").values_list(
        "payload", flat=True
    ):
        found.update(ref["sha256"] for ref in image_refs(payload))
    return found


def forget_unreferenced(hashes: set[str] | None = None) -> int:
    """Delete the stored images no transcript event refers to any more; ``hashes``: only
    these (a deleted session's images), None: every stored image (the housekeeping sweep).
    Returns how many were deleted.

    An event refers to an image when its payload holds the image's SHA-256 (a message's
    ``images``; any other mention keeps it too, which only keeps an image longer). Each
    image is deleted in a transaction that locks its row first: a message attaching the
    same bytes meanwhile (:func:`store`, in the transaction that records it) either
    commits first — its event is seen and the image stays — or stores the image again
    after the delete."""
    if hashes is None:
        candidates = set(StoredImage.objects.values_list("sha256", flat=True))
        referenced: set[str] = set()
        for payload in TranscriptEvent.objects.filter(payload__icontains="sha256").values_list("payload", flat=True):
            referenced.update(_HASH.findall(json.dumps(payload)))
        candidates -= referenced
    else:
        candidates = set(hashes)
    deleted = 0
    for sha256 in sorted(candidates):
        with transaction.atomic():
            if not list(StoredImage.objects.select_for_update().filter(sha256=sha256).values_list("pk", flat=True)):
                continue  # gone already
            if TranscriptEvent.objects.filter(payload__icontains=sha256).exists():
                continue
            deleted += StoredImage.objects.filter(sha256=sha256).delete()[0]
    return deleted


_HASH = re.compile(r"[0-9a-f]{64}")


#: Media types llama-server's image loader reads as they are (llama.cpp's mtmd decodes
#: with stb_image: PNG, JPEG, GIF, … but not WebP, which it answers with HTTP 400 "Failed
#: to load image or audio file").
SERVER_READS = {"image/png", "image/jpeg", "image/gif"}


def as_png(data: bytes) -> bytes:
    """An image's pixels re-encoded as PNG (lossless): the same bytes in give the same bytes
    out, so a request carrying it stays byte-identical turn after turn."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        pixels = image if image.mode in ("RGB", "RGBA", "L", "LA", "P", "1") else image.convert("RGBA")
        out = io.BytesIO()
        pixels.save(out, "PNG")
    return out.getvalue()


def data_uri(ref: ImageRef) -> str | None:
    """The image as the URL of an OpenAI ``image_url`` content part (``data:<media
    type>;base64,<bytes>``, what llama-server's multimodal chat accepts), or None when it
    is not stored (any more). A kind llama-server cannot read (WebP: :data:`SERVER_READS`)
    is sent as PNG; the stored image and the page's thumbnail keep the original. The same
    bytes always give the same text, so a request's prefix stays byte-identical turn after
    turn (docs/behaviour.md §13)."""
    data = read(ref)
    if data is None:
        return None
    media_type = ref["media_type"]
    if media_type not in SERVER_READS:
        data, media_type = server_copy(ref, data), "image/png"
        if data is None:
            return None  # checked when attached; unreadable now is as good as missing
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def server_copy(ref: ImageRef, data: bytes) -> bytes | None:
    """The PNG a request carries for an image llama-server cannot read as it is (``data``:
    the stored bytes of ``ref``), made once and kept with the image (``server_png``): an
    image goes with every later request of its session, and decoding it anew each time
    would cost its pixels every turn. None when its pixels cannot be read."""
    kept = StoredImage.objects.filter(sha256=ref["sha256"]).values_list("server_png", flat=True).first()
    if kept is not None:
        return bytes(kept)
    try:
        png = as_png(data)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    StoredImage.objects.filter(sha256=ref["sha256"]).update(server_png=png)
    return png
