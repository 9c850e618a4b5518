"""Model keys: a model's path relative to the models directory, checked before it is used
(:func:`validate_key`), and the parts of a gguf-split set told by their names
(:func:`split_key_parts`)."""

from __future__ import annotations

import posixpath
import re

# llama.cpp llama_split_path(): "%s-%05d-of-%05d.gguf"
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


class InvalidModelKey(ValueError):
    """A model key that is not a safe path relative to the models directory. The message is for the user."""


def validate_key(key: str) -> str:
    """Check that key is a safe '/'-separated path relative to the models directory.

    Refused (InvalidModelKey): the empty string, absolute paths ('/x'), empty parts
    ('a//b', a trailing '/'), '.' or '..' parts, backslashes and NUL characters.
    Returns key unchanged when it is fine. Never touches the file system.
    """
    if not isinstance(key, str) or key == "":
        raise InvalidModelKey("Model key must not be empty.")
    if "\x00" in key:
        raise InvalidModelKey(f"Model key {key!r} is not allowed: it may not contain NUL characters.")
    if "\\" in key:
        raise InvalidModelKey(f"Model key {key!r} is not allowed: it may not contain backslashes.")
    if key.startswith("/"):
        raise InvalidModelKey(f"Model key {key!r} is not allowed: it must be relative to the models directory.")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidModelKey(f"Model key {key!r} is not allowed: parts may not be empty, '.' or '..'.")
    return key


def split_key_parts(key: str) -> tuple[str, int, int] | None:
    """For a gguf-split part return (key without "-NNNNN-of-MMMMM.gguf", part number, part count).

    None when the file name (last part of key) is not a split part name, has an empty
    prefix, or inconsistent numbers (part 0, part > count). Part numbers are 1-based as
    in the file names, e.g. "dir/X-00002-of-00003.gguf" -> ("dir/X", 2, 3).
    """
    directory, basename = posixpath.split(key)
    match = _SPLIT_RE.match(basename)
    if match is None:
        return None
    number, count = int(match["no"]), int(match["count"])
    if not 1 <= number <= count:
        return None
    return posixpath.join(directory, match["prefix"]), number, count
