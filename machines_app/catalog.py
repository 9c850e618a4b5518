"""The list of models on a machine — one function answers it everywhere (docs/behaviour.md §3).

Refreshing reads only the head of each GGUF through the machine's Transport and stores
the result as :class:`ModelFile` rows; the picker, the spawn form and the admin all read
:func:`models_for`.
"""

from __future__ import annotations

import posixpath
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from .discovery import InvalidModelKey, discover, read_model_head, validate_key
from .gguf import GGUFError, GGUFHead
from .models import Machine, ModelFile
from .transports import Transport, TransportError, transport_for


class ModelUnavailable(Exception):
    """A session names a model that cannot be started; the message says why, naming the machine."""


@dataclass(frozen=True)
class ResolvedModel:
    key: str
    path: str  # absolute path on the machine (for a split set: the first part)
    has_mtp: bool
    display_name: str
    mmproj_path: str = ""  # absolute path of its vision projector there; "" without one
    chat_template: str = ""  # a built-in template name an admin set (docs/behaviour.md §17)
    chat_template_file: str = ""  # or a template file, as an absolute path on the machine
    context_length: int | None = None  # <arch>.context_length: the context it was trained with


def context_refusal(model: ResolvedModel, context_size: int | None) -> str | None:
    """Why ``context_size`` (tokens, the ``-c`` of llama-server) cannot be asked of
    ``model``, or None when it can: above the length it was trained with (its GGUF
    ``<arch>.context_length``) llama.cpp either fails to start or answers badly. An
    unknown trained length (docs/behaviour.md C13) or no size chosen (the model's own) is fine."""
    if context_size is None or model.context_length is None or context_size <= model.context_length:
        return None
    return (
        f"{model.display_name} was trained with a context of {model.context_length:,} tokens: choose at most "
        f"{model.context_length:,} (or leave it empty)."
    )


def models_for(machine: Machine) -> QuerySet[ModelFile]:
    """Every model file known on ``machine``, by display name (docs/behaviour.md §3: the same list in
    the picker, the spawn form and the API)."""
    return ModelFile.objects.filter(machine=machine).order_by("display_name", "key")


def _text(value: object, field: str) -> str:
    """A metadata string as the column can hold it: no NUL, no lone surrogate, cut to
    the column's length (docs/behaviour.md C13: odd metadata is shown, never a crash)."""
    text = "" if value is None else str(value)
    text = text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    limit = ModelFile._meta.get_field(field).max_length
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def _count(value: object) -> int | None:
    """A positive count that fits the column, else unknown."""
    return value if isinstance(value, int) and 0 < value < 2**31 else None


class _HeadCache:
    """The heads this process has read, by machine, models directory and key, each with
    the size and modification time its file had: a refresh reads again only the files
    whose size or time changed (or that it has not read yet), so refreshing a directory
    of fifty models that did not change reads none of them. Bounded to ``LIMIT`` heads
    (the oldest go first); a new process reads each file once."""

    LIMIT = 5000

    def __init__(self) -> None:
        self.heads: OrderedDict[tuple[int, str, str], tuple[int, int, GGUFHead]] = OrderedDict()
        self.lock = threading.Lock()

    def unchanged(self, machine_id: int, root: str, stamped: list[tuple[str, int, int]]) -> dict[str, GGUFHead]:
        found = {}
        with self.lock:
            for key, size, mtime in stamped:
                held = self.heads.get((machine_id, root, key))
                if held is not None and held[:2] == (size, mtime):
                    found[key] = held[2]
        return found

    def keep(self, machine_id: int, root: str, stamps: dict[str, tuple[int, int]], key: str, head: GGUFHead) -> None:
        stamp = stamps.get(key)
        if stamp is None:
            return
        with self.lock:
            self.heads[(machine_id, root, key)] = (*stamp, head)
            self.heads.move_to_end((machine_id, root, key))
            while len(self.heads) > self.LIMIT:
                self.heads.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.heads.clear()


_HEADS = _HeadCache()


def refresh_models(machine: Machine) -> list[ModelFile]:
    """Re-read the machine's models directory (heads only, and only of files whose size or
    modification time changed since this process last read them) and store what was found.

    Raises TransportError when the machine or directory cannot be read; the error is also
    kept on the machine for the admin page.
    """
    transport = transport_for(machine)
    try:
        root = transport.expand_path(machine.models_dir)
        stamped = transport.list_gguf_stamped(root)
        known = _HEADS.unchanged(machine.pk, root, stamped)
        stamps = {key: (size, mtime) for key, size, mtime in stamped}
        infos = discover(
            [(key, size) for key, size, _mtime in stamped],
            read_ranges=lambda ranges: transport.read_ranges(
                [(posixpath.join(root, key), offset, n) for key, offset, n in ranges]
            ),
            known=known,
            read=lambda key, head: _HEADS.keep(machine.pk, root, stamps, key, head),
        )
    except TransportError as exc:
        Machine.objects.filter(pk=machine.pk).update(models_refresh_error=str(exc), models_refreshed_at=timezone.now())
        raise
    with transaction.atomic():
        keep = []
        for info in infos:
            if _text(info.key, "key") != info.key:
                continue  # a file name no database column can hold exactly: it could not be started by key
            obj, _ = ModelFile.objects.update_or_create(
                machine=machine,
                key=info.key,
                defaults={
                    "display_name": _text(info.display_name, "display_name"),
                    "name": _text(info.name, "name"),
                    "architecture": _text(info.architecture, "architecture"),
                    "size_label": _text(info.size_label, "size_label"),
                    "quantization": _text(info.quantization, "quantization"),
                    "context_length": _count(info.context_length),
                    "file_size": info.file_size,
                    "has_chat_template": info.has_chat_template,
                    "has_mtp": info.has_mtp,
                    "has_vision": info.has_vision,
                    "projector_key": _text(info.projector_key, "projector_key") if info.projector_key else "",
                    "split_count": info.split_count,
                    "missing_parts": list(info.missing_parts),
                    "error": _text(info.error, "error") if info.error else "",
                    "sampling_defaults": info.sampling_defaults,
                    "special_tokens": list(info.special_tokens),
                    "memory_shape": info.memory_shape,
                },
            )
            keep.append(obj.pk)
        ModelFile.objects.filter(machine=machine).exclude(pk__in=keep).delete()
        Machine.objects.filter(pk=machine.pk).update(models_refresh_error="", models_refreshed_at=timezone.now())
    return list(models_for(machine))


def model_for_session(machine: Machine, key: str,
                      reach: Callable[[Machine], Transport] = transport_for) -> ResolvedModel:
    """The model a session may start, checked before anything starts (docs/behaviour.md §3, §11).

    Raises ModelUnavailable for a key with empty, '.' or '..' parts (never reaching the
    file system), a model the machine does not have, a broken/incomplete file, or a
    machine that cannot be asked. ``reach``: how the machine is reached,
    :func:`transport_for` by default; a page passes :func:`machines_app.transports.reader_for`,
    so another host's local machine is asked through that host.
    """
    try:
        validate_key(key)
    except InvalidModelKey as exc:
        raise ModelUnavailable(str(exc)) from None
    model = ModelFile.objects.filter(machine=machine, key=key).first()
    if model is None:
        raise ModelUnavailable(
            f"Machine '{machine.name}' has no model '{key}' in {machine.models_dir}; "
            "the file has to be on that machine (refresh the model list after copying it there)."
        )
    if model.problem:
        raise ModelUnavailable(f"Model '{model.display_name}' on '{machine.name}' cannot be started: {model.problem}.")
    transport = reach(machine)
    try:
        root = transport.expand_path(machine.models_dir)
        template_file = transport.expand_path(model.chat_template_file) if model.chat_template_file else ""
    except TransportError as exc:
        raise ModelUnavailable(str(exc)) from None
    return ResolvedModel(
        key=key, path=posixpath.join(root, key), has_mtp=model.has_mtp, display_name=model.display_name,
        mmproj_path=posixpath.join(root, model.projector_key) if model.projector_key else "",
        chat_template=model.chat_template, chat_template_file=template_file,
        context_length=model.context_length,
    )


def special_tokens(model: ModelFile) -> list[str]:
    """The strings the server's tokenizer reads as ``model``'s special tokens
    (:attr:`ModelFile.special_tokens`), read from the file's head through its machine once
    when discovery has not (a row from before they were kept) and stored.

    Raises TransportError when the machine cannot be asked or the file cannot be read
    (nothing is stored then: the next request asks again); a file that no longer parses
    gives [] (its server cannot load it either)."""
    if model.special_tokens is not None:
        return model.special_tokens
    transport = transport_for(model.machine)
    path = posixpath.join(transport.expand_path(model.machine.models_dir), model.key)
    try:
        head = read_model_head(model.key, lambda _key, n, offset=0: transport.read_head(path, n, offset))
        found = list(head.special_tokens)
    except GGUFError:
        found = []
    except OSError as exc:
        raise TransportError(f"could not read the model file {path} on {model.machine.name}: {exc}") from None
    ModelFile.objects.filter(pk=model.pk).update(special_tokens=found)
    model.special_tokens = found
    return found


def vision(machine: Machine, key: str) -> tuple[str, bool]:
    """The model's display name (its key when the machine does not list it) and whether it
    takes images: a vision projector was found beside it (docs/behaviour.md §16)."""
    model = ModelFile.objects.filter(machine=machine, key=key).values_list("display_name", "projector_key").first()
    if model is None:
        return key, False
    return model[0], bool(model[1])
