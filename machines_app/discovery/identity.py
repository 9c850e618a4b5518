"""What a model file says of itself: the name it is shown by (:func:`model_name`, the rules
of :mod:`machines_app.discovery`'s docstring) and whether it names an architecture
llama-server can load (:func:`architecture_problem`)."""

from __future__ import annotations

import re

from ..gguf import GGUFHead


def _kind_of(value: object) -> str:
    if isinstance(value, bool):
        return "a true/false flag"
    if isinstance(value, int | float):
        return f"the number {value}"
    return "a list"


def architecture_problem(head: GGUFHead) -> str | None:
    """Why llama-server cannot load a file for want of an architecture, or None.

    llama.cpp reads ``general.architecture`` first to pick the model's code and refuses
    a file where that key is missing, empty or not a string ("unknown model
    architecture"); discovery says so before anyone tries to start it.
    """
    value = head.metadata.get("general.architecture")
    if value is None:
        return ("the file does not say which model architecture it is (no general.architecture), "
                "so llama-server cannot load it")
    if not isinstance(value, str):
        return (f"the file's model architecture (general.architecture) is {_kind_of(value)} instead of a name, "
                "so llama-server cannot load it")
    if not value.strip():
        return "the file's model architecture (general.architecture) is empty, so llama-server cannot load it"
    return None


#: A quantisation suffix at the end of a file stem, as llama.cpp's tools and the usual
#: uploaders write it: "-Q8_0", ".Q4_K_M", "-IQ2_XXS", "-f16", "-bf16", "-q4_0_4_4".
_QUANT_SUFFIX_RE = re.compile(r"[-._](?:i?q\d[\w]*|f16|f32|bf16)$", re.IGNORECASE)
_WORD_SPLIT_RE = re.compile(r"[\s\-_]+")


def _words(text: str) -> list[str]:
    return [word.casefold() for word in _WORD_SPLIT_RE.split(text) if word]


def model_name(head: GGUFHead, file_stem: str = "") -> str | None:
    """The name of a model from its GGUF identity (the rules in the docstring of
    :mod:`machines_app.discovery`), or None when the file says nothing of itself (the
    caller shows the file name).

    ``file_stem``: the file name without ``.gguf`` (and the split suffix). Examples:
    ``general.name`` "Gemma 3 270m It" → "Gemma 3 270m It"; "Llama 3.1" with size label
    "8B" and finetune "Instruct" → "Llama 3.1 8B Instruct"; "Smollm2 135M 8k Lc100K Mix1
    Ep2" (basename "smollm2", size label "135M", finetune "8k-lc100k-mix1-ep2") in
    "SmolLM2-135M-Instruct-Q8_0.gguf" → "SmolLM2-135M-Instruct".
    """
    meta = head.metadata

    def text(key: str) -> str:
        value = meta.get(key)
        return value.strip() if isinstance(value, str) else ""

    name, basename = text("general.name"), text("general.basename")
    parts = [part for part in (text("general.size_label"), text("general.finetune")) if part]
    identity = [basename, text("general.version"), *parts]
    stem = _QUANT_SUFFIX_RE.sub("", file_stem).strip() if file_stem else ""
    if name and basename and _words(name) == _words(" ".join(p for p in identity if p)):
        # The converter's own title-casing of the directory it read: the file name,
        # when it is the same model told by its publisher, says more.
        if stem and _words(stem)[:len(_words(basename))] == _words(basename) and _words(stem) != _words(name):
            return stem
        return name
    if name:
        have = _words(name)
        for part in parts:
            words = _words(part)
            if not any(have[i:i + len(words)] == words for i in range(len(have) - len(words) + 1)):
                name = f"{name} {part}"
                have += words
        return name
    if basename:
        return " ".join([basename, *parts])
    return None
