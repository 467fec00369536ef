"""csi_pmem.loader.load_transformers: a model built from the staged config on meta and
filled with the volume's tensors gives the logits from_pretrained gives, bit for bit."""

from __future__ import annotations

import json

import pytest
import tiny
import torch
from transformers import AutoModelForCausalLM

from csi_pmem.loader import LoaderError, build_on_meta, fill_transformers, load_transformers

import loader_models as lm

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 64, 127, 2]])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_equal_from_pretrained(tmp_path, tied):
    src = tiny.llama_dir(tmp_path / "src", tied=tied)
    if tied:  # the checkpoint really omits the head: tie_weights must supply it
        from safetensors import safe_open
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()
    volume = lm.staged_volume(src, tmp_path / "vol")
    ref = AutoModelForCausalLM.from_pretrained(src).eval()
    model = load_transformers(volume, device="cpu")

    assert not [n for n, p in model.named_parameters() if p.is_meta]
    assert not [n for n, b in model.named_buffers() if b.is_meta]
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        want, got = ref(TOKENS).logits, model(TOKENS).logits
    assert got.shape == (1, TOKENS.shape[1], 128)
    assert torch.equal(got, want)


def test_fill_without_the_buffer_fix_would_fail(tmp_path):
    """The rotary inv_freq is in no checkpoint: load_state_dict alone leaves it on meta
    (what the fill exists to fix; without this the test above could pass vacuously)."""
    src = tiny.llama_dir(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    model = build_on_meta(config)
    from safetensors.torch import load_file
    model.load_state_dict(load_file(str(src / "model.safetensors")), strict=False,
                          assign=True)
    assert [n for n, b in model.named_buffers() if b.is_meta]


def test_missing_tensor_is_named(tmp_path):
    src = tiny.llama_dir(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    from safetensors.torch import load_file
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(LoaderError, match=r"no tensor for model\.layers\.1\.mlp\.down_proj"):
        fill_transformers(build_on_meta(config), weights)


def test_config_comes_from_the_volume(tmp_path):
    """A volume staged without config.json: a LoaderError saying what to stage."""
    src = tiny.llama_dir(tmp_path / "src")
    (src / "config.json").unlink()
    (src / "generation_config.json").unlink()
    volume = lm.staged_volume(src, tmp_path / "vol")
    with pytest.raises(LoaderError, match=r"no staged file .config\.json."):
        load_transformers(volume)
