"""The GPU path's CPU-side logic, without torch: planning, buffer recycling, NUMA.

The fake device performs each "DMA" only when its buffer is waited on, as a real copy
engine may still be reading a pinned buffer long after the transfer was queued: a
pipeline that refills a buffer before waiting for it produces wrong bytes here.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time

import pytest

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu.pipeline import BouncePipeline
from csi_pmem.loader.gpu.registered import register_pieces
from csi_pmem.numa import node_cpus, parse_cpulist
from csi_pmem.weights.mapping import buffer_address
from csi_pmem.weights.stformat import TensorInfo


class LazyDevice:
    """Transfers land at wait() time; records the most buffers ever in flight."""

    def __init__(self, nbuffers: int, size: int, dest: bytearray, jitter: float = 0.0):
        self.buffers = [bytearray(size) for _ in range(nbuffers)]
        self.addresses = [buffer_address(b) for b in self.buffers]
        self.dest = dest
        self.pending: dict[int, planning.Chunk] = {}
        self.lock = threading.Lock()
        self.max_inflight = 0
        self.jitter = jitter

    def buffer_address(self, buf: int) -> int:
        with self.lock:
            assert buf not in self.pending, "buffer refilled while its transfer is queued"
        return self.addresses[buf]

    def transfer(self, buf: int, chunk: planning.Chunk) -> None:
        with self.lock:
            self.pending[buf] = chunk
            self.max_inflight = max(self.max_inflight, len(self.pending))

    def wait(self, buf: int) -> None:
        if self.jitter:
            time.sleep(random.random() * self.jitter)
        with self.lock:
            chunk = self.pending.pop(buf)
        self.dest[chunk.dst:chunk.dst + chunk.nbytes] = self.buffers[buf][:chunk.nbytes]


def tensors_from(sizes: list[int], gaps: list[int] | None = None) -> list[TensorInfo]:
    out, off = [], 0
    for i, n in enumerate(sizes):
        off += (gaps[i] if gaps else 0)
        out.append(TensorInfo(f"t{i}", "U8", (n,), off, n))
        off += n
    return out


def run_pipeline(source: bytes, tensors, *, nbuffers=3, size=1000, threads=3, jitter=0.0):
    placements, total = planning.place(tensors)
    chunks = planning.bounce_chunks(placements, size)
    dest = bytearray(total)
    dev = LazyDevice(nbuffers, size, dest, jitter)
    src = ctypes.create_string_buffer(source, len(source))
    completion = planning.Completion(placements, chunks)
    finished = list(completion.ready)
    pipe = BouncePipeline(dev, nbuffers, size, threads)
    try:
        pipe.run(chunks, ctypes.addressof(src), lambda c: finished.extend(completion.done(c)))
    finally:
        pipe.close()
    return placements, dest, finished, dev


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("0-8:4") == [0, 4, 8]
    assert parse_cpulist("") == []
    with pytest.raises(ValueError):
        parse_cpulist("a-b")


def test_node_cpus_intersects_allowed(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text(f"{allowed[0]},{max(allowed) + 100}\n")
    assert node_cpus(1, sysfs=str(tmp_path)) == [allowed[0]]
    # A node whose CPUs this process may not use, or an unknown node: all allowed CPUs.
    (tmp_path / "node2").mkdir()
    (tmp_path / "node2" / "cpulist").write_text(f"{max(allowed) + 100}\n")
    assert node_cpus(2, sysfs=str(tmp_path)) == allowed
    assert node_cpus(7, sysfs=str(tmp_path)) == allowed
    assert node_cpus(None) == allowed


def test_place_keeps_contiguous_runs_and_alignment():
    ts = [TensorInfo("a", "F32", (4,), 1000, 16), TensorInfo("b", "F32", (4,), 1016, 16),
          TensorInfo("c", "F16", (3,), 5000, 6), TensorInfo("e", "F32", (0,), 6000, 0)]
    placements, total = planning.place(ts)
    a, b, c, e = placements
    assert b.dst == a.dst + 16  # contiguous in the file -> contiguous on the device
    assert c.dst % planning.GRANULE == 5000 % planning.GRANULE and c.dst >= b.dst + 16
    assert a.dst % 4 == 1000 % 4
    assert total == max(p.dst + p.nbytes for p in placements)
    assert e.nbytes == 0


def test_bounce_chunks_cover_every_byte_once_and_fit():
    ts = tensors_from([10, 3000, 1, 0, 999, 1000, 1001, 5], gaps=[0, 7, 0, 0, 300, 0, 1, 2])
    placements, _ = planning.place(ts)
    chunks = planning.bounce_chunks(placements, 1000)
    covered = []
    for c in chunks:
        assert 0 < c.nbytes <= 1000
        for p in c.pieces:
            assert p.buf_off + p.nbytes <= c.nbytes
            covered += range(p.src, p.src + p.nbytes)
    assert sorted(covered) == sorted(b for t in ts for b in range(t.offset, t.offset + t.nbytes))


def test_direct_chunks_split_at_registration_boundaries():
    ts = [TensorInfo("x", "U8", (5000,), 100, 5000)]
    placements, _ = planning.place(ts)
    chunks = planning.direct_chunks(placements, 2000, boundaries=[1000, 4096])
    spans = [(c.pieces[0].src, c.pieces[0].src + c.nbytes) for c in chunks]
    assert spans == [(100, 1000), (1000, 3000), (3000, 4096), (4096, 5100)]
    assert all(c.dst - placements[0].dst == c.pieces[0].src - 100 for c in chunks)


def random_model(rnd: random.Random, count: int) -> tuple[list[TensorInfo], bytes]:
    """``count`` tensors of sizes around a 1000-byte buffer (empty, one byte, exactly a
    buffer, one more), with small gaps, and random bytes holding them."""
    sizes = [rnd.choice([0, 1, 7, 100, 999, 1000, 1001, 2500]) for _ in range(count)]
    gaps = [rnd.choice([0, 0, 3, 64]) for _ in sizes]
    ts = tensors_from(sizes, gaps)
    return ts, bytes(rnd.getrandbits(8) for _ in range(ts[-1].offset + ts[-1].nbytes + 1))


@pytest.mark.parametrize("seed", range(5))
def test_pipeline_bytes_exact_with_lazy_device(seed):
    rnd = random.Random(seed)
    ts, source = random_model(rnd, 40)
    placements, dest, finished, dev = run_pipeline(
        source, ts, nbuffers=rnd.choice([1, 2, 4]), threads=rnd.choice([1, 3]), jitter=0.001)
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source[p.src:p.src + p.nbytes], p
    assert sorted(finished) == sorted(t.name for t in ts)
    assert dev.max_inflight >= 1


def test_pipeline_reports_a_failing_memcpy_and_recovers():
    ts = tensors_from([500] * 20)
    placements, _ = planning.place(ts)
    chunks = planning.bounce_chunks(placements, 1000)
    dest = bytearray(10_000)
    dev = LazyDevice(2, 1000, dest)
    calls = []

    def memcpy(dst, src, n):
        calls.append(n)
        if len(calls) == 7:
            raise OSError("simulated fault")
        ctypes.memmove(dst, src, n)

    source = ctypes.create_string_buffer(bytes(range(256)) * 40)
    pipe = BouncePipeline(dev, 2, 1000, 3, memcpy=memcpy)
    try:
        with pytest.raises(OSError, match="simulated"):
            pipe.run(chunks, ctypes.addressof(source), lambda c: None)
        assert not dev.pending  # everything queued was waited for
        pipe.memcpy = ctypes.memmove
        pipe.run(chunks, ctypes.addressof(source), lambda c: None)  # reusable afterwards
    finally:
        pipe.close()
    for p in placements:
        assert dest[p.dst:p.dst + p.nbytes] == source.raw[p.src:p.src + p.nbytes]


def test_completion_counts_tensors_spanning_chunks():
    ts = tensors_from([2500, 10, 0])
    placements, _ = planning.place(ts)
    chunks = planning.bounce_chunks(placements, 1000)
    comp = planning.Completion(placements, chunks)
    assert comp.ready == ["t2"]
    done = [comp.done(c) for c in chunks]
    assert done[:2] == [[], []] and sorted(done[2]) == ["t0", "t1"]


def test_register_pieces_are_per_file_and_stable_under_subsets():
    files = [(0, 5000), (6144, 8192), (8192, 9000)]
    pieces = register_pieces(files, step=2048)
    assert pieces == [(0, 2048), (2048, 4096), (4096, 5000), (6144, 8192), (8192, 9000)]
    # A subset gets exactly the pieces the full model has for those files.
    assert set(register_pieces(files[1:], step=2048)) <= set(pieces)


def _pieces_of(sizes: list[int]) -> list[list[planning.Chunk]]:
    seq = iter(range(10_000))
    return [[planning.Chunk(next(seq), 0, 0, 1, (planning.Piece(0, 0, 1),)) for _ in range(n)]
            for n in sizes]


def test_meet_in_the_middle_hands_out_every_chunk_once():
    by_piece = _pieces_of([3, 0, 2, 4, 1, 5])
    sides = planning.MeetInTheMiddle(by_piece)
    got: list[int] = []
    lock = threading.Lock()

    def back() -> None:
        while (c := sides.take()) is not None:
            with lock:
                got.append(c.seq)
            time.sleep(0.001)

    def front() -> None:
        while (i := sides.claim_front()) is not None:
            with lock:
                got.extend(c.seq for c in by_piece[i])
            time.sleep(0.002)

    threads = [threading.Thread(target=back) for _ in range(3)] + [
        threading.Thread(target=front)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(15)) and not sides.left
    # The front side works from the first pieces, the back side from the last.
    assert sides.front_pieces == sorted(sides.front_pieces)
    assert not sides.front_pieces or sides.front_pieces[0] == 0


def test_a_piece_given_back_goes_to_the_back_side():
    by_piece = _pieces_of([2, 2, 2])
    sides = planning.MeetInTheMiddle(by_piece)
    first = sides.claim_front()
    assert first == 0
    sides.give_back(first)  # its registration failed
    taken = []
    while (c := sides.take()) is not None:
        taken.append(c.seq)
    assert sorted(taken) == list(range(6)) and sides.front_pieces == []


def test_bounce_copy_choice_is_checked(monkeypatch):
    """CSI_PMEM_BOUNCE_COPY picks the transfer; a typo is a loader error naming both
    choices, and ``torch`` never touches cuda-python."""
    from csi_pmem.loader.gpu.bounce import _driver_copy
    from csi_pmem.weights.errors import LoaderError

    monkeypatch.setenv("CSI_PMEM_BOUNCE_COPY", "torch")
    assert _driver_copy(None, None, [0] * 4) is None
    monkeypatch.setenv("CSI_PMEM_BOUNCE_COPY", "dirver")
    with pytest.raises(LoaderError, match=r"'dirver'.*driver.*torch"):
        _driver_copy(None, None, [0] * 4)
