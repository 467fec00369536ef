"""csi_pmem.loader.gpu.batchcheck's arithmetic, on the CPU: chunks cut by batch
boundaries summed in pieces and combined, pieces inside a word left to the host, and a
damaged byte in a batch's copy found in the right chunk.

Why on the CPU: the check runs only where CUDA is (the GPU suite on the GPU host runs it
for real, tests/test_loader_torch.py); its pieces, offsets and words are plain
arithmetic over torch tensors, and torch's reductions (devsums.TorchSums, the check's
fallback) run on CPU tensors too. The one seam: the CUDA stream, device context and
event become no-ops, and each batch's "device copy" is a CPU buffer holding the batch's
volume bytes, its tensors views of it, as the loader lays them out.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from csi_pmem.loader import open_volume
from csi_pmem.loader.batches import plan_batches
from csi_pmem.loader.gpu import batchcheck, devsums
from csi_pmem.loader.model import open_model

import loader_models as lm

MiB = lm.MiB


class _Event:
    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(batchcheck.streams, "driver_stream", lambda device: (None, lambda: None))
    monkeypatch.setattr(batchcheck.gpuverify, "device_sums", lambda device: devsums.TorchSums())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)


def staged(tmp_path, odd: bool):
    """Eight 12 MiB uint8 tensors in one file (a 64 MiB chunk and a half); with ``odd``
    each is 3 bytes longer, so that every boundary after the first falls inside a word."""
    n = (12 << 20) + (3 if odd else 0)
    lm.save_numpy_model(tmp_path / "m", {f"w{i}": (np.arange(n, dtype=np.int64) * (i + 7)
                                                  % 251).astype(np.uint8) for i in range(8)})
    return lm.staged_volume(tmp_path / "m", tmp_path / "v", size=160 * MiB)


def check_batches(vol, damage: int | None = None) -> batchcheck.BatchCheck:
    """Every batch of 20 MiB through a BatchCheck, each from a CPU copy of its volume
    bytes; ``damage``: a volume offset whose byte the copy gets wrong."""
    with open_volume(vol) as v:
        view = open_model(v)
        selection = view.select()
        check = batchcheck.BatchCheck(view, selection, "cpu")
        (fname,) = selection
        assert check.covers(fname)
        for batch in plan_batches(selection, 20 << 20):
            a = batch[0].offset
            b = batch[-1].offset + batch[-1].nbytes
            copy = bytearray(v.view(a, b - a))
            if damage is not None and a <= damage < b:
                copy[damage - a] ^= 0x5A
            buf = torch.frombuffer(copy, dtype=torch.uint8)
            tensors = {t.name: buf[t.offset - a:t.offset - a + t.nbytes] for t in batch}
            check.submit(fname, batch, tensors)
            check.release(keep=1)
        check.bad = check.mismatches()
        check.nbytes = sum(t.nbytes for t in selection[fname])
        check.file_length = view.file(fname).length
        check.cut = plan_batches(selection, 20 << 20)[1][0].offset
    return check


@pytest.mark.parametrize("odd", [False, True])
def test_pieces_of_chunks_two_batches_share_add_up(tmp_path, on_cpu, odd):
    check = check_batches(staged(tmp_path, odd))
    assert check.bad == []
    if odd:  # every chunk is cut inside a word somewhere: each goes to the host whole
        assert check.host_bytes == check.file_length
        assert check.device_bytes < check.nbytes
    else:
        assert check.host_bytes == 0 and check.device_bytes == check.nbytes


def test_a_bad_byte_in_a_batch_copy_fails_its_chunk(tmp_path, on_cpu):
    """The byte just before the second batch, in chunk 0's piece in the first batch;
    then one in chunk 1: each fails its own chunk and no other."""
    vol = staged(tmp_path, odd=False)
    cut = check_batches(vol).cut
    assert [m.chunk.index for m in check_batches(vol, damage=cut - 1).bad] == [0]
    assert [m.chunk.index for m in check_batches(vol, damage=cut + (64 << 20)).bad] == [1]


def test_chunks_left_to_the_host_check_the_volume(tmp_path, on_cpu):
    """Where pieces would start inside a word the host sums the chunk from the volume:
    a damaged staged byte still fails the load."""
    vol = staged(tmp_path, odd=True)
    cut = check_batches(vol).cut
    with open(vol, "r+b") as f:
        f.seek(cut - 1)
        byte = f.read(1)[0]
        f.seek(cut - 1)
        f.write(bytes([byte ^ 0x5A]))
    assert [m.chunk.index for m in check_batches(vol).bad] == [0]
