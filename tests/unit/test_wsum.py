"""wsum64, the staged-weights checksum: the numpy implementation against a plain
reference, its linearity (a chunk summed in parts), what it detects, and old SHA-256
volumes that must stay loadable."""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from csi_pmem.loader import ChecksumError, LayoutError, open_volume, verify
from csi_pmem.loader.api import load_numpy
from csi_pmem.weights import layout, wsum

import loader_models as lm

MASK = (1 << 64) - 1


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-wsum-") as d:
        yield d


def reference(data: bytes) -> tuple[int, int]:
    """The definition, word by word."""
    padded = data + b"\0" * (-len(data) % 8)
    s1 = s2 = 0
    for k in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * k:8 * k + 8], "little")
        s1 += w
        s2 += (k + 1) * w
    return s1 & MASK, s2 & MASK


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=3 * 8 * wsum.ROW + 37))
def test_numpy_sums_match_the_definition(data):
    assert wsum.cpu_sums(data) == reference(data)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=16, max_size=2 * 8 * wsum.ROW + 50), st.data())
def test_a_chunk_summed_in_parts_equals_the_whole(data, draw):
    cut = draw.draw(st.integers(0, len(data) // 8)) * 8
    head, tail = wsum.cpu_sums(data[:cut]), wsum.cpu_sums(data[cut:])
    assert wsum.combine(head, wsum.shift(*tail, cut // 8)) == wsum.cpu_sums(data)


def test_detects_flips_swaps_and_zeroed_pages():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    base = wsum.digest(data)
    flipped = bytearray(data)
    flipped[12345] ^= 0x80
    swapped = bytearray(data)
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    zeroed = bytearray(data)
    zeroed[4096:8192] = bytes(4096)
    shifted = data[8:] + data[:8]
    for changed in (flipped, swapped, zeroed, shifted):
        assert wsum.digest(bytes(changed)) != base
    assert len(base) == wsum.HEX_LEN and wsum.parse(base) == wsum.cpu_sums(data)


def test_a_damaged_byte_fails_verification(shm):
    lm.sharded_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    with open_volume(vol) as v:
        model = layout.read_index(v).select()
    f = model.safetensors[-1]
    with open(vol, "r+b") as fh:
        fh.seek(f.end - 3)
        b = fh.read(1)
        fh.seek(f.end - 3)
        fh.write(bytes([b[0] ^ 1]))
    with open_volume(vol) as v:
        bad = verify(v)
    assert [m.chunk.file for m in next(iter(bad.values()))] == [f.name]
    with pytest.raises(ChecksumError, match="wsum64"):
        load_numpy(vol)


def _rewrite_as_sha256(vol) -> None:
    """Turn a staged volume into what an earlier version wrote: SHA-256 chunks and no
    algo key at all (entries before the key existed)."""
    with open_volume(vol, writable=True) as v:
        index = layout.read_index(v)
        for m in index.models:
            m.algo = "sha256"
            for f in m.files:
                f.chunks = [hashlib.sha256(v.view(f.offset + o, n)).hexdigest()
                            for o, n in layout.chunk_ranges(f.length, m.chunk_size)]
        layout.write_index(v, index)


def test_volumes_staged_with_sha256_still_load_and_verify(shm):
    lm.sharded_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    want = {k: v.copy() for k, v in load_numpy(vol).items()}
    _rewrite_as_sha256(vol)
    with open_volume(vol) as v:
        assert layout.read_index(v).select().algo == "sha256"
        assert verify(v) == {"m": []}
    got = load_numpy(vol)
    assert set(got) == set(want)
    for k in want:
        assert np.array_equal(got[k], want[k])


def test_an_index_entry_without_algo_is_sha256():
    doc = {"name": "m", "state": "committed", "chunk_size": 64 << 20,
           "files": [{"name": "a.safetensors", "offset": 8 << 20, "length": 10,
                      "kind": "safetensors", "chunks": ["0" * 64], "done": True}]}
    model = layout._model_from(json.loads(json.dumps(doc)))
    assert model.algo == "sha256"
    doc["algo"] = "md5"
    with pytest.raises(LayoutError, match="upgrade csi-pmem"):
        layout._model_from(doc)
    doc["algo"] = "wsum64"
    with pytest.raises(LayoutError, match="malformed checksums"):
        layout._model_from(doc)  # 64 hex digits are not a wsum64 checksum


def test_chunks_become_checkable_as_their_bytes_land():
    from csi_pmem.loader.gpu.verify import FilePlan, _FileProgress
    from csi_pmem.weights import checksum
    from csi_pmem.weights.layout import FileEntry

    size = 8 * wsum.ROW  # chunk size of the plan; the file: 4.5 chunks, 100-byte header
    entry = FileEntry("f.safetensors", 1 << 20, 4 * size + size // 2, "safetensors")
    model = layout.ModelEntry("m", "", "committed", [entry], chunk_size=size)
    plan = FilePlan(entry, entry.offset + 104, size, checksum.model_chunks(model, [entry]))
    p = _FileProgress(plan)
    assert p.add(3 * size, 4 * size) == [3]          # a tensor in the middle
    assert p.add(104, size - 8) == []                # chunk 0 still misses 8 bytes
    assert p.add(size - 8, 2 * size) == [0, 1]       # header + data: chunks 0 and 1
    assert p.add(4 * size, entry.length) == [4]      # the short last chunk
    assert p.add(2 * size, 3 * size) == [2] and not p.unchecked


def _one_file_plan():
    from csi_pmem.loader.gpu.verify import FilePlan
    from csi_pmem.weights import checksum
    from csi_pmem.weights.layout import FileEntry

    size = 8 * wsum.ROW
    entry = FileEntry("f.safetensors", 1 << 20, 2 * size, "safetensors")
    model = layout.ModelEntry("m", "", "committed", [entry], chunk_size=size)
    return entry, size, {entry.name: FilePlan(entry, entry.offset + 8, size,
                                              checksum.model_chunks(model, [entry]))}


def test_device_verifier_batches_shrink_towards_a_files_end(monkeypatch):
    """Whole batches while much is still to land, then a quarter of what is left, so
    that the check after the last copy covers little; every chunk is queued once, in
    order."""
    from csi_pmem.loader.gpu import verify as gpuverify
    from csi_pmem.weights import checksum
    from csi_pmem.weights.layout import FileEntry

    size = 8 * wsum.ROW
    monkeypatch.setattr(gpuverify, "BATCH", 8 * size)
    monkeypatch.setattr(gpuverify, "TAIL_BATCH", size)
    monkeypatch.setattr(gpuverify.DeviceVerifier, "_run", lambda self: None)
    entry = FileEntry("f.safetensors", 1 << 20, 64 * size, "safetensors")
    model = layout.ModelEntry("m", "", "committed", [entry], chunk_size=size)
    plans = {entry.name: gpuverify.FilePlan(entry, entry.offset + 8, size,
                                            checksum.model_chunks(model, [entry]))}
    v = gpuverify.DeviceVerifier(None, plans, None, lambda bad, exc: None)
    for k in range(64):
        v.submit(entry.name, None, 0, entry.offset + k * size, entry.offset + (k + 1) * size)
    batches = [ready for _, _, _, ready in v._queue]
    assert [i for b in batches for i in b] == list(range(64))
    assert [len(b) for b in batches] == [8, 8, 8, 8, 7, 5, 4, 4, 3, 2, 2, 1, 1, 1, 1, 1]
    assert gpuverify.batch_threshold(0) == size and gpuverify.batch_threshold(1 << 40) == 8 * size


def test_device_verifier_starts_nothing_before_a_batch_and_reports_a_failure_once():
    """A load that fails before any chunk landed ends the check at once, with its error;
    a tensor reported afterwards starts no thread and no second report."""
    from csi_pmem.loader.gpu.verify import DeviceVerifier

    entry, size, plans = _one_file_plan()
    reports = []
    v = DeviceVerifier(None, plans, None, lambda bad, exc: reports.append((bad, exc)))
    v.submit(entry.name, None, 0, entry.offset, entry.offset + size // 2)  # no chunk yet
    assert v._thread is None and reports == []
    v.fail(RuntimeError("copy failed"))
    v.submit(entry.name, None, 0, entry.offset, entry.end)  # both chunks complete now
    assert v._thread is None
    assert [(bad, str(exc)) for bad, exc in reports] == [([], "copy failed")]


def test_device_verifier_without_a_stream_reports_why(monkeypatch):
    """The first complete batch starts the checking thread; when it cannot make its
    stream (here: no CUDA), the check ends once with that error, not with silence."""
    from csi_pmem.loader.gpu import streams
    from csi_pmem.loader.gpu import verify as gpuverify

    def no_stream(device):
        raise LayoutError("no stream here")

    monkeypatch.setattr(streams, "driver_stream", no_stream)
    entry, _, plans = _one_file_plan()
    done = threading.Event()
    reports = []

    def report(bad, exc):
        reports.append((bad, exc))
        done.set()

    v = gpuverify.DeviceVerifier(None, plans, None, report)
    v.submit(entry.name, None, 0, entry.offset, entry.end)
    assert done.wait(10)
    v._thread.join(10)
    assert [str(exc) for _, exc in reports] == ["no stream here"]
