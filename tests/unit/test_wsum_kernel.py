"""The checksum kernel's compiled module: built from the source in the repository, the
right image picked per GPU, launch geometry, and the fallback when it cannot load."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from csi_pmem.loader.gpu import devsums, kernelsum, wsum_kernel
from csi_pmem.loader.gpu import verify as gpuverify

ROOT = Path(__file__).resolve().parents[2]


def test_the_compiled_module_is_the_sources():
    """Edit wsum_kernel.cu, then run scripts/gen_wsum_kernel.py: this fails until then."""
    source = (ROOT / "csi_pmem" / "loader" / "gpu" / "_native" / "wsum_kernel.cu").read_bytes()
    assert wsum_kernel.SOURCE_SHA256 == hashlib.sha256(source).hexdigest()
    assert f".entry {wsum_kernel.KERNEL}(" in wsum_kernel.PTX
    assert f"__launch_bounds__({wsum_kernel.BLOCK})" in source.decode()
    for cc, text in wsum_kernel.CUBINS.items():
        image = base64.b64decode(text)
        assert image[:4] == b"\x7fELF", cc  # a cubin is an ELF image
        assert wsum_kernel.KERNEL.encode() in image


@pytest.mark.parametrize("capability,kind", [((9, 0), "cubin sm_90"), ((8, 0), "cubin sm_80"),
                                             ((8, 9), "cubin sm_89"), ((7, 5), "PTX"),
                                             ((10, 0), "PTX"), ((12, 0), "PTX")])
def test_each_gpu_gets_its_cubin_or_the_ptx(capability, kind):
    image, got = kernelsum.image_for(capability)
    assert got == kind
    if kind == "PTX":
        assert image.endswith(b"\0") and b".target sm_70" in image
    else:
        assert image.startswith(b"\x7fELF")


def test_grid_width_grows_with_the_range_and_is_capped():
    per_block = 8 * wsum_kernel.BLOCK * kernelsum.WORDS_PER_THREAD
    assert kernelsum.grid_x(0) == kernelsum.grid_x(per_block - 1) == 1
    assert kernelsum.grid_x(5 * per_block) == 5
    assert kernelsum.grid_x(64 << 20) == min(kernelsum.MAX_BLOCKS, (64 << 20) // per_block)
    assert kernelsum.grid_x(1 << 40) == kernelsum.MAX_BLOCKS


def test_a_batch_larger_than_a_grid_is_split_into_launches():
    m = kernelsum.MAX_RANGES
    assert kernelsum.launches(0) == []
    assert kernelsum.launches(5) == [(0, 5)]
    assert kernelsum.launches(m) == [(0, m)]
    assert kernelsum.launches(2 * m + 3) == [(0, m), (m, m), (2 * m, 3)]


@pytest.mark.parametrize("ptr,stride", [(0x1004, 0), (0x1000, 12)])
def test_a_misaligned_range_is_refused_before_the_device_sees_it(ptr, stride):
    """A misaligned word read would be a device fault that poisons the CUDA context; the
    check refuses it instead, before any driver call (there is no driver here)."""
    sums = kernelsum.KernelSums.__new__(kernelsum.KernelSums)
    with pytest.raises(ValueError, match="8-byte aligned"):
        sums._launch(ptr, 64, 2, stride, 0x2000)


def test_without_the_kernel_the_check_uses_torch(monkeypatch):
    """No torch or CUDA here, so the kernel cannot load: the check falls back (and
    CSI_PMEM_VERIFY_KERNEL=torch asks for the fallback without trying)."""
    tried = []

    class Refused:
        def __init__(self, device):
            tried.append(device)
            raise RuntimeError("no CUDA")

    monkeypatch.setattr(kernelsum, "KernelSums", Refused)
    monkeypatch.delenv(gpuverify.KERNEL_ENV, raising=False)
    assert isinstance(gpuverify.device_sums("cuda:0"), devsums.TorchSums) and tried == ["cuda:0"]
    monkeypatch.setenv(gpuverify.KERNEL_ENV, "torch")
    assert isinstance(gpuverify.device_sums("cuda:1"), devsums.TorchSums) and tried == ["cuda:0"]
