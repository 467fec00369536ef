"""Copy planning for the GPU path: pure arithmetic, testable without torch or a GPU.

Why a plan: the device side wants few, large DMA transfers; the host side wants memcpy
pieces that fit the reusable pinned buffers; futures want to know which tensors a
finished transfer completes. Placing tensors on the device so that runs contiguous on
the volume stay contiguous on the device turns a whole-file load into one stream of
full-buffer transfers, while a tensor-parallel subset is packed without the holes.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from csi_pmem.loader.stformat import TensorInfo
from csi_pmem.sizes import round_up

# Device placement keeps each tensor's source offset modulo this, so a tensor aligned
# for its dtype in the file is aligned on the device too (cudaMalloc gives 256).
GRANULE = 256


@dataclass(frozen=True)
class Placement:
    """One tensor: ``src`` absolute in the volume, ``dst`` in its file's device buffer."""

    name: str
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """A memcpy from the volume into a pinned buffer at ``buf_off``."""

    src: int
    buf_off: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """One host-to-device transfer of ``nbytes`` to ``dst`` of target ``target``.

    Bounce path: the pieces fill a pinned buffer, whose first ``nbytes`` then go to
    the device in one transfer (gaps between pieces carry don't-care bytes into
    padding). Registered path: each piece is its own transfer straight from the volume
    (``buf_off`` is then relative to ``dst``).
    """

    seq: int
    target: int
    dst: int
    nbytes: int
    pieces: tuple[Piece, ...]


def place(tensors: list[TensorInfo], granule: int = GRANULE) -> tuple[list[Placement], int]:
    """Device offsets for ``tensors``; returns the placements and the buffer size."""
    out = []
    cursor = 0
    prev_end: int | None = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if prev_end == t.offset:
            dst = cursor
        else:
            dst = round_up(cursor, granule) + t.offset % granule
        out.append(Placement(t.name, t.offset, dst, t.nbytes))
        cursor = dst + t.nbytes
        prev_end = t.offset + t.nbytes
    return out, cursor


def runs(placements: list[Placement]) -> list[tuple[int, int, int]]:
    """Merge placements contiguous on both sides into (src, dst, nbytes) runs."""
    merged: list[list[int]] = []
    for p in placements:
        if p.nbytes == 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == p.src \
                and merged[-1][1] + merged[-1][2] == p.dst:
            merged[-1][2] += p.nbytes
        else:
            merged.append([p.src, p.dst, p.nbytes])
    return [(s, d, n) for s, d, n in merged]


def _split(runs_: list[tuple[int, int, int]], limit: int,
           boundaries: list[int]) -> list[tuple[int, int, int]]:
    """Cut runs to at most ``limit`` bytes and at source ``boundaries``."""
    out = []
    for src, dst, n in runs_:
        while n:
            take = min(n, limit)
            i = bisect.bisect_right(boundaries, src)
            if i < len(boundaries) and boundaries[i] < src + take:
                take = boundaries[i] - src
            out.append((src, dst, take))
            src, dst, n = src + take, dst + take, n - take
    return out


def bounce_chunks(placements: list[Placement], buffer_size: int, target: int = 0,
                  first_seq: int = 0) -> list[Chunk]:
    """Group runs into windows of the device address space that fit one buffer."""
    if buffer_size <= 0:
        raise ValueError("buffer_size must be positive")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    start = 0

    def close() -> None:
        if pieces:
            end = max(p.buf_off + p.nbytes for p in pieces)
            chunks.append(Chunk(first_seq + len(chunks), target, start, end, tuple(pieces)))

    for src, dst, n in _split(runs(placements), buffer_size, []):
        if not pieces or dst + n - start > buffer_size:
            close()
            pieces, start = [], dst
        pieces.append(Piece(src, dst - start, n))
    close()
    return chunks


def direct_chunks(placements: list[Placement], max_bytes: int, boundaries: list[int],
                  target: int = 0, first_seq: int = 0) -> list[Chunk]:
    """Transfers straight from a registered mapping, never crossing a registration
    boundary (a copy spanning two registrations would not be treated as pinned)."""
    out: list[Chunk] = []
    for src, dst, n in _split(runs(placements), max_bytes, sorted(boundaries)):
        out.append(Chunk(first_seq + len(out), target, dst, n, (Piece(src, 0, n),)))
    return out


class Completion:
    """Counts outstanding transfers per tensor; says which tensors a chunk finishes.

    Zero-byte tensors are complete from the start (:attr:`ready`).
    """

    def __init__(self, placements: list[Placement], chunks: list[Chunk]):
        self._left: dict[str, int] = {}
        self._by_chunk: dict[int, list[str]] = {}
        self.ready: list[str] = []
        starts = sorted((c.dst, c.dst + c.nbytes, c.seq) for c in chunks)
        keys = [s[0] for s in starts]
        for p in placements:
            if p.nbytes == 0:
                self.ready.append(p.name)
                continue
            lo = max(0, bisect.bisect_right(keys, p.dst) - 1)
            hits = []
            for dst, end, seq in starts[lo:]:
                if dst >= p.dst + p.nbytes:
                    break
                if end > p.dst:
                    hits.append(seq)
            self._left[p.name] = len(hits)
            for seq in hits:
                self._by_chunk.setdefault(seq, []).append(p.name)

    def done(self, chunk: Chunk) -> list[str]:
        finished = []
        for name in self._by_chunk.pop(chunk.seq, []):
            self._left[name] -= 1
            if self._left[name] == 0:
                finished.append(name)
        return finished


class MeetInTheMiddle:
    """Hands out a load's registration pieces from both ends, for the hybrid first load.

    Why: a fresh process cannot register a whole model before copying (0.025 s/GB on
    2 MiB pages, 0.1 on 4 KiB), and bounce buffers alone are bound by host memory
    bandwidth. Together they fill the link: one thread registers pieces from the front
    and queues their copies straight from the mapping, while the memcpy threads take
    chunks from the back, and whichever side is faster simply does more. ``by_piece[i]``
    are the chunks of piece ``i`` (pieces in volume order, empty ones allowed). Thread
    safe; each chunk is handed out exactly once.
    """

    def __init__(self, by_piece: list[list[Chunk]]):
        self._pieces = [i for i, cs in enumerate(by_piece) if cs]
        self._by_piece = by_piece
        self._front = 0
        self._back = len(self._pieces)
        self._current: list[Chunk] = []
        self._lock = threading.Lock()
        self.front_pieces: list[int] = []

    def claim_front(self) -> int | None:
        """The next piece for the registering side, or None when the sides met."""
        with self._lock:
            if self._front >= self._back:
                return None
            i = self._pieces[self._front]
            self._front += 1
            self.front_pieces.append(i)
            return i

    def give_back(self, piece: int) -> None:
        """The front side could not take ``piece`` (its registration failed): the back
        side copies it, and the front side claims nothing more."""
        with self._lock:
            assert self.front_pieces and self.front_pieces[-1] == piece
            self.front_pieces.pop()
            self._front -= 1

    def take(self) -> Chunk | None:
        """The next chunk for a memcpy thread (from the back), or None when done."""
        with self._lock:
            while not self._current:
                if self._back <= self._front:
                    return None
                self._back -= 1
                self._current = list(reversed(self._by_piece[self._pieces[self._back]]))
            return self._current.pop()

    @property
    def left(self) -> bool:
        with self._lock:
            return bool(self._current) or self._front < self._back
