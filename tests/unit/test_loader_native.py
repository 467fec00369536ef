"""The native bounce loop (csi_pmem/loader/gpu/_native/bounce.c) on its fake device, without a GPU.

In fake mode a transfer lands only when its buffer is next waited for, as a copy engine
may still read a pinned buffer long after the transfer was queued: a loop that refilled
a buffer before waiting for it would produce wrong bytes here. The library is built by
the project's install (setup.py); these tests fail, not skip, where it is missing,
because CI installs with a compiler and must ship it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loader_pipeline import random_model, tensors_from

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu import native
from csi_pmem.weights.errors import LoaderError


def fake_run(source: bytes, tensors, *, nbuffers=3, size=1000, threads=3, on_done=None,
             src_fd=-1):
    placements, total = planning.place(tensors)
    chunks = planning.bounce_chunks(placements, size)
    dest = ctypes.create_string_buffer(max(total, 1))
    flat = native.plan_bounce([placements], [ctypes.addressof(dest)], size)
    assert flat.chunks == native.flatten([chunks], [ctypes.addressof(dest)]).chunks
    src = ctypes.create_string_buffer(source, len(source))
    buffers = [ctypes.create_string_buffer(size) for _ in range(nbuffers)]
    ready = bytearray(nbuffers)
    completion = planning.Completion(placements, chunks)
    finished = list(completion.ready)
    reported: list[int] = []

    def done(index: int) -> None:
        c = chunks[index]
        assert flat.span(index) == (0, c.dst, c.nbytes)
        reported.append(c.seq)
        finished.extend(completion.done(c))
        if on_done is not None:
            on_done(c)

    native.run(flat, ctypes.addressof(src), [ctypes.addressof(b) for b in buffers], ready,
               size, done,
               threads=threads, fake=True, src_fd=src_fd)
    return placements, dest.raw[:total], finished, reported, chunks, ready


def test_the_library_is_built():
    assert native.library() is not None, \
        "csi_pmem/loader/gpu/_native/bounce*.so is missing: pip install -e . builds it (needs gcc)"


@pytest.mark.parametrize("seed", range(8))
def test_bytes_exact_every_chunk_once(seed):
    rnd = random.Random(seed)
    ts, source = random_model(rnd, 60)
    placements, dest, finished, reported, chunks, ready = fake_run(
        source, ts, nbuffers=rnd.choice([1, 2, 5, 8]), threads=rnd.choice([1, 2, 3, 4]))
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source[p.src:p.src + p.nbytes], p
    assert sorted(reported) == [c.seq for c in chunks]
    assert sorted(finished) == sorted(t.name for t in ts)
    assert 1 <= sum(ready) <= min(len(ready), len(chunks)), "prepared buffers are flagged"


@pytest.mark.parametrize("seed", range(4))
def test_reading_the_file_moves_the_same_bytes(tmp_path, seed):
    """src_fd: the workers pread() each piece from the file at its offset; the mapping
    address is not used (a zeroed buffer stands in for it, so a memcpy would show)."""
    rnd = random.Random(seed)
    ts, source = random_model(rnd, 60)
    path = tmp_path / "volume.img"
    path.write_bytes(source)
    fd = os.open(path, os.O_RDONLY)
    try:
        placements, dest, finished, reported, chunks, _ = fake_run(
            bytes(len(source)), ts, nbuffers=rnd.choice([1, 3, 8]),
            threads=rnd.choice([1, 2, 4]), src_fd=fd)
    finally:
        os.close(fd)
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source[p.src:p.src + p.nbytes], p
    assert sorted(reported) == [c.seq for c in chunks]
    assert sorted(finished) == sorted(t.name for t in ts)


def test_a_file_shorter_than_its_pieces_is_an_error_not_zeros(tmp_path):
    ts = tensors_from([1000] * 20)
    path = tmp_path / "short.img"
    path.write_bytes(b"x" * 5000)  # the pieces reach 20000
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(native.NativeError, match="ended early"):
            fake_run(bytes(20000), ts, nbuffers=2, threads=2, src_fd=fd)
    finally:
        os.close(fd)


def test_a_closed_fd_is_refused_before_the_loop_starts():
    ts = tensors_from([1000] * 4)
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as info:
        fake_run(bytes(4000), ts, nbuffers=2, threads=2, src_fd=r)
    assert info.value.errno == errno.EBADF


def test_the_loop_reads_through_its_own_fd(tmp_path):
    """The caller's fd (the volume's) closed mid-load, its number taken by another
    file: the workers still read the volume, and the caller's fd is never closed by
    the loop."""
    ts = tensors_from([1000] * 40)
    source = bytes(range(256)) * 160
    path = tmp_path / "volume.img"
    path.write_bytes(source)
    other = tmp_path / "other.img"
    other.write_bytes(bytes(len(source)))
    fd = os.open(path, os.O_RDONLY)
    taken: list[int] = []

    def close_the_volume(c):
        if not taken:
            os.close(fd)
            taken.append(os.open(other, os.O_RDONLY))  # likely the same number

    try:
        placements, dest, _, reported, chunks, _ = fake_run(
            source, ts, nbuffers=2, threads=2, src_fd=fd, on_done=close_the_volume)
    finally:
        for f in taken:
            os.close(f)
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source[p.src:p.src + p.nbytes], p
    assert sorted(reported) == [c.seq for c in chunks]
    fd2 = os.open(path, os.O_RDONLY)
    try:
        fake_run(source, ts[:2], src_fd=fd2)
        os.fstat(fd2)  # still the caller's
    finally:
        os.close(fd2)


def test_more_threads_than_buffers():
    ts = tensors_from([300] * 30)
    source = bytes(range(256)) * 40
    placements, dest, _, reported, chunks, _ = fake_run(source, ts, nbuffers=2, threads=6)
    assert sorted(reported) == [c.seq for c in chunks]
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source[p.src:p.src + p.nbytes]


def test_a_callback_error_stops_the_loop_and_is_raised():
    ts = tensors_from([1000] * 200)
    seen = []

    def boom(c):
        seen.append(c.seq)
        if len(seen) == 3:
            raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        fake_run(bytes(200_000), ts, nbuffers=2, threads=2, on_done=boom)
    assert len(seen) == 3  # nothing is reported after the error


def test_a_chunk_larger_than_its_buffer_is_an_error():
    chunk = planning.Chunk(0, 0, 0, 64, (planning.Piece(0, 0, 64),))
    src = ctypes.create_string_buffer(64)
    dest = ctypes.create_string_buffer(64)
    buf = ctypes.create_string_buffer(32)
    with pytest.raises(native.NativeError, match="larger than its bounce buffer"):
        native.run(native.flatten([[chunk]], [ctypes.addressof(dest)]),
                   ctypes.addressof(src), [ctypes.addressof(buf)], bytearray(1), 32,
                   lambda c: None, fake=True)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=40),
       gaps=st.lists(st.sampled_from([0, 0, 3, 64, 300]), min_size=40, max_size=40),
       skip=st.lists(st.booleans(), min_size=40, max_size=40),
       buffer_size=st.integers(1, 4096), targets=st.integers(1, 3))
def test_the_native_planner_cuts_what_the_python_one_does(sizes, gaps, skip, buffer_size,
                                                          targets):
    """csi_bounce_plan and chunks.bounce_chunks make the same chunks and pieces, in the
    same order, for whole files and subsets (skipped tensors leave holes), over
    several targets with their own device bases; the flat plan's spans and bounds say
    where each chunk lands."""
    ts = tensors_from(sizes, gaps)
    chosen = [t for t, s in zip(ts, skip, strict=False) if not s] or ts
    by_target, chunks_by_target, seq = [], [], 0
    for i in range(targets):
        placements, _ = planning.place(chosen[i::targets])
        by_target.append(placements)
        chunks_by_target.append(planning.bounce_chunks(placements, buffer_size, i, seq))
        seq += len(chunks_by_target[-1])
    bases = [(i + 1) << 40 for i in range(targets)]
    flat = native.plan_bounce(by_target, bases, buffer_size)
    want = native.flatten(chunks_by_target, bases)
    assert (flat.chunks, flat.pieces, flat.first) == (want.chunks, want.pieces, want.first)
    every = [c for cs in chunks_by_target for c in cs]
    assert [flat.span(i) for i in range(len(flat))] == \
        [(c.target, c.dst, c.nbytes) for c in every]
    for i, cs in enumerate(chunks_by_target):
        assert flat.bounds(i) == ([c.dst for c in cs], [c.dst + c.nbytes for c in cs])


@pytest.mark.parametrize("seed", range(3))
def test_the_native_planner_at_every_buffer_size(seed):
    """Every buffer size from one byte to past the whole load, for a subset with holes:
    windows that a run fills exactly, or misses by one byte, are rare for random sizes."""
    rnd = random.Random(seed)
    ts, _ = random_model(rnd, 12)
    placements, total = planning.place([t for t in ts if rnd.random() < 0.7])
    for size in range(1, total + 2):
        flat = native.plan_bounce([placements], [0], size)
        want = native.flatten([planning.bounce_chunks(placements, size)], [0])
        assert (flat.chunks, flat.pieces) == (want.chunks, want.pieces), size


def test_the_native_planner_refuses_an_empty_buffer():
    with pytest.raises(ValueError, match="buffer_size"):
        native.plan_bounce([[planning.Placement("a", 0, 0, 8)]], [0], 0)


def test_the_switch(monkeypatch):
    monkeypatch.setenv(native.ENV, "off")
    assert native.library() is None
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(LoaderError, match="CSI_PMEM_BOUNCE_NATIVE='fast'"):
        native.library()


def test_without_libcuda_the_gpu_mode_says_what_is_missing():
    """On a host without a CUDA driver (CI), a non-fake run fails with a clear error
    instead of crashing; the GPU loader never asks for it there."""
    chunk = planning.Chunk(0, 0, 0, 8, (planning.Piece(0, 0, 8),))
    src = ctypes.create_string_buffer(8)
    buf = ctypes.create_string_buffer(8)
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this host has a CUDA driver")
    except OSError:
        pass
    with pytest.raises(native.NativeError, match="libcuda"):
        native.run(native.flatten([[chunk]], [0]), ctypes.addressof(src),
                   [ctypes.addressof(buf)], bytearray(1), 8, lambda c: None)
