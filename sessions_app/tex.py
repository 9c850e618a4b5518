"""TeX in assistant text as MathML (docs/behaviour.md §12, "Math").

A model writes ``$E=mc^2$`` (inline) and ``$$…$$`` (display); the page shows them as
MathML, which Chromium, Firefox and Safari draw natively: no script, and the same
sanitiser as the rest of the reply (sessions_app/live/markdown.py keeps the MathML elements
and attributes listed here, nothing else).

Delimiters follow pandoc's ``tex_math_dollars``, so prices stay text:

- ``$$…$$`` is display math, inline or on lines of its own;
- ``$…$`` is inline math when the opening ``$`` has a non-space character to its right,
  the closing one a non-space character to its left and no digit right after it
  (``$5 and $10`` is text), and no bare ``$`` or backtick inside;
- ``\\$`` is a dollar sign; inside a code span or block nothing is math (markdown-it reads
  code first).

:func:`math_plugin` adds the two rules to a markdown-it parser; :func:`to_mathml` converts
one formula with ``latex2mathml`` (a formula it cannot read is shown as its source, in a
code span); :func:`formulas` lists the formulas of a text, for the page's preview of a
reply still streaming (static/corral/session.js renders the same rules in the browser
and takes each formula's MathML from the server).

This module must not import Django.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from latex2mathml.converter import convert
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.rules_block import StateBlock
from markdown_it.rules_inline import StateInline
from markdown_it.token import Token

__all__ = ["MATHML_ATTRIBUTES", "MATHML_TAGS", "MAX_TEX_CHARS", "formulas", "math_plugin", "to_mathml"]

#: A formula longer than this is shown as its source (bounded conversion time).
MAX_TEX_CHARS = 4000

#: The MathML elements latex2mathml writes (MathML Core plus ``menclose``).
MATHML_TAGS = frozenset({
    "math", "mi", "mn", "mo", "ms", "mspace", "mtext", "mrow", "mfrac", "msqrt", "mroot", "msub", "msup",
    "msubsup", "munder", "mover", "munderover", "mtable", "mtr", "mtd", "mstyle", "mpadded", "mphantom",
    "menclose", "merror", "semantics", "annotation", "mmultiscripts", "mprescripts", "none",
})

#: Presentation attributes kept on any MathML element. Not kept: ``href`` (``\\href``:
#: a link out of a formula), ``class`` and ``style`` (``\\class``, ``\\style``: the page's
#: CSP refuses inline styles anyway), ``mathcolor``/``mathbackground`` (text that hides).
MATHML_ATTRIBUTES = frozenset({
    "display", "xmlns", "mathvariant", "mathsize", "displaystyle", "scriptlevel", "stretchy", "fence",
    "separator", "form", "lspace", "rspace", "largeop", "movablelimits", "accent", "accentunder",
    "linethickness", "width", "height", "depth", "voffset", "minsize", "maxsize", "notation",
    "columnalign", "columnlines", "columnspacing", "rowlines", "rowspacing", "encoding",
})

_DOLLAR = 0x24


@lru_cache(maxsize=1024)
def to_mathml(tex: str, display: bool) -> str:
    """One formula (without its ``$`` delimiters) → a ``<math>`` element
    (``display="block"`` when ``display``), unsanitised: the caller's sanitiser keeps
    :data:`MATHML_TAGS` and :data:`MATHML_ATTRIBUTES`. A formula latex2mathml cannot read,
    or longer than :data:`MAX_TEX_CHARS`, is its source in a ``<code>``."""
    source = tex.strip()
    if source and len(source) <= MAX_TEX_CHARS:
        try:
            return convert(source, display="block" if display else "inline")
        except Exception:  # latex2mathml raises many kinds on what it cannot read
            pass
    fence = "$$" if display else "$"
    return f"<code>{escapeHtml(fence + tex + fence)}</code>"


def _closing(src: str, start: int, end: int) -> int:
    """The index of the ``$`` that closes inline math opened just before ``start``, or -1:
    the first unescaped ``$``, when it may close; inline math holds no bare ``$`` (so in
    "costs $5. $E=mc^2$" the price stays text and the formula is found)."""
    pos = start
    while pos < end:
        char = src[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "`":
            return -1  # a code span begins: nothing in it is math, nor is a formula across it
        if char == "$":
            after = src[pos + 1] if pos + 1 < end else ""
            return pos if not src[pos - 1].isspace() and not after.isdigit() else -1
        pos += 1
    return -1


def _math_inline(state: StateInline, silent: bool) -> bool:
    src, pos, end = state.src, state.pos, state.posMax
    if src[pos] != "$":
        return False
    if src.startswith("$$", pos):
        close = src.find("$$", pos + 2, end)
        if close == -1 or close == pos + 2:
            return False
        tex, display, after = src[pos + 2:close], True, close + 2
    else:
        if pos + 1 >= end or src[pos + 1].isspace():
            return False
        close = _closing(src, pos + 1, end)
        if close == -1:
            return False
        tex, display, after = src[pos + 1:close], False, close + 1
    if not silent:
        token = state.push("math_inline", "math", 0)
        token.content = tex.strip()
        token.markup = "$$" if display else "$"
        token.meta = {"display": display}
    state.pos = after
    return True


def _math_block(state: StateBlock, start_line: int, end_line: int, silent: bool) -> bool:
    begin = state.bMarks[start_line] + state.tShift[start_line]
    maximum = state.eMarks[start_line]
    if state.sCount[start_line] - state.blkIndent >= 4 or not state.src.startswith("$$", begin):
        return False
    first = state.src[begin + 2:maximum].rstrip()
    if first.endswith("$$"):
        body, last_line = first[:-2], start_line  # $$ … $$ on one line
        if not body.strip():
            return False
    elif first.strip():
        return False  # "$$x" with more on the line after: inline math in a paragraph
    else:
        lines = []
        line = start_line + 1
        while line < end_line:
            text = state.src[state.bMarks[line] + state.tShift[line]:state.eMarks[line]].rstrip()
            if text.endswith("$$"):
                lines.append(text[:-2])
                break
            lines.append(text)
            line += 1
        else:
            return False  # never closed: text (while streaming, until the closing line comes)
        body, last_line = "\n".join(lines), line
    if silent:
        return True
    token = state.push("math_block", "math", 0)
    token.block = True
    token.content = body.strip()
    token.markup = "$$"
    token.map = [start_line, last_line + 1]
    state.line = last_line + 1
    return True


def _render_inline(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    token = tokens[idx]
    return to_mathml(token.content, bool(token.meta.get("display")))


def _render_block(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    return to_mathml(tokens[idx].content, True) + "\n"


def math_plugin(md: MarkdownIt) -> None:
    """Add ``$…$`` / ``$$…$$`` to ``md`` (see the module's docstring for the rules)."""
    md.inline.ruler.before("escape", "math_inline", _math_inline)
    md.block.ruler.before("fence", "math_block", _math_block, {"alt": ["paragraph", "reference", "blockquote", "list"]})
    md.add_render_rule("math_inline", _render_inline)
    md.add_render_rule("math_block", _render_block)


def formulas(md: MarkdownIt, text: str) -> list[tuple[str, bool]]:
    """The formulas of ``text`` as ``md`` reads them, in order, each once:
    ``[(tex, display), …]`` (``[]`` fast when there is no ``$``)."""
    if "$" not in text:
        return []
    found: dict[tuple[str, bool], None] = {}
    for token in md.parse(text):
        if token.type == "math_block":
            found.setdefault((token.content, True))
        for child in token.children or ():
            if child.type == "math_inline":
                found.setdefault((child.content, bool(child.meta.get("display"))))
    return list(found)
