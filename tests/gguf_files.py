"""Small GGUF files written with gguf.GGUFWriter for the discovery and machine tests.

numpy and gguf only (no Django): tests/test_gguf_discovery.py runs without Django settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

MiB = 1024 * 1024

# (key, value, type) triples for metadata beyond general.architecture / general.name
KV = tuple[str, object, GGUFValueType]


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str | None = None,
    kv: Sequence[KV] = (),
    tensors: dict[str, np.ndarray] | None = None,
    split_max_tensors: int = 0,
    small_first_shard: bool = False,
) -> None:
    """Write a GGUF file (or a gguf-split set when split_max_tensors is set) with GGUFWriter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    if name is not None:
        writer.add_key_value("general.name", name, GGUFValueType.STRING)
    for key, value, vtype in kv:
        writer.add_key_value(key, value, vtype)
    for tensor_name, array in (tensors or {}).items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model(
    root: Path,
    key: str,
    name: str | None = None,
    *,
    arch: str = "llama",
    kv: Sequence[KV] = (),
    tensor_bytes: int = 64,
) -> Path:
    """A single-file model with one small float32 tensor."""
    path = root / key
    write_gguf(path, arch=arch, name=name, kv=kv, tensors={"w": np.zeros(tensor_bytes // 4, dtype=np.float32)})
    return path


def two_long_strings_model(root: Path, key: str = "long.gguf") -> Path:
    """A model whose metadata is two 30 MiB strings (a template and a note), then a short
    key: the shape that once cost 92 MiB of reads, each growth starting again at byte 0."""
    return model(root, key, "Long", kv=[
        ("tokenizer.chat_template", "{{ x }}" + "x" * (30 * MiB), GGUFValueType.STRING),
        ("general.description", "y" * (30 * MiB), GGUFValueType.STRING),
        ("llama.context_length", 2048, GGUFValueType.UINT32),
    ])


def write_split_set(root: Path, prefix: str, name: str | None = "Split Model") -> list[Path]:
    """A 3-part set: part 1 metadata only (no tensors), parts 2 and 3 one tensor each."""
    write_gguf(
        root / f"{prefix}.gguf",
        name=name,
        kv=[("llama.context_length", 4096, GGUFValueType.UINT32)],
        tensors={"a": np.zeros(256, dtype=np.float32), "b": np.ones(256, dtype=np.float32)},
        split_max_tensors=1,
        small_first_shard=True,
    )
    parts = [root / f"{prefix}-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.is_file() for p in parts)
    assert not (root / f"{prefix}.gguf").exists()
    return parts
