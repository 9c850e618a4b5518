"""TeX as MathML, rendered on the server (latex2mathml) and sanitised
with the rest; prices and code stay text; a reply still streaming carries the server's
MathML for its preview. The browser side is tests/test_search_versions_browser.py."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup

from sessions_app.live.markdown import render_markdown, reply_formulas
from sessions_app.live.transcript_view import TranscriptView
from sessions_app.tex import MATHML_TAGS
from sessions_app.transcript import Event


def test_inline_and_display_math_become_mathml():
    html = render_markdown("Energy: $E=mc^2$.\n\n$$\n\\int_0^1 x\\,dx = \\frac{1}{2}\n$$\n\nDone.")
    soup = BeautifulSoup(html, "html.parser")
    inline, block = soup.find_all("math")
    assert inline["display"] == "inline" and inline.find("msup") is not None
    assert block["display"] == "block" and block.find("mfrac") is not None and block.find("msubsup") is not None
    assert [p.get_text() for p in soup.find_all("p")][-1] == "Done."
    assert "$" not in soup.get_text()


@pytest.mark.parametrize("text", [
    "It costs $5 and $10.", "between $5-$10 a day", "a $ b $ c", "`$x$` in code", "```\n$E=mc^2$\n```",
    "an escaped \\$x$ dollar", "$$ never closed", "only one $ here", "from $5 to $ 7",
    "costs $10; `$x$` is code",
])
def test_prices_code_and_stray_dollars_stay_text(text):
    html = render_markdown(text)
    assert "<math" not in html
    assert "$" in BeautifulSoup(html, "html.parser").get_text()


def test_a_price_before_a_formula_stays_text_and_the_formula_is_found():
    soup = BeautifulSoup(render_markdown("It costs $5. $E=mc^2$ is free."), "html.parser")
    assert len(soup.find_all("math")) == 1 and soup.get_text().startswith("It costs $5. ")


def test_inline_display_math_and_formulas_list_each_once_in_order():
    text = "$a$ and $$b+c$$ and $a$ again, `$d$` not\n\n$$\ne\n$$"
    assert reply_formulas(text) == [("a", False), ("b+c", True), ("e", True)]


def test_what_latex2mathml_cannot_read_is_shown_as_its_source():
    html = render_markdown("broken $\\frac{$ here")
    assert "<math" not in html and "<code>$\\frac{$</code>" in html


def test_the_sanitiser_keeps_mathml_and_drops_links_styles_and_script():
    html = render_markdown("$\\href{javascript:alert(1)}{x}$ $\\style{color:red}{y}$ $\\class{evil}{z}$ "
                           "$\\color{red}{w}$ $\\text{<script>alert(1)</script>}$")
    soup = BeautifulSoup(html, "html.parser")
    assert len(soup.find_all("math")) == 5
    for element in soup.find_all(True):
        assert element.name in {"p", *MATHML_TAGS}, element.name
        assert not {"href", "style", "class", "mathcolor"} & set(element.attrs), element
        assert not any(name.startswith("on") for name in element.attrs)
    assert soup.find("script") is None and "<script" not in html


def test_a_streaming_reply_carries_the_servers_mathml_for_each_formula_once():
    view = TranscriptView(1)
    view.feed(Event(1, "message_taken", {"text": "energy?", "queued_id": None}))
    first = view.feed(Event(2, "assistant_text", {"text": "It is $E=m"}))
    soup = BeautifulSoup(first[-1]["html"], "html.parser")
    assert soup.select_one("#a-2-math") is not None and soup.select("#a-2-math span") == []
    ops = view.feed(Event(3, "assistant_text", {"text": "c^2$, not $5."}))
    math = [op for op in ops if op.get("target") == "a-2-math"]
    assert len(math) == 1
    span = BeautifulSoup(math[0]["html"], "html.parser").span
    assert (span["data-tex"], span["data-display"]) == ("E=mc^2", "0") and span.find("math") is not None
    assert not [op for op in view.feed(Event(4, "assistant_text", {"text": " $E=mc^2$ again"}))
                if op.get("target") == "a-2-math"]
    closed = view.feed(Event(5, "turn_end", {"reason": "done"}))
    final = BeautifulSoup(closed[0]["html"], "html.parser")
    assert final.select_one(".math-list") is None and len(final.find_all("math")) == 2
