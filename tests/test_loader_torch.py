"""The torch paths of the loader: CPU views with real dtypes, and the GPU paths.

Skipped without torch (CI has none); the GPU tests also need CUDA. The lead runs them
on the GPU host: ``python -m pytest -q tests/test_loader_torch.py``.
"""

from __future__ import annotations

import pytest

from csi_pmem.loader import (
    ChecksumError,
    load_safetensors,
    open_model,
    open_volume,
    stage,
    start_load,
)
from csi_pmem.weights.layout import read_index
from csi_pmem.weights.mapping import buffer_address

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


@pytest.mark.parametrize("writes", ["readonly", "private"])
def test_cpu_views_share_the_mapping_and_outlive_close(models, writes):
    """readonly views lie in the shared mapping, the default (private) ones in the
    copy-on-write mapping of the same file; neither is unmapped by close()."""
    vol = lm.staged_volume(models / "np", models / "v")
    with open_volume(vol) as v:
        got = load_safetensors(v, "cpu", writes=writes)
        base = v.address if writes == "readonly" else buffer_address(v.private_mapping())
        t = got["f32"]
        assert base <= t.data_ptr() < base + v.size
    # close() must not unmap under live tensors (a use-after-unmap would crash here).
    assert_same(got, reference(models / "np"))


@cuda
@pytest.mark.parametrize("mode", ["bounce", "registered", "hybrid"])
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
    from csi_pmem.loader.gpu import GpuLoader, registered

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
@pytest.mark.parametrize("mode", ["bounce", "registered", "hybrid"])
@pytest.mark.parametrize("where", ["data", "header"])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_gpu_load_refuses_corrupt_data(models, mode, where, kernel, monkeypatch):
    from csi_pmem.loader.gpu import GpuLoader
    from csi_pmem.loader.gpu import verify as gpuverify
    from csi_pmem.loader.model import open_model

    vol = lm.staged_volume(models / "np", models / "v")
    with open_volume(vol) as v:
        view = open_model(v)
        f = view.model.files[0]
        data_start = view.headers[f.name].data_start
    with open(vol, "r+b") as fh:
        # The last tensor bytes are checked on the device, the header from the mapping:
        # its last byte is JSON padding, so a tab there still parses.
        if where == "data":
            fh.seek(f.offset + f.length - 3)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x10]))
        else:
            fh.seek(data_start - 1)
            assert fh.read(1) == b" "
            fh.seek(-1, 1)
            fh.write(b"\t")
    monkeypatch.setenv(gpuverify.KERNEL_ENV, kernel)
    with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=2, mode=mode) as loader, \
            pytest.raises(ChecksumError, match="wsum64"):
        load_safetensors(str(vol), "cuda:0", loader=loader)


@cuda
def test_a_bad_chunk_in_an_early_batch_fails_the_load(tmp_path, monkeypatch):
    """The check compares each batch while the next lands (only the last one is left
    for the load's end): a corrupt byte in the first 64 MiB chunk, checked in the
    first of several batches, still fails the load."""
    import numpy as np

    from csi_pmem.loader.gpu import verify as gpuverify
    from csi_pmem.loader.model import open_model

    monkeypatch.setattr(gpuverify, "BATCH", 1)  # every complete chunk is its own batch
    monkeypatch.setattr(gpuverify, "TAIL_BATCH", 1)
    lm.save_numpy_model(tmp_path / "m", {f"w{i}": np.full(10 << 20, i, dtype=np.float32)
                                         for i in range(4)})
    vol = lm.staged_volume(tmp_path / "m", tmp_path / "v", size=256 * lm.MiB)
    with open_volume(vol) as v:
        view = open_model(v)
        f = view.model.files[0]
        data_start = view.headers[f.name].data_start
    with open(vol, "r+b") as fh:
        fh.seek(data_start + 4096)
        fh.write(b"\x01")
    with pytest.raises(ChecksumError, match=r"1 chunk\(s\) .* first: .*: chunk 0 "):
        load_safetensors(str(vol), "cuda:0")


@cuda
def test_device_sums_equal_the_host_sums():
    import numpy as np

    from csi_pmem.loader.gpu import devsums
    from csi_pmem.weights import wsum

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 3 * 8 * wsum.ROW * 4 + 123, dtype=np.uint8)
    dev = torch.from_numpy(data).cuda()
    for start, end in [(0, len(data)), (8, 8 * wsum.ROW + 5), (16, 24), (0, 3)]:
        assert devsums.device_sums(dev[start:end]) == wsum.cpu_sums(data[start:end].tobytes())
    chunk = 8 * wsum.ROW * 4
    assert devsums.device_chunk_sums(dev[:3 * chunk], chunk) == [
        wsum.cpu_sums(data[i * chunk:(i + 1) * chunk].tobytes()) for i in range(3)]


@cuda
def test_sums_sharing_one_read_back_equal_the_host_sums():
    """Results queued in one Readback (the fallback's) come back in one copy, each where
    it belongs."""
    import numpy as np

    from csi_pmem.loader.gpu import devsums
    from csi_pmem.weights import wsum

    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 * 8 * wsum.ROW * 4 + 123, dtype=np.uint8)
    dev = torch.from_numpy(data).cuda()
    rb = devsums.Readback()
    spans = [(0, len(data)), (8, 8 * wsum.ROW + 5), (16, 24), (0, 3), (40, 8 * wsum.ROW * 2)]
    singles = [devsums.device_sums_async(dev[a:b], rb) for a, b in spans]
    chunk = 8 * wsum.ROW * 4
    chunks = devsums.device_chunk_sums_async(dev[:3 * chunk], chunk, rb)
    assert len(rb._queued) > len(spans)  # nothing read back yet
    assert chunks.result() == [wsum.cpu_sums(data[i * chunk:(i + 1) * chunk].tobytes())
                               for i in range(3)]
    assert rb._queued == []  # all of them in that one read-back
    assert [p.result() for p in singles] == [wsum.cpu_sums(data[a:b].tobytes())
                                             for a, b in spans]
    late = devsums.device_sums_async(dev[8:16], rb)  # noted after a read-back: read on its own
    assert late.result() == wsum.cpu_sums(data[8:16].tobytes())


@cuda
def test_the_checksum_kernel_equals_the_host_sums(monkeypatch):
    """The kernel's sums (whole chunks split over launches, single ranges with a partial
    last word, results over several pages read back more than once) equal numpy's."""
    import numpy as np

    from csi_pmem.loader.gpu import kernelsum
    from csi_pmem.weights import wsum

    monkeypatch.setattr(kernelsum, "PAGE", 4)
    monkeypatch.setattr(kernelsum, "MAX_RANGES", 2)  # 3 and 6 chunks: several launches
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * 8 * wsum.ROW * 4 + 123, dtype=np.uint8)
    dev = torch.from_numpy(data).cuda()
    sums = kernelsum.KernelSums("cuda:0")
    chunk = 8 * wsum.ROW * 4
    first = sums.chunks(dev[:3 * chunk], chunk)
    spans = [(0, len(data)), (8, 8 * wsum.ROW + 5), (16, 24), (0, 3), (40, 8 * wsum.ROW * 2)]
    singles = [sums.range(dev[a:b]) for a, b in spans]
    want = [wsum.cpu_sums(data[i * chunk:(i + 1) * chunk].tobytes()) for i in range(3)]
    assert first() == want
    assert [get() for get in singles] == [wsum.cpu_sums(data[a:b].tobytes()) for a, b in spans]
    later = sums.range(dev[8:16])  # a slot of a page read before: read again
    assert later() == wsum.cpu_sums(data[8:16].tobytes())
    big = sums.chunks(dev[:3 * chunk], chunk // 2)  # more ranges than a page holds
    assert big() == [wsum.cpu_sums(data[i * chunk // 2:(i + 1) * chunk // 2].tobytes())
                     for i in range(6)]
    assert sums.chunks(dev[:10], chunk)() == [] and sums.range(dev[:0])() == (0, 0)


@cuda
def test_a_verified_load_uses_the_kernel(models, monkeypatch):
    """A default verified load sums with the project's kernel, not torch's reductions."""
    from csi_pmem.loader.gpu import devsums, kernelsum
    from csi_pmem.loader.gpu import verify as gpuverify

    made = []
    real = gpuverify.device_sums
    monkeypatch.setattr(gpuverify, "device_sums", lambda device: made.append(
        real(device)) or made[-1])
    monkeypatch.delenv(gpuverify.KERNEL_ENV, raising=False)
    vol = lm.staged_volume(models / "np", models / "v")
    got = load_safetensors(str(vol), "cuda:0")
    assert_same(got, reference(models / "np"))
    assert made and all(isinstance(s, kernelsum.KernelSums) for s in made)
    assert not any(isinstance(s, devsums.TorchSums) for s in made)


@cuda
def test_a_subset_load_is_verified_on_the_host(models):
    vol = lm.staged_volume(models / "sharded", models / "v")
    with open_volume(vol) as v:
        f = read_index(v).models[0].file("model-00002-of-00003.safetensors")
    with open(vol, "r+b") as fh:
        fh.seek(f.offset + f.length - 3)
        fh.write(b"\xff\xfe\xfd")
    with pytest.raises(ChecksumError):
        # One tensor of the file: its chunk also holds bytes this load does not copy.
        load_safetensors(str(vol), "cuda:0", names=["layers.1.3.weight"])


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


def bounce_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "bounce buffers" in r.getMessage()]


@cuda
@pytest.mark.parametrize("mode", ["registered", "auto"])
def test_a_file_on_a_dax_mount_is_never_registered(models, tmp_path, monkeypatch, caplog,
                                                   mode):
    """fsdax: the kernel refuses the pins, so the loader must not even try."""
    from csi_pmem.loader.gpu import GpuLoader, registered
    from csi_pmem.loader.model import open_model
    from csi_pmem.weights import mapping as mapping_mod

    def must_not_register(self, start, end):
        raise AssertionError("a DAX file's mapping was registered")

    monkeypatch.setattr(registered.Registration, "ensure", must_not_register)
    vol = lm.staged_volume(models / "sharded", models / "v")
    fake = lm.fake_mountinfo(tmp_path / "mountinfo",
                             [(str(models), "ext4", "/dev/pmem0", "rw,dax=always")], vol)
    monkeypatch.setattr(mapping_mod, "MOUNTINFO", str(fake))
    caplog.set_level("INFO", logger="csi_pmem.loader.gpu.loader")
    with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=2, mode=mode) as loader, \
            open_volume(vol) as v:
        assert "DAX file system" in (v.registration_refused_reason or "")
        assert loader.register(open_model(v)) is None
        for _ in range(3):  # auto would register from the second load
            got = load_safetensors(v, "cuda:0", loader=loader)
            assert loader.last_path == "bounce"
            assert loader.registration_refused_reason == v.registration_refused_reason
        assert not loader._registrations
    said = [r for r in caplog.records if "DAX file system" in r.getMessage()
            and "bounce buffers" in r.getMessage()]
    assert len(said) == 1  # once per mapping
    assert_same(got, reference(models / "sharded"))


@cuda
def test_cuda_host_register_raising_falls_back_with_one_warning(models, monkeypatch, caplog):
    from csi_pmem.loader.gpu import GpuLoader

    real = torch.cuda.cudart

    class Raising:
        def __init__(self):
            self.rt = real()

        def cudaHostRegister(self, *args):
            raise RuntimeError("simulated binding failure")

        def __getattr__(self, name):
            return getattr(self.rt, name)

    monkeypatch.setattr(torch.cuda, "cudart", Raising)
    vol = lm.staged_volume(models / "np", models / "v")
    with GpuLoader("cuda:0", mode="registered") as loader, open_volume(vol) as v:
        for _ in range(3):
            got = load_safetensors(v, "cuda:0", loader=loader)
            assert loader.last_path == "bounce"
            assert "simulated binding failure" in loader.registration_refused_reason
        assert not loader._registrations
    warned = bounce_warnings(caplog)
    assert len(warned) == 1 and "RuntimeError" in warned[0]
    assert_same(got, reference(models / "np"))


@cuda
@pytest.mark.skipif(not lm.can_make_loop_devices(), reason="needs root and losetup")
def test_a_block_device_loads_through_bounce_buffers(models, monkeypatch):
    from csi_pmem.loader.gpu import GpuLoader, registered

    def must_not_register(self, start, end):
        raise AssertionError("a block device's mapping was registered")

    monkeypatch.setattr(registered.Registration, "ensure", must_not_register)
    backing = lm.volume_file(models / "backing.img", 64 * lm.MiB)
    with lm.loop_device(backing) as device:
        with open_volume(device, writable=True) as v:
            stage(v, str(models / "bf16"))
        with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=2,
                       mode="registered") as loader:
            got = load_safetensors(device, "cuda:0", loader=loader)
            assert loader.last_path == "bounce"
            assert "block device" in loader.registration_refused_reason
    assert_same(got, reference(models / "bf16"))


def _cuda_bindings() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


node_copy = pytest.mark.skipif(not (torch.cuda.is_available() and _cuda_bindings()),
                               reason="needs CUDA and cuda-bindings")


@cuda
@pytest.mark.parametrize("copy", ["driver", "torch"])
def test_both_bounce_copies_are_bit_exact(models, monkeypatch, copy):
    """The default driver-call copy, and torch's ``copy_`` that CSI_PMEM_BOUNCE_COPY=torch
    (or a missing cuda-python) falls back to."""
    if copy == "driver" and not _cuda_bindings():
        pytest.skip("needs cuda-bindings")
    from csi_pmem.loader.gpu import GpuLoader

    monkeypatch.setenv("CSI_PMEM_BOUNCE_COPY", copy)
    vol = lm.staged_volume(models / "sharded", models / "sharded.vol")
    with GpuLoader("cuda:0", buffers=3, buffer_size=4096, threads=3, mode="bounce") as loader, \
            open_volume(vol) as v:
        got = load_safetensors(v, "cuda:0", loader=loader)
        assert (loader._backend.driver_copy is not None) == (copy == "driver")
    assert_same(got, reference(models / "sharded"))


def node_load(vol, tmp_path, verify):
    """Load ``vol`` through the node's copy service (the standalone publication), in a
    loader of its own; the load must take the node path."""
    from csi_pmem.driver.standalone import published
    from csi_pmem.loader.gpu import GpuLoader

    with published(str(vol), str(tmp_path / "pub")) as directory, \
            GpuLoader("cuda:0") as loader:
        handle = start_load(directory, "cuda:0", loader=loader, verify=verify)
        got = handle.result(timeout=60)
        assert handle.path == "node" and loader.node_copy_refused is None
    return got


@node_copy
@pytest.mark.parametrize("verify", [True, False])
def test_the_node_copy_service_loads_bit_exact(models, tmp_path, verify):
    got = node_load(lm.staged_volume(models / "sharded", models / "v"), tmp_path, verify)
    assert_same(got, reference(models / "sharded"))


@node_copy
@pytest.mark.parametrize("verify", [True, False])
def test_a_node_copied_file_in_two_allocations_is_bit_exact(tmp_path, monkeypatch, verify):
    """The first file's head is its own exportable allocation (nodecopy.NODE_HEAD, shrunk
    here to 4 MiB so that a 16 MiB tensor spans the cut): its copies stop at the cut,
    both parts are copied into, and the tensors are views across both."""
    from csi_pmem.loader.gpu import nodecopy

    made: list[list[tuple[int, int]]] = []
    real = nodecopy.ExportableAllocation

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(list(self.parts))

    monkeypatch.setattr(nodecopy, "ExportableAllocation", Recording)
    monkeypatch.setattr(nodecopy, "NODE_HEAD", 4 << 20)
    lm.large_model(tmp_path / "big", 16 << 20)
    got = node_load(lm.staged_volume(tmp_path / "big", tmp_path / "v"), tmp_path, verify)
    assert made and made[0][0] == (0, 4 << 20) and len(made[0]) == 2
    assert_same(got, reference(tmp_path / "big"))


@node_copy
def test_an_allocation_in_two_parts_is_one_range():
    """Both parts mapped back to back: a tensor over the whole range reads what was
    written across the cut, and each part exports its own fd."""
    import os

    from csi_pmem.loader.gpu.nodecopy import ExportableAllocation

    alloc = ExportableAllocation(0, 8 << 20, head=2 << 20)
    try:
        assert alloc.parts == [(0, 2 << 20), (2 << 20, 6 << 20)]
        alloc.map_all()
        t = torch.as_tensor(alloc, device="cuda:0")
        t.copy_((torch.arange(8 << 20, device="cuda:0") % 251).to(torch.uint8))
        assert torch.equal(t.cpu(), (torch.arange(8 << 20) % 251).to(torch.uint8))
        fds = [alloc.export_fd(i) for i in range(2)]
        assert all(fd >= 0 for fd in fds) and fds[0] != fds[1]
        for fd in fds:
            os.close(fd)
        del t
        torch.cuda.synchronize()
        single = ExportableAllocation(0, 8 << 20, head=3 << 20)  # not on the granularity
        assert single.parts == [(0, 8 << 20)]
        single.free()
    finally:
        alloc.free()


@node_copy
def test_a_corrupt_byte_fails_a_node_copied_load(models, tmp_path):
    from csi_pmem.driver.standalone import published

    vol = lm.staged_volume(models / "np", models / "v")
    with open_volume(vol) as v:
        f = read_index(v).models[0].files[0]
    with open(vol, "r+b") as fh:
        fh.seek(f.offset + f.length - 3)
        fh.write(b"\xff\xfe\xfd")
    with published(str(vol), str(tmp_path / "pub")) as directory, \
            pytest.raises(ChecksumError, match="wsum64"):
        load_safetensors(directory, "cuda:0")


@node_copy
def test_the_cuda_copier_takes_back_discarded_events():
    """A token discarded instead of waited for (the copies behind a failed one) gives
    its event back to the pool once its copy completed; none is lost either way."""
    import ctypes
    import os

    from csi_pmem.gpucopy.cuda import CudaCopier
    from csi_pmem.loader.gpu.nodecopy import ExportableAllocation

    copier = CudaCopier()
    alloc = ExportableAllocation(0, 4 << 20)
    host = ctypes.create_string_buffer(1 << 20)
    fd = alloc.export_fd()
    try:
        target = copier.open_target(fd, alloc.size, alloc.uuid)
    finally:
        os.close(fd)
    try:
        pool = len(copier._events[target.ordinal])
        tokens = copier.enqueue(target, [(ctypes.addressof(host), i << 20, 1 << 20)
                                         for i in range(4)])
        assert len(copier._events[target.ordinal]) == pool - 4
        copier.wait(tokens[0])
        torch.cuda.synchronize()
        copier.cu.cuStreamSynchronize(target.stream())
        for token in tokens[1:]:
            copier.discard(token)  # completed by now: back to the pool
        assert len(copier._events[target.ordinal]) == pool
    finally:
        target.close()
        alloc.free()


@node_copy
def test_without_the_service_the_load_falls_back_once(models, tmp_path, caplog):
    import os

    from csi_pmem.driver.standalone import published
    from csi_pmem.loader.gpu import GpuLoader

    vol = lm.staged_volume(models / "sharded", models / "v")
    with published(str(vol), str(tmp_path / "pub")) as directory:
        os.unlink(os.path.join(directory, ".gpu-copy-control.sock"))  # the service "died"
        with GpuLoader("cuda:0") as loader:
            got = load_safetensors(directory, "cuda:0", loader=loader)
            again = load_safetensors(directory, "cuda:0", loader=loader)
            assert loader.last_path in ("hybrid", "registered", "bounce")
            assert "not reachable" in (loader.node_copy_refused or "")
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "in-pod" in r.message]
    assert len(warned) == 1
    assert_same(got, reference(models / "sharded"))
    assert_same(again, reference(models / "sharded"))


FRESH = """
import sys, torch
from csi_pmem.loader import load_safetensors
from csi_pmem.loader.gpu import GpuLoader
path, mode = sys.argv[1], sys.argv[2]
loader = GpuLoader("cuda:0", mode=mode)  # left open: the exit must still be clean
got = load_safetensors(path, "cuda:0", loader=loader)
torch.cuda.synchronize()
print(loader.last_path, len(got))
"""


@cuda
@pytest.mark.parametrize("mode", ["bounce", "registered", "hybrid", "node"])
def test_fresh_processes_exit_cleanly(models, tmp_path, mode):
    import os
    import subprocess
    import sys
    from contextlib import nullcontext
    from pathlib import Path

    if mode == "node" and not _cuda_bindings():
        pytest.skip("needs cuda-bindings")
    from csi_pmem.driver.standalone import published

    vol = lm.staged_volume(models / "sharded", models / "v")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ctx = published(str(vol), str(tmp_path / "pub")) if mode == "node" else nullcontext()
    with ctx as directory:
        for _ in range(5):
            out = subprocess.run([sys.executable, "-c", FRESH, directory or str(vol),
                                  "auto" if mode == "node" else mode], env=env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            assert out.stdout.split()[0] == mode, out.stdout


def batched_model(directory, odd: bool):
    """Eight 24 MiB tensors in one file (three 64 MiB chunks and a bit); with ``odd``
    each is 3 bytes longer, so that every boundary after the first falls inside a word."""
    import numpy as np

    n = (24 << 20) + (3 if odd else 0)
    lm.save_numpy_model(directory, {f"w{i}": (np.arange(n, dtype=np.int64) * (i + 7) % 251)
                                    .astype(np.uint8) for i in range(8)})
    return directory


def batched_load(vol, budget, directory=None):
    """Every tensor of a BatchedLoad on cuda:0, copied to the host, and the load."""
    from csi_pmem.loader.batches import BatchedLoad
    from csi_pmem.loader.model import open_model

    with open_volume(directory or vol) as v:
        load = BatchedLoad(open_model(v), "cuda:0", budget=budget)
        got = {name: t.cpu() for name, t in load}
        try:
            load.verified()
        finally:
            load.settle()
    return got, load


@cuda
@pytest.mark.parametrize("odd", [False, True])
def test_batches_are_checked_on_the_device_across_their_boundaries(tmp_path, odd):
    """Batches of one 24 MiB tensor cut the file's 64 MiB chunks: each piece is summed on the
    device while its batch is alive and the pieces combined, so no tensor byte is
    hashed on the host. Where boundaries fall inside a word the cut chunks go to the
    host, whole, and the load is still verified and bit-exact."""
    src = batched_model(tmp_path / "m", odd)
    vol = lm.staged_volume(src, tmp_path / "v", size=256 * lm.MiB)
    got, load = batched_load(vol, budget=80 << 20)
    assert len(load.batches) > 3 and load.check is not None
    assert_same(got, reference(src))
    if odd:
        assert 0 < load.check.host_bytes < load.nbytes
    else:
        assert load.check.host_bytes == 0 and load.check.device_bytes == load.nbytes


@cuda
def test_the_batches_of_one_load_keep_the_first_ones_path(tmp_path):
    """A batched load is one load of the model: every batch takes the bounce buffers a
    first load takes, none the registered path that the loader chooses from a mapping's
    second load on (each batch would register its own pages and never reuse them)."""
    from csi_pmem.loader.batches import BatchedLoad
    from csi_pmem.loader.gpu.loader import GpuLoader
    from csi_pmem.loader.model import open_model

    src = batched_model(tmp_path / "m", False)
    vol = lm.staged_volume(src, tmp_path / "v", size=256 * lm.MiB)
    loader = GpuLoader("cuda:0", node_copy=False)
    try:
        with open_volume(vol) as v:
            view = open_model(v)
            load = BatchedLoad(view, "cuda:0", budget=80 << 20, loader=loader)
            got = {name: t.cpu() for name, t in load}
            load.verified()
            assert len(load.batches) > 3 and load.path == "bounce"
            # The policy itself is kept: the next load of the mapping is its second.
            second = "bounce" if v.registration_refused_reason else "registered"
            assert loader._choose(view) == second
        assert_same(got, reference(src))
    finally:
        loader.close()


@cuda
@pytest.mark.parametrize("odd", [False, True])
def test_a_damaged_byte_in_a_chunk_two_batches_share_fails_the_load(tmp_path, odd):
    """The byte just before the second batch starts, in chunk 0: the piece of the chunk
    in the first batch carries the damage, the piece in the second does not."""
    from csi_pmem.loader.batches import plan_batches
    from csi_pmem.loader.model import open_model

    src = batched_model(tmp_path / "m", odd)
    vol = lm.staged_volume(src, tmp_path / "v", size=256 * lm.MiB)
    with open_volume(vol) as v:
        view = open_model(v)
        cut = plan_batches(view.select(), 40 << 20)[1][0].offset
    with open(vol, "r+b") as fh:
        fh.seek(cut - 1)
        byte = fh.read(1)
        fh.seek(cut - 1)
        fh.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(ChecksumError, match=r"1 chunk\(s\) .* first: .*: chunk 0 "):
        batched_load(vol, budget=80 << 20)


@node_copy
def test_node_copied_batches_are_checked_on_the_device(tmp_path):
    from csi_pmem.driver.standalone import published

    src = batched_model(tmp_path / "m", odd=False)
    vol = lm.staged_volume(src, tmp_path / "v", size=256 * lm.MiB)
    with published(str(vol), str(tmp_path / "pub")) as directory:
        got, load = batched_load(vol, budget=80 << 20, directory=directory)
    assert load.path == "node" and load.check is not None
    assert load.check.host_bytes == 0 and load.check.device_bytes == load.nbytes
    assert_same(got, reference(src))
    # One connection for the load, and its few allocations filled again and again.
    from csi_pmem.loader.api import default_loader

    pool = default_loader("cuda:0").last_pool
    assert pool is not None and pool.failed is None and pool.report is not None
    assert pool.report["requests"] == len(load.batches) > 3
    assert pool.made <= load.ahead + 1 and pool.made + pool.reused == len(load.batches)
    assert not pool.slots  # every allocation freed once its tensors went


@node_copy
def test_node_copied_batches_survive_a_slot_of_every_size(tmp_path):
    """Tensors of three sizes, a big one among them: the pool lets go of allocations
    to make room within the cap, and every byte still lands."""
    import numpy as np

    from csi_pmem.driver.standalone import published
    from csi_pmem.loader.api import default_loader

    sizes = [8 << 20, 8 << 20, 60 << 20, 8 << 20, 3 << 20, 3 << 20, 8 << 20, 60 << 20, 1]
    src = tmp_path / "m"
    lm.save_numpy_model(src, {f"w{i}": (np.arange(n, dtype=np.int64) * (i + 3) % 253)
                              .astype(np.uint8) for i, n in enumerate(sizes)})
    vol = lm.staged_volume(src, tmp_path / "v", size=256 * lm.MiB)
    with published(str(vol), str(tmp_path / "pub")) as directory:
        got, load = batched_load(vol, budget=72 << 20, directory=directory)
    assert load.path == "node"
    assert_same(got, reference(src))
    pool = default_loader("cuda:0").last_pool
    assert pool is not None and pool.failed is None and pool.let_go >= 1
    assert pool.made + pool.reused == len(load.batches)


@node_copy
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_through_the_node_service_are_bit_exact(tmp_path, tp):
    """Each rank's cuts, as vLLM's loaders make them (a row range; a stretch of every
    row: one 2D copy), through the node's copy service into slots of 2 MiB and out into
    CUDA tensors on the server's stream: bit-exact, and all of them by the service."""
    from safetensors import safe_open

    from csi_pmem.driver.standalone import published
    from csi_pmem.loader.gpu import rankslots, slices

    src = tmp_path / "sharded"
    lm.sharded_model(src)
    for j in range(3):  # rows of a few KB and more than one slot: several copies each
        safetensors_torch.save_file(
            {f"big.{j}.weight": torch.randn(512 * (j + 1), 1024 + 8 * j).to(torch.bfloat16)},
            str(src / f"extra-{j}.safetensors"))
    vol = lm.staged_volume(src, tmp_path / "v")
    want = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            want.update({k: g.get_tensor(k) for k in g.keys()})
    dev = torch.device("cuda:0")
    with published(str(vol), str(tmp_path / "pub")) as directory:
        for rank in range(tp):
            model = open_model(directory)  # open while the copier runs, as vLLM's is
            handle = start_load(model, "cpu", verify=False, writes="readonly")
            volume = model.volume
            copier = rankslots.rank_copier(volume, dev, rank, tp, "readonly", 8 << 20)
            assert copier.path == rankslots.PATH, copier.describe()
            copier.small = 0
            got, cuts = {}, {}
            with slices.active(copier):
                for fut in handle.files.values():
                    for name, view in fut.result().items():
                        dim = 1 if name.endswith(("1.weight", "big.1.weight")) else 0
                        n = view.shape[dim] // tp
                        cuts[name] = (dim, rank * n, n)
                        part = slices.wrap(view).narrow(dim, rank * n, n)
                        got[name] = torch.empty(part.shape, dtype=view.dtype, device=dev)
                        got[name].copy_(part)
            copier.finish()
            torch.cuda.synchronize()
            assert copier.refused is None and copier.node_copied == copier.copied > 0
            for name, (dim, start, n) in cuts.items():
                assert torch.equal(bits(got[name]), bits(want[name].narrow(dim, start, n))), \
                    (name, rank)
            volume.close()
