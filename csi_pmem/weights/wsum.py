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
        from csi_pmem.weights.errors import LoaderError

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
