"""Parallel verification of staged bytes against the index's chunk checksums.

Two algorithms, named per model in the index (``ModelEntry.algo``): ``wsum64``
(:mod:`.wsum`, what staging writes now; GPU loads check it on the device after the copy)
and ``sha256`` (volumes staged by earlier versions; still verified, on the host). Why
chunks and threads: one checksum stream runs at one core's speed, far below what a copy
to the GPU reaches; hashlib and numpy release the GIL, so 64 MiB chunks summed by a
pool scale with cores. Loads of a tensor subset verify only the chunks that hold the
tensors they read.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

from csi_pmem.weights import wsum
from csi_pmem.weights.errors import LayoutError
from csi_pmem.weights.layout import FileEntry, ModelEntry, chunk_ranges
from csi_pmem.weights.volume import Volume

Progress = Callable[[int], None]


def default_threads(limit: int = 8) -> int:
    return max(1, min(limit, len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class Chunk:
    file: str
    index: int
    offset: int  # absolute in the volume
    length: int
    expected: str
    algo: str = wsum.ALGO


def model_chunks(model: ModelEntry, files: Iterable[FileEntry] | None = None,
                 ranges: dict[str, list[tuple[int, int]]] | None = None) -> list[Chunk]:
    """Chunks of ``files`` (default: all), restricted to those overlapping ``ranges``
    (absolute [start, end) per file name) when given."""
    out = []
    for f in model.files if files is None else files:
        wanted = None if ranges is None else ranges.get(f.name, [])
        for i, (off, length) in enumerate(chunk_ranges(f.length, model.chunk_size)):
            start = f.offset + off
            if wanted is not None and not any(
                    a < start + length and start < b for a, b in wanted):
                continue
            out.append(Chunk(f.name, i, start, length, f.chunks[i] if f.chunks else "",
                             model.algo))
    return out


def _sha256(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


DIGESTS: dict[str, Callable[[memoryview], str]] = {"sha256": _sha256, wsum.ALGO: wsum.digest}


def digest(view: memoryview, algo: str = wsum.ALGO) -> str:
    try:
        return DIGESTS[algo](view)
    except KeyError:
        raise LayoutError(f"unknown checksum algorithm {algo!r}; this version knows "
                          f"{', '.join(sorted(DIGESTS))} (upgrade csi-pmem)") from None


@dataclass(frozen=True)
class Mismatch:
    chunk: Chunk
    got: str

    def __str__(self) -> str:
        c = self.chunk
        return (f"{c.file}: chunk {c.index} (volume bytes {c.offset}-{c.offset + c.length}) "
                f"has {c.algo} {self.got[:16]}…, staged as {c.expected[:16]}…")


def _check(volume: Volume, chunk: Chunk) -> Mismatch | None:
    got = digest(volume.view(chunk.offset, chunk.length), chunk.algo)
    return None if got == chunk.expected else Mismatch(chunk, got)


def verify_chunks(volume: Volume, chunks: list[Chunk], *, executor: Executor | None = None,
                  threads: int | None = None,
                  progress: Progress | None = None) -> list[Mismatch]:
    """Hash every chunk; return the mismatches (empty when all match)."""
    own = executor is None
    pool = executor or ThreadPoolExecutor(threads or default_threads(),
                                          thread_name_prefix="verify")
    try:
        futures = [pool.submit(_check, volume, c) for c in chunks]
        problems = []
        for chunk, fut in zip(chunks, futures, strict=True):
            problem = fut.result()
            if problem:
                problems.append(problem)
            if progress:
                progress(chunk.length)
        return problems
    finally:
        if own:
            pool.shutdown(cancel_futures=True)


def start_verify(volume: Volume, chunks: list[Chunk], *,
                 threads: int | None = None) -> Future[list[Mismatch]]:
    """Verify in the background (own thread and pool); the future gives the problems."""
    result: Future[list[Mismatch]] = Future()
    result.set_running_or_notify_cancel()

    def run() -> None:
        try:
            result.set_result(verify_chunks(volume, chunks, threads=threads))
        except BaseException as exc:  # relay anything to whoever waits on the future
            result.set_exception(exc)

    threading.Thread(target=run, name="verify", daemon=True).start()
    return result
