"""Verification of a GPU load on the device, after the copy (torch, imported lazily).

Why here and not on the host: hashing every byte on the host halved a verified load
(the host reads at tens of GB/s with all cores; the device reads its memory at TB/s),
and what matters is that the bytes the model will use are the staged bytes, which is a
check of the device copy itself. A file loaded whole holds its tensor bytes on the
device exactly as on the volume (placement keeps contiguous runs contiguous and every
offset's alignment), so each ``wsum64`` chunk is summed there, a run of whole chunks in
one launch of the project's kernel (:mod:`.kernelsum`; torch's reductions where it
cannot load, :func:`device_sums`). The few bytes a chunk has before the tensor data
(the safetensors header, which the loader parsed from the mapping) are summed from the
mapping, and the two parts combined (:func:`.wsum.shift`). Each file is checked as
soon as it is complete, on a stream of its own, chunk by chunk as their tensors land.
The sums are queued without waiting and read back together after the last, so only
the last chunks' check adds to the load.

What cannot be checked on the device goes to the host check (:func:`device_plan`
returns None): a subset of a file's tensors (tensor parallelism: the chunks also hold
bytes that were not loaded), SHA-256 volumes, files whose tensor data has holes or does
not start on a word.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from csi_pmem.loader.gpu import devsums, streams
from csi_pmem.loader.model import ModelView
from csi_pmem.weights import checksum, wsum
from csi_pmem.weights.layout import FileEntry, chunk_ranges
from csi_pmem.weights.stformat import TensorInfo

log = logging.getLogger(__name__)

BATCH = 1 << 30  # bytes of complete chunks checked together, at most
# Near a file's end batches shrink to a quarter of what is left to land, down to this:
# the last batch's reduction and read-back come after the last copy, so a 1 GiB one
# added its device time to every verified load.
TAIL_BATCH = 64 << 20
KERNEL_ENV = "CSI_PMEM_VERIFY_KERNEL"  # "torch": torch's reductions instead of the kernel


def batch_threshold(unlanded: int) -> int:
    """Bytes of complete chunks to check together while ``unlanded`` bytes of the
    file have not landed yet."""
    return min(BATCH, max(TAIL_BATCH, unlanded // 4))


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


def launch_chunks(view: ModelView, plan: FilePlan, buffer: Any, first_dst: int,
                  indices: list[int], sums: Any = None) -> devsums.Pending:
    """Queue the sums of the chunks ``indices`` of ``plan``'s file on the current
    stream; ``result()`` waits for them and returns the mismatches. ``buffer`` is the
    file's device buffer, whose byte ``first_dst`` holds the volume byte
    ``plan.data_start``. ``sums`` (:func:`device_sums`) computes and reads back."""
    entry, ds, size = plan.entry, plan.data_start - plan.entry.offset, plan.chunk_size
    sums = sums if sums is not None else devsums.TorchSums()

    def dev(rel_start: int, rel_end: int) -> Any:
        return buffer[first_dst + rel_start - ds:first_dst + rel_end - ds]

    ranges = chunk_ranges(entry.length, size)
    got: dict[int, Any] = {}  # chunk index -> () -> (s1, s2)
    # Runs of consecutive whole chunks past the header: one batched reduction each.
    full = sorted(i for i in indices if ranges[i][0] >= ds and ranges[i][1] == size)
    run: list[int] = []
    for i in [*full, None]:
        if run and (i is None or i != run[-1] + 1):
            batch = devsums.Pending(sums.chunks(
                dev(ranges[run[0]][0], ranges[run[-1]][0] + size), size))
            for k, index in enumerate(run):
                got[index] = lambda batch=batch, k=k: batch.result()[k]
            run = []
        if i is not None:
            run.append(i)
    for i in indices:
        if i in got:
            continue
        off, n = ranges[i]
        parts: list[Any] = []
        if off < ds:  # the header: from the mapping the loader parsed it from
            head = wsum.cpu_sums(view.volume.view(entry.offset + off, min(off + n, ds) - off))
            parts.append(lambda head=head: head)
        start = max(off, ds)
        if start < off + n:
            part = sums.range(dev(start, off + n))

            def shifted(part: Any = part, words: int = (start - off) // 8
                        ) -> tuple[int, int]:
                s1, s2 = part()
                return wsum.shift(s1, s2, words)

            parts.append(shifted)
        got[i] = lambda parts=parts: wsum.combine(*(p() for p in parts))

    def mismatches() -> list[checksum.Mismatch]:
        out = []
        for chunk in plan.chunks:
            if chunk.index in got:
                digest = wsum.fmt(*got[chunk.index]())
                if digest != chunk.expected:
                    out.append(checksum.Mismatch(chunk, digest))
        return out

    return devsums.Pending(mismatches)


def device_sums(device: Any) -> Any:
    """What sums a check's chunks on ``device``: the project's kernel
    (:class:`.kernelsum.KernelSums`), or torch's reductions where the kernel cannot be
    loaded (no cuda-python, a driver that refuses it) or ``CSI_PMEM_VERIFY_KERNEL=torch``
    asks for them. Call with ``device``'s context current (the check's thread)."""
    if os.environ.get(KERNEL_ENV, "auto") != "torch":
        try:
            from csi_pmem.loader.gpu import kernelsum

            return kernelsum.KernelSums(device)
        except Exception as exc:  # ImportError, a CUDA error: the fallback works anyway
            log.debug("checksum kernel unavailable (%s); using torch's reductions", exc)
    return devsums.TorchSums()


class _FileProgress:
    """Which bytes of one file are on the device, and which chunks are still unchecked."""

    def __init__(self, plan: FilePlan):
        self.plan = plan
        rel_ds = plan.data_start - plan.entry.offset
        self.covered: list[list[int]] = [[0, rel_ds]]  # the header counts as there
        self.unchecked = {c.index for c in plan.chunks}
        self.ranges = chunk_ranges(plan.entry.length, plan.chunk_size)

    def add(self, start: int, end: int) -> list[int]:
        """Record [start, end) (file-relative) as landed; the chunks now complete."""
        merged: list[list[int]] = []
        for a, b in sorted([*self.covered, [start, end]]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.covered = merged
        ready = []
        for i in sorted(self.unchecked):
            off, n = self.ranges[i]
            if any(a <= off and off + n <= b for a, b in merged):
                ready.append(i)
        self.unchecked.difference_update(ready)
        return ready


class DeviceVerifier:
    """Checks chunks on the device as the load reports their tensors landed.

    ``submit(fname, buffer, first_dst, start, end)`` says that the volume bytes
    [start, end) of ``fname`` are on the device (called right after each tensor's
    future resolved); every chunk that is then complete is queued, so checking runs
    beside the copies and only the last chunks' check is left when the copy ends.
    ``done`` fires once with every mismatch, or with the exception that stopped the
    check, after the last chunk.
    """

    def __init__(self, view: ModelView, plans: dict[str, FilePlan], device: Any,
                 done: Callable[[list[checksum.Mismatch], BaseException | None], None]):
        self.view, self.plans, self.device = view, plans, device
        self._sums: Any = None  # device_sums(device), made by the thread at its first batch
        self._done = done
        self._left = set(plans)
        self._progress = {f: _FileProgress(p) for f, p in plans.items()}
        self._pending: dict[str, list[int]] = {}
        self._bad: list[checksum.Mismatch] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._queue: list[tuple[str, Any, int, list[int]]] = []
        self._wake = threading.Condition(self._lock)
        # No thread and no CUDA work until the first batch is queued: this runs when
        # a load starts, and whatever it did there (a thread asking for the GIL, a
        # stream) delayed the load's first copy by several ms in fresh processes.
        # Measured on an H200 (fresh processes, 5 each): starting the thread and
        # loading the kernel with the load gave a median of 40.95 GB/s against 43.93
        # at the first batch; running torch's reductions once before the copies (the
        # fallback's kernels) put the first copy 60 ms late.
        self._thread: threading.Thread | None = None
        self._queued_at = 0.0  # when the latest batch was queued (a debug line's)
        self._closed = False  # failed before any batch: nothing will start a thread
        self._reported = False
        if not plans:
            self._finish()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verify-gpu", daemon=True)
        self._thread.start()

    def submit(self, fname: str, buffer: Any, first_dst: int, start: int, end: int) -> None:
        if fname not in self.plans:
            return
        offset = self.plans[fname].entry.offset
        with self._wake:
            progress = self._progress[fname]
            pending = self._pending.setdefault(fname, [])
            pending += progress.add(start - offset, end - offset)
            # Coalesced: a few large batched reductions cost less GIL and fewer
            # synchronisations than one per tensor, and the copy threads need both.
            size = sum(progress.ranges[i][1] for i in pending)
            unlanded = sum(progress.ranges[i][1] for i in progress.unchecked)
            if pending and (size >= batch_threshold(unlanded) or not progress.unchecked) \
                    and not self._closed:
                self._queue.append((fname, buffer, first_dst, sorted(pending)))
                self._queued_at = time.monotonic()
                self._pending[fname] = []
                if self._thread is None:
                    self._start()
                self._wake.notify()

    def fail(self, exc: BaseException) -> None:
        """The load failed: stop waiting for files that will not come."""
        with self._wake:
            if self._error is None:
                self._error = exc
            self._left.clear()
            idle = self._thread is None
            self._closed = self._closed or idle
            self._wake.notify()
        if idle:  # no thread will report
            self._finish()

    def _run(self) -> None:
        try:
            stream, release = streams.driver_stream(self.device)
        except BaseException as exc:  # no stream: nothing can be checked
            log.error("checking on the device failed: %s", exc)
            with self._wake:
                self._error = self._error or exc
            self._finish()
            return
        try:
            self._check_all(stream)
        except BaseException as exc:  # a bug here must still end the check
            log.error("checking on the device failed: %s", exc)
            with self._wake:
                self._error = self._error or exc
        finally:
            t = time.monotonic()
            release()  # before the result is out: the process may exit then
            log.debug("check: its stream released in %.2f ms", (time.monotonic() - t) * 1e3)
        self._finish()

    def _check_all(self, stream: Any) -> None:
        # The buffers stay referenced until the reductions that read them are done, so
        # that the caching allocator cannot hand their memory out under them.
        launched: list[tuple[devsums.Pending, Any]] = []
        bad: list[checksum.Mismatch] = []
        while True:
            with self._wake:
                while not self._queue and self._left:
                    self._wake.wait()
                if not self._queue:
                    break
                fname, buffer, first_dst, ready = self._queue.pop(0)
            exc_: BaseException | None = None
            picked = time.monotonic()
            if launched:
                # The batches before this one were launched a batch ago and are done:
                # read back and compare them now, while the copy still runs, so that
                # the load's end waits for one batch, not for all of them (23 batches
                # of a 13 GB load took 0.8-1.05 ms there).
                got, exc_ = self._collect(stream, launched)
                bad += got
                launched.clear()
            try:
                import torch

                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    if self._sums is None:
                        self._sums = device_sums(self.device)
                    launched.append((launch_chunks(self.view, self.plans[fname], buffer,
                                                   first_dst, ready, self._sums), buffer))
            except BaseException as exc:  # a device error: the check did not happen
                log.error("checking %s on the device failed: %s", fname, exc)
                exc_ = exc_ or exc
            del buffer
            with self._wake:
                if exc_ is not None and self._error is None:
                    self._error = exc_
                if not self._progress[fname].unchecked:
                    self._left.discard(fname)
                last = not self._left and not self._queue
            if last:
                # What the load's end waits for, after its last bytes landed.
                log.debug("check: the last batch waited %.2f ms for this thread and took "
                          "%.2f ms to launch", (picked - self._queued_at) * 1e3,
                          (time.monotonic() - picked) * 1e3)
                break
        t = time.monotonic()
        got, exc_ = self._collect(stream, launched)
        bad += got
        log.debug("check: the last %d batch(es) read back and compared in %.2f ms",
                  len(launched), (time.monotonic() - t) * 1e3)
        # Drop every device tensor before the result is out: a process may exit as soon
        # as it is, and tensors freed by this thread during interpreter teardown would
        # reach a CUDA runtime that is going away (an abort at exit). The sums hold
        # their results' device memory.
        launched.clear()
        self._sums = None
        with self._wake:
            self._bad += bad
            if exc_ is not None and self._error is None:
                self._error = exc_

    def _collect(self, stream: Any, launched: list[tuple[devsums.Pending, Any]]
                 ) -> tuple[list[checksum.Mismatch], BaseException | None]:
        """Every reduction is queued: one read-back for all of them (on their stream, so
        it waits for them), then compare."""
        bad: list[checksum.Mismatch] = []
        if not launched:
            return bad, None
        try:
            import torch

            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                for pending, _buffer in launched:
                    bad += pending.result()
        except BaseException as exc:
            log.error("checking on the device failed: %s", exc)
            return bad, exc
        return bad, None

    def _finish(self) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported = True
            bad, error = list(self._bad), self._error
        self._done(bad, error)
