"""Draw the app's PNG icons (the web app manifest's, static/corral/icon-*.png) from the
favicon's shape: ``python -m attention_app.make_icons``. Pillow only; the files are committed."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

GREEN, CREAM = (0x2F, 0x5D, 0x50), (0xF3, 0xEA, 0xD8)
#: The fence of static/corral/favicon.svg, in its 32×32 units: (x, y, width, height).
BARS = [(6, 7, 3, 19), (14.5, 7, 3, 19), (23, 7, 3, 19), (4, 11, 24, 3), (4, 19, 24, 3)]
STATIC = Path(__file__).resolve().parent.parent / "static" / "corral"


def draw(size: int, *, maskable: bool = False) -> Image.Image:
    """The icon at ``size`` pixels; ``maskable``: full-bleed background, the fence inside
    the central 80 % a launcher's mask keeps."""
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    pen = ImageDraw.Draw(image)
    if maskable:
        pen.rectangle((0, 0, size, size), fill=GREEN)
        scale, offset = size * 0.6 / 32, size * 0.2
    else:
        pen.rounded_rectangle((0, 0, size - 1, size - 1), radius=size * 6 / 32, fill=GREEN)
        scale, offset = size / 32, 0
    for x, y, w, h in BARS:
        box = (offset + x * scale, offset + y * scale, offset + (x + w) * scale, offset + (y + h) * scale)
        pen.rounded_rectangle(box, radius=scale, fill=CREAM)
    return image


if __name__ == "__main__":
    draw(192).save(STATIC / "icon-192.png")
    draw(512).save(STATIC / "icon-512.png")
    draw(512, maskable=True).save(STATIC / "icon-maskable-512.png")
