#!/usr/bin/env python3
"""Write a synthetic safetensors model of a given size, shaped like a decoder LLM.

Why synthetic: the GPU benchmark needs >= 16 GB of weights on a host that cannot
download any, and CI needs the same shapes at a few MB. Tensors are bf16 (what real
checkpoints ship) with a few f32 norms; every tensor's bytes differ (a random block
plus a per-tensor offset), so a loader that copies the wrong range fails the
comparison instead of copying identical zeros. Some bf16 patterns are NaN: compare
raw bits, not values. Shards are capped like the
Hugging Face default (5 GB) and come with ``model.safetensors.index.json`` and a
``config.json``. Data is streamed, so memory use stays at one 64 MiB block.

Usage: benchmarks/make_model.py --size-gb 16 --out /dev/shm/model [--shard-gb 5]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np

BLOCK = 64 << 20


def layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...], str]]:
    inter = hidden * 7 // 2
    kv = max(hidden // 8, 64)
    return [("input_layernorm.weight", (hidden,), "F32"),
            ("self_attn.q_proj.weight", (hidden, hidden), "BF16"),
            ("self_attn.k_proj.weight", (kv, hidden), "BF16"),
            ("self_attn.v_proj.weight", (kv, hidden), "BF16"),
            ("self_attn.o_proj.weight", (hidden, hidden), "BF16"),
            ("post_attention_layernorm.weight", (hidden,), "F32"),
            ("mlp.gate_proj.weight", (inter, hidden), "BF16"),
            ("mlp.up_proj.weight", (inter, hidden), "BF16"),
            ("mlp.down_proj.weight", (hidden, inter), "BF16")]


# Llama-3-8B's shapes (hidden 4096, 32 layers, GQA with 8 KV heads, MLP 14336, vocab
# 128256) with q/k/v biases as Qwen2 has them: 16.06 GB of bf16 in 387 tensors of mixed
# sizes, from 8 KB biases to 1 GB embeddings; what a vLLM-shaped load must stream.
LLAMA3_8B = {"hidden": 4096, "layers": 32, "kv": 1024, "inter": 14336, "vocab": 128256}


def llama3_8b() -> tuple[int, list[tuple[str, tuple[int, ...], str]]]:
    h, kv, inter = LLAMA3_8B["hidden"], LLAMA3_8B["kv"], LLAMA3_8B["inter"]
    layer = [("input_layernorm.weight", (h,), "BF16"),
             ("self_attn.q_proj.weight", (h, h), "BF16"),
             ("self_attn.q_proj.bias", (h,), "BF16"),
             ("self_attn.k_proj.weight", (kv, h), "BF16"),
             ("self_attn.k_proj.bias", (kv,), "BF16"),
             ("self_attn.v_proj.weight", (kv, h), "BF16"),
             ("self_attn.v_proj.bias", (kv,), "BF16"),
             ("self_attn.o_proj.weight", (h, h), "BF16"),
             ("post_attention_layernorm.weight", (h,), "BF16"),
             ("mlp.gate_proj.weight", (inter, h), "BF16"),
             ("mlp.up_proj.weight", (inter, h), "BF16"),
             ("mlp.down_proj.weight", (h, inter), "BF16")]
    tensors = [("model.embed_tokens.weight", (LLAMA3_8B["vocab"], h), "BF16")]
    for i in range(LLAMA3_8B["layers"]):
        tensors += [(f"model.layers.{i}.{n}", s, d) for n, s, d in layer]
    tensors += [("model.norm.weight", (h,), "BF16"),
                ("lm_head.weight", (LLAMA3_8B["vocab"], h), "BF16")]
    return h, tensors


SHAPES = ("synthetic", "llama3-8b")


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return int(np.prod(shape)) * (4 if dtype == "F32" else 2)


def plan(size: int) -> tuple[int, list[tuple[str, tuple[int, ...], str]]]:
    """Pick a hidden size so that 8+ layers fill ``size`` bytes; list every tensor."""
    hidden = 8192
    while hidden > 64 and sum(nbytes(s, d) for _, s, d in layer_shapes(hidden)) * 8 > size:
        hidden //= 2
    vocab = max(1000, min(32000, size // (hidden * 2 * 16)))
    tensors = [("model.embed_tokens.weight", (vocab, hidden), "BF16")]
    used = nbytes(*tensors[0][1:])
    per_layer = sum(nbytes(s, d) for _, s, d in layer_shapes(hidden))
    layers = max(1, (size - 2 * used) // per_layer)
    for i in range(layers):
        tensors += [(f"model.layers.{i}.{n}", s, d) for n, s, d in layer_shapes(hidden)]
    tensors += [("model.norm.weight", (hidden,), "F32"),
                ("lm_head.weight", (vocab, hidden), "BF16")]
    return hidden, tensors


def shard(tensors: list, shard_bytes: int) -> list[list]:
    shards, cur, cur_size = [], [], 0
    for t in tensors:
        size = nbytes(t[1], t[2])
        if cur and cur_size + size > shard_bytes:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(t)
        cur_size += size
    return shards + ([cur] if cur else [])


def write_shard(path: str, tensors: list, block: np.ndarray, seed: int) -> int:
    header, off = {}, 0
    for name, shape, dtype in tensors:
        size = nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    scratch = np.empty_like(block)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (_, shape, dtype) in enumerate(tensors):
            left = nbytes(shape, dtype)
            salt = np.uint8((seed * 131 + i * 7 + 1) % 251 + 1)
            while left:
                take = min(left, BLOCK)
                if dtype == "F32":  # keep norms finite floats near 1.0
                    chunk = np.full(take // 4, 1.0 + float(salt) / 1024, "<f4").view(np.uint8)
                else:  # wraps in uint8: distinct bytes per tensor
                    chunk = np.add(block[:take], salt, out=scratch[:take])
                f.write(memoryview(chunk))
                left -= take
    return off


def make(size: int, out: str, shard_bytes: int = 5 * 10**9, seed: int = 0,
         shape: str = "synthetic") -> dict:
    """``shape``: "synthetic" (sized to ``size``) or "llama3-8b" (``size`` unused)."""
    os.makedirs(out, exist_ok=True)
    hidden, tensors = llama3_8b() if shape == "llama3-8b" else plan(size)
    block = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
    shards = shard(tensors, shard_bytes)
    weight_map, total = {}, 0
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(os.path.join(out, name), part, block, i)
        weight_map.update({t[0]: name for t in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"model_type": "synthetic", "shape": shape, "hidden_size": hidden,
                   "num_tensors": len(tensors)}, f, indent=1)
    return {"bytes": total, "tensors": len(tensors), "shards": len(shards), "hidden": hidden}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=0.0,
                   help="total weight bytes, in GB (the synthetic shape)")
    p.add_argument("--shape", choices=SHAPES, default="synthetic")
    p.add_argument("--out", required=True)
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.shape == "synthetic" and a.size_gb <= 0:
        p.error("--size-gb is required for the synthetic shape")
    info = make(int(a.size_gb * 1e9), a.out, int(a.shard_gb * 1e9), a.seed, a.shape)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
