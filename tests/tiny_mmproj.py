"""A tiny vision projector that the real llama-server loads with ``--mmproj``.

No vision model ships with the test kit, so this writes one: a LLaVA-style CLIP encoder
(``clip.projector_type`` ``mlp``) of one block, 32 wide, taking 32×32 images in 16×16
patches, with random weights and an output as wide as the text model's embeddings
(``<arch>.embedding_length`` of the model it goes beside, which llama.cpp's mtmd checks).
The answers about an image are nonsense; what it proves is real: llama-server loads the
pair, turns ``image_url`` parts into image tokens and keeps them in its prompt cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from machines_app.discovery import read_model_head

WIDTH, FFN, HEADS, IMAGE, PATCH = 32, 64, 2, 32, 16


def text_embedding_length(model: Path) -> int:
    """The text model's embedding width, from its GGUF metadata."""
    head = read_model_head(model.name, lambda _key, n: model.read_bytes()[:n])
    return int(head.metadata[f"{head.architecture}.embedding_length"])


def write_tiny_projector(path: Path, text_width: int) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_bool("clip.use_gelu", True)
    for key, value in {"image_size": IMAGE, "patch_size": PATCH, "embedding_length": WIDTH,
                       "feed_forward_length": FFN, "projection_dim": text_width, "attention.head_count": HEADS,
                       "block_count": 1}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def tensor(name: str, *shape: int) -> None:  # numpy order: ggml's ne reversed
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("v.patch_embd.weight", WIDTH, 3, PATCH, PATCH)
    tensor("v.class_embd", WIDTH)
    tensor("v.position_embd.weight", (IMAGE // PATCH) ** 2 + 1, WIDTH)
    for norm in ("v.pre_ln", "v.blk.0.ln1", "v.blk.0.ln2", "v.post_ln"):
        tensor(f"{norm}.weight", WIDTH)
        tensor(f"{norm}.bias", WIDTH)
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensor(f"v.blk.0.{part}.weight", WIDTH, WIDTH)
        tensor(f"v.blk.0.{part}.bias", WIDTH)
    tensor("v.blk.0.ffn_up.weight", FFN, WIDTH)
    tensor("v.blk.0.ffn_up.bias", FFN)
    tensor("v.blk.0.ffn_down.weight", WIDTH, FFN)
    tensor("v.blk.0.ffn_down.bias", WIDTH)
    tensor("mm.0.weight", text_width, WIDTH)
    tensor("mm.0.bias", text_width)
    tensor("mm.2.weight", text_width, text_width)
    tensor("mm.2.bias", text_width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
