"""From a listing of ``*.gguf`` files to the models shown (:func:`discover`): files grouped
into single models and split sets, projectors found, heads read and checked, names told
apart; the rules are in :mod:`machines_app.discovery`'s docstring."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..gguf import GGUFError, GGUFHead
from ..memory import model_shape
from .heads import ReadHead, ReadRanges, ranges_from, read_model_heads
from .identity import architecture_problem, model_name
from .keys import InvalidModelKey, split_key_parts, validate_key

_GGUF_SUFFIX_RE = re.compile(r"\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelInfo:
    """One model as listed for a machine.

    Attributes:
        key: path relative to the models directory; for split sets the key of part 1
            (or of the lowest present part when part 1 is missing).
        display_name: what the UI shows (see the rules in the docstring of machines_app.discovery).
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


def _clean_name(head: GGUFHead | None, fallback_name: str = "") -> str | None:
    """The name a model is shown by before ties are told apart (:func:`model_name`)."""
    return model_name(head, fallback_name) if head is not None else None


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
        display_name ignoring case, then key. See the rules in the docstring of machines_app.discovery.
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
