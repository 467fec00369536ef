"""``wsum64``: the staged-weights checksum that a GPU can check at memory speed.

Why not SHA-256 any more (it stays readable, for volumes staged before): a verified load
hashed every byte on the host at 14 GB/s with all cores, which halved a load that the
link moves at 55 GB/s. The weights land in device memory anyway, and an H200 reads its
memory at several TB/s, so the check belongs there, after the copy, where it also covers
the copy itself. That needs a sum a GPU computes with plain reductions, identically to
the CPU at staging time:

    words  w_k: the chunk's bytes as little-endian 64-bit words, the last one zero-padded
    s1 = sum(w_k)            mod 2**64
    s2 = sum((k + 1) * w_k)  mod 2**64         (k counts words from the chunk's start)

rendered as 32 hex digits (s1 then s2). s2 is computed without a weight vector: lay the
words out as rows of ``ROW`` words, then ``s2 = ROW * sum(i * rowsum_i) + sum((j + 1) *
colsum_j)`` plus the words after the last full row. Two reductions over the data, no
temporaries, the same integers on both sides (wrap-around arithmetic is exact and
order-independent). Both sums are linear, so a chunk can be summed in parts (the
safetensors header from the mapping, the tensor bytes on the device) with
:func:`shift`.

What it catches: any change of one word (every weight k + 1 is nonzero, and s1 alone
sees any single-word change), zeroed or torn pages, words swapped or shifted (s2), a
chunk read from the wrong place. What it does not: deliberate forgery. Whoever can write
the volume can rewrite its index too, so a keyed or cryptographic hash would buy nothing
here; the checksum exists to catch media errors, interrupted copies and bugs.
"""

from __future__ import annotations

from typing import Any

ALGO = "wsum64"
ROW = 4096  # words per row of the reduction layout
MASK = (1 << 64) - 1
HEX_LEN = 32


def fmt(s1: int, s2: int) -> str:
    return f"{s1 & MASK:016x}{s2 & MASK:016x}"


def parse(text: str) -> tuple[int, int]:
    return int(text[:16], 16), int(text[16:], 16)


def shift(s1: int, s2: int, words: int) -> tuple[int, int]:
    """The sums of a part that starts ``words`` words into its chunk, given its sums
    computed as if it started the chunk: every weight grows by ``words``."""
    return s1 & MASK, (s2 + words * s1) & MASK


def combine(*parts: tuple[int, int]) -> tuple[int, int]:
    s1 = s2 = 0
    for a, b in parts:
        s1, s2 = s1 + a, s2 + b
    return s1 & MASK, s2 & MASK


def cpu_sums(data: Any) -> tuple[int, int]:
    """(s1, s2) of a buffer (bytes, memoryview of a mapping) with numpy.

    numpy releases the GIL in these reductions, so chunks sum in parallel threads.
    """
    try:
        import numpy as np
    except ImportError:
        from csi_pmem.loader.errors import LoaderError

        raise LoaderError("wsum64 checksums need numpy: pip install 'csi-pmem[loader]'") \
            from None

    view = memoryview(data).cast("B")
    n = len(view)
    full = n // 8
    words = np.frombuffer(view, dtype="<u8", count=full)
    s1, s2 = _np_rows(np, words)
    rem = n - full * 8
    if rem:
        last = int.from_bytes(bytes(view[full * 8:]) + b"\0" * (8 - rem), "little")
        s1, s2 = combine((s1, s2), (last, (full + 1) * last))
    return s1, s2


def _np_rows(np: Any, words: Any) -> tuple[int, int]:
    rows = len(words) // ROW
    s1 = s2 = 0
    if rows:
        block = words[:rows * ROW].reshape(rows, ROW)
        r = block.sum(axis=1, dtype=np.uint64)
        c = block.sum(axis=0, dtype=np.uint64)
        with np.errstate(over="ignore"):
            i = np.arange(rows, dtype=np.uint64)
            j = np.arange(1, ROW + 1, dtype=np.uint64)
            s1 = int(r.sum(dtype=np.uint64))
            s2 = (ROW * int((r * i).sum(dtype=np.uint64))
                  + int((c * j).sum(dtype=np.uint64)))
    rest = words[rows * ROW:]
    if len(rest):
        with np.errstate(over="ignore"):
            k = np.arange(rows * ROW + 1, rows * ROW + 1 + len(rest), dtype=np.uint64)
            s1 += int(rest.sum(dtype=np.uint64))
            s2 += int((rest * k).sum(dtype=np.uint64))
    return s1 & MASK, s2 & MASK


def digest(data: Any) -> str:
    return fmt(*cpu_sums(data))


# --- on the device (torch) ----------------------------------------------------------

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
