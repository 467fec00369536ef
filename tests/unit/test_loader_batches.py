"""Batched loads (csi_pmem.loader.batches): the cut, the order, the bound on batches in
flight and the verification, without a GPU.

The device copy is the one seam: each batch's ``start_load`` is replaced by the real
``start_load`` of the same names on the CPU (numpy views of the mapping), so every
other part (the selection, the cut, the look-ahead, the handle's ``drop``, checksum
verification of a damaged volume) runs as it does on a GPU. What only a GPU shows, the
device memory a batch holds, is measured by benchmarks/bench_vllm.py.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from csi_pmem.loader import ChecksumError, open_model, start_load
from csi_pmem.loader import batches as batches_mod
from csi_pmem.loader.batches import BatchedLoad, plan_batches
from csi_pmem.weights.stformat import TensorInfo

import loader_models as lm

MiB = lm.MiB


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-batches") as d:
        yield d


class CpuStart:
    """``start_load`` of each batch, on the CPU; logs when each batch starts, counted
    against the tensors the consumer has taken. Also the device's shared loader, of
    which a batched load uses ``one_load`` only: ``inside`` says whether every batch
    started within it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.taken = 0
        self.depth = 0
        self.inside = True
        self.caps: list[int | None] = []

    def __call__(self, view, device, *, names, verify, loader):
        assert device == "cuda:0" and loader is None
        names = list(names)
        self.events.append(("start", self.taken))
        self.inside = self.inside and self.depth == 1
        return start_load(view, "cpu", names=names, verify=verify, framework="numpy")

    @contextlib.contextmanager
    def one_load(self, view, cap=None, sizes=()):
        self.caps.append(cap)
        self.sizes = list(sizes)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


@pytest.fixture
def cpu_start(monkeypatch):
    start = CpuStart()
    monkeypatch.setattr(batches_mod, "start_load", start)
    monkeypatch.setattr(batches_mod, "default_loader", lambda device: start)
    return start


def counted(load, start):
    """The load's pairs, counting each one the consumer is done with."""
    for name, tensor in load:
        yield name, tensor
        start.taken += 1


def staged(shm, sharded=True):
    src = shm / "src"
    ref = lm.sharded_model(src, shards=3, per_shard=4) if sharded else lm.numpy_tensors()
    if not sharded:
        lm.save_numpy_model(src, ref)
    vol = lm.staged_volume(src, shm / "vol.img")
    return vol, ref


def test_plan_cuts_runs_within_files_and_keeps_large_tensors_whole(shm):
    vol, _ = staged(shm)
    view = open_model(vol)
    try:
        selection = view.select()
        sizes = sorted({t.nbytes for ts in selection.values() for t in ts})
        limit = sizes[-1] + sizes[0]  # room for one large tensor and a small one at most
        cut = plan_batches(selection, limit)
        flat = [t for ts in selection.values() for t in sorted(ts, key=lambda t: t.offset)]
        assert [t.name for b in cut for t in b] == [t.name for t in flat]  # volume order
        files = {t.name: f for f, ts in selection.items() for t in ts}
        for batch in cut:
            assert len({files[t.name] for t in batch}) == 1  # never across files
            assert len(batch) == 1 or sum(t.nbytes for t in batch) <= limit
        alone = plan_batches(selection, 1)  # every tensor over the limit: one per batch
        assert [len(b) for b in alone] == [1] * len(flat)
    finally:
        view.volume.close()


def test_every_tensor_once_in_volume_order_with_two_batches_at_most(shm, cpu_start):
    vol, ref = staged(shm)
    start = cpu_start
    view = open_model(vol)
    try:
        load = BatchedLoad(view, "cuda:0", budget=2 * 9000, grain=1)
        assert len(load.batches) > 3
        got = {name: np.array(t) for name, t in counted(load, start)}
        load.verified()
        lm.assert_same(got, ref)
        order = [t.name for b in load.batches for t in b]
        assert list(got) == order
        # Batch k+1 starts once the consumer took the first tensor of batch k: so at
        # most two batches (the one read, the one loading) hold memory at any time.
        firsts = [0]
        for b in load.batches[:-1]:
            firsts.append(firsts[-1] + len(b))
        assert start.events == [("start", 0)] + [("start", n + 1) for n in firsts[:-1]]
        assert load.nbytes == sum(a.nbytes for a in ref.values())
        assert load.path == "cpu-view"
        # Every batch started inside the loader's one_load: one load of the mapping.
        assert start.inside and start.depth == 0
        # The node path's slots are told the bound the load keeps to.
        assert start.caps == [max(load.bound, load.budget)]
        assert start.sizes == [s for s in load.sizes if s <= load.limit]
    finally:
        view.volume.close()


KiB = 1024


def held_at_starts(load, start):
    """The device memory each batch's start finds held, counted from the consumer's
    side: batch m is free once the consumer took the first tensor of batch m + 1 and
    asked for the next one (its loop variable held m's last tensor until then)."""
    firsts = [0]
    for size in load.batches:
        firsts.append(firsts[-1] + len(size))
    peak = 0
    for j, (_, taken) in enumerate(start.events):  # batches start in order
        held = sum(load.sizes[m] for m in range(j) if taken < firsts[m + 1] + 1)
        peak = max(peak, held + load.sizes[j])
    return peak


def llama_like(shm, big=60 * KiB, small=(4 * KiB, 12 * KiB)):
    """A big embedding first and a big head last (as Llama's 1002 MiB ones against a
    1 GiB budget), layers of mixed small tensors between."""
    r = lm.rng(7)
    ref = {"a_embed": r.standard_normal(big // 2).astype(np.float16),
           "z_head": r.standard_normal(big // 2).astype(np.float16)}
    for i in range(25):  # 4 KiB tensors first and last
        ref[f"m_layer_{i:02d}"] = r.standard_normal(small[i % 2] // 2).astype(np.float16)
    src = shm / "src"
    lm.save_numpy_model(src, ref)
    return lm.staged_volume(src, shm / "vol.img"), ref


@pytest.mark.parametrize("ahead", [1, 2])
def test_big_tensors_stay_within_the_budget_counted_in_bytes(shm, cpu_start, ahead):
    vol, ref = llama_like(shm)
    start = cpu_start
    view = open_model(vol)
    try:
        budget = 64 * KiB
        load = BatchedLoad(view, "cuda:0", budget=budget, ahead=ahead, grain=1)
        names = [b[0].name for b in load.batches]
        assert names[0] == "a_embed" and len(load.batches[0]) == 1
        assert load.batches[-1][0].name == "z_head"
        # The runs beside a big tensor are cut to the room it leaves (one neighbour
        # each here: the first and the last tensor are the big ones).
        assert load.sizes[1] <= budget - load.sizes[0]
        assert load.sizes[-2] <= budget - load.sizes[-1]
        got = {name: np.array(t) for name, t in counted(load, start)}
        load.verified()
        lm.assert_same(got, ref)
        assert load.bound <= budget
        assert held_at_starts(load, start) == load.bound
    finally:
        view.volume.close()


def test_a_tensor_that_cannot_fit_is_loaded_beyond_the_budget_and_said(shm, cpu_start,
                                                                      caplog):
    vol, ref = llama_like(shm, big=60 * KiB, small=(12 * KiB, 12 * KiB))
    start = cpu_start
    view = open_model(vol)
    try:
        load = BatchedLoad(view, "cuda:0", budget=64 * KiB, ahead=2, grain=1)
        # The embedding and its 12 KiB neighbour, as placed on the device.
        assert load.bound == load.sizes[0] + load.sizes[1] == 72 * KiB
        with caplog.at_level("INFO", logger=batches_mod.__name__):
            got = {name: np.array(t) for name, t in counted(load, start)}
        load.verified()
        lm.assert_same(got, ref)
        assert held_at_starts(load, start) == load.bound
        assert "the load holds up to" in caplog.text, caplog.text
    finally:
        view.volume.close()


def infos(sizes, files=1):
    """Synthetic tensors of ``sizes`` bytes, back to back, spread over ``files``."""
    out = {f"f{k}": [] for k in range(files)}
    for i, n in enumerate(sizes):
        f = f"f{i * files // len(sizes)}"
        offset = sum(t.nbytes for t in out[f])
        out[f].append(TensorInfo(f"t{i:03d}", "U8", (n,), offset, n))
    return out


def test_the_neighbours_of_a_big_tensor_give_up_what_it_needs():
    # The tensor beside the 80 does not fit half its room (10): the split falls back to
    # what fits the whole room (20), one tensor, so the pair stays in the budget.
    cut = plan_batches(infos([5, 80, 15, 10]), 33, 100)
    assert [[t.nbytes for t in b] for b in cut] == [[5], [80], [15], [10]]
    assert batches_mod.peak_held([5, 80, 15, 10], 100, 2) <= 100
    # Counted as allocations of 8-byte grains, the 10 beside the 80 is 16: still fits.
    rounded = plan_batches(infos([5, 80, 15, 10]), 33, 100,
                           lambda b: -(-sum(t.nbytes for t in b) // 8) * 8)
    assert [[t.nbytes for t in b] for b in rounded] == [[5], [80], [15], [10]]
    # Without the budget the runs are as the limit cuts them.
    assert [[t.nbytes for t in b] for b in plan_batches(infos([5, 80, 15, 10]), 33)] == \
        [[5], [80], [15, 10]]


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 200), min_size=1, max_size=30),
       budget=st.integers(2, 200), ahead=st.integers(1, 3), files=st.integers(1, 3),
       grain=st.sampled_from([1, 4, 16]))
def test_every_cut_keeps_order_and_files_and_its_bound_is_the_worst_pair(sizes, budget,
                                                                         ahead, files,
                                                                         grain):
    """``grain``: batches counted as allocations rounded up, as a batched load counts
    them, in the cut and in the window alike."""
    files = min(files, len(sizes))
    selection = infos(sizes, files)
    limit = budget // (ahead + 1)

    def counted(batch):
        return -(-sum(t.nbytes for t in batch) // grain) * grain

    cut = plan_batches(selection, limit, budget, counted)
    flat = [t for ts in selection.values() for t in ts]
    assert [t.name for b in cut for t in b] == [t.name for t in flat]
    owner = {t.name: f for f, ts in selection.items() for t in ts}
    assert all(b and len({owner[t.name] for t in b}) == 1 for b in cut)
    batch_sizes = [counted(b) for b in cut]
    bound = batches_mod.peak_held(batch_sizes, budget, ahead)
    pairs = [a + b for a, b in itertools.pairwise(batch_sizes)]
    # Never over the budget but where one batch, or two neighbours, are on their own.
    assert bound <= max([budget, *batch_sizes, *pairs])
    # Beside a big batch, a neighbour in its file was cut to fit the room it leaves, as
    # counted, unless it is one tensor already.
    for i, b in enumerate(cut):
        if sum(t.nbytes for t in b) <= limit:
            continue
        for j in (i - 1, i + 1):
            if 0 <= j < len(cut) and owner[cut[j][0].name] == owner[b[0].name]:
                assert batch_sizes[i] + batch_sizes[j] <= budget or len(cut[j]) == 1
    # Every batch starts once, in order, before it is awaited.
    window = batches_mod.Window(batch_sizes, budget, ahead)
    started = window.fill()
    for i in range(len(batch_sizes)):
        started += window.need(i)
        assert i in started
        started += window.first_taken(i)
    assert started == list(range(len(batch_sizes)))


def test_batches_are_counted_as_allocated(shm, cpu_start):
    vol, _ = llama_like(shm)
    view = open_model(vol)
    try:
        load = BatchedLoad(view, "cuda:0", budget=8 << 20)
        assert load.sizes and all(n == 2 << 20 for n in load.sizes)  # the 2 MiB grain
        assert load.bound <= 8 << 20
    finally:
        view.volume.close()


def test_a_damaged_chunk_fails_the_load(shm, cpu_start):
    vol, _ = staged(shm)
    view = open_model(vol)
    entry = view.file(next(iter(view.headers)))
    view.volume.close()
    with open(vol, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[entry.end - 1] ^= 0xFF  # the last byte of the first file's last tensor
    view = open_model(vol)
    try:
        load = BatchedLoad(view, "cuda:0", budget=2 * 9000, grain=1)
        for _ in load:
            pass
        with pytest.raises(ChecksumError, match="do not match their staged checksums"):
            load.verified()
    finally:
        view.volume.close()


def test_bad_arguments_are_refused(shm):
    vol, _ = staged(shm)
    view = open_model(vol)
    try:
        with pytest.raises(ValueError, match="CUDA device"):
            BatchedLoad(view, "cpu")
        with pytest.raises(ValueError, match="budget"):
            BatchedLoad(view, "cuda:0", budget=0)
        load = BatchedLoad(view, "cuda:0", names=[])
        assert load.batches == [] and list(load) == []
        with pytest.raises(RuntimeError, match="once"):
            list(load)
    finally:
        view.volume.close()
