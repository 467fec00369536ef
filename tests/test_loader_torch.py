"""The torch paths of the loader: CPU views with real dtypes, and the GPU paths.

Skipped without torch (CI has none); the GPU tests also need CUDA. The lead runs them
on the GPU host: ``python -m pytest -q tests/test_loader_torch.py``.
"""

from __future__ import annotations

import pytest

from csi_pmem.loader import ChecksumError, load_safetensors, open_volume, start_load
from csi_pmem.loader.layout import read_index

import loader_models as lm

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].dtype == v.dtype, k
        assert tuple(got[k].shape) == tuple(v.shape), k
        assert torch.equal(bits(got[k]), bits(v)), k


@pytest.fixture
def models(tmp_path):
    lm.save_numpy_model(tmp_path / "np", lm.numpy_tensors())
    lm.bf16_model(tmp_path / "bf16")
    lm.sharded_model(tmp_path / "sharded")
    lm.many_small_model(tmp_path / "small", 500)
    return tmp_path


def reference(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", ["np", "bf16", "sharded", "small"])
def test_cpu_views_match_safetensors(models, kind):
    vol = lm.staged_volume(models / kind, models / f"{kind}.vol")
    got = load_safetensors(str(vol), "cpu")
    assert_same(got, reference(models / kind))


def test_cpu_views_share_the_mapping_and_outlive_close(models):
    vol = lm.staged_volume(models / "np", models / "v")
    with open_volume(vol) as v:
        got = load_safetensors(v, "cpu")
        base = v.address
        t = got["f32"]
        assert base <= t.data_ptr() < base + v.size
    # close() must not unmap under live tensors (a use-after-unmap would crash here).
    assert_same(got, reference(models / "np"))


@cuda
@pytest.mark.parametrize("mode", ["bounce", "registered"])
@pytest.mark.parametrize("kind", ["np", "bf16", "sharded", "small"])
def test_gpu_matches_safetensors(models, kind, mode):
    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / kind, models / f"{kind}.vol")
    # Tiny buffers so that even small models take many chunks and recycle buffers.
    with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=2, mode=mode) as loader, \
            open_volume(vol) as v:
        got = load_safetensors(v, "cuda:0", loader=loader)
        assert loader.last_path == mode
    assert all(t.device.type == "cuda" for t in got.values())
    assert_same(got, reference(models / kind))


@cuda
def test_gpu_subset_and_futures(models):
    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / "sharded", models / "v")
    ref = reference(models / "sharded")
    with GpuLoader("cuda:0", buffers=2, buffer_size=8192, threads=2) as loader:
        handle = start_load(str(vol), "cuda:0", loader=loader,
                            predicate=lambda n: n.startswith("layers.1."))
        for name, fut in handle.tensors.items():
            assert torch.equal(bits(fut.result(timeout=60)), bits(ref[name]))
        assert list(handle.files) == ["model-00002-of-00003.safetensors"]
        assert set(handle.files["model-00002-of-00003.safetensors"].result()) == \
            {k for k in ref if k.startswith("layers.1.")}
        handle.result()


@cuda
def test_registered_subset_then_whole_model(models):
    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / "sharded", models / "v")
    with GpuLoader("cuda:0", mode="registered") as loader, open_volume(vol) as v:
        part = load_safetensors(v, "cuda:0", loader=loader,
                                predicate=lambda n: n.startswith("layers.1."))
        got = load_safetensors(v, "cuda:0", loader=loader)
        assert loader.last_path == "registered"
    ref = reference(models / "sharded")
    assert_same(got, ref)
    assert_same(part, {k: v for k, v in ref.items() if k.startswith("layers.1.")})


@cuda
def test_a_volume_opened_for_one_load_is_unregistered_after_it(models):
    import time

    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / "np", models / "v")
    with GpuLoader("cuda:0", mode="registered") as loader:
        got = load_safetensors(str(vol), "cuda:0", loader=loader)
        assert loader.last_path == "registered"
        deadline = time.monotonic() + 10
        while loader._registrations and time.monotonic() < deadline:
            time.sleep(0.01)  # released by a done-callback, just after result()
        assert not loader._registrations
    assert_same(got, reference(models / "np"))


@cuda
def test_auto_mode_registers_a_reused_mapping(models):
    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / "np", models / "v")
    with GpuLoader("cuda:0", auto_register_after=2) as loader, open_volume(vol) as v:
        load_safetensors(v, "cuda:0", loader=loader)
        assert loader.last_path == "bounce"
        load_safetensors(v, "cuda:0", loader=loader)
        assert loader.last_path == "registered"


@cuda
def test_refused_registration_falls_back_loudly(models, monkeypatch, caplog):
    from csi_pmem.loader import registered
    from csi_pmem.loader.gpu import GpuLoader

    def refuse(self, start, end):
        raise registered.RegistrationError("cudaHostRegister refused (simulated)")

    monkeypatch.setattr(registered.Registration, "ensure", refuse)
    vol = lm.staged_volume(models / "np", models / "v")
    with GpuLoader("cuda:0", mode="registered") as loader:
        got = load_safetensors(str(vol), "cuda:0", loader=loader)
        assert loader.last_path == "bounce"
    assert "refused (simulated)" in caplog.text and "bounce buffers" in caplog.text
    assert_same(got, reference(models / "np"))


@cuda
def test_gpu_load_refuses_corrupt_data(models):
    vol = lm.staged_volume(models / "np", models / "v")
    with open_volume(vol) as v:
        f = read_index(v).models[0].files[0]
    with open(vol, "r+b") as fh:
        fh.seek(f.offset + f.length - 3)
        fh.write(b"\xff\xfe\xfd")
    with pytest.raises(ChecksumError):
        load_safetensors(str(vol), "cuda:0")


@cuda
@pytest.mark.parametrize("mode", ["bounce", "registered"])
def test_reserved_device_memory_is_used_by_the_next_load(models, mode):
    from csi_pmem.loader.gpu import GpuLoader
    from csi_pmem.loader.model import open_model

    vol = lm.staged_volume(models / "sharded", models / "sharded.vol")
    with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=2, mode=mode) as loader, \
            open_volume(vol) as v:
        view = open_model(v)
        nbytes = loader.reserve(view)
        arena = loader._arena
        assert arena is not None and arena.numel() == nbytes
        start, end = arena.data_ptr(), arena.data_ptr() + nbytes
        got = load_safetensors(v, "cuda:0", loader=loader)
        assert loader._arena is None  # consumed by that load
        assert all(start <= t.data_ptr() < end for t in got.values() if t.numel())
        again = load_safetensors(v, "cuda:0", loader=loader)  # no reservation: fresh memory
    assert_same(got, reference(models / "sharded"))
    assert_same(again, reference(models / "sharded"))
