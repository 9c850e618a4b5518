"""Read the head (header + key/value metadata) of a GGUF model file.

Pure Python, no Django. Input is the first bytes of a file, output is a
:class:`GGUFHead`. The tensor index and the weights are never parsed, so a
caller only has to fetch the head of a (possibly many GiB) model file.

Layout (the GGUF format as ggml defines it, restated here), all little-endian::

    magic        4 bytes  b"GGUF"
    version      u32      2 or 3 (version 1 used u32 counts and is refused)
    tensor_count u64
    kv_count     u64
    kv_count times:
        key        gguf string (u64 byte length + UTF-8 bytes)
        value_type u32      a ``gguf.GGUFValueType``
        value      scalar | gguf string | array (u32 element type, u64 length, elements)
    ... tensor index and tensor data follow (not read here)

Value type numbers and the file-type names come from the ``gguf`` package
(``gguf.GGUFValueType``, ``gguf.LlamaFileType``) rather than being retyped.
The ``split.*`` keys are the ones written by llama.cpp's ``gguf-split`` tool.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from gguf import GGUF_MAGIC, GGUFValueType, Keys, LlamaFileType, TokenType

__all__ = [
    "ARRAY_SUMMARY_THRESHOLD",
    "SAMPLING_KEYS",
    "ArraySummary",
    "GGUFError",
    "GGUFHead",
    "NeedMoreBytes",
    "parse_head",
    "special_token_texts",
]

#: Arrays longer than this are stored as an :class:`ArraySummary`, not as values.
ARRAY_SUMMARY_THRESHOLD = 64

#: The model file's own sampling defaults (``general.sampling.*``, names from the gguf
#: package) → the request parameter of llama-server's ``/v1/chat/completions`` that sets the
#: same value. llama-server applies these keys itself to a request that does not set them
#: (llama.cpp ``common_init_sampler_from_model``); ``general.sampling.sequence`` (the sampler
#: order) has no numeric value and is left out.
SAMPLING_KEYS: dict[str, str] = {
    Keys.General.SAMPLING_TEMP: "temperature",
    Keys.General.SAMPLING_TOP_K: "top_k",
    Keys.General.SAMPLING_TOP_P: "top_p",
    Keys.General.SAMPLING_MIN_P: "min_p",
    Keys.General.SAMPLING_PENALTY_REPEAT: "repeat_penalty",
    Keys.General.SAMPLING_PENALTY_LAST_N: "repeat_last_n",
    Keys.General.SAMPLING_XTC_PROBABILITY: "xtc_probability",
    Keys.General.SAMPLING_XTC_THRESHOLD: "xtc_threshold",
    Keys.General.SAMPLING_MIROSTAT: "mirostat",
    Keys.General.SAMPLING_MIROSTAT_TAU: "mirostat_tau",
    Keys.General.SAMPLING_MIROSTAT_ETA: "mirostat_eta",
}

_MAGIC = GGUF_MAGIC.to_bytes(4, "little")  # b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
#: Above this a version number is taken for damage, not for a newer format.
_LIKELY_VERSIONS = 255

# Sanity limits: a header claiming more than this is corrupt, not just big.
# They exist so that a damaged count or length raises GGUFError instead of
# asking for (or allocating) absurd amounts of memory.
_MAX_TENSOR_COUNT = 1 << 24  # real models have at most tens of thousands
_MAX_KV_COUNT = 1 << 20  # real models have tens to a few hundred keys
_MAX_STRING_BYTES = 1 << 30  # 1 GiB for a single string
_MAX_ARRAY_LENGTH = 1 << 32  # elements in one array
_MAX_ARRAY_DEPTH = 8  # nesting of arrays of arrays

_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# The smallest possible encoded size of one element (a string is at least its u64 length,
# an array at least its u32 type + u64 length); used to estimate how many bytes are needed.
_MIN_ELEMENT_SIZE: dict[GGUFValueType, int] = {
    **{t: s.size for t, s in _SCALAR_FORMATS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
# Smallest key/value pair: empty key (8) + value type (4) + a 1-byte value.
_MIN_KV_SIZE = 13


class GGUFError(ValueError):
    """Not a GGUF file, or a corrupt GGUF header. The message is in plain words."""


class NeedMoreBytes(GGUFError):
    """The buffer ended before the metadata did: retry with a longer head.

    Attributes:
        needed: a byte count (from the start of the file) that is enough to
            get past the point where the buffer ran out; for long arrays and
            remaining key/value pairs it is a lower-bound estimate, so a retry
            may raise NeedMoreBytes again with a larger ``needed``.
    """

    def __init__(self, needed: int, have: int) -> None:
        self.needed = needed
        self.have = have
        super().__init__(f"the GGUF metadata continues past the first {have} bytes; read at least {needed} bytes")


@dataclass(frozen=True)
class ArraySummary:
    """Stand-in for a metadata array longer than ARRAY_SUMMARY_THRESHOLD elements.

    Big arrays (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``, ...) hold tens of
    thousands of entries; only their element type and length are kept.
    """

    element_type: GGUFValueType
    length: int


@dataclass(frozen=True)
class GGUFHead:
    """The parsed head of a GGUF file.

    Attributes:
        version: GGUF format version (2 or 3).
        tensor_count: number of tensors the file says it holds (0 for a
            metadata-only first split part).
        metadata: key -> value. Scalars are int/float/bool, strings are str
            (UTF-8 decoded with errors="replace"), arrays of up to
            ARRAY_SUMMARY_THRESHOLD elements are tuples of such values, longer
            arrays are an :class:`ArraySummary`.
        metadata_end: byte offset where the key/value metadata ends and the
            tensor index begins (0 when not built by :func:`parse_head`).

    The derived properties read ``metadata`` and return None (False for the
    flags) when a key is missing or has an unexpected type; they never raise.
    """

    version: int
    tensor_count: int
    metadata: dict[str, object]
    metadata_end: int = field(default=0, compare=False)
    #: The vocabulary's strings that llama.cpp's tokenizer reads as special tokens of the
    #: template (:func:`special_token_texts`), in vocabulary order; () when the file has
    #: no vocabulary (a projector, a later split part) or it could not be read.
    special_tokens: tuple[str, ...] = field(default=(), compare=False)

    def _str(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    def _int(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def name(self) -> str | None:
        """``general.name``, as stored (may be empty)."""
        return self._str("general.name")

    @property
    def architecture(self) -> str | None:
        """``general.architecture``, e.g. "llama", "gemma3", "clip" (vision projector)."""
        return self._str("general.architecture")

    @property
    def size_label(self) -> str | None:
        """``general.size_label``, e.g. "135M" or "8x7B"."""
        return self._str("general.size_label")

    @property
    def file_type(self) -> int | None:
        """``general.file_type``: a ``gguf.LlamaFileType`` number (e.g. 3 = Q4_1, 15 = Q4_K_M)."""
        return self._int("general.file_type")

    @property
    def quantization(self) -> str | None:
        """Name of ``file_type`` without the MOSTLY_/ALL_ prefix ("Q4_1", "Q4_K_M", "F16", "F32").

        None when the file type is missing, unknown to the ``gguf`` package, or GUESSED.
        """
        file_type = self.file_type
        if file_type is None:
            return None
        try:
            member = LlamaFileType(file_type)
        except ValueError:
            return None
        if member is LlamaFileType.GUESSED:
            return None
        return member.name.removeprefix("MOSTLY_").removeprefix("ALL_")

    @property
    def context_length(self) -> int | None:
        """``<architecture>.context_length``: the training context, in tokens."""
        arch = self.architecture
        return self._int(f"{arch}.context_length") if arch else None

    @property
    def has_chat_template(self) -> bool:
        """True when ``tokenizer.chat_template`` or any ``tokenizer.chat_template.<name>`` is a string."""
        return any(
            (key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")) and isinstance(value, str)
            for key, value in self.metadata.items()
        )

    @property
    def has_mtp(self) -> bool:
        """True when ``<architecture>.nextn_predict_layers`` > 0 (llama.cpp's MTP / NextN head marker)."""
        arch = self.architecture
        if not arch:
            return False
        layers = self._int(f"{arch}.nextn_predict_layers")
        return layers is not None and layers > 0

    @property
    def sampling_defaults(self) -> dict[str, int | float]:
        """The file's ``general.sampling.*`` values by request parameter name (see
        :data:`SAMPLING_KEYS`), e.g. ``{"temperature": 0.6, "top_k": 20}``. Floats are
        stored as float32, so they are rounded to 6 significant digits (0.25 stays 0.25,
        0.6 reads 0.6, not 0.6000000238). Keys of another type, and values that are not
        finite numbers, are left out (docs/behaviour.md C13: odd metadata never breaks a listing)."""
        found: dict[str, int | float] = {}
        for key, name in SAMPLING_KEYS.items():
            value = self.metadata.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue  # NaN and infinities too: no request could carry them
            found[name] = float(f"{value:.6g}") if isinstance(value, float) else value
        return found

    @property
    def split_no(self) -> int | None:
        """``split.no`` as written by gguf-split: the ZERO-based index of this part (file name -00001- is 0)."""
        return self._int("split.no")

    @property
    def split_count(self) -> int | None:
        """``split.count`` as written by gguf-split: number of parts in the set."""
        return self._int("split.count")


class _Cursor:
    """Little-endian reader over a buffer that raises NeedMoreBytes when it runs out."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0

    def need(self, nbytes: int) -> None:
        if self.pos + nbytes > len(self.data):
            raise NeedMoreBytes(needed=self.pos + nbytes, have=len(self.data))

    def unpack(self, fmt: struct.Struct) -> object:
        self.need(fmt.size)
        (value,) = fmt.unpack_from(self.data, self.pos)
        self.pos += fmt.size
        return value

    def u32(self) -> int:
        self.need(4)
        (value,) = _U32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        self.need(8)
        (value,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        return int(value)

    def string_bytes(self, what: str) -> memoryview:
        length = self.u64()
        if length > _MAX_STRING_BYTES:
            raise GGUFError(f"not a GGUF file or damaged: {what} claims to be {length} bytes long")
        self.need(length)
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw

    def string(self, what: str) -> str:
        return str(self.string_bytes(what), "utf-8", errors="replace")


def _value_type(raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"not a GGUF file or damaged: key {key!r} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> object:
    """Read one value of type vtype; big arrays are skipped and summarised."""
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is not None:
        return cur.unpack(fmt)
    if vtype is GGUFValueType.STRING:
        return cur.string(f"the value of {key!r}")
    # ARRAY
    if depth >= _MAX_ARRAY_DEPTH:
        raise GGUFError(f"not a GGUF file or damaged: arrays nested too deeply in {key!r}")
    etype = _value_type(cur.u32(), key)
    length = cur.u64()
    if length > _MAX_ARRAY_LENGTH:
        raise GGUFError(f"not a GGUF file or damaged: array {key!r} claims {length} elements")
    # Fail early with a useful estimate instead of creeping through a long array.
    cur.need(length * _MIN_ELEMENT_SIZE[etype])
    if length <= ARRAY_SUMMARY_THRESHOLD:
        return tuple(_read_value(cur, etype, key, depth + 1) for _ in range(length))
    _skip_array_elements(cur, etype, length, key, depth)
    return ArraySummary(element_type=etype, length=length)


def _skip_array_elements(cur: _Cursor, etype: GGUFValueType, length: int, key: str, depth: int) -> None:
    fmt = _SCALAR_FORMATS.get(etype)
    if fmt is not None:
        cur.need(fmt.size * length)
        cur.pos += fmt.size * length
        return
    if etype is GGUFValueType.STRING:
        data, start, end = cur.data, cur.pos, len(cur.data)
        pos = start
        unpack_from = _U64.unpack_from
        for index in range(length):
            if pos + 8 > end:
                # Guess that the remaining strings are as long, on average, as those seen so far.
                average = (pos - start) / index if index else 8
                raise NeedMoreBytes(needed=pos + int(average * (length - index)) + 8, have=end)
            (size,) = unpack_from(data, pos)
            if size > _MAX_STRING_BYTES:
                raise GGUFError(f"not a GGUF file or damaged: a string in array {key!r} claims {size} bytes")
            pos += 8 + size
        if pos > end:
            raise NeedMoreBytes(needed=pos, have=end)
        cur.pos = pos
        return
    for _ in range(length):  # nested arrays: rare, no need to be fast
        _read_value(cur, GGUFValueType.ARRAY, key, depth + 1)


def parse_head(data: bytes | bytearray | memoryview) -> GGUFHead:
    """Parse the GGUF header and all key/value metadata from the first bytes of a file.

    Args:
        data: the first N bytes of the file (any N; the whole file works too).

    Returns:
        a GGUFHead; ``metadata_end`` is the number of bytes the parse needed.

    Raises:
        NeedMoreBytes: ``data`` ends before the metadata does; ``.needed`` says how many
            bytes to read next time (at least; estimates may be refined by a later retry).
        GGUFError: not a GGUF file (wrong magic: text, safetensors, ...), an unsupported
            version, a big-endian file, or a corrupt header (unknown value type, absurd
            counts or lengths, duplicate keys). Never MemoryError for corrupt counts.
    """
    cur = _Cursor(data)
    head = bytes(cur.data[:4])
    if head != _MAGIC[: len(head)]:
        raise GGUFError(f"not a GGUF file (it starts with {head!r}, not b'GGUF')")
    cur.need(4)
    cur.pos = 4
    version = cur.u32()
    if version not in _SUPPORTED_VERSIONS:
        if version in (v << 24 for v in (1, 2, 3)):
            raise GGUFError("big-endian GGUF files are not supported")
        if version == 1:
            raise GGUFError("GGUF version 1 is too old; convert the file with a current llama.cpp")
        if version > _LIKELY_VERSIONS:
            # Not a version any llama.cpp wrote: bytes that merely start with "GGUF" (a
            # truncated download, a file overwritten in place).
            raise GGUFError(f"not a GGUF file or damaged: its header names GGUF version {version}, which does not exist")
        raise GGUFError(f"unsupported GGUF version {version}: Corral reads versions 2 and 3; "
                        "this file is newer than Corral")
    tensor_count = cur.u64()
    kv_count = cur.u64()
    if tensor_count > _MAX_TENSOR_COUNT:
        raise GGUFError(f"not a GGUF file or damaged: tensor count {tensor_count} is absurd")
    if kv_count > _MAX_KV_COUNT:
        raise GGUFError(f"not a GGUF file or damaged: metadata key count {kv_count} is absurd")

    metadata: dict[str, object] = {}
    vocabulary: dict[str, tuple[int, int]] = {}  # tokens / token types → where their array lies
    for index in range(kv_count):
        try:
            key = cur.string(f"key #{index}")
            vtype = _value_type(cur.u32(), key)
            start = cur.pos
            value = _read_value(cur, vtype, key)
            if key in (_TOKENS, _TOKEN_TYPES) and vtype is GGUFValueType.ARRAY:
                vocabulary[key] = (start, cur.pos)
        except NeedMoreBytes as exc:
            # Also account for the key/value pairs that are still to come.
            remaining = kv_count - index - 1
            raise NeedMoreBytes(needed=exc.needed + remaining * _MIN_KV_SIZE, have=exc.have) from None
        if key in metadata:
            raise GGUFError(f"not a GGUF file or damaged: duplicate metadata key {key!r}")
        metadata[key] = value
    specials: tuple[str, ...] = ()
    if _TOKENS in vocabulary and _TOKEN_TYPES in vocabulary:
        types = _array_ints(cur.data, *vocabulary[_TOKEN_TYPES])
        # Only the tokens of a type that can be special are decoded: a vocabulary has
        # 50,000 to 260,000 strings and a few hundred of those.
        maybe = {i for i, kind in enumerate(types) if kind in _MAYBE}
        tokens = _array_strings(cur.data, *vocabulary[_TOKENS], keep=maybe)
        specials = special_token_texts(tokens, types, _templates(metadata))
    return GGUFHead(
        version=version, tensor_count=tensor_count, metadata=metadata, metadata_end=cur.pos, special_tokens=specials
    )


_TOKENS = Keys.Tokenizer.LIST  # "tokenizer.ggml.tokens"
_TOKEN_TYPES = Keys.Tokenizer.TOKEN_TYPE  # "tokenizer.ggml.token_type"
_MAYBE = frozenset(int(t) for t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED))


def special_token_texts(tokens: list[str], types: list[int], templates: list[str]) -> tuple[str, ...]:
    """The strings of the vocabulary ``tokens`` (``tokenizer.ggml.tokens``) that the
    server's tokenizer would read as the template's special tokens in a message's text.

    llama.cpp's tokenizer matches the text of every CONTROL, UNKNOWN and USER_DEFINED
    token (``types``: ``tokenizer.ggml.token_type``, values of gguf's ``TokenType``) in a
    prompt before anything else, and llama-server tokenises a chat prompt with special
    tokens on. Kept:

    - every CONTROL and UNKNOWN token (``<|im_start|>``, ``<end_of_turn>``, ``<unk>``…);
    - a USER_DEFINED token only when a chat template of the file (``templates``) writes
      it: these are also the model's ordinary spelling of text (Gemma's ``<table>``), and
      breaking them up everywhere would change how a model reads plain HTML. The ones a
      template writes (``<tool_call>``) are its markup.

    Left out: strings shorter than two characters (nothing can be put inside them) and
    strings of white space only (``▁`` counts as white space): neither can open a turn.
    Returns the strings in vocabulary order, each once.
    """
    wanted = {int(TokenType.CONTROL), int(TokenType.UNKNOWN)}
    user_defined = int(TokenType.USER_DEFINED)
    found: dict[str, None] = {}
    for text, kind in zip(tokens, types, strict=False):
        if len(text) < 2 or not text.replace("\u2581", " ").strip():
            continue
        if kind in wanted or (kind == user_defined and any(text in template for template in templates)):
            found[text] = None
    return tuple(found)


def _templates(metadata: dict[str, object]) -> list[str]:
    return [
        value for key, value in metadata.items()
        if (key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")) and isinstance(value, str)
    ]


def _array_strings(data: memoryview, start: int, end: int, keep: set[int]) -> list[str]:
    """The elements of a string array whose encoding (element type, count, elements)
    lies in ``data[start:end]``, "" for each index not in ``keep``, and only up to the
    last index in ``keep`` (the rest is never walked: a vocabulary whose special tokens
    come first costs a few steps, not one per token); [] for an array of another type.
    Already bounds-checked by the parse that found it."""
    cur = _Cursor(data[start:end])
    etype, length = cur.u32(), cur.u64()
    if etype != GGUFValueType.STRING or not keep:
        return []
    found = []
    view, pos, unpack_from = cur.data, cur.pos, _U64.unpack_from
    for index in range(min(length, max(keep) + 1)):
        (size,) = unpack_from(view, pos)
        pos += 8
        found.append(str(view[pos:pos + size], "utf-8", errors="replace") if index in keep else "")
        pos += size
    return found


def _array_ints(data: memoryview, start: int, end: int) -> list[int]:
    """The elements of an integer array in ``data[start:end]``; [] for another type."""
    cur = _Cursor(data[start:end])
    etype, length = cur.u32(), cur.u64()
    fmt = _SCALAR_FORMATS.get(GGUFValueType(etype))  # a known type: the parse checked it
    if fmt is None or etype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL):
        return []
    return [int(value) for (value,) in fmt.iter_unpack(cur.data[cur.pos : cur.pos + fmt.size * length])]
