"""What a model needs in memory and what a machine has (docs/behaviour.md §5 "Room on a machine").

Pure Python, no Django, no I/O of its own: the shape of a model comes from its GGUF head
(:func:`model_shape`, stored with the model file at discovery), the machine's figures from
text its transport read there (:func:`parse_meminfo`, :func:`parse_gpus`). Every size is in
bytes.

The estimate of one ``llama-server`` (:func:`estimate`) adds up what llama.cpp allocates:

- the weights: the model file's size (llama.cpp maps or copies every tensor);
- the KV cache: for each layer, K and V of ``head_count_kv × key_length`` (and
  ``value_length``) elements per token of context, 2 bytes each (``--cache-type-k/v``
  default ``f16``). A layer with sliding-window attention keeps only the window plus one
  micro-batch (``n_swa + n_ubatch`` tokens, llama.cpp ``llama_kv_cache_iswa``), which is
  what keeps Gemma 3's cache small;
- the vision projector (mmproj file) when the model has one;
- an overhead measured on real servers (:data:`OVERHEAD`, :data:`OUTPUT_BYTES_PER_TOKEN`):
  the compute buffers, the logits of one micro-batch over the vocabulary, the program.

tests/test_memory.py holds the estimate against the resident memory of real servers.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import Keys

from .gguf import ArraySummary, GGUFHead

MIB = 1024 * 1024

#: llama-server's default micro-batch (``-ub``, tokens): the SWA cache holds one beyond its window.
N_UBATCH = 512
#: llama.cpp pads a KV cache's size to this many cells.
KV_PAD = 256
#: Bytes per cached element for each ``--cache-type-k/v`` (ggml block sizes); f16 is the default.
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
#: Layers out of how many use sliding-window attention, per architecture, where the file
#: does not say (llama.cpp sets the pattern in code: ``hparams.set_swa_pattern``): for
#: Gemma 3 five of every six, the sixth is global.
SWA_PATTERN = {"gemma3": 6, "gemma3n": 5, "gemma2": 2, "cohere2": 4, "gpt-oss": 2}

#: The measured part of a server's memory that is neither weights nor cache nor
#: projector: the program, its libraries and fixed buffers. Measured on this project's
#: llama-server (CPU build) with SmolLM2 135M and Gemma 3 270M at 2,048 tokens and at their
#: trained context: resident memory less weights and cache was 38 MiB for SmolLM2's 49,152
#: vocabulary entries and 74–81 MiB for Gemma 3's 262,144, i.e. about 29 MiB plus 192 bytes
#: per entry; rounded up a little (tests/test_memory.py keeps it within 20 %).
OVERHEAD = 32 * MIB
#: And the part that grows with the vocabulary: the output (logits) and compute buffers,
#: in bytes per vocabulary entry.
OUTPUT_BYTES_PER_TOKEN = 192


def _int(head: GGUFHead, key: str) -> int | None:
    value = head.metadata.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, tuple) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(max(value))  # a per-layer array (some files): the largest layer bounds the cache
    return None


def model_shape(head: GGUFHead) -> dict:
    """What :func:`estimate` needs from a model's GGUF head, as a JSON-able dict (stored on
    the model file): ``n_layer``, ``n_head_kv``, ``k_dim``, ``v_dim``, ``n_swa``,
    ``swa_every``, ``n_vocab``, ``n_ctx_train``. A key the file lacks is left out (the
    estimate is then weights plus overhead only). ``key_length`` missing: the head
    dimension is ``embedding_length / head_count`` (llama.cpp's default)."""
    arch = head.architecture
    if not arch:
        return {}
    shape: dict = {}
    n_layer = _int(head, Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_head = _int(head, Keys.Attention.HEAD_COUNT.format(arch=arch))
    n_head_kv = _int(head, Keys.Attention.HEAD_COUNT_KV.format(arch=arch)) or n_head
    n_embd = _int(head, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
    k_dim = _int(head, Keys.Attention.KEY_LENGTH.format(arch=arch))
    v_dim = _int(head, Keys.Attention.VALUE_LENGTH.format(arch=arch))
    if k_dim is None and n_embd and n_head:
        k_dim = n_embd // n_head
    if v_dim is None:
        v_dim = k_dim
    for name, value in (("n_layer", n_layer), ("n_head_kv", n_head_kv), ("k_dim", k_dim), ("v_dim", v_dim)):
        if value is not None and value > 0:
            shape[name] = value
    n_swa = _int(head, Keys.Attention.SLIDING_WINDOW.format(arch=arch))
    if n_swa and arch in SWA_PATTERN:
        shape["n_swa"], shape["swa_every"] = n_swa, SWA_PATTERN[arch]
    vocab = _int(head, Keys.LLM.VOCAB_SIZE.format(arch=arch))
    tokens = head.metadata.get(Keys.Tokenizer.LIST)
    if vocab is None and isinstance(tokens, ArraySummary):
        vocab = tokens.length
    elif vocab is None and isinstance(tokens, tuple):
        vocab = len(tokens)
    if vocab:
        shape["n_vocab"] = vocab
    if head.context_length:
        shape["n_ctx_train"] = head.context_length
    return shape


@dataclass(frozen=True)
class Need:
    """What one server of a model needs, in bytes, by part; ``context`` in tokens."""

    weights: int
    kv_cache: int
    projector: int
    overhead: int
    context: int | None = None

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.projector + self.overhead

    def words(self) -> str:
        """'about 412 MiB (weights 138 MiB, context of 8,192 tokens 180 MiB, overhead 94 MiB)'."""
        parts = [f"weights {size(self.weights)}"]
        if self.kv_cache:
            tokens = f" of {self.context:,} tokens" if self.context else ""
            parts.append(f"context{tokens} {size(self.kv_cache)}")
        if self.projector:
            parts.append(f"vision projector {size(self.projector)}")
        parts.append(f"overhead {size(self.overhead)}")
        return f"about {size(self.total)} ({', '.join(parts)})"


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def estimate(file_size: int, shape: dict, *, context_size: int | None = None, projector_size: int = 0,
             cache_type: str = "f16") -> Need:
    """The memory of one llama-server of a model: ``file_size`` (the model file, all its
    split parts), its :func:`model_shape`, the session's ``context_size`` (``-c``; None:
    the trained context, which llama-server takes by default), its projector's size."""
    n_ctx = context_size or shape.get("n_ctx_train") or 4096
    kv = 0
    if all(k in shape for k in ("n_layer", "n_head_kv", "k_dim", "v_dim")):
        per_token_layer = shape["n_head_kv"] * (shape["k_dim"] + shape["v_dim"]) * CACHE_TYPE_BYTES.get(cache_type, 2.0)
        cells = _pad(n_ctx, KV_PAD)
        n_layer = shape["n_layer"]
        swa_layers = 0
        if shape.get("n_swa") and shape.get("swa_every"):
            every = shape["swa_every"]
            swa_layers = sum(1 for il in range(n_layer) if (il + 1) % every != 0)
            swa_cells = min(cells, _pad(shape["n_swa"] + N_UBATCH, KV_PAD))
            kv += int(swa_layers * swa_cells * per_token_layer)
        kv += int((n_layer - swa_layers) * cells * per_token_layer)
    overhead = OVERHEAD + shape.get("n_vocab", 0) * OUTPUT_BYTES_PER_TOKEN
    return Need(weights=file_size, kv_cache=kv, projector=projector_size, overhead=overhead, context=n_ctx)


def size(n: int | float | None) -> str:
    """A byte count for people: '412 MiB', '23.5 GiB' (binary units, as free(1) and nvidia-smi count)."""
    if n is None:
        return "unknown"
    if abs(n) >= 1024 * MIB:
        return f"{n / (1024 * MIB):.1f} GiB"
    return f"{round(n / MIB)} MiB"


# --- what a machine has ------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi --query-gpu=index,memory.total,memory.used,memory.free`` reports it (bytes)."""

    index: int
    total: int
    used: int
    free: int


#: The nvidia-smi command whose output :func:`parse_gpus` reads.
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"]


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from ``/proc/meminfo`` (proc(5): kB); None where absent."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            found[name] = int(fields[0]) * 1024
    return found.get("MemTotal"), found.get("MemAvailable")


def parse_gpus(text: str) -> list[Gpu]:
    """Each GPU from :data:`GPU_QUERY`'s output ("0, 24576, 1024, 23552" per line, MiB);
    lines that do not read as four numbers ("[N/A]") are left out."""
    gpus = []
    for row in text.splitlines():
        parts = [part.strip() for part in row.split(",")]
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            index, total, used, free = (int(p) for p in parts)
            gpus.append(Gpu(index, total * MIB, used * MIB, free * MIB))
    return gpus


@dataclass(frozen=True)
class Room:
    """The memory a start is measured against on one machine: ``where`` says which
    ("its memory budget", "GPU memory", "memory"), ``total`` and ``free`` in bytes."""

    where: str
    total: int
    free: int

    def words(self, machine: str) -> str:
        return f"{size(max(self.free, 0))} of {size(self.total)} free on {machine} ({self.where})"


@dataclass(frozen=True)
class Fit:
    """What a start of ``need`` bytes meets: ``kind`` one of FITS, AFTER_SLEEP (put
    ``to_sleep`` — session ids, least recently used first — to sleep, then it fits), WAITS
    (``ahead`` starts before it, or no room even then), TOO_BIG (more than ``room.total``)."""

    FITS = "fits"
    AFTER_SLEEP = "after_sleep"
    WAITS = "waits"
    TOO_BIG = "too_big"

    kind: str
    need: int
    room: Room
    to_sleep: tuple[int, ...] = ()
    ahead: int = 0

    def label(self) -> str:
        """The picker's words for it."""
        if self.kind == self.FITS:
            return "fits now"
        if self.kind == self.AFTER_SLEEP:
            n = len(self.to_sleep)
            return f"fits after sleeping {n} idle server{'s' if n != 1 else ''}"
        if self.kind == self.TOO_BIG:
            return f"too big: needs {size(self.need)}, {self.room.where} is {size(self.room.total)}"
        return "waits for memory" + (f" ({self.ahead} ahead)" if self.ahead else "")


def plan(need: int, room: Room, idle: list[tuple[int, int]], ahead: int = 0) -> Fit:
    """Whether ``need`` bytes fit in ``room``: now, after putting some of ``idle`` to sleep
    (``(session id, bytes it frees)``, least recently used first; as few as do), or not
    yet. A start with others ``ahead`` of it in the machine's line waits its turn; one
    larger than the whole room never fits."""
    if need > room.total:
        return Fit(Fit.TOO_BIG, need, room, ahead=ahead)
    if ahead:
        return Fit(Fit.WAITS, need, room, ahead=ahead)
    if need <= room.free:
        return Fit(Fit.FITS, need, room)
    freed, chosen = 0, []
    for session_id, frees in idle:
        chosen.append(session_id)
        freed += frees
        if need <= room.free + freed:
            return Fit(Fit.AFTER_SLEEP, need, room, to_sleep=tuple(chosen))
    return Fit(Fit.WAITS, need, room)
