"""Tests for sessions_app/live/markdown.py: assistant text as safe Markdown (docs/behaviour.md §12)."""

from __future__ import annotations

import re

import pytest

from sessions_app.live.markdown import ALLOWED_TAGS, pygments_css, render_markdown

# (name, markdown, must appear in the HTML, must not appear (case-insensitive))
CASES: list[tuple[str, str, list[str], list[str]]] = [
    ("empty", "", [], ["<"]),
    (
        "paragraph and emphasis",
        "Hello *there* **you**",
        ["<p>Hello <em>there</em> <strong>you</strong></p>"],
        [],
    ),
    (
        "code fence with language is highlighted",
        "```python\ndef f(x):\n    return 1\n```",
        [
            '<pre class="highlight"><code class="language-python">',
            '<span class="k">def</span>',
            '<span class="nf">f</span>',
        ],
        [],
    ),
    (
        "code fence with unknown language is escaped, not highlighted",
        "```nosuchlang\n<b>x</b>\n```",
        [
            '<pre><code class="language-nosuchlang">&lt;b&gt;x&lt;/b&gt;',
        ],
        ["<span", "<b>"],
    ),
    (
        "code fence without language",
        "```\na < b\n```",
        ["<pre><code>a &lt; b"],
        ["<span"],
    ),
    (
        "inline code is escaped",
        "use `<script>` here",
        ["<code>&lt;script&gt;</code>"],
        ["<script"],
    ),
    (
        "script in text is escaped",
        "<script>alert(1)</script>",
        ["&lt;script&gt;alert(1)&lt;/script&gt;"],
        ["<script"],
    ),
    (
        "script block is escaped",
        "hi\n\n<script>\nalert(1)\n</script>\n",
        ["&lt;script&gt;"],
        ["<script"],
    ),
    (
        "javascript link",
        "[x](javascript:alert(1))",
        [],
        ['javascript:alert(1)"', 'href="javascript', "<a"],
    ),
    ("javascript autolink", "<javascript:alert(1)>", [], ["href"]),
    ("entity-encoded javascript link", "[x](&#106;avascript:alert(1))", [], ["href"]),
    ("data link", "[x](data:text/html;base64,PHNjcmlwdD4=)", [], ["href"]),
    (
        "img onerror",
        "<img src=x onerror=alert(1)>",
        ["&lt;img src=x onerror=alert(1)&gt;"],
        ["<img"],
    ),
    (
        "markdown image is only its alt text",
        "![the *alt*](http://evil.example/p.png?d=secret)",
        ["<p>the alt</p>"],
        ["<img", "evil.example"],
    ),
    (
        "http link gets rel",
        "[site](http://example.com/a?b=1)",
        [
            (
                '<a href="http://example.com/a?b=1" rel="noopener noreferrer nofollow">'
                "site</a>"
            )
        ],
        [],
    ),
    (
        "https autolink gets rel",
        "<https://example.com>",
        ['href="https://example.com"', 'rel="noopener noreferrer nofollow"'],
        [],
    ),
    (
        "mailto link",
        "[mail](mailto:a@example.com)",
        ['href="mailto:a@example.com"'],
        [],
    ),
    ("relative link loses its href", "[admin](/admin/delete)", ["admin"], ["href"]),
    (
        "link title is escaped",
        '[t](http://x.example "a\\"onclick=b")',
        ['title="a&quot;onclick=b"'],
        [" onclick="],
    ),
    (
        "table renders",
        "| a | b |\n|:--|--:|\n| 1 | 2 |\n",
        [
            "<table>",
            "<thead>",
            '<th class="align-left">a</th>',
            '<td class="align-right">2</td>',
            "</tbody>",
        ],
        ["style="],
    ),
    ("strikethrough is del", "~~gone~~", ["<del>gone</del>"], ["<s>"]),
    ("lists", "1. a\n2. b\n\n- c\n", ["<ol>", "<li>a</li>", "<ul>", "<li>c</li>"], []),
    ("ordered list start", "3. a\n4. b\n", ['<ol start="3">'], []),
    (
        "heading, quote, rule, hard break",
        "# T\n\n> q\n\n---\n\na  \nb",
        ["<h1>T</h1>", "<blockquote>", "<hr>", "<br>"],
        [],
    ),
    (
        "event attribute via html-ish text",
        '<a href="x" onclick="alert(1)">y</a>',
        ["&lt;a href="],
        ["<a href"],
    ),
    ("svg", "<svg onload=alert(1)>", [], ["<svg"]),
    ("iframe", "<iframe src=http://x></iframe>", [], ["<iframe"]),
]


@pytest.mark.parametrize(
    ("text", "present", "absent"),
    [
        pytest.param(text, present, absent, id=name)
        for name, text, present, absent in CASES
    ],
)
def test_it_renders_markdown(text: str, present: list[str], absent: list[str]) -> None:
    html = render_markdown(text)
    for fragment in present:
        assert fragment in html, html
    for fragment in absent:
        assert fragment.lower() not in html.lower(), html


@pytest.mark.parametrize(
    ("text"), [pytest.param(text, id=name) for name, text, _p, _a in CASES]
)
def test_it_emits_only_allowed_markup(text: str) -> None:
    html = render_markdown(text)
    tags = {m.lower() for m in re.findall(r"</?([a-zA-Z][a-zA-Z0-9]*)", html)}
    assert tags <= ALLOWED_TAGS, tags
    for tag in re.findall(r"<[^>]*>", html):
        assert not re.search(r"\son[a-z]+\s*=", tag, re.IGNORECASE), tag
    for href in re.findall(r'<a\s[^>]*href="([^"]*)"', html):
        assert href.startswith(("http://", "https://", "mailto:")), href
    for anchor in re.findall(r"<a\s[^>]*>", html):
        assert 'rel="noopener noreferrer nofollow"' in anchor


def test_it_renders_none_as_empty() -> None:
    assert render_markdown(None) == ""


def test_it_is_deterministic() -> None:
    text = "```python\nx = 1\n```\n\n| a |\n|---|\n| b |\n"
    assert render_markdown(text) == render_markdown(text)


def test_it_provides_the_highlight_stylesheet() -> None:
    css = pygments_css()
    assert ".highlight .k" in css
