"""Text files attached to a message (docs/behaviour.md §16, "Text files").

Code, logs and Markdown go to any model as text: each file becomes a fenced block after
the message's own text, headed by its name, so the model reads it and the transcript keeps
it as it was sent (the message is what was said; there is no second store). A file is
refused, with a sentence naming it, when it is larger than ``CORRAL_TEXT_FILE_MAX_BYTES``
or is not text (not UTF-8, or it holds NUL bytes: a binary file); the whole message is
then not sent, as for an image refused.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from django.conf import settings

from .images import Upload, megabytes
from .rules import MAX_MESSAGE_CHARS

__all__ = ["TextFileRefused", "attach", "limits_sentence", "max_bytes", "max_count", "read_text"]


class TextFileRefused(Exception):
    """A file that cannot go as text; the message says why, naming the file."""


#: Control characters a log may carry (colour codes, bells) other than tab and new lines:
#: replaced by U+FFFD, which the model reads as "a character was here".
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab, new lines
#: File extension → the fence's language (Pygments' names), for the common ones.
LANGUAGES = {".py": "python", ".js": "javascript", ".ts": "typescript", ".md": "markdown", ".json": "json",
             ".sh": "bash", ".rs": "rust", ".go": "go", ".c": "c", ".h": "c", ".cpp": "cpp", ".java": "java",
             ".html": "html", ".css": "css", ".sql": "sql", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml",
             ".rb": "ruby", ".php": "php", ".diff": "diff", ".patch": "diff", ".log": "text", ".txt": "text"}


def max_bytes() -> int:
    """``CORRAL_TEXT_FILE_MAX_BYTES``: the largest text file a message may carry."""
    return settings.CORRAL_TEXT_FILE_MAX_BYTES


def max_count() -> int:
    """How many text files one message may carry (``CORRAL_IMAGE_MAX_COUNT``, the same limit as images)."""
    return settings.CORRAL_IMAGE_MAX_COUNT


def limits_sentence() -> str:
    """The composer's line about text files."""
    return (f"Text files (code, logs, Markdown) go to any model as text, up to {megabytes(max_bytes())} each "
            f"and {MAX_MESSAGE_CHARS:,} characters in all with the message.")


def read_text(upload: Upload) -> str:
    """The text of ``upload``, new lines as ``\\n``; raises :class:`TextFileRefused`."""
    name = upload.name or "the file"
    if upload.length > max_bytes():
        raise TextFileRefused(f"{name} is {megabytes(upload.length)}; a text file can be at most "
                              f"{megabytes(max_bytes())}.")
    try:
        text = upload.data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise TextFileRefused(f"{name} is not a text file (code, logs and Markdown are attached as text; "
                              "images only to a model that takes them).")
    return _CONTROLS.sub("\ufffd", text.replace("\r\n", "\n").replace("\r", "\n"))


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in ``text`` (CommonMark closes a
    fence only with one at least as long), so a file never ends its own block."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def attach(text: str, uploads: list[Upload]) -> str:
    """``text`` followed by each file as a fenced block: ``name:`` then the fence, with
    a language from the extension when known. Raises :class:`TextFileRefused` for the
    first file refused, or for more files than :func:`max_count`."""
    if len(uploads) > max_count():
        raise TextFileRefused(f"A message can carry at most {max_count()} text files; this one has {len(uploads)}.")
    parts = [text] if text else []
    for upload in uploads:
        content = read_text(upload)
        name = PurePath(upload.name or "file").name
        fence = _fence(content)
        language = LANGUAGES.get(PurePath(name).suffix.lower(), "")
        parts.append(f"{name}:\n{fence}{language}\n{content.rstrip(chr(10))}\n{fence}")
    whole = "\n\n".join(parts)
    if len(whole) > MAX_MESSAGE_CHARS:
        names = ", ".join(PurePath(u.name or "file").name for u in uploads)
        raise TextFileRefused(f"With its files ({names}) this message is {len(whole):,} characters long; a message "
                              f"can be at most {MAX_MESSAGE_CHARS:,}. Send fewer or smaller files at once.")
    return whole
