"""``wsum64`` on the device: the same sums as :mod:`csi_pmem.weights.wsum`, in torch.

Why apart from the CPU side: the weight store (:mod:`csi_pmem.weights`) is read by the
node's copy service and staged on the CPU, with numpy only; these reductions run where
the weights land, in device memory, and need torch. The arithmetic and the layout
(rows of ``ROW`` words) are the store's, so both sides give the same integers.
"""

from __future__ import annotations

from typing import Any

from csi_pmem.weights.wsum import MASK, ROW, combine


def _torch() -> Any:
    import torch

    return torch


def _row_sums(torch: Any, block: Any) -> tuple[Any, Any]:
    """Per-batch (s1, s2) of int64 blocks shaped [batch, rows, ROW], on the device."""
    rows = block.shape[1]
    r = block.sum(dim=2)  # [batch, rows]
    c = block.sum(dim=1)  # [batch, ROW]
    i = torch.arange(rows, dtype=torch.int64, device=block.device)
    j = torch.arange(1, ROW + 1, dtype=torch.int64, device=block.device)
    return r.sum(dim=1), (r * i).sum(dim=1) * ROW + (c * j).sum(dim=1)


class Readback:
    """Integers on the device, read back together: one copy and one wait for a check.

    Why: ``tolist()`` per reduction is a device-to-host copy and a wait each. A verified
    14.7 GB load queued about 70 reductions, and reading them one by one after the last
    copy added 2 ms to the load (a fresh process's trace on an H200). Here each queued
    result is only noted; the first :meth:`get` concatenates every result noted so far
    on the device and copies them in one go (on the caller's current stream, which must
    be the one they were queued on or ordered after it).
    """

    def __init__(self) -> None:
        self._queued: list[Any] = []  # flat int64 device tensors, not read yet
        self._values: list[list[int]] = []  # what was read, one list per tensor

    def add(self, tensor: Any) -> int:
        """Note ``tensor``'s values for reading; the index for :meth:`get`."""
        self._queued.append(tensor.reshape(-1))
        return len(self._values) + len(self._queued) - 1

    def get(self, index: int) -> list[int]:
        if index >= len(self._values):
            queued, self._queued = self._queued, []
            flat = (_torch().cat(queued) if len(queued) > 1 else queued[0]).tolist()
            at = 0
            for t in queued:
                n = t.numel()
                self._values.append(flat[at:at + n])
                at += n
        return self._values[index]


def _pairs(rb: Readback, s1: Any, s2: Any) -> Any:
    """A getter of [(s1, s2), ...] for two queued int64 vectors."""
    a, b = rb.add(s1), rb.add(s2)
    return lambda: [(x & MASK, y & MASK) for x, y in zip(rb.get(a), rb.get(b), strict=True)]


class Pending:
    """Sums queued on the device and not read back yet: :meth:`result` reads them.

    Why: reading a result waits for the device. A check that read back each batch as it
    went would wait once per batch, holding the GIL the copy threads need, and the last
    waits would add up after the copy; queued, the reductions run beside the copy and
    the reads cost one wait at the end.
    """

    def __init__(self, compute: Any):
        self._compute = compute
        self._value: Any = None
        self._done = False

    def result(self) -> Any:
        if not self._done:
            self._value, self._done = self._compute(), True
            self._compute = None
        return self._value


def device_sums_async(buf: Any, readback: Readback | None = None) -> Pending:
    """:func:`device_sums`, queued: ``result()`` is the (s1, s2) pair. Results noted in
    ``readback`` are read back with everything else noted there."""
    torch = _torch()
    rb = readback or Readback()
    n = buf.numel()
    full = n // 8
    words = buf[:full * 8].view(torch.int64)
    parts: list[Any] = []
    rows = full // ROW
    if rows:
        block = words[:rows * ROW].view(1, rows, ROW)
        get = _pairs(rb, *_row_sums(torch, block))
        parts.append(lambda get=get: get()[0])
    if full - rows * ROW:
        rest = words[rows * ROW:]
        k = torch.arange(rows * ROW + 1, full + 1, dtype=torch.int64, device=buf.device)
        get = _pairs(rb, rest.sum().view(1), (rest * k).sum().view(1))
        parts.append(lambda get=get: get()[0])
    rem = n - full * 8
    if rem:
        tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
        tail[:rem] = buf[full * 8:]
        index = rb.add(tail.view(torch.int64))

        def last(index: int = index) -> tuple[int, int]:
            word = rb.get(index)[0] & MASK
            return word, (full + 1) * word

        parts.append(last)
    return Pending(lambda: combine(*(p() for p in parts)) if parts else (0, 0))


def device_sums(buf: Any) -> tuple[int, int]:
    """(s1, s2) of a uint8 CUDA tensor whose first byte is 8-byte aligned, as if it
    started a chunk. The last partial word is zero-padded in a small copy."""
    return device_sums_async(buf).result()


def device_chunk_sums_async(buf: Any, chunk_bytes: int,
                            readback: Readback | None = None) -> Pending:
    """:func:`device_chunk_sums`, queued: ``result()`` is the list of pairs."""
    torch = _torch()
    n = buf.numel() // chunk_bytes
    if n == 0:
        return Pending(list)
    block = buf[:n * chunk_bytes].view(torch.int64).view(n, chunk_bytes // 8 // ROW, ROW)
    return Pending(_pairs(readback or Readback(), *_row_sums(torch, block)))


class TorchSums:
    """Sums of device buffers by torch's reductions, read back together
    (:class:`Readback`): the fallback of :class:`.kernelsum.KernelSums` (same interface)
    where cuda-python or the kernel is not available."""

    def __init__(self) -> None:
        self._rb = Readback()

    def chunks(self, buf: Any, chunk_bytes: int) -> Any:
        return device_chunk_sums_async(buf, chunk_bytes, self._rb).result

    def range(self, buf: Any) -> Any:
        return device_sums_async(buf, self._rb).result


def device_chunk_sums(buf: Any, chunk_bytes: int) -> list[tuple[int, int]]:
    """(s1, s2) of each ``chunk_bytes`` chunk of a uint8 CUDA tensor that holds whole
    chunks back to back (``chunk_bytes`` a multiple of 8 * ROW): one batched reduction."""
    return device_chunk_sums_async(buf, chunk_bytes).result()
