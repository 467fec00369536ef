"""A tiny random Llama saved the way Hugging Face saves one (safetensors + config.json),
and a csi-pmem volume staged from it: the model every test here loads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from csi_pmem.loader.staging import open_for_staging, stage

MiB = 1 << 20


def llama_dir(directory: Path, *, tied: bool = False, seed: int = 0,
              hidden: int = 64, kv_heads: int = 2) -> Path:
    """hidden 64, 2 layers, vocab 128, 4 heads over 2 KV heads: Llama's shape in small
    (grouped-query attention, fused qkv and gate_up in vLLM), float32. The engine's CPU
    attention needs a head size of 32 or more: hidden=256 for that."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, tie_word_embeddings=tied,
                      dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def stage_dir(src: Path, volume_dir: Path, name: str = "tiny") -> Path:
    """Stage ``src`` into a directory volume (an fsdax file system mount's layout: the
    image file inside it), as the staging sidecar does; returns the directory."""
    volume_dir.mkdir(parents=True, exist_ok=True)
    with open_for_staging(volume_dir) as vol:
        stage(vol, str(src), name=name)
    return volume_dir
