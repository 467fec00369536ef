"""device="cpu": torch tensors that are views of the mapping, bit-exact against what
safetensors reads from the same files (real dtypes: bf16 and fp8 included)."""

from __future__ import annotations

import pytest
import tiny
import torch
from safetensors.torch import load_file

from csi_pmem.loader import load_safetensors, open_volume, stage
from csi_pmem.weights.mapping import buffer_address

import loader_models as lm


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def reference(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def make(kind: str, directory):
    if kind == "np":
        lm.save_numpy_model(directory, lm.numpy_tensors())
    elif kind == "bf16":
        lm.bf16_model(directory)
    elif kind == "sharded":
        lm.sharded_model(directory)
    else:
        tiny.llama_dir(directory)


@pytest.mark.parametrize("kind", ["np", "bf16", "sharded", "llama"])
def test_cpu_views_are_bit_exact(tmp_path, kind):
    src = tmp_path / kind
    make(kind, src)
    volume = lm.staged_volume(src, tmp_path / "vol")
    got = load_safetensors(volume, device="cpu")
    ref = reference(src)
    assert got.keys() == ref.keys()
    assert ref, "the reference must not be empty, or nothing was compared"
    for name, want in ref.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == want.dtype, name
        assert tuple(got[name].shape) == tuple(want.shape), name
        assert torch.equal(bits(got[name]), bits(want)), name


def test_cpu_views_are_the_mapping(tmp_path):
    """No copy: a read-only tensor's bytes live in the volume's shared mapping, and a
    default (copy-on-write) one in its private mapping of the same pages."""
    src = tmp_path / "np"
    lm.save_numpy_model(src, lm.numpy_tensors())
    volume = lm.staged_volume(src, tmp_path / "vol")
    with open_volume(volume) as vol:
        t = load_safetensors(vol, device="cpu", writes="readonly")["f32"]
        assert vol.address <= t.data_ptr() < vol.address + vol.size
        cow = load_safetensors(vol, device="cpu")["f32"]
        base = buffer_address(vol.private_mapping())
        assert base <= cow.data_ptr() < base + vol.size


def test_flipped_byte_on_the_volume_fails_the_load(tmp_path):
    src = tmp_path / "np"
    lm.save_numpy_model(src, lm.numpy_tensors())
    path = tmp_path / "vol"
    lm.volume_file(path)
    with open_volume(path, writable=True) as vol:
        model = stage(vol, str(src), name="m").model
        f = model.safetensors[0]
        vol.view(f.offset + f.length - 1, 1)[0] ^= 0xFF  # the last data byte
    from csi_pmem.loader import ChecksumError
    with pytest.raises(ChecksumError, match="do not match"):
        load_safetensors(path, device="cpu")
