"""The stylesheet side of contrast: every colour highlighted code takes meets WCAG
AA, 4.5:1, on the code block's background, in light mode and in dark mode. The pages as a
whole are checked with axe-core in the browser (tests/test_search_versions_browser.py)."""

from __future__ import annotations

import re

from sessions_app.live.markdown import render_markdown

from .conftest import ROOT

CSS = (ROOT / "static" / "corral" / "corral.css").read_text()
COLOUR = re.compile(r"^\s*\.highlight \.(\w+) \{[^}]*?(?<![-\w])color:\s*(#[0-9A-Fa-f]{3,6})", re.M)


def luminance(colour: str) -> float:
    digits = colour.lstrip("#")
    if len(digits) == 3:
        digits = "".join(c * 2 for c in digits)
    channels = [int(digits[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    r, g, b = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def dark_block() -> str:
    start = CSS.index("@media (prefers-color-scheme: dark) {\n  .body.md pre.highlight")
    return CSS[start:CSS.index("\n}", start)]


def test_every_code_colour_meets_4_5_to_1_in_both_modes():
    dark = dark_block()
    light_css = CSS.replace(dark, "")
    light = dict(COLOUR.findall(light_css))
    darks = dict(COLOUR.findall(dark))
    light_bg = re.search(r"^\.body\.md pre\.highlight \{ background:(#\w+)", CSS, re.M).group(1)
    dark_bg = re.search(r"\.body\.md pre\.highlight \{ background:(#\w+)", dark).group(1)
    assert len(light) > 60 and len(darks) > 60
    assert set(light) <= set(darks), "a class coloured in light mode keeps its light colour in dark mode"
    low = {name: round(contrast(c, light_bg), 2) for name, c in light.items() if contrast(c, light_bg) < 4.5}
    assert low == {}, f"light mode below 4.5:1 on {light_bg}: {low}"
    low = {name: round(contrast(c, dark_bg), 2) for name, c in darks.items() if contrast(c, dark_bg) < 4.5}
    assert low == {}, f"dark mode below 4.5:1 on {dark_bg}: {low}"


def test_the_classes_pygments_writes_are_the_ones_coloured():
    html = render_markdown("```python\n@decorator\ndef f(x: int) -> str:\n    return f'{x!r}' # note\n```")
    used = set(re.findall(r'<span class="(\w+)"', html))
    assert used and used <= set(dict(COLOUR.findall(dark_block()))) | {"w", "p", "n"}
