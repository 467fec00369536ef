"""The checksums of a batched load (:mod:`.batches`), summed on the device batch by batch.

Why: a batch is a run of one file's tensors, which the whole-file device check
(:mod:`.verify`) cannot take, so each batch used to be hashed on the host. On an
H100 that took a 16 GB vLLM-shaped load from 37.5 GB/s unverified to 28.6 verified:
the hash and the copy shared the host's memory bandwidth, and a chunk two batches
share was hashed twice. Here a batch's bytes are summed on the device while the batch
is alive (the device reads its memory at TB/s). A 64 MiB chunk cut by a batch boundary
is summed in two pieces, each as if it started the chunk, and the pieces combined
(:func:`~csi_pmem.weights.wsum.shift`): no byte is summed twice, and none on the host
but a file's header, which the loader parsed from the mapping.

A batch whose tensors do not lie back to back on the device, or a piece that would
start inside a 64-bit word, leaves its chunks to the host, whole, at the end: slower,
never unchecked. Sums are queued on a stream of their own and read back together in
:meth:`BatchCheck.mismatches`; each batch's memory is held until its sums ran
(:meth:`BatchCheck.release`), so the allocator cannot hand it out under them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from csi_pmem.loader.gpu import streams
from csi_pmem.loader.gpu import verify as gpuverify
from csi_pmem.loader.model import ModelView
from csi_pmem.weights import checksum, wsum
from csi_pmem.weights.layout import chunk_ranges
from csi_pmem.weights.stformat import TensorInfo

log = logging.getLogger(__name__)

Sums = Callable[[], tuple[int, int]]


class BatchCheck:
    """Per-chunk pieces of a batched load's checksums, summed on ``device``.

    ``covers(fname)`` says whether a file's batches are checked here (a whole file of
    wsum64 chunks is loaded); the others are the caller's to check on the host.
    ``submit`` after each such batch landed, ``release(keep)`` before its memory may
    be freed, ``mismatches()`` once after the last batch.
    """

    def __init__(self, view: ModelView, selection: dict[str, list[TensorInfo]],
                 device: Any):
        self.view, self.device = view, device
        self.plans = {f: p for f, ts in selection.items()
                      if (p := gpuverify.device_plan(view, f, ts)) is not None}
        self._ranges = {f: chunk_ranges(p.entry.length, p.chunk_size)
                        for f, p in self.plans.items()}
        self._parts: dict[tuple[str, int], list[Sums]] = {}
        self._covered: dict[tuple[str, int], int] = {}
        self._host: set[tuple[str, int]] = set()
        self._alive: list[tuple[Any, Any]] = []  # (event, buffer) until their sums ran
        self._stream: Any = None
        self._close: Callable[[], None] = lambda: None
        self._sums: Any = None
        self.error: BaseException | None = None
        self.device_bytes = 0  # tensor bytes summed on the device
        self.host_bytes = 0  # chunk bytes left to the host

    def covers(self, fname: str) -> bool:
        return fname in self.plans

    def prepare(self) -> None:
        """Make the check's stream and load its kernel now, while the first batch is
        copied. Made at the first :meth:`submit`, they took 7.7 ms of an H100 load in
        which the link idled: the next batches wait for that submit."""
        import torch

        if self.error is not None or not self.plans:
            return
        try:
            if self._stream is None:
                self._stream, self._close = streams.driver_stream(torch.device(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                if self._sums is None:
                    self._sums = gpuverify.device_sums(self.device)
        except Exception as exc:  # a device error: submit meets it again and says so
            log.debug("preparing the device check failed: %s", exc)

    def submit(self, fname: str, batch: list[TensorInfo], tensors: dict[str, Any]) -> bool:
        """Queue the sums of ``batch`` (its ``tensors`` on the device, just landed).
        True when the sums hold the batch's memory until :meth:`release` lets it go."""
        import torch

        plan = self.plans[fname]
        ordered = sorted(batch, key=lambda t: t.offset)
        base = plan.entry.offset
        ra = ordered[0].offset - base
        rb = ordered[-1].offset + ordered[-1].nbytes - base
        if self.error is not None:
            span = None
        else:
            span = _span(torch, ordered, tensors)
        ranges = self._ranges[fname]
        size = plan.chunk_size
        ds = plan.data_start - base
        if rb <= ra:
            return False
        try:
            if span is not None and self._stream is None:
                self._stream, self._close = streams.driver_stream(torch.device(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                if span is not None and self._sums is None:
                    self._sums = gpuverify.device_sums(self.device)
                run: list[int] = []
                # The file's first batch (it starts at the tensor data) also sums the
                # header's chunks, from the mapping: those wholly inside it too.
                first = 0 if ra <= ds else ra // size
                for i in range(first, (rb - 1) // size + 1):
                    off, n = ranges[i]
                    key = (fname, i)
                    if key in self._host:
                        continue
                    if off < ds and ra <= ds:
                        end = min(off + n, ds)
                        head = wsum.cpu_sums(self.view.volume.view(base + off, end - off))
                        self._add(key, partial(_value, head), end - off)
                    lo, hi = max(off, ra, ds), min(off + n, rb)
                    if lo >= hi:
                        continue
                    if span is None or (lo - off) % 8 or (hi < off + n and (hi - off) % 8) \
                            or (span.data_ptr() + lo - ra) % 8:
                        self._to_host(key)
                        continue
                    if lo == off and n == size and hi == off + n:
                        if run and run[-1] != i - 1:
                            self._chunks(fname, run, span, ra)
                            run = []
                        run.append(i)
                        continue
                    part = self._sums.range(span[lo - ra:hi - ra])
                    self._add(key, partial(_shifted, part, (lo - off) // 8), hi - lo)
                    self.device_bytes += hi - lo
                if run:
                    self._chunks(fname, run, span, ra)
                if span is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._alive.append((event, span))
                    return True
        except Exception as exc:  # a device error: these chunks were not checked
            log.error("checking %s on the device failed: %s", fname, exc)
            self.error = self.error or exc
        return False

    def _chunks(self, fname: str, run: list[int], span: Any, ra: int) -> None:
        size = self.plans[fname].chunk_size
        first = self._ranges[fname][run[0]][0]
        got = self._sums.chunks(span[first - ra:first - ra + len(run) * size], size)
        for k, i in enumerate(run):
            self._add((fname, i), partial(_nth, got, k), size)
        self.device_bytes += len(run) * size

    def _add(self, key: tuple[str, int], part: Sums, nbytes: int) -> None:
        self._parts.setdefault(key, []).append(part)
        self._covered[key] = self._covered.get(key, 0) + nbytes

    def _to_host(self, key: tuple[str, int]) -> None:
        self._host.add(key)
        self._parts.pop(key, None)

    def release(self, keep: int = 0) -> None:
        """Wait for the sums of all but the last ``keep`` batches and drop their memory."""
        while len(self._alive) > keep:
            event, _span = self._alive.pop(0)
            try:
                event.synchronize()
            except Exception as exc:
                self.error = self.error or exc

    def mismatches(self) -> list[checksum.Mismatch]:
        """Every chunk's digest against the staged one; raises what stopped a check."""
        try:
            self.release()
            if self.error is not None:
                raise self.error
            bad: list[checksum.Mismatch] = []
            for fname, plan in self.plans.items():
                for chunk in plan.chunks:
                    key = (fname, chunk.index)
                    if key in self._host:
                        got = wsum.cpu_sums(self.view.volume.view(chunk.offset, chunk.length))
                        self.host_bytes += chunk.length
                    elif self._covered.get(key) == chunk.length:
                        got = wsum.combine(*(p() for p in self._parts[key]))
                    else:  # not every byte landed: a bug in the batches, not damage
                        raise RuntimeError(
                            f"{fname}: chunk {chunk.index} was summed over "
                            f"{self._covered.get(key, 0)} of its {chunk.length} bytes")
                    digest = wsum.fmt(*got)
                    if digest != chunk.expected:
                        bad.append(checksum.Mismatch(chunk, digest))
            log.debug("batched check: %d bytes summed on the device, %d on the host",
                      self.device_bytes, self.host_bytes)
            return bad
        finally:
            self.close()

    def close(self) -> None:
        """Drop every device buffer and the stream (also after a failed load)."""
        self.release()
        self._parts.clear()
        self._sums = None
        close, self._close = self._close, lambda: None
        close()


def _value(pair: tuple[int, int]) -> tuple[int, int]:
    return pair


def _shifted(part: Sums, words: int) -> tuple[int, int]:
    s1, s2 = part()
    return wsum.shift(s1, s2, words)


def _nth(chunks: Callable[[], list[tuple[int, int]]], k: int) -> tuple[int, int]:
    return chunks()[k]


def _span(torch: Any, ordered: list[TensorInfo], tensors: dict[str, Any]) -> Any:
    """A uint8 device tensor over the batch's bytes, volume order, or None when its
    tensors do not lie back to back in one allocation as they do on the volume."""
    first = tensors[ordered[0].name]
    storage = first.untyped_storage()
    start = first.storage_offset() * first.element_size()
    nbytes = ordered[-1].offset + ordered[-1].nbytes - ordered[0].offset
    if start + nbytes > storage.nbytes():
        return None
    whole = torch.empty(0, dtype=torch.uint8, device=first.device)
    whole.set_(storage)
    span = whole[start:start + nbytes]
    for t in ordered:
        got = tensors[t.name]
        if t.nbytes and (got.untyped_storage().data_ptr() != storage.data_ptr()
                         or got.data_ptr() - span.data_ptr() != t.offset - ordered[0].offset
                         or not got.is_contiguous()):
            return None
    return span


def for_load(view: ModelView, selection: dict[str, list[TensorInfo]],
             device: str) -> BatchCheck | None:
    """The device check of a batched load, or None where its batches are hashed on the
    host instead: no CUDA device (the CPU seam of the tests), or no file it can take."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    check = BatchCheck(view, selection, device)
    return check if check.plans else None
