"""A tensor-parallel rank's slices through the node's GPU copy service: only the rank's
bytes, at the speed of the link, with no packing in the pod.

Why: the pinned ring of :mod:`.slices` has the pod's own threads gather every slice
into pinned buffers; on an H100 the ranks reached 0.41-0.51 of the link that way (one
GPU, docs/inference.md), the packing and the bounce's second pass over the bytes
costing what the node's registered mapping does not. The service can read the slice
where it lies: a column-parallel cut is a run of whole rows (one plain copy), a
row-parallel one a stretch of every row (one 2D copy, :class:`~csi_pmem.gpucopy.
protocol.Copy` with ``rows``). It writes only into memory the pod exported, not into
vLLM's parameters, so the slice goes through a small ring of the pool's slots
(:mod:`.nodepool`): the service fills a slot, and a device-to-device copy on the
server's stream moves it into the parameter.

Ordering without waiting: ``copy_`` must return with the parameter's write queued on
the current stream (the server may queue work after it, or read the parameter), but
the slot is filled by another process that no stream of this one orders. So the copy
out of the slot waits on the GPU, not on the CPU: the stream waits for a host word
(``cuStreamWaitValue32``, a pinned word) that the pool's reader thread sets to the
count of the service's copies landed. ``copy_`` sends the request, queues that wait and
the device copy, and returns at once; the CPU waits only to reuse a slot, for the copy
that filled it ``SLOTS`` copies ago.

Failures: when the service fails or falls silent, the word is set past every count, so
the stream never hangs, and each slice whose copy had not landed is copied again
through the pinned ring, on the same stream after the device copy that moved stale
bytes, before ``copy_`` or :meth:`NodeRankCopier.finish` returns; the rest of the load
takes the ring, and the log line says why.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from csi_pmem.gpucopy import protocol
from csi_pmem.loader import cpu
from csi_pmem.loader.gpu import nodecopy, slices
from csi_pmem.loader.gpu.nodecopy import NodeCopyError, allocation_failed
from csi_pmem.loader.gpu.nodepool import Lease, NodePool
from csi_pmem.sizes import MiB, describe_size
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.mapping import buffer_address
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

PATH = "rank-node-slices"  # the path's name in log lines and results
SLOTS = 4  # slots in the ring: one being emptied on the GPU, the others on the link
SLOT = 64 * MiB  # per slot: a copy's round trip is noise beside moving it
SMALL = 1 * MiB  # a slice below this takes the pinned ring: packing it costs less
RELEASE = 1 << 30  # the word's value once nothing will land (the wait is cyclic: >= k)


class Rows(NamedTuple):
    """A tensor's bytes in the mapping: ``rows`` rows of ``width`` bytes, one every
    ``pitch`` bytes from ``offset``."""

    offset: int
    rows: int
    width: int
    pitch: int

    def copy(self) -> protocol.Copy:
        return protocol.Copy(self.offset, 0, self.rows * self.width, self.rows,
                             self.pitch if self.rows > 1 else 0)


def rows_of(t: torch.Tensor, base: int, span: int) -> Rows | None:
    """``t``'s elements, in order, as rows of the mapping at ``base`` (``span`` bytes),
    or None when they are not (a transposed or interleaved view, or outside it)."""
    es = t.element_size()
    dims = [(n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1]
    inner, i = 1, len(dims)
    while i and dims[i - 1][1] == inner:  # the contiguous innermost block
        inner *= dims[i - 1][0]
        i -= 1
    if dims and i == len(dims):
        return None  # the last dimension is strided: one element per row
    outer = dims[:i]
    rows, pitch = 1, 0
    if outer:
        for (_, st), (n2, st2) in itertools.pairwise(outer):
            if st != st2 * n2:
                return None  # more than one stride between rows
        for n, _ in outer:
            rows *= n
        pitch = outer[-1][1] * es
    width = inner * es
    offset = t.data_ptr() - base
    if rows > 1 and pitch < width:
        return None
    if offset < 0 or offset + (rows - 1) * pitch + width > span:
        return None
    if rows > 1 and pitch == width:  # rows that touch: one plain run
        rows, width, pitch = 1, rows * width, 0
    return Rows(offset, rows, width, pitch)


class Gate(Protocol):
    """Orders the copy out of a slot after the service's copy into it."""

    def after(self, count: int) -> None:
        """Work queued after this (on the current stream) runs once ``count`` of the
        connection's copies have landed, or once :meth:`release` was called."""

    def landed(self, count: int | None) -> None:
        """The pool's watcher: ``count`` copies landed; None: none ever will again."""

    def close(self) -> None: ...


class CudaGate:
    """A pinned host word the stream waits on (``cuStreamWaitValue32``)."""

    def __init__(self, device: torch.device):
        from csi_pmem.gpucopy import cuda as gpucuda

        cu = self._cu = gpucuda.driver()
        self._check = gpucuda.check
        self.device = device
        self._lock = threading.Lock()
        self._value = 0
        # torch's context (the device's primary one), current in this thread even
        # where torch has made no CUDA call yet.
        self._dev_handle = self._check(cu, cu.cuDeviceGet(device.index or 0),
                                       "cuDeviceGet")
        self._ctx = self._check(cu, cu.cuDevicePrimaryCtxRetain(self._dev_handle),
                                "cuDevicePrimaryCtxRetain")
        self._check(cu, cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._host = self._check(cu, cu.cuMemHostAlloc(
            4, cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP),
            "allocating the pinned word (cuMemHostAlloc)")
        try:
            self._word = ctypes.c_uint32.from_address(int(self._host))
            self._word.value = 0
            self._dev = self._check(cu, cu.cuMemHostGetDevicePointer(self._host, 0),
                                    "cuMemHostGetDevicePointer")
            self.after(0)  # the call works here (stream memory operations supported)
        except BaseException:
            cu.cuMemFreeHost(self._host)
            cu.cuDevicePrimaryCtxRelease(self._dev_handle)
            raise

    def after(self, count: int) -> None:
        cu = self._cu
        self._check(cu, cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        self._check(cu, cu.cuStreamWaitValue32(
            stream, self._dev, count,
            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def landed(self, count: int | None) -> None:
        with self._lock:
            value = RELEASE if count is None else count
            if value > self._value:
                self._value = value
                self._word.value = value

    def close(self) -> None:
        """After every wait on the word has passed (the caller synchronized)."""
        self.landed(None)
        host, self._host = self._host, None
        if host is not None:
            self._cu.cuMemFreeHost(host)
            self._cu.cuDevicePrimaryCtxRelease(self._dev_handle)


class HostGate:
    """The same order on the CPU (a copier pointed at the CPU: tests, vLLM's CPU build):
    :meth:`after` blocks until the copies landed, or the pool failed or fell silent."""

    def __init__(self, pool: NodePool):
        self.pool = pool

    def after(self, count: int) -> None:
        if self.pool.landed >= count:
            return
        with contextlib.suppress(NodeCopyError):  # the copier copies it again
            for _ in self.pool.progress(0, count):
                pass

    def landed(self, count: int | None) -> None:
        pass

    def close(self) -> None:
        pass


class _Ring(NamedTuple):
    lease: Lease  # its slot, held for the whole load
    view: torch.Tensor  # bytes of the slot, as this process sees them


class _Sent(NamedTuple):
    """A slice sent through the service, kept until it landed (else copied again)."""

    end: int
    dst: torch.Tensor
    src: torch.Tensor


class NodeRankCopier(slices.RankCopier):
    """A :class:`~.slices.RankCopier` whose slices of at least :data:`SMALL` go through
    the node's copy service (``pool``) from the mapping at ``base`` (``span`` bytes);
    everything else, and everything after the service failed, through the pinned ring.

    ``view(lease)``: this process's tensor over a slot's memory (a CUDA tensor; tests
    pass memfd-backed CPU ones); the copier owns ``pool`` and ``gate`` and closes them
    in :meth:`finish`.
    """

    def __init__(self, device: torch.device, rank: int, size: int, *, pool: NodePool,
                 gate: Gate, base: int, span: int,
                 view: Callable[[Lease], torch.Tensor], slots: int = SLOTS,
                 slot_size: int = SLOT, small: int | None = None, **kw: Any):
        super().__init__(device, rank, size, **kw)
        self.pool, self.gate, self.base, self.span = pool, gate, base, span
        self.slot_size = slot_size
        self.small = SMALL if small is None else small
        self.node_copied = 0  # bytes the service moved (and that landed)
        self.refused: str | None = None  # why the service stopped serving, if it did
        self._ring: list[_Ring] = []
        self._ends: list[int] = []  # per ring slot: the count its last fill ends at
        # Per ring slot: its last device copy out (the pinned ring's own events are
        # the base class's, for its buffers: a slice of either path may come next).
        self._slot_events: list[Any] = []
        self._turn = 0
        self._sent: collections.deque[_Sent] = collections.deque()
        self._finished = threading.Event()
        pool.watchers.append(gate.landed)
        try:
            for _ in range(max(1, slots)):
                slot = pool.acquire(slot_size)
                lease = pool.lease(slot, slot_size)
                self._ring.append(_Ring(lease, view(lease)))
                self._ends.append(0)
                self._slot_events.append(None)
        except Exception as exc:
            self._stop(exc if isinstance(exc, NodeCopyError) else allocation_failed(exc))
        self.path = PATH if self._ring and self.refused is None else slices.PATH
        if self.refused is None:
            threading.Thread(target=self._watch, name="rank-slices-watch",
                             daemon=True).start()

    def _watch(self) -> None:
        """Fail a service that falls silent with slices outstanding, even while this
        process waits on the GPU outside the copier (the stream would wait forever)."""
        landed, since = -1, 0.0
        while not self._finished.wait(1.0):
            now = time.monotonic()
            if not self._sent or self.pool.landed != landed:
                landed, since = self.pool.landed, now
            elif now - since > self.pool.timeout:
                self.pool.spend(NodeCopyError(
                    f"the GPU copy service at {self.pool.path} sent no progress in "
                    f"{self.pool.timeout:.0f} s", self.pool.landed))
                return

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        plain = slices._plain(src)
        nbytes = plain.numel() * plain.element_size()
        with self._lock:
            if self.refused is None and self.pool.failed is not None:
                self._stop(self.pool.failed)
            if (self.refused is None and nbytes >= self.small
                    and slices._row_bytes(plain) <= self.slot_size
                    and rows_of(plain, self.base, self.span) is not None):
                before = self.copied
                try:
                    self._through_service(dst, plain)
                    return
                except NodeCopyError as exc:
                    self.copied = before  # counted again below, whole
                    self._stop(exc)
            self._redo()
            super().copy(dst, src)

    def _through_service(self, dst: torch.Tensor, plain: torch.Tensor) -> None:
        rows = plain.shape[0] if plain.dim() else 1
        per = max(1, self.slot_size // max(1, slices._row_bytes(plain)))
        for start in range(0, rows, per):
            n = min(per, rows - start)
            part = plain if plain.dim() == 0 else plain.narrow(0, start, n)
            out = dst if dst.dim() == 0 else dst.narrow(0, start, n)
            cut = rows_of(part, self.base, self.span)
            assert cut is not None, "a run of whole leading rows of a slice is rows too"
            self._fill(out, part, cut)
            self.copied += part.numel() * part.element_size()
        self.copies += 1

    def _fill(self, dst: torch.Tensor, src: torch.Tensor, cut: Rows) -> None:
        """One slot's worth: the service fills the next slot of the ring, the stream
        waits for it on the GPU and copies it into ``dst``."""
        i = self._turn
        self._turn = (i + 1) % len(self._ring)
        ring = self._ring[i]
        self._wait_landed(self._ends[i])  # the fill before: landed (or never will)
        if self._slot_events[i] is not None:
            self._slot_events[i].synchronize()  # and copied out of the slot
            self._slot_events[i] = None
        nbytes = cut.rows * cut.width
        if self.pool.landed >= RELEASE // 2:
            raise NodeCopyError("this connection's copies reached the count the GPU "
                                "waits on")
        _, end = self.pool.submit(ring.lease.slot, [cut.copy()])
        self._ends[i] = end
        self._sent.append(_Sent(end, dst, src))
        self.gate.after(end)
        staged = ring.view[:nbytes].view(src.dtype).view(src.shape)
        dst.copy_(staged, non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_events[i] = event
        self._forget_landed()

    def _wait_landed(self, count: int) -> None:
        if self.pool.landed >= count:
            return
        for _ in self.pool.progress(0, count):
            pass

    def _forget_landed(self) -> None:
        landed = self.pool.landed
        while self._sent and self._sent[0].end <= landed:
            sent = self._sent.popleft()
            self.node_copied += sent.src.numel() * sent.src.element_size()

    def _stop(self, exc: NodeCopyError) -> None:
        """The service stopped serving: the stream waits no more; the slices it had not
        landed are copied again (:meth:`_redo`)."""
        if self.refused is None:
            self.refused = str(exc)
            log.warning("rank %d: %s; its slices go through pinned buffers from here",
                        self.rank, exc)
        self.pool.spend(exc if isinstance(exc, NodeCopyError) else NodeCopyError(str(exc)))
        self.gate.landed(None)

    def _redo(self) -> None:
        """Copy again, through the pinned ring, every slice whose service copy did not
        land: queued after the device copy that moved the slot's stale bytes."""
        if self.refused is None:
            return
        self._forget_landed()
        while self._sent:
            sent = self._sent.popleft()
            super().copy(sent.dst, sent.src)
            self.copies -= 1  # counted when it was sent
            self.copied -= sent.src.numel() * sent.src.element_size()

    def describe(self) -> str:
        out = super().describe()
        if self.node_copied:
            out += (f" ({describe_size(self.node_copied)} of them by the node's copy "
                    f"service, through {len(self._ring)} slots of "
                    f"{describe_size(self.slot_size)})")
        if self.refused is not None:
            out += f"; the copy service stopped: {self.refused}"
        return out

    def finish(self) -> None:
        """Wait for every slice to land (copying again those that did not), then every
        copy out of the slots, then free the ring and close the connection."""
        self._finished.set()
        with self._lock:
            try:
                if self.refused is None and self.pool.failed is not None:
                    self._stop(self.pool.failed)
                if self._sent and self.refused is None:
                    try:
                        self._wait_landed(self._sent[-1].end)
                    except NodeCopyError as exc:
                        self._stop(exc)
                self._redo()
                self._forget_landed()
            finally:
                for event in self._slot_events:
                    if event is not None:
                        with contextlib.suppress(Exception):
                            event.synchronize()
                self._slot_events = [None] * len(self._slot_events)
                self.gate.landed(None)
                super().finish()
                self._ring = []
                with contextlib.suppress(ValueError):
                    self.pool.watchers.remove(self.gate.landed)
                self.pool.close()
                self.gate.close()


def rank_copier(volume: Volume, device: torch.device, rank: int, size: int, writes: str,
                budget: int) -> slices.RankCopier:
    """The copier for tensor-parallel rank ``rank`` of ``size`` whose views are of the
    ``writes`` mapping of ``volume`` (open while the copier is used): through the node's
    copy service where the volume has one that copies rows (a ring of slots within
    ``budget`` bytes of device memory), else the pinned ring; says why when the service
    was there but not used."""
    path = nodecopy.service_socket(volume)
    if path is None or device.type != "cuda":
        return slices.RankCopier(device, rank, size)
    slot = max(2 * MiB, min(SLOT, budget // SLOTS) // (2 * MiB) * (2 * MiB))
    pool: NodePool | None = None
    try:
        pool = NodePool(path, device.index or 0, SLOTS * slot, sizes=[slot])
        if not pool.greeted.wait(pool.timeout) or pool.session.gpus is None:
            raise NodeCopyError(f"the GPU copy service at {path} sent no hello "
                                f"({pool.failed or 'in time'})")
        if not pool.session.copies_rows:
            raise NodeCopyError(f"the GPU copy service at {path} is older than this "
                                "loader (it copies no rows of a tensor-parallel slice)")
        try:
            gate = CudaGate(device)
        except Exception as exc:  # no cuda-python, no stream memory operations
            raise NodeCopyError(f"cannot order the copies out of the service's memory "
                                f"on the GPU ({exc})") from exc
    except NodeCopyError as exc:
        if pool is not None:
            pool.close()
        log.warning("rank %d: %s; its slices go through pinned buffers", rank, exc)
        return slices.RankCopier(device, rank, size)
    try:
        base = buffer_address(cpu.source(volume, writes))
    except LoaderError as exc:  # closed under the caller: the ring still works
        pool.close()
        gate.close()
        log.warning("rank %d: %s; its slices go through pinned buffers", rank, exc)
        return slices.RankCopier(device, rank, size)
    return NodeRankCopier(device, rank, size, pool=pool, gate=gate, base=base,
                          span=volume.size,
                          view=lambda lease: torch.as_tensor(lease, device=device),
                          slot_size=slot)
