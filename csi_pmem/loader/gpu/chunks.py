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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from csi_pmem.sizes import round_up
from csi_pmem.weights.stformat import TensorInfo

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


class Piece(NamedTuple):
    """A memcpy from the volume into a pinned buffer at ``buf_off``.

    Piece and :class:`Chunk` are named tuples, not frozen dataclasses: a 13 GB load
    plans about 3,100 of each before its first byte moves, and a frozen dataclass costs
    three times as much to create (the whole plan took 7-13 ms of a 0.28 s load).
    """

    src: int
    buf_off: int
    nbytes: int


class Chunk(NamedTuple):
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


def _split(runs_: list[tuple[int, int, int]], limit: int, boundaries: list[int],
           cuts: Sequence[int] = ()) -> list[tuple[int, int, int]]:
    """Cut runs to at most ``limit`` bytes, at source ``boundaries`` and at device
    offsets ``cuts`` (all sorted)."""
    out = []
    for src, dst, n in runs_:
        while n:
            take = min(n, limit)
            i = bisect.bisect_right(boundaries, src)
            if i < len(boundaries) and boundaries[i] < src + take:
                take = boundaries[i] - src
            i = bisect.bisect_right(cuts, dst)
            if i < len(cuts) and cuts[i] < dst + take:
                take = cuts[i] - dst
            out.append((src, dst, take))
            src, dst, n = src + take, dst + take, n - take
    return out


def bounce_chunks(placements: list[Placement], buffer_size: int, target: int = 0,
                  first_seq: int = 0) -> list[Chunk]:
    """Group runs into windows of the device address space that fit one buffer.

    One pass, no intermediate lists: this runs once per chunk of every bounce load, on
    the clock before the first copy starts.
    """
    if buffer_size <= 0:
        raise ValueError("buffer_size must be positive")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    start = end = 0  # the open window's device offset, and its bytes so far
    for src, dst, n in runs(placements):
        while n:
            take = n if n < buffer_size else buffer_size
            if pieces and dst + take - start > buffer_size:
                chunks.append(Chunk(first_seq + len(chunks), target, start, end,
                                    tuple(pieces)))
                pieces = []
            if not pieces:
                if take == buffer_size:  # a window of its own: most chunks of a load
                    chunks.append(Chunk(first_seq + len(chunks), target, dst, take,
                                        (Piece(src, 0, take),)))
                    src, dst, n = src + take, dst + take, n - take
                    continue
                start, end = dst, 0
            off = dst - start
            pieces.append(Piece(src, off, take))
            if off + take > end:
                end = off + take
            src, dst, n = src + take, dst + take, n - take
    if pieces:
        chunks.append(Chunk(first_seq + len(chunks), target, start, end, tuple(pieces)))
    return chunks


def direct_chunks(placements: list[Placement], max_bytes: int, boundaries: list[int],
                  target: int = 0, first_seq: int = 0, cuts: Sequence[int] = ()
                  ) -> list[Chunk]:
    """Transfers straight from a registered mapping, never crossing a registration
    boundary (a copy spanning two registrations would not be treated as pinned), nor a
    device offset in ``cuts`` (where one device allocation ends and the next begins)."""
    out: list[Chunk] = []
    for src, dst, n in _split(runs(placements), max_bytes, sorted(boundaries),
                              sorted(cuts)):
        out.append(Chunk(first_seq + len(out), target, dst, n, (Piece(src, 0, n),)))
    return out


class Completion:
    """Counts outstanding transfers per tensor; says which tensors a chunk finishes.

    Zero-byte tensors are complete from the start (:attr:`ready`). The chunks of one
    target never overlap on the device (two would race to write the same bytes), nor
    do its tensors, so both sides are kept as sorted bounds and matched by bisection:
    nothing per chunk is built here. A whole-file load has thousands of chunks and a
    few dozen tensors, and this runs on the clock before the first copy starts.
    """

    def __init__(self, placements: list[Placement], chunks: list[Chunk]):
        self._setup(placements, sorted(c.dst for c in chunks),
                    sorted(c.dst + c.nbytes for c in chunks))

    @classmethod
    def of_spans(cls, placements: list[Placement], starts: list[int],
                 ends: list[int]) -> Completion:
        """The same from the chunks' device starts and ends (a flat plan's chunks are
        in device order already, and sorting a sorted list is one linear pass)."""
        self = cls.__new__(cls)
        self._setup(placements, sorted(starts), sorted(ends))
        return self

    def _setup(self, placements: list[Placement], starts: list[int],
               ends: list[int]) -> None:
        self.ready = [p.name for p in placements if p.nbytes == 0]
        live = sorted((p for p in placements if p.nbytes), key=lambda p: p.dst)
        self._names = [p.name for p in live]
        self._starts = [p.dst for p in live]
        self._ends = [p.dst + p.nbytes for p in live]
        # Sorted each by itself, intervals do not overlap exactly when every end is at
        # most the next start.
        if any(e > s for e, s in zip(ends, starts[1:], strict=False)) or \
                any(e > s for e, s in zip(self._ends, self._starts[1:], strict=False)):
            raise ValueError("chunks (or tensors) of one target overlap on the device")
        # A tensor [a, b) waits for the chunks that end after a and start before b.
        self._left = {name: bisect.bisect_left(starts, b) - bisect.bisect_right(ends, a)
                      for name, a, b in zip(self._names, self._starts, self._ends,
                                            strict=True)}
        self._seen: set[int] = set()

    def done(self, chunk: Chunk) -> list[str]:
        return self.done_span(chunk.seq, chunk.dst, chunk.nbytes)

    def done_span(self, seq: int, dst: int, nbytes: int) -> list[str]:
        """The tensors that chunk ``seq`` (``nbytes`` at ``dst``) finishes; a chunk
        reported twice counts once."""
        if seq in self._seen:
            return []
        self._seen.add(seq)
        first = bisect.bisect_right(self._ends, dst)
        last = bisect.bisect_left(self._starts, dst + nbytes)
        finished = []
        for name in self._names[first:last]:
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
