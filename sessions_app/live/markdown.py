"""Assistant text as sanitised HTML (docs/behaviour.md §12).

:func:`render_markdown` turns what a model wrote into HTML that is safe to put in the
session page: "assistant text is rendered as sanitised Markdown (code blocks
highlighted); nothing a model writes can run script in the page" (docs/behaviour.md §12).

Three layers, each sufficient on its own for the script-injection case:

1. ``markdown-it-py`` with the ``commonmark`` preset plus tables and strikethrough, and
   ``html=False``: raw HTML written by the model is emitted as escaped text, never as
   markup; markdown-it's own link validation rejects ``javascript:``/``vbscript:``/
   ``file:``/``data:`` destinations.
2. Fenced code with a language Pygments knows is highlighted (CSS classes, no inline
   styles); everything else in code is HTML-escaped.
3. The HTML is passed through ``nh3`` with an explicit allow-list of tags and attributes
   (:data:`ALLOWED_TAGS`, :data:`ALLOWED_ATTRIBUTES`); links keep only ``http``,
   ``https`` and ``mailto`` URLs (relative ones are removed) and get
   ``rel="noopener noreferrer nofollow"``.

TeX between dollars becomes MathML (:mod:`sessions_app.tex`): the allow-list keeps the
MathML elements and presentation attributes latex2mathml writes, nothing that links or
styles.

Images are never loaded from model output (a remote image is a way to leak data by URL
the moment the page renders): ``![alt](url)`` renders as its alt text.

This module must not import Django; a template filter wraps it elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import nh3
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.renderer import RendererProtocol
from markdown_it.rules_core import StateCore
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight as pygments_highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from ..tex import MATHML_ATTRIBUTES, MATHML_TAGS, formulas, math_plugin, to_mathml

__all__ = [
    "ALIGN_CLASSES",
    "ALLOWED_ATTRIBUTES",
    "ALLOWED_TAGS",
    "ALLOWED_URL_SCHEMES",
    "HIGHLIGHT_CSS_CLASS",
    "LINK_REL",
    "MAX_HIGHLIGHT_CHARS",
    "pygments_css",
    "render_markdown",
]

#: CSS class of the ``<pre>`` around a highlighted code block (Pygments' own default).
HIGHLIGHT_CSS_CLASS = "highlight"

#: Code blocks longer than this are escaped, not highlighted (bounded render time).
MAX_HIGHLIGHT_CHARS = 100_000

#: ``rel`` put on every link.
LINK_REL = "noopener noreferrer nofollow"

#: URL schemes a link may use; relative URLs are removed.
ALLOWED_URL_SCHEMES = frozenset({"http", "https", "mailto"})

#: Every tag that may survive sanitising.
ALLOWED_TAGS = frozenset(
    {
        "p",
        "br",
        "hr",
        "em",
        "strong",
        "del",
        "code",
        "pre",
        "span",
        "a",
        "ul",
        "ol",
        "li",
        "blockquote",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
    }
) | MATHML_TAGS

#: Attributes allowed per tag (``rel`` on links is added by the sanitiser, not kept).
#: Table cells carry their column alignment as a class (:data:`ALIGN_CLASSES`): the
#: page's Content-Security-Policy blocks ``style`` attributes (docs/deployment.md).
ALLOWED_ATTRIBUTES: dict[str, frozenset[str]] = {
    "a": frozenset({"href", "title"}),
    "span": frozenset({"class"}),
    "code": frozenset({"class"}),
    "pre": frozenset({"class"}),
    "ol": frozenset({"start"}),
    "th": frozenset({"class"}),
    "td": frozenset({"class"}),
    **{tag: MATHML_ATTRIBUTES for tag in MATHML_TAGS},
}

#: GFM column alignment (``|:--|:-:|--:|``) → the class a table cell gets.
ALIGN_CLASSES = {"left": "align-left", "center": "align-center", "right": "align-right"}

_FORMATTER = HtmlFormatter(nowrap=True)


def _attribute_filter(tag: str, attribute: str, value: str) -> str | None:
    """nh3 attribute filter: keep only the class values this module itself emits."""
    if attribute == "class":
        if tag == "pre":
            return value if value == HIGHLIGHT_CSS_CLASS else None
        if tag == "code":
            return value if value.startswith("language-") and " " not in value else None
        if tag in ("th", "td"):
            return value if value in ALIGN_CLASSES.values() else None
    return value


_CLEANER = nh3.Cleaner(
    tags=set(ALLOWED_TAGS),
    clean_content_tags={"script", "style"},
    attributes={tag: set(names) for tag, names in ALLOWED_ATTRIBUTES.items()},
    attribute_filter=_attribute_filter,
    link_rel=LINK_REL,
    url_schemes=set(ALLOWED_URL_SCHEMES),
    url_relative="deny",
)


def _highlight(code: str, lang: str, _attrs: str) -> str:
    """markdown-it ``highlight`` hook: a full ``<pre>`` block, or ``""`` to escape.

    Returns ``<pre class="highlight"><code class="language-LANG">`` + Pygments spans
    for a language Pygments knows (and code no longer than
    :data:`MAX_HIGHLIGHT_CHARS`); ``""``
    otherwise, which makes markdown-it escape the code itself.
    """
    if not lang or len(code) > MAX_HIGHLIGHT_CHARS:
        return ""
    try:
        lexer = get_lexer_by_name(lang, stripnl=False)
    except ClassNotFound:
        return ""
    spans = pygments_highlight(code, lexer, _FORMATTER)
    return (
        f'<pre class="{HIGHLIGHT_CSS_CLASS}"><code class="language-{escapeHtml(lang)}">'
        f"{spans}</code></pre>"
    )


def _image_as_text(
    self: RendererProtocol,
    tokens: Sequence[Token],
    idx: int,
    options: OptionsDict,
    env: EnvType,
) -> str:
    """Render ``![alt](url)`` as its escaped alt text: no image is ever fetched."""
    children = tokens[idx].children or []
    alt = "".join(
        child.content for child in children if child.type in {"text", "code_inline"}
    )
    return escapeHtml(alt)


def _fixed_tag(html: str) -> Callable[..., str]:
    """A markdown-it render rule that always writes ``html``."""

    def rule(self: RendererProtocol, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
        return html

    return rule


def _alignment_as_class(state: StateCore) -> None:
    """markdown-it core rule: a table cell's ``style="text-align:X"`` becomes
    ``class="align-X"`` (see :data:`ALIGN_CLASSES`); any other style is dropped."""
    for token in state.tokens:
        if token.type in ("th_open", "td_open") and "style" in token.attrs:
            style = str(token.attrs.pop("style"))
            align = style.removeprefix("text-align:").strip()
            if align in ALIGN_CLASSES:
                token.attrSet("class", ALIGN_CLASSES[align])


def _make_parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": _highlight})
    md.enable(["table", "strikethrough"])
    md.core.ruler.push("alignment_as_class", _alignment_as_class)
    math_plugin(md)  # $…$ and $$…$$ as MathML (sessions_app/tex.py)
    md.add_render_rule("image", _image_as_text)
    # Strikethrough as <del> (markdown-it-py writes <s>, which the sanitiser drops).
    md.add_render_rule("s_open", _fixed_tag("<del>"))
    md.add_render_rule("s_close", _fixed_tag("</del>"))
    return md


_MD = _make_parser()

#: How many texts' renderings (and formulas) a process keeps: the replies its sockets are
#: folding now, each asked for once per socket within moments (live pushes), are rendered
#: once. Every rendering is a function of the text alone. Bounded in memory: 128 replies
#: of 50 kB and their HTML are some 20 MB at worst.
RENDERS_KEPT = 128


def reply_formulas(text: str) -> list[tuple[str, bool]]:
    """The formulas of a reply as :func:`render_markdown` reads them (``[(tex, display)]``,
    in order, each once): what the page's preview of a streaming reply takes from the
    server (sessions_app/tex.py). Read once per text for all the pages that fold it (:data:`RENDERS_KEPT`)."""
    return list(_formulas(text))


@functools.lru_cache(maxsize=RENDERS_KEPT)
def _formulas(text: str) -> tuple[tuple[str, bool], ...]:
    return tuple(formulas(_MD, text))


@functools.lru_cache(maxsize=RENDERS_KEPT)
def formula_html(tex: str, display: bool) -> str:
    """One formula as sanitised MathML (or its source in a ``<code>``)."""
    return _CLEANER.clean(to_mathml(tex, display))


def render_markdown(text: str | None) -> str:
    """Markdown written by a model → sanitised HTML fragment (docs/behaviour.md §12).

    Contract:

    - CommonMark plus GFM tables and strikethrough (rendered as ``<del>``).
    - ``$…$`` and ``$$…$$`` as MathML (sessions_app/tex.py; ``$5 and $10`` stays text).
    - Raw HTML in ``text`` never becomes markup: it is shown as escaped text.
    - Fenced code with a language Pygments knows is highlighted with CSS classes inside
      ``<pre class="highlight"><code class="language-…">``; see :func:`pygments_css`.
    - The output contains only :data:`ALLOWED_TAGS` with :data:`ALLOWED_ATTRIBUTES`;
      no event-handler attributes, no ``script``, no images; every ``<a>`` has an
      ``http``/``https``/``mailto`` ``href`` (or none) and ``rel="noopener noreferrer
      nofollow"``.
    - ``None`` or ``""`` gives ``""``. Deterministic: the same text, the same HTML — so
      it is rendered once for all the pages that show it: every socket of a session folds
      the same reply (200 watchers: one render, not 200; :data:`RENDERS_KEPT`).
    """
    if not text:
        return ""
    return _render(text)


@functools.lru_cache(maxsize=RENDERS_KEPT)
def _render(text: str) -> str:
    return _CLEANER.clean(_MD.render(text))


def pygments_css(
    selector: str = f".{HIGHLIGHT_CSS_CLASS}", style: str = "default"
) -> str:
    """The stylesheet for highlighted code blocks, scoped to ``selector``.

    For a static CSS file or a ``<style>`` block; ``style`` is a Pygments style name.
    """
    formatter: Any = HtmlFormatter(style=style)
    return str(formatter.get_style_defs(selector))
