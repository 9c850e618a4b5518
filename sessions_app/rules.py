"""Text rules that pages, forms and the write layer share, with no import of Django or of
the project: a module below everything that reads them (docs/architecture.md, the layers).

Each ``check_*`` returns the text as it will be stored and raises :class:`SessionError`
with one sentence in the user's terms when it refuses."""

from __future__ import annotations

import unicodedata

#: The longest message a person may send, in characters (after surrounding spaces are cut).
MAX_MESSAGE_CHARS = 200_000


class SessionError(Exception):
    """An action refused, with the reason in the user's terms."""


# Tab, newline and carriage return are text; every other control character (C0, DEL,
# C1) is not something a person types, and PostgreSQL's jsonb cannot store NUL at all.
_TEXT_CONTROLS = {"\t", "\n", "\r"}


def _refuse_controls(text: str, what: str) -> None:
    for index, char in enumerate(text):
        if unicodedata.category(char) == "Cc" and char not in _TEXT_CONTROLS:
            raise SessionError(
                f"{what} contains a control character (U+{ord(char):04X} at character {index + 1:,}), "
                "which cannot be sent; remove it and send again."
            )


#: The longest title a session may have (the column's length).
MAX_TITLE_CHARS = 200


def check_title(title: str) -> str:
    """A session's title as stored, whichever way it comes (the new-session form, the
    settings form, Rename, the admin): one line, as a heading and a tab title show it (runs
    of white space, line breaks included, become one space); '' = "Session <id>". Raises
    SessionError for a control character or more than :data:`MAX_TITLE_CHARS` characters."""
    title = " ".join(title.split())
    _refuse_controls(title, "The title")
    if len(title) > MAX_TITLE_CHARS:
        raise SessionError(f"A title can be at most {MAX_TITLE_CHARS} characters long; this one has {len(title)}.")
    return title


def check_system_prompt(text: str) -> str:
    """A session's system prompt as stored: without surrounding white space ('' = the
    model file's or the deployment's default, docs/behaviour.md §17). Raises SessionError
    for a control character, as for a message."""
    text = text.strip()
    _refuse_controls(text, "The system prompt")
    return text


#: Characters that show nothing and are not white space to str.strip: the Hangul fillers
#: and the braille blank; Unicode format characters (category Cf: U+200B, U+200D, U+2060,
#: U+FEFF…) are found by their category.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def _invisible(char: str) -> bool:
    return char.isspace() or char in _BLANK_LETTERS or unicodedata.category(char) == "Cf"


def check_message(text: str, *, with_images: bool = False) -> str:
    """The message as it will be sent: ``text`` without surrounding white space.

    Raises SessionError with one sentence per reason: nothing typed (and no image
    attached: ``with_images`` lets the text be empty), longer than
    MAX_MESSAGE_CHARS characters, a control character (NUL and the like; tab and new
    lines are fine), only invisible characters (zero-width spaces and the like), or a slash command (not supported for llama.cpp sessions).
    """
    text = text.strip()
    if not text:
        if with_images:
            return ""
        raise SessionError("Type a message first.")
    if all(_invisible(char) for char in text):
        # Zero-width spaces, joiners, a byte-order mark: nothing a person can read, yet
        # tokens the model would answer, as if something had been asked.
        if with_images:
            return ""
        raise SessionError("This message holds only invisible characters (zero-width spaces or the like): "
                           "type something to send.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise SessionError(
            f"This message is {len(text):,} characters long; a message can be at most {MAX_MESSAGE_CHARS:,}."
        )
    _refuse_controls(text, "This message")
    if text.startswith("/"):
        command = text.split()[0]
        raise SessionError(f"{command}: compact and slash commands are not supported for llama.cpp sessions.")
    return text


