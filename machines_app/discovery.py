"""Turn a listing of the ``*.gguf`` files in a machine's models directory into model entries.

Pure Python, no Django, no file system access of its own: the caller lists the
files and supplies a ``read_head(key, nbytes, offset=0)`` function (local read, SSH, ...).
Only the head of each file (header + metadata, see :mod:`machines_app.gguf`) is
ever read, never the weights.

Rules:

* Split sets: files named ``<prefix>-NNNNN-of-MMMMM.gguf`` (llama.cpp's
  gguf-split naming, 5-digit numbers starting at 1) in the same directory with the
  same prefix and part count are one model, listed once under the key of part 1
  (llama-server is given the first part and finds the rest). Metadata comes from
  part 1, or from the lowest present part when part 1 is missing.
* Vision projectors: a file whose name starts with ``mmproj`` (any case), or whose
  ``general.architecture`` is ``clip``, is not a model; it sets ``has_vision`` on
  every model in the same directory, and ``projector_key`` to the projector's key (the
  first by key when a directory holds several): the file llama-server is given with
  ``--mmproj``.
* Names (:func:`model_name`): a model is shown by its GGUF identity, the way people say
  it. ``general.name`` first; where the name leaves out the ``general.size_label`` or
  the ``general.finetune`` ("Llama 3.1" of an "8B" "Instruct" file) they are added. A
  ``general.name`` that is only llama.cpp's converter title-casing the checkpoint
  directory it read (its words are exactly ``general.basename``, ``general.version``,
  ``general.size_label`` and ``general.finetune``: "Smollm2 135M 8k Lc100K Mix1 Ep2") names
  a training run, not the model: when the file name starts with that basename and says
  something else ("SmolLM2-135M-Instruct-Q8_0.gguf"), the file name wins, without its
  quantisation suffix. Without ``general.name``, the basename, size label and finetune;
  without those, the file name without ``.gguf`` (and without ``-00001-of-0000N`` for
  split sets). When two or more models share a name (compared ignoring case and
  surrounding spaces) each is shown as ``"<name> (<file name>)"``.
* A file that cannot be parsed, or whose ``general.architecture`` is missing, empty or
  not a string (llama-server cannot load it), is still listed, with ``error`` set and
  its file name as display name, so the admin sees it; such entries cannot be started.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .gguf import GGUFError, GGUFHead, NeedMoreBytes, parse_head
from .memory import model_shape

__all__ = [
    "INITIAL_HEAD_BYTES",
    "MAX_HEAD_BYTES",
    "InvalidModelKey",
    "ModelInfo",
    "architecture_problem",
    "discover",
    "read_model_head",
    "read_model_heads",
    "split_key_parts",
    "validate_key",
]

#: First read of every file: enough for the metadata of nearly all models.
INITIAL_HEAD_BYTES = 2 * 1024 * 1024
#: Largest head ever read; metadata beyond this is reported as an error.
MAX_HEAD_BYTES = 64 * 1024 * 1024

#: ``read_head(key, nbytes, offset=0)``: up to ``nbytes`` of that file from byte
#: ``offset`` (fewer only where the file ends). The first read of a file is from its start
#: and passes no offset.
ReadHead = Callable[..., bytes]

# llama.cpp llama_split_path(): "%s-%05d-of-%05d.gguf"
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_GGUF_SUFFIX_RE = re.compile(r"\.gguf$", re.IGNORECASE)


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


@dataclass(frozen=True)
class ModelInfo:
    """One model as listed for a machine.

    Attributes:
        key: path relative to the models directory; for split sets the key of part 1
            (or of the lowest present part when part 1 is missing).
        display_name: what the UI shows (see the module docstring for the rules).
        name: ``general.name`` as read (None when absent).
        architecture, size_label, quantization, context_length: from the metadata, see
            :class:`machines_app.gguf.GGUFHead`; context_length is in tokens.
        file_size: bytes on disk; for split sets the sum of the parts present.
        has_chat_template: the file carries a chat template.
        sampling_defaults: the file's ``general.sampling.*`` values by request name
            (:attr:`machines_app.gguf.GGUFHead.sampling_defaults`).
        special_tokens: the strings of its vocabulary the server reads as the template's
            special tokens (:attr:`machines_app.gguf.GGUFHead.special_tokens`).
        has_mtp: the file carries a multi-token-prediction (NextN) head.
        has_vision: a vision projector (mmproj) lies in the same directory.
        projector_key: that projector's key (the first by key when there are several),
            None without one.
        split_count: number of parts (1 for a single file).
        missing_parts: 1-based part numbers absent from a split set; () when complete.
        error: why the file cannot be used (e.g. "not a GGUF file ..."); None when fine.
        memory_shape: what a server of it needs in memory
            (:func:`machines_app.memory.model_shape`, plus ``projector_size``: the bytes of
            its projector file, when it has one).
    """

    key: str
    display_name: str
    name: str | None
    architecture: str | None
    size_label: str | None
    quantization: str | None
    context_length: int | None
    file_size: int
    has_chat_template: bool
    has_mtp: bool
    has_vision: bool
    split_count: int
    missing_parts: tuple[int, ...]
    error: str | None
    projector_key: str | None = None
    sampling_defaults: dict = field(default_factory=dict)
    special_tokens: tuple[str, ...] = ()
    memory_shape: dict = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        """True when the model can be started: no missing split parts and no error."""
        return not self.missing_parts and self.error is None


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


#: ``read_ranges([(key, offset, nbytes), ...])``: for each, what ``read_head`` would give, or
#: the OSError that file gave; one call may serve many files at once (a pipelined batch
#: over SFTP, see ``Transport.read_ranges``).
ReadRanges = Callable[[list[tuple[str, int, int]]], list]

#: Bytes one batch of :func:`read_model_heads` asks for at most (all of it is held in memory).
BATCH_BYTES = 64 * 1024 * 1024


def _next_ask(data: bytes, asked: int, exc: NeedMoreBytes) -> int:
    """How many bytes from the start to hold next, after a parse of ``data`` (``asked``
    were asked for) raised ``exc``; raises GGUFError when there is no point reading on."""
    if len(data) < asked:
        if len(data) < 8:
            raise GGUFError(f"not a GGUF file (only {len(data)} bytes long)") from None
        raise GGUFError("the file ends inside its GGUF metadata (truncated or still being copied?)") from None
    if asked >= MAX_HEAD_BYTES or exc.needed > MAX_HEAD_BYTES:
        raise GGUFError(f"metadata larger than {MAX_HEAD_BYTES // (1024 * 1024)} MiB") from None
    margin = min(exc.needed // 8, INITIAL_HEAD_BYTES)
    return min(max(exc.needed + margin, asked + asked // 4), MAX_HEAD_BYTES)


def read_model_heads(keys: list[str], read_ranges: ReadRanges) -> dict[str, GGUFHead | GGUFError | OSError]:
    """The heads of many files, read in rounds: every file's first INITIAL_HEAD_BYTES in
    one batch, then for those whose metadata goes on, only the bytes past those held, sized
    as :func:`read_model_head` sizes them (what the header says it needs, plus a margin),
    all of them in the next batch. A batch holds at most BATCH_BYTES (files past that wait
    for the next), so a directory of any size is read in bounded memory and, over SSH, in
    a few round trips per batch rather than one per request.

    Returns each key's GGUFHead, or the GGUFError / OSError that file gave."""
    done: dict[str, GGUFHead | GGUFError | OSError] = {}
    state = {key: (b"", INITIAL_HEAD_BYTES) for key in keys}  # bytes held, bytes to hold
    while state:
        batch: list[tuple[str, int, int]] = []
        total = 0
        for key, (data, asked) in state.items():
            want = asked - len(data)
            if batch and total + want > BATCH_BYTES:
                break
            batch.append((key, len(data), want))
            total += want
        answers = read_ranges(batch)
        for (key, _offset, _want), answer in zip(batch, answers, strict=True):
            data, asked = state.pop(key)
            if isinstance(answer, OSError):
                done[key] = answer
                continue
            data += bytes(answer)
            try:
                done[key] = parse_head(data)
            except NeedMoreBytes as exc:
                try:
                    state[key] = (data, _next_ask(data, asked, exc))
                except GGUFError as error:
                    done[key] = error
            except GGUFError as exc:
                done[key] = exc
    return done


def ranges_from(read_head: ReadHead) -> ReadRanges:
    """A :data:`ReadRanges` that reads one range after the other through ``read_head``."""

    def read_ranges(ranges: list[tuple[str, int, int]]) -> list:
        answers: list = []
        for key, offset, nbytes in ranges:
            try:
                answers.append(read_head(key, nbytes) if offset == 0 else read_head(key, nbytes, offset=offset))
            except OSError as exc:
                answers.append(exc)
        return answers

    return read_ranges


def read_model_head(key: str, read_head: ReadHead) -> GGUFHead:
    """Read and parse the head of one file, reading on from where the last read stopped
    until the metadata fits (docs/behaviour.md C42: a header, not the file).

    The first read is INITIAL_HEAD_BYTES from the start; on NeedMoreBytes only the bytes
    past those already held are asked for (``read_head(key, nbytes, offset=have)``), up to
    ``needed`` plus a margin of an eighth of it (at most INITIAL_HEAD_BYTES) for the small
    keys after a long value, and at least a quarter more than before. ``needed`` never
    exceeds what the metadata takes (it is exact for strings, a lower bound for long
    arrays), so a file costs its metadata plus at most INITIAL_HEAD_BYTES, and never
    more than MAX_HEAD_BYTES in all, whatever its header claims.

    Raises GGUFError (plain-words message) for a non-GGUF or corrupt file, a file that
    ends inside its metadata, or metadata larger than MAX_HEAD_BYTES. Exceptions from
    read_head propagate.
    """
    data = bytes(read_head(key, INITIAL_HEAD_BYTES))
    asked = INITIAL_HEAD_BYTES
    while True:
        try:
            return parse_head(data)
        except NeedMoreBytes as exc:
            asked = _next_ask(data, asked, exc)
            # A new bytes object (a copy: a few per file at most): the parse's views of the
            # old one may live on in the exception's frames.
            data += read_head(key, asked - len(data), offset=len(data))


def _is_projector_name(basename: str) -> bool:
    return basename.lower().startswith("mmproj")


@dataclass
class _Candidate:
    """A model before naming: one single file or one split set."""

    key: str
    directory: str
    fallback_name: str  # file name without .gguf / split suffix
    file_size: int
    split_count: int
    missing_parts: tuple[int, ...]
    head: GGUFHead | None = None
    error: str | None = None


def _group(files: Iterable[tuple[str, int]]) -> tuple[list[_Candidate], dict[str, list[str]]]:
    """Group the listing into candidates; also return the mmproj files by directory."""
    singles: list[_Candidate] = []
    splits: dict[tuple[str, str, int], dict[int, tuple[str, int]]] = {}
    vision_dirs: dict[str, list[str]] = {}
    seen: set[str] = set()
    for key, size in files:
        if key in seen:
            continue
        seen.add(key)
        directory, basename = posixpath.split(key)
        if _is_projector_name(basename):
            vision_dirs.setdefault(directory, []).append(key)
            continue
        split = split_key_parts(key)
        if split is None:
            fallback = _GGUF_SUFFIX_RE.sub("", basename) or basename
            singles.append(_Candidate(key, directory, fallback, size, 1, ()))
        else:
            prefix, number, count = split
            splits.setdefault((directory, prefix, count), {})[number] = (key, size)
    candidates = singles
    for (directory, prefix, count), parts in splits.items():
        first = min(parts)
        candidates.append(
            _Candidate(
                key=parts[first][0],
                directory=directory,
                fallback_name=posixpath.basename(prefix),
                file_size=sum(size for _, size in parts.values()),
                split_count=count,
                missing_parts=tuple(n for n in range(1, count + 1) if n not in parts),
            )
        )
    return candidates, vision_dirs


def _load(candidate: _Candidate, head: GGUFHead | GGUFError | OSError | None) -> None:
    try:
        validate_key(candidate.key)
    except InvalidModelKey as exc:
        candidate.error = str(exc)
        return
    if isinstance(head, GGUFError):
        candidate.error = str(head)
        return
    if isinstance(head, OSError) or head is None:
        candidate.error = f"could not read the file: {head}"
        return
    candidate.head = head
    if candidate.split_count > 1 and 1 not in candidate.missing_parts:
        stated = head.split_count
        if stated is not None and stated != candidate.split_count:
            candidate.error = f"the file says the model has {stated} parts, but its name says {candidate.split_count}"
            return
    if 1 not in candidate.missing_parts:  # later parts of a split set carry no architecture of their own
        candidate.error = architecture_problem(head)


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


def _clean_name(head: GGUFHead | None, fallback_name: str = "") -> str | None:
    """The name a model is shown by before ties are told apart (:func:`model_name`)."""
    return model_name(head, fallback_name) if head is not None else None


def model_name(head: GGUFHead, file_stem: str = "") -> str | None:
    """The name of a model from its GGUF identity (the module docstring's rules), or None
    when the file says nothing of itself (the caller shows the file name).

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


def _memory_shape(head: GGUFHead | None, candidate: _Candidate, vision_dirs: dict[str, list[str]],
                  sizes: dict[str, int]) -> dict:
    shape = model_shape(head) if head is not None and candidate.error is None else {}
    if candidate.directory in vision_dirs:
        shape["projector_size"] = sizes.get(min(vision_dirs[candidate.directory]), 0)
    return shape


def _display_names(models: list[_Candidate]) -> dict[str, str]:
    """Each model's display name by key: the name inside its GGUF file; same-named models
    are told apart by their file name, and by their whole key when those match too
    (a.gguf and sub/a.gguf); a file without a name shows its own name."""
    name_counts: dict[str, int] = {}
    for candidate in models:
        name = _clean_name(candidate.head, candidate.fallback_name)
        if name is not None and candidate.error is None:
            name_counts[name.casefold()] = name_counts.get(name.casefold(), 0) + 1

    # Same-named models whose file names also match (a.gguf and sub/a.gguf) are told
    # apart by their whole key, the path under the models directory.
    basename_counts: dict[tuple[str, str], int] = {}
    for candidate in models:
        name = _clean_name(candidate.head, candidate.fallback_name)
        if name is not None and candidate.error is None:
            pair = (name.casefold(), posixpath.basename(candidate.key))
            basename_counts[pair] = basename_counts.get(pair, 0) + 1

    displays: dict[str, str] = {}
    for candidate in models:
        basename = posixpath.basename(candidate.key)
        name = _clean_name(candidate.head, candidate.fallback_name)
        if name is not None and basename_counts.get((name.casefold(), basename), 0) > 1:
            basename = candidate.key
        if candidate.error is not None:
            display = basename
        elif name is None:
            display = candidate.fallback_name
        elif name_counts[name.casefold()] > 1:
            display = f"{name} ({basename})"
        else:
            display = name
        displays[candidate.key] = display
    return displays


def _model_info(candidate: _Candidate, display: str, vision_dirs: dict[str, list[str]],
                sizes: dict[str, int]) -> ModelInfo:
    """What the picker and the catalogue know of one model, from its candidate file."""
    head = candidate.head
    return ModelInfo(
        key=candidate.key,
        display_name=display,
        name=head.name if head else None,
        architecture=head.architecture if head else None,
        size_label=head.size_label if head else None,
        quantization=head.quantization if head else None,
        context_length=head.context_length if head else None,
        file_size=candidate.file_size,
        has_chat_template=head.has_chat_template if head else False,
        has_mtp=head.has_mtp if head else False,
        has_vision=candidate.directory in vision_dirs,
        projector_key=min(vision_dirs[candidate.directory]) if candidate.directory in vision_dirs else None,
        split_count=candidate.split_count,
        missing_parts=candidate.missing_parts,
        error=candidate.error,
        sampling_defaults=head.sampling_defaults if head else {},
        special_tokens=head.special_tokens if head else (),
        memory_shape=_memory_shape(head, candidate, vision_dirs, sizes),
    )


def discover(
    files: list[tuple[str, int]],
    read_head: ReadHead | None = None,
    *,
    read_ranges: ReadRanges | None = None,
    known: dict[str, GGUFHead] | None = None,
    read: Callable[[str, GGUFHead], None] | None = None,
) -> list[ModelInfo]:
    """List the models in a models directory.

    Args:
        files: every ``*.gguf`` file under the models directory as (key, size in bytes);
            key is the '/'-separated path relative to that directory.
        read_head: read_head(key, nbytes, offset=0) returns up to nbytes of that file
            from byte offset (see ReadHead and :func:`read_model_head`). OSError from it
            marks that one file as unreadable; other exceptions propagate.
        read_ranges: instead of ``read_head``, a batch reader (:data:`ReadRanges`): all
            heads are read by :func:`read_model_heads`, a few batches for the directory.
        known: heads already read (by key) of files that did not change since; they
            are not read again.
        read: told ``(key, head)`` of each head read now, to be kept for a later ``known``.

    Returns:
        one ModelInfo per single file or split set (projectors excluded), sorted by
        display_name ignoring case, then key. See the module docstring for the rules.
    """
    files = list(files)
    sizes = dict(files)
    candidates, vision_dirs = _group(files)
    if read_ranges is None and read_head is None:
        raise TypeError("discover() needs read_head or read_ranges")
    reader = read_ranges or ranges_from(read_head)  # type: ignore[arg-type]  # checked just above
    known = known or {}
    wanted = []
    for candidate in candidates:
        try:
            validate_key(candidate.key)
        except InvalidModelKey:
            continue  # never read; _load says why
        if candidate.key not in known:
            wanted.append(candidate.key)
    fresh = read_model_heads(wanted, reader)
    if read is not None:
        for key, found in fresh.items():
            if isinstance(found, GGUFHead):
                read(key, found)
    heads: dict[str, GGUFHead | GGUFError | OSError] = {**known, **fresh}
    for candidate in candidates:
        _load(candidate, heads.get(candidate.key))
    # Projectors recognised by their metadata rather than their file name.
    models: list[_Candidate] = []
    for candidate in candidates:
        if candidate.head is not None and candidate.head.architecture == "clip" and candidate.error is None:
            vision_dirs.setdefault(candidate.directory, []).append(candidate.key)
        else:
            models.append(candidate)

    displays = _display_names(models)
    result = [_model_info(candidate, displays[candidate.key], vision_dirs, sizes) for candidate in models]
    result.sort(key=lambda m: (m.display_name.casefold(), m.key))
    return result
