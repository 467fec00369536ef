"""Verification of a GPU load on the device, after the copy (torch, imported lazily).

Why here and not on the host: hashing every byte on the host halved a verified load
(the host reads at tens of GB/s with all cores; the device reads its memory at TB/s),
and what matters is that the bytes the model will use are the staged bytes, which is a
check of the device copy itself. A file loaded whole holds its tensor bytes on the
device exactly as on the volume (placement keeps contiguous runs contiguous and every
offset's alignment), so each ``wsum64`` chunk is summed there in one batched reduction;
the few bytes a chunk has before the tensor data (the safetensors header, which the
loader parsed from the mapping) are summed from the mapping, and the two parts combined
(:func:`.wsum.shift`). Each file is checked as soon as it is complete, on a stream of
its own, while later files still copy, so only the last file's check adds to the load.

What cannot be checked on the device goes to the host check (:func:`device_plan`
returns None): a subset of a file's tensors (tensor parallelism: the chunks also hold
bytes that were not loaded), SHA-256 volumes, files whose tensor data has holes or does
not start on a word.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from csi_pmem.loader import checksum, wsum
from csi_pmem.loader.layout import FileEntry, chunk_ranges
from csi_pmem.loader.model import ModelView
from csi_pmem.loader.stformat import TensorInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FilePlan:
    """How one file's chunks split between the mapping (header) and the device."""

    entry: FileEntry
    data_start: int  # absolute in the volume
    chunk_size: int
    chunks: list[checksum.Chunk]


def device_plan(view: ModelView, fname: str, tensors: list[TensorInfo]) -> FilePlan | None:
    """The plan for checking ``fname`` on the device, or None when it must be checked
    on the host (see the module docstring)."""
    model = view.model
    if model.algo != wsum.ALGO or model.chunk_size % (8 * wsum.ROW):
        return None
    header = view.headers[fname]
    if len(tensors) != len(header.tensors):
        return None
    entry = view.file(fname)
    if (header.data_start - entry.offset) % 8:
        return None
    cursor = header.data_start
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset != cursor:
            return None
        cursor += t.nbytes
    if cursor != entry.end:
        return None
    return FilePlan(entry, header.data_start, model.chunk_size,
                    checksum.model_chunks(model, [entry]))


def check_on_device(view: ModelView, plan: FilePlan, buffer: Any,
                    first_dst: int) -> list[checksum.Mismatch]:
    """Sum ``plan``'s chunks; ``buffer`` is the file's device buffer, whose byte
    ``first_dst`` holds the volume byte ``plan.data_start``. Returns the mismatches."""
    entry, ds, size = plan.entry, plan.data_start - plan.entry.offset, plan.chunk_size

    def dev(rel_start: int, rel_end: int) -> Any:
        return buffer[first_dst + rel_start - ds:first_dst + rel_end - ds]

    got: dict[int, tuple[int, int]] = {}
    ranges = chunk_ranges(entry.length, size)
    full = [i for i, (off, n) in enumerate(ranges) if off >= ds and n == size]
    if full:
        a, b = full[0], full[-1] + 1  # full chunks past the header are contiguous
        sums = wsum.device_chunk_sums(dev(ranges[a][0], ranges[b - 1][0] + size),
                                      size)
        got.update(zip(range(a, b), sums, strict=True))
    for i, (off, n) in enumerate(ranges):
        if i in got:
            continue
        parts = []
        if off < ds:  # the header: from the mapping the loader parsed it from
            head = min(off + n, ds)
            parts.append(wsum.cpu_sums(view.volume.view(entry.offset + off, head - off)))
        start = max(off, ds)
        if start < off + n:
            parts.append(wsum.shift(*wsum.device_sums(dev(start, off + n)),
                                    (start - off) // 8))
        got[i] = wsum.combine(*parts)
    out = []
    for chunk in plan.chunks:
        digest = wsum.fmt(*got[chunk.index])
        if digest != chunk.expected:
            out.append(checksum.Mismatch(chunk, digest))
    return out


class DeviceVerifier:
    """Checks files on the device as the load reports them complete.

    ``submit(fname, buffer, first_dst)`` queues one file (called from the load thread
    right after the file's future resolved); ``done`` fires once with every mismatch,
    or with the exception that stopped the check, after the last expected file.
    """

    def __init__(self, view: ModelView, plans: dict[str, FilePlan], device: Any,
                 done: Callable[[list[checksum.Mismatch], BaseException | None], None]):
        import torch

        self.view, self.plans, self.device = view, plans, device
        self._done = done
        self._left = set(plans)
        self._bad: list[checksum.Mismatch] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device=device)
        self._queue: list[tuple[str, Any, int]] = []
        self._wake = threading.Condition(self._lock)
        if plans:
            threading.Thread(target=self._run, name="verify-gpu", daemon=True).start()
        else:
            self._finish()

    def submit(self, fname: str, buffer: Any, first_dst: int) -> None:
        if fname not in self.plans:
            return
        with self._wake:
            self._queue.append((fname, buffer, first_dst))
            self._wake.notify()

    def fail(self, exc: BaseException) -> None:
        """The load failed: stop waiting for files that will not come."""
        with self._wake:
            if self._error is None:
                self._error = exc
            self._left.clear()
            self._wake.notify()

    def _run(self) -> None:
        import torch

        while True:
            with self._wake:
                while not self._queue and self._left:
                    self._wake.wait()
                if not self._queue:
                    break
                fname, buffer, first_dst = self._queue.pop(0)
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    bad = check_on_device(self.view, self.plans[fname], buffer, first_dst)
            except BaseException as exc:  # a device error: the check did not happen
                log.error("checking %s on the device failed: %s", fname, exc)
                bad, exc_ = [], exc
            else:
                exc_ = None
            del buffer
            with self._wake:
                self._bad += bad
                if exc_ is not None and self._error is None:
                    self._error = exc_
                self._left.discard(fname)
                last = not self._left
            if last:
                break
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            bad, error = list(self._bad), self._error
        self._done(bad, error)
