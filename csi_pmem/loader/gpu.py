"""The GPU paths (torch, imported lazily): the node's copy service, registered mappings,
bounce buffers.

Why several (docs/design.md §3, docs/gpu-copy-service.md), in the order a load tries them:
- Node (:mod:`.nodecopy`): where the volume directory has ``gpu.sock``, the node's copy
  service fills exportable allocations from a mapping it registered at publish time.
  What it does not finish is copied by the paths below, with one warning.
- Registered (:mod:`.registered`): the model's ranges of the mapping are registered
  with CUDA in pieces; copies then run at link speed with no CPU work. Registration
  costs about 0.03 s/GB on 2 MiB pages and 0.06-0.1 s/GB on 4 KiB pages, so
  ``mode="auto"`` registers whole from the ``auto_register_after``-th load of the same
  open :class:`Volume` (or call :meth:`GpuLoader.register` ahead of time).
- Hybrid: the first load of a large-page mapping (devdax, huge tmpfs, hugetlbfs) faults
  pieces in from the loader's threads and registers them one by one, queueing each
  piece's copies right after it (optionally with bounce buffers from the back,
  :class:`.plan.MeetInTheMiddle`). Pieces registered stay registered for later loads.
- Bounce (:mod:`.pipeline`): pinned buffers allocated once per loader, filled by memcpy
  threads on the volume's NUMA node and drained by one CUDA stream. Works for any
  mapping and is the first load of a 4 KiB-page one; costs CPU and memory bandwidth
  (each byte is read, written, read again). With driver-call copies and the native
  loop built (:mod:`.native`), the same buffers, stream and events are driven by native
  threads that need no GIL; otherwise by the Python pipeline.

Never registered, whatever the mode: a volume whose ``registration_refused_reason`` is
set when it is opened (:func:`.volume.registration_refusal`: a file on a file system
mounted ``-o dax``, where the kernel refuses the long-term pins, or a block device,
whose mapping is page cache). Those loads go straight to bounce buffers, say why once
per mapping in the log and in :attr:`GpuLoader.registration_refused_reason`. A
registration that fails anyway (``cudaHostRegister`` returns an error or raises) does
not fail the load: one warning, the load and later loads of that mapping use bounce
buffers (in ``mode="auto"`` the loader stops registering altogether).

Device placement: one device buffer per file, tensors are views into it (see
:func:`.plan.place`), so a whole-file load is a stream of large transfers.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from csi_pmem.gpucopy import protocol
from csi_pmem.gpucopy.copier import CopyError
from csi_pmem.loader import native, nodecopy, streams
from csi_pmem.loader import plan as planning
from csi_pmem.loader.cpu import torch_dtype
from csi_pmem.loader.model import ModelView
from csi_pmem.loader.numa import node_cpus
from csi_pmem.loader.pipeline import BouncePipeline
from csi_pmem.loader.registered import (
    DIRECT_CHUNK,
    HOST_REGISTER_PORTABLE,
    Pending,
    Registration,
    RegistrationError,
    copy_direct,
    queue_copies,
    register_pieces,
    report_landed,
)
from csi_pmem.sizes import MiB, round_up
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.stformat import TensorInfo
from csi_pmem.weights.volume import MADV_POPULATE_WRITE, Volume, format_size, libc

log = logging.getLogger(__name__)

# cuda-python's driver module is what the in-pod bounce copies (_DriverCopy) and the
# node path call. It is imported with this module, which imports torch's CUDA side
# anyway, and not inside the first load: a fresh process that imported it there paid
# for the import in the load itself (the in-pod load measured 323-326 ms in
# bench_fresh.py against 292-302 ms in profile_load.py, which imported it first).
with contextlib.suppress(ImportError):
    from cuda.bindings import driver as _cuda_driver  # noqa: F401

BOUNCE = "bounce"
REGISTERED = "registered"
HYBRID = "hybrid"
NODE = "node"  # the node's GPU copy service did the copies (csi_pmem.gpucopy)
# The first file of a node-path load goes out as a head of this size and the rest, each
# its own exportable allocation: the copies start after making and exporting 256 MiB,
# not a whole file, and 256 MiB (one copy, about 5 ms on the link) covers making the rest.
NODE_HEAD = 256 * MiB
POPULATE_SLICE = 64 * MiB  # one madvise(MADV_POPULATE_*) call of the hybrid's prefault
# Registration piece of this loader (hybrid and registered loads alike, since CUDA
# refuses to register a range twice): 256 MiB let the first copies start after a few
# ms and moved 13 GB fastest in a fresh process on 2 MiB pages (H200 host, 32 MiB to
# 4 GiB tried).
HYBRID_STEP = 256 * MiB
AUTO = "auto"

TensorDone = Callable[[str, Any], None]
FileDone = Callable[[str, dict[str, Any]], None]
# (file, its device buffer, the buffer offset of its first tensor byte, and the volume
# byte range [start, end) of a tensor now on the device): for checks that read the
# bytes on the device as they land.
FileData = Callable[[str, Any, int, int, int], None]


def _torch() -> Any:
    import torch

    return torch


class PinnedArena:
    """Pinned host memory for bounce buffers: huge-page anonymous memory registered
    with CUDA slice by slice, as each slice is first used, or ``pin_memory`` where
    registration fails.

    Why not ``pin_memory``: it pins 4 KiB pages at about 0.4 s/GiB, which a fresh
    process pays before its first byte moves. Registering transparent-huge-page memory
    costs about 0.025 s/GiB. Why slice by slice: the kernel zeroes every new page as it
    is faulted in, and faulting in and registering a whole 96-512 MiB arena up front took
    19-80 ms on the H200 host, with the copy engine idle. Each slice (one bounce buffer)
    is faulted in and registered by the memcpy thread that takes it first, so the
    threads prepare their buffers in parallel and the first copies start after one
    slice. ``cudaHostRegister`` holds a driver lock that stalls copies issued by other
    threads (measured: copies fell from 54.7 to 19 GB/s while another thread
    registered), so the slices are small and registered once per process.
    """

    def __init__(self, nbytes: int, slice_size: int | None = None):
        torch = _torch()
        self.nbytes = nbytes
        self.slice_size = slice_size or nbytes
        self.kind = "pin_memory"
        self._mapping: mmap.mmap | None = None
        self._cudart: Any = None
        self._address = 0
        self._ready: list[bool] = []
        self.registered: list[int] = []  # offsets of the registered slices
        started = time.monotonic()
        try:
            self.tensor = self._registered(torch, nbytes)
            self.kind = "registered huge pages"
        except Exception as exc:  # no THP, no registration: the plain way
            log.debug("huge-page pinned buffers unavailable (%s); using pin_memory", exc)
            self.close()
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._ready = [True] * -(-nbytes // self.slice_size)
        self.seconds = time.monotonic() - started

    def _registered(self, torch: Any, nbytes: int) -> Any:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mapping = m
        with contextlib.suppress(OSError, AttributeError):
            m.madvise(mmap.MADV_HUGEPAGE)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        self._cudart = torch.cuda.cudart()
        self._ready = [False] * -(-nbytes // self.slice_size)
        self.prepare(0)  # a refusal shows here, before any load relies on the arena
        return torch.frombuffer(m, dtype=torch.uint8)

    def prepare(self, index: int) -> None:
        """Fault in and register slice ``index`` unless done; called by the one thread
        that holds that slice (a bounce buffer is owned while it is taken)."""
        if self._ready[index]:
            return
        off = index * self.slice_size
        n = min(self.slice_size, self.nbytes - off)
        address = self._address + off
        rc = libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(n),
                            ctypes.c_int(MADV_POPULATE_WRITE))
        if rc != 0:  # no MADV_POPULATE_WRITE: fault the slice in by writing it
            ctypes.memset(address, 0, n)
        err = self._cudart.cudaHostRegister(address, n, HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a {format_size(n)} bounce buffer "
                               f"returned {int(err)}")
        self.registered.append(address)
        self._ready[index] = True

    def adopt(self, ready: bytearray) -> None:
        """Record the slices the native bounce loop prepared (flag set in ``ready``),
        so that they are not prepared again and are unregistered by :meth:`close`."""
        for index, flag in enumerate(ready):
            if flag and not self._ready[index]:
                self._ready[index] = True
                self.registered.append(self._address + index * self.slice_size)

    def close(self) -> None:
        self.tensor = None
        if self._cudart is not None:
            for address in self.registered:
                with contextlib.suppress(Exception):
                    self._cudart.cudaHostUnregister(address)
            self.registered = []
            self._cudart = None
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()
            self._mapping = None


class _TorchBackend:
    """Pinned buffers, the copy stream of one device, and how chunks cross to it (a
    :class:`_DriverCopy`, or a :class:`_TorchCopy` without cuda-python)."""

    def __init__(self, device: Any, nbuffers: int, buffer_size: int):
        self.device = device
        self.arena = PinnedArena(nbuffers * buffer_size, buffer_size)
        whole = self.arena.tensor
        self.buffers = [whole[i * buffer_size:(i + 1) * buffer_size] for i in range(nbuffers)]
        self.addresses = [b.data_ptr() for b in self.buffers]
        # A driver stream: torch's first stream of a process took 3.7-4.7 ms, with the
        # copy engine idle, of a fresh process's first bounce load (:mod:`.streams`).
        started = time.monotonic()
        self.stream, self._release_stream = streams.driver_stream(device)
        try:
            self._copy: _Copy = (_driver_copy(device, self.stream, self.addresses)
                                 or _TorchCopy(self.stream, self.buffers))
        except BaseException:
            self._release_stream()
            self.arena.close()
            raise
        self.targets: list[Any] = []
        log.debug("allocated %d pinned buffers of %s (%s) in %.3f s, stream and events "
                  "in %.2f ms", nbuffers, format_size(buffer_size), self.arena.kind,
                  self.arena.seconds, (time.monotonic() - started) * 1e3)

    def close(self) -> None:
        self._release_stream()  # waits for the copies still queued on it
        self._copy.close()
        self.buffers, self.addresses = [], []
        self.arena.close()

    def thread_init(self) -> None:
        # The current device and stream are per thread, in CUDA and in torch.
        torch = _torch()
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def buffer_address(self, buf: int) -> int:
        self.arena.prepare(buf)  # the first use of a buffer makes it pinned
        return self.addresses[buf]

    def transfer(self, buf: int, chunk: planning.Chunk) -> None:
        self._copy.transfer(buf, self.targets[chunk.target], chunk.dst, chunk.nbytes)

    def wait(self, buf: int) -> None:
        self._copy.wait(buf)


class _Copy(Protocol):
    """How a filled bounce buffer reaches the device: enqueue its first ``nbytes`` to
    ``target[dst:]`` on the backend's stream and mark the buffer busy; ``wait`` until
    it is free again."""

    def transfer(self, buf: int, target: Any, dst: int, nbytes: int) -> None: ...

    def wait(self, buf: int) -> None: ...

    def close(self) -> None: ...


class _TorchCopy:
    """Transfers through torch: ``Tensor.copy_`` and an ``Event`` per buffer, on the
    current stream (the backend's, set per thread by ``thread_init``)."""

    def __init__(self, stream: Any, buffers: list[Any]):
        torch = _torch()
        self.stream, self.buffers = stream, buffers
        self.events = [torch.cuda.Event() for _ in buffers]

    def transfer(self, buf: int, target: Any, dst: int, nbytes: int) -> None:
        target[dst:dst + nbytes].copy_(self.buffers[buf][:nbytes], non_blocking=True)
        self.events[buf].record(self.stream)

    def wait(self, buf: int) -> None:
        self.events[buf].synchronize()

    def close(self) -> None:
        self.events, self.buffers = [], []  # the views go before the arena does


def _driver_copy(device: Any, stream: Any, addresses: list[int]) -> _DriverCopy | None:
    """The driver-call transfer unless ``CSI_PMEM_BOUNCE_COPY=torch`` asks for torch's
    ``copy_``, or cuda-python is not installed (then torch's, with a debug line)."""
    choice = os.environ.get("CSI_PMEM_BOUNCE_COPY", "driver")
    if choice not in ("driver", "torch"):
        raise LoaderError(f"CSI_PMEM_BOUNCE_COPY={choice!r} is not a bounce copy: use "
                          "driver (cuda-python's cuMemcpyHtoDAsync, the default) or torch")
    if choice == "torch":
        return None
    try:
        index = device.index if device.index is not None else _torch().cuda.current_device()
        return _DriverCopy(index, stream.cuda_stream, addresses)
    except ImportError as exc:
        log.debug("bounce copies through torch: cuda-python is not importable (%s)", exc)
    except CopyError as exc:
        log.warning("bounce copies through torch: %s", exc)
    return None


class _DriverCopy:
    """Per-chunk transfers through cuda-python's driver calls instead of torch.

    Why: a bounce chunk is 4 MiB, about 0.08 ms on the link, and each one went
    through torch's ``copy_`` + ``Event.record``, which dispatch while holding the GIL
    that twelve memcpy threads and the verifier's thread share. ``cuMemcpyHtoDAsync``
    and ``cuEventRecord`` release it. Measured on H200 hosts in fresh processes
    (docs/loader-benchmark.md, runs of 2026-12-02): unverified level with torch's copy on
    one host and 9-11% ahead on another; verified, the in-pod cost of verification fell
    from 9% to 2.7% on the first. Same stream as torch's, so torch work queued after the
    load orders behind it.
    """

    def __init__(self, device_index: int, stream_handle: int, addresses: list[int]):
        from csi_pmem.gpucopy.cuda import check, driver

        cu = self.cu = driver()
        self._check = check
        self._device = check(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        self._ctx = check(cu, cu.cuDevicePrimaryCtxRetain(self._device),
                          "retaining the GPU's primary context")
        self._tls = threading.local()
        self.events: list[Any] = []
        self.addresses = addresses  # of the bounce buffers, one event each
        try:
            self._current()
            self.stream = cu.CUstream(stream_handle)
            flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
            for _ in addresses:
                self.events.append(check(cu, cu.cuEventCreate(flags), "cuEventCreate"))
        except BaseException:
            self.close()  # the events made so far and the context reference
            raise

    def _current(self) -> None:
        if not getattr(self._tls, "ok", False):
            self._check(self.cu, self.cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._tls.ok = True

    def transfer(self, buf: int, target: Any, dst: int, nbytes: int) -> None:
        cu = self.cu
        self._current()
        err, = cu.cuMemcpyHtoDAsync(target.data_ptr() + dst, self.addresses[buf], nbytes,
                                    self.stream)
        if int(err) == 0:
            err, = cu.cuEventRecord(self.events[buf], self.stream)
        if int(err) != 0:
            self._check(cu, (err,), "cuMemcpyHtoDAsync of a bounce buffer")

    def wait(self, buf: int) -> None:
        self._current()
        err, = self.cu.cuEventSynchronize(self.events[buf])
        if int(err) != 0:
            self._check(self.cu, (err,), "waiting for a bounce buffer's copy")

    def close(self) -> None:
        for event in self.events:
            with contextlib.suppress(Exception):
                self.cu.cuEventDestroy(event)
        self.events = []
        with contextlib.suppress(Exception):
            self.cu.cuDevicePrimaryCtxRelease(self._device)


@dataclass
class FileTarget:
    """One file's placements, device buffer (a slice of the load's allocation) and
    tensor views."""

    name: str
    infos: dict[str, TensorInfo]
    placements: list[planning.Placement]
    size: int
    buffer: Any = None
    tensors: dict[str, Any] = field(default_factory=dict)
    unaligned: dict[str, planning.Placement] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    # Buffer offset of the file's first tensor byte (kept when a partial target is
    # made from this one: its own placements may start later).
    first_dst: int = 0

    def attach(self, buffer: Any) -> None:
        """Take ``buffer`` (this file's slice of the load's allocation); make the views."""
        self.buffer = buffer
        for p in self.placements:
            view = self._view(p, self.infos[p.name])
            if view is None:
                self.unaligned[p.name] = p
            else:
                self.tensors[p.name] = view


    def _view(self, p: planning.Placement, t: TensorInfo) -> Any:
        torch = _torch()
        dtype = torch_dtype(t.dtype)
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype, device=self.buffer.device)
        raw = self.buffer[p.dst:p.dst + p.nbytes]
        if dtype is torch.uint8 and t.dtype != "U8":
            return raw  # sub-byte types, or a dtype this torch lacks: flat raw bytes
        if p.dst % dtype.itemsize:
            return None  # a file without padding: copied into its own tensor when done
        return raw.view(dtype).view(t.shape)

    def finish(self, name: str) -> Any:
        """The finished tensor (copying an unaligned one into a tensor of its own)."""
        self.finished.add(name)
        p = self.unaligned.pop(name, None)
        if p is not None:
            torch = _torch()
            t = self.infos[name]
            device = self.buffer.device
            # The bytes are on the device already (we waited for their transfer); copy on
            # the default stream so the copy stream keeps its queue.
            stream = torch.cuda.default_stream(device)
            with torch.cuda.stream(stream):
                out = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device)
                out.view(-1).view(torch.uint8).copy_(self.buffer[p.dst:p.dst + p.nbytes])
            stream.synchronize()
            self.tensors[name] = out
        return self.tensors[name]


class _Plan:
    """One load's transfers, cut by ``split``, and which tensors each completes.

    Every path (bounce, registered, hybrid, node) plans the same way and differs only
    in how it cuts runs into transfers; ``done`` may be called from several threads.
    The native bounce loop's plan is :meth:`of_flat`: its chunks stay in the loop's
    own arrays (``flat``) and are reported by index (:meth:`done_index`).
    """

    def __init__(self, targets: list[FileTarget],
                 split: Callable[[list[planning.Placement], int, int], list[planning.Chunk]],
                 finish: Callable[[FileTarget, str], None]):
        self.targets, self._finish = targets, finish
        self.chunks: list[planning.Chunk] = []
        self.flat: native.Flat | None = None
        self.completions: list[planning.Completion] = []
        for i, target in enumerate(targets):
            file_chunks = split(target.placements, i, len(self.chunks))
            self.completions.append(planning.Completion(target.placements, file_chunks))
            self.chunks += file_chunks
        self._lock = threading.Lock()

    @classmethod
    def of_flat(cls, targets: list[FileTarget], flat: native.Flat,
                finish: Callable[[FileTarget, str], None]) -> _Plan:
        plan = cls(targets, lambda ps, i, seq: [], finish)
        plan.flat = flat
        plan.completions = [planning.Completion.of_spans(t.placements, *flat.bounds(i))
                            for i, t in enumerate(targets)]
        return plan

    def __len__(self) -> int:
        return len(self.flat) if self.flat is not None else len(self.chunks)

    def ready(self, target: int | None = None) -> None:
        """Finish the zero-byte tensors (of one target, or of all)."""
        for i in range(len(self.targets)) if target is None else [target]:
            for name in self.completions[i].ready:
                self._finish(self.targets[i], name)

    def done(self, chunk: planning.Chunk) -> None:
        self._done(chunk.seq, chunk.target, chunk.dst, chunk.nbytes)

    def done_index(self, index: int) -> None:
        """Chunk ``index`` of the flat plan landed."""
        assert self.flat is not None
        self._done(index, *self.flat.span(index))

    def _done(self, seq: int, target: int, dst: int, nbytes: int) -> None:
        with self._lock:
            for name in self.completions[target].done_span(seq, dst, nbytes):
                self._finish(self.targets[target], name)


def choose_path(mode: str, volume: Volume, loads: int, registered: bool,
                auto_register_after: int | None, refused: str | None = None
                ) -> tuple[str, str | None]:
    """The path of the ``loads``-th load of ``volume``'s mapping (counting this one),
    and why it cannot be the registered one (None when it could).

    ``registered``: pieces of the mapping are registered already; ``refused``: an
    earlier registration of this mapping failed. A volume carrying
    ``registration_refused_reason`` (fsdax file, block device) takes bounce buffers
    in every mode, also ``"registered"``.
    """
    reason = volume.registration_refused_reason or refused
    if reason is not None:
        return BOUNCE, reason
    if mode in (BOUNCE, HYBRID):
        return mode, None
    if mode == REGISTERED or registered or (
            auto_register_after is not None and loads >= auto_register_after):
        return REGISTERED, None
    # auto, a mapping not (yet) worth registering whole: bounce buffers. Registering
    # piece by piece as the copies go (hybrid) lost to them in fresh processes on the
    # H200 host even on 2 MiB pages (34-40 GB/s against 43-45): registration is serial
    # at 0.022 s/GB and holds a driver lock that stalls the copies other threads issue.
    return BOUNCE, None


def _unfinished(targets: list[FileTarget]) -> list[FileTarget]:
    """What is left of a load after a node-side copy stopped: the targets, sharing
    their buffers, with only the placements whose tensors did not finish."""
    out = []
    for t in targets:
        if t.buffer is None:
            out.append(t)
            continue
        left = [p for p in t.placements if p.name not in t.finished]
        if left:
            out.append(FileTarget(t.name, t.infos, left, t.size, t.buffer, t.tensors,
                                  t.unaligned, t.finished, t.first_dst))
    return out


def load_bytes(sizes: Iterable[int]) -> int:
    """Device bytes one load of files with these placed sizes takes (see allocate)."""
    total = 0
    for size in sizes:
        total = round_up(total + size, 4096)
    return total


def allocate(targets: list[FileTarget], device: Any, arena: Any = None) -> None:
    """One device allocation for the whole load, sliced per file, before any copy.

    Fresh device memory costs about 2.3 ms/GB to allocate on an H200 (34 ms for a
    14.7 GB model); allocating per file between copies hid only a few ms of that, so
    the simpler single allocation stays. Tensors are views into it: the memory is
    returned when the last tensor of the load is freed.
    """
    targets = [t for t in targets if t.buffer is None]  # the node path may have some
    if not targets:
        return
    torch = _torch()
    bases, total = [], 0
    for t in targets:
        bases.append(total)
        total = round_up(total + t.size, 4096)  # keeps each file's mod-256 layout
    if arena is not None and arena.numel() >= total:
        whole = arena[:total]  # reserved ahead of the load (GpuLoader.reserve)
    else:
        if arena is not None:
            log.warning("reserved device memory (%d bytes) is smaller than this load "
                        "(%d bytes); allocating afresh", arena.numel(), total)
        started = time.monotonic()
        whole = torch.empty(total, dtype=torch.uint8, device=device)
        log.debug("allocated %s of device memory in %.2f ms", format_size(total),
                  (time.monotonic() - started) * 1e3)
    for t, base in zip(targets, bases, strict=True):
        t.attach(whole[base:base + t.size])


_live_loaders: weakref.WeakSet[GpuLoader] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def _hook_exit() -> None:
    """Register :func:`_close_at_exit` once, after torch is imported (see there)."""
    global _exit_hooked
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_close_at_exit)
            _exit_hooked = True


def _close_at_exit() -> None:
    """Close every loader while the interpreter is still whole.

    Why: a process that exits with mappings still registered and memcpy threads parked
    in CUDA calls tears them down during finalization, in whatever order modules and
    the CUDA runtime go away; that is where a fresh process used to abort (SIGABRT)
    after a registered load. atexit handlers run last-registered first, and this one
    is registered by the first loader, after torch was imported, so it runs before
    torch's own.
    """
    for loader in list(_live_loaders):
        try:
            if not loader.close(timeout=30):
                log.warning("a load to %s still runs at exit; not closing its loader",
                            loader.device)
        except Exception as exc:  # never turn an exit into a traceback
            log.debug("closing %s at exit: %s", loader.device, exc)


class GpuLoader:
    """Loads onto one CUDA device; keep it: buffers, threads and registrations persist.

    Defaults come from fresh processes on H200 hosts (16 cores, 13 GB model, the native
    bounce loop): 12 memcpy threads and 32 x 4 MiB pinned buffers. On a host whose
    memcpy bound the load they moved a 2 MiB-page mapping 3-5% faster than 24 x 8 MiB
    (best and median, verified and not; 128 MiB of buffers fits its 300 MiB L3, which
    may let the copy engine read them from cache: inferred, not measured); on a faster
    host 4 and 8 MiB buffers were level.
    Buffers of 2 MiB, 12 x 8 MiB and 16 threads were slower; registering pieces from the
    front with bounce buffers from the back too. docs/loader-benchmark.md has the runs.
    ``last_path`` is the path of the last load; ``registration_refused_reason`` says why
    that load could not use a registered mapping (None when it could).
    """

    def __init__(self, device: str | Any = "cuda", *, buffers: int = 32,
                 buffer_size: int = 4 * MiB, threads: int = 12, mode: str = AUTO,
                 auto_register_after: int | None = 2, node_copy: bool = True,
                 register_step: int = HYBRID_STEP, hybrid_bounce: bool = False):
        torch = _torch()
        if mode not in (AUTO, BOUNCE, REGISTERED, HYBRID):
            raise ValueError(f"mode must be {AUTO}, {BOUNCE}, {REGISTERED} or {HYBRID}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"GpuLoader needs a cuda device, not {device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.nbuffers, self.buffer_size, self.threads = buffers, buffer_size, threads
        self.mode = mode
        self.auto_register_after = auto_register_after
        self.register_step = register_step  # bytes per cudaHostRegister call
        self.hybrid_bounce = hybrid_bounce  # bounce buffers from the back in hybrid loads
        # Use the node's GPU copy service when the volume offers one (gpu.sock).
        self.node_copy = node_copy
        self.node_copy_refused: str | None = None  # why the last load could not use it
        self._node_warned: set[str] = set()
        self._backend: _TorchBackend | None = None
        self._pipelines: dict[int | None, BouncePipeline] = {}
        self._populate_pool: ThreadPoolExecutor | None = None
        self._registrations: dict[int, Registration] = {}
        self._loads: dict[int, int] = {}
        self._refused: dict[int, str] = {}  # mappings whose registration failed
        self._lock = threading.Lock()
        self.last_path: str | None = None
        self.registration_refused_reason: str | None = None
        self._arena: Any = None
        _live_loaders.add(self)
        _hook_exit()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the memcpy threads, unregister every mapping, free the pinned buffers.

        Returns False (closing nothing) when a load still runs after ``timeout`` s.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            for p in self._pipelines.values():
                p.close()
            self._pipelines.clear()
            if self._populate_pool is not None:
                self._populate_pool.shutdown(wait=True, cancel_futures=True)
                self._populate_pool = None
            for r in self._registrations.values():
                r.close()
            self._registrations.clear()
            if self._backend is not None:
                self._backend.close()
            self._backend = None
            return True
        finally:
            self._lock.release()

    def __enter__(self) -> GpuLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(self, numa_node: int | None = None) -> None:
        """Allocate the pinned buffers and start the memcpy threads now rather than in
        the first load (pinned allocation costs about 0.4 s/GiB)."""
        with self._lock:
            self._pipeline(numa_node)

    def register(self, view: ModelView) -> Registration | None:
        """Register the model's ranges of the mapping now (e.g. while a server starts).

        Returns None, registering nothing, for a volume that must not be registered
        (``view.volume.registration_refused_reason``): its loads use bounce buffers.
        """
        reason = view.volume.registration_refused_reason
        if reason is not None:
            log.info("not registering %s: %s", view.volume.source, reason)
            return None
        with self._lock:
            reg = self._registration(view)
            for start, end in self._pieces(view):
                reg.ensure(start, end)
            return reg

    def release(self, volume: Volume) -> None:
        """Forget a mapping: unregister it and drop its load count (call before
        closing a volume this loader has loaded from, if the loader lives on)."""
        with self._lock:
            key = id(volume.mapping)
            self._loads.pop(key, None)
            self._refused.pop(key, None)
            reg = self._registrations.pop(key, None)
            if reg is not None:
                reg.close()

    def _registration(self, view: ModelView) -> Registration:
        key = id(view.volume.mapping)
        if key not in self._registrations:
            self._registrations[key] = Registration(view.volume)
        return self._registrations[key]

    def _pieces(self, view: ModelView, files: Iterable[str] | None = None
                ) -> list[tuple[int, int]]:
        vol = view.volume
        wanted = None if files is None else set(files)
        return register_pieces([(f.offset, min(vol.size, round_up(f.end, vol.align)))
                                for f in view.model.safetensors
                                if wanted is None or f.name in wanted], self.register_step)

    def _pipeline(self, numa_node: int | None) -> BouncePipeline:
        if self._backend is None:
            self._backend = _TorchBackend(self.device, self.nbuffers, self.buffer_size)
        pipe = self._pipelines.get(numa_node)
        if pipe is None:
            cpus = node_cpus(numa_node)
            pipe = BouncePipeline(self._backend, self.nbuffers, self.buffer_size,
                                  max(1, min(self.threads, len(cpus))), cpus=cpus,
                                  memcpy=ctypes.memmove, thread_init=self._backend.thread_init)
            self._pipelines[numa_node] = pipe
        return pipe

    def _choose(self, view: ModelView) -> str:
        key = id(view.volume.mapping)
        loads = self._loads[key] = self._loads.get(key, 0) + 1
        path, reason = choose_path(self.mode, view.volume, loads, key in self._registrations,
                                   self.auto_register_after, self._refused.get(key))
        self.registration_refused_reason = reason
        if reason is not None and key not in self._refused and loads == 1:
            # Refused up front (fsdax file, block device): expected, said once per mapping.
            level = logging.WARNING if self.mode == REGISTERED else logging.INFO
            log.log(level, "%s; loading through pinned bounce buffers", reason)
        return path

    def _refuse(self, view: ModelView, exc: Exception) -> None:
        """A registration failed: say so once, and use bounce buffers from now on."""
        key = id(view.volume.mapping)
        log.warning("%s; loading through pinned bounce buffers instead (slower than a "
                    "registered mapping, and busy memcpy threads)", exc)
        self._refused[key] = self.registration_refused_reason = str(exc)
        reg = self._registrations.pop(key, None)
        if reg is not None:
            reg.close()  # nothing registered yet; releases its export of the mapping
        if self.mode == AUTO:
            self.auto_register_after = None  # do not try (and warn) for every mapping

    def reserve(self, view: ModelView, names: Iterable[str] | None = None) -> int:
        """Allocate the device memory of the next load of ``view`` now; return its size.

        Fresh device memory costs about 2.3 ms/GB on an H200 (34 ms for 14.7 GB) the
        first time it is written, whether or not the allocation happened earlier: the
        cost is in committing the pages, so the reservation is also written once (a
        device memset, ~5 ms). A server that knows its model can reserve while it does
        other start-up work (CUDA context, tokenizer, graph capture); the next load then
        only copies. The reservation is consumed by that load: its tensors are views
        into it.
        """
        torch = _torch()
        sizes = [planning.place(tensors)[1] for tensors in view.select(names).values()]
        nbytes = load_bytes(sizes)
        arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        arena.zero_()
        torch.cuda.synchronize(self.device)
        with self._lock:
            self._arena = arena
        return nbytes

    def _allocate(self, targets: list[FileTarget]) -> None:
        """Device memory for the targets that have none yet (the node path or a refused
        registration may have attached it), from the reservation if there is one."""
        if any(t.buffer is None for t in targets):
            arena, self._arena = self._arena, None
            allocate(targets, self.device, arena)

    def load(self, view: ModelView, selection: dict[str, list[TensorInfo]],
             on_tensor: TensorDone, on_file: FileDone,
             on_data: FileData | None = None) -> str:
        """Copy ``selection`` to the device; callbacks fire as tensors and files land
        (``on_data`` right after each ``on_tensor``).

        Returns the path used: ``"node"``, ``"bounce"``, ``"registered"`` or ``"hybrid"``.
        """
        with self._lock:
            targets = []
            for fname, tensors in selection.items():
                placements, size = planning.place(tensors)
                targets.append(FileTarget(fname, {t.name: t for t in tensors}, placements,
                                          size, first_dst=placements[0].dst if placements
                                          else 0))
            left = {t.name: len(t.placements) for t in targets}

            def finish(target: FileTarget, name: str) -> None:
                on_tensor(name, target.finish(name))
                if on_data is not None:
                    info = target.infos[name]
                    on_data(target.name, target.buffer, target.first_dst, info.offset,
                            info.offset + info.nbytes)
                left[target.name] -= 1
                if left[target.name] == 0:
                    on_file(target.name, dict(target.tensors))

            node = nodecopy.service_socket(view.volume) if self.node_copy else None
            if node is not None:
                remaining = self._load_node(view, targets, finish, node)
                if remaining is None:
                    self.last_path = NODE
                    return NODE
                targets = remaining
            path = self._choose(view)
            if path == HYBRID:
                refused = self._load_hybrid(view, targets, finish)
                if refused is not None:
                    self._refuse(view, refused)
            if path == REGISTERED:
                try:
                    self._load_registered(view, targets, finish)
                except RegistrationError as exc:
                    self._refuse(view, exc)
                    path = BOUNCE
            if path == BOUNCE:
                self._load_bounce(view, targets, finish)
            self.last_path = path
            return path

    def _load_bounce(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None]) -> None:
        torch = _torch()
        steps = [time.monotonic()]
        self._allocate(targets)
        steps.append(time.monotonic())
        pipe = self._pipeline(view.volume.numa_node)
        backend = self._backend
        assert backend is not None
        backend.targets = [t.buffer for t in targets]
        try:
            # The device buffers were allocated on the current stream; order ours after it.
            backend.stream.wait_stream(torch.cuda.current_stream(self.device))
            steps.append(time.monotonic())
            lib = native.library() if isinstance(backend._copy, _DriverCopy) else None
            if lib is None:
                plan = _Plan(targets, lambda ps, i, seq: planning.bounce_chunks(
                    ps, self.buffer_size, i, seq), finish)
            else:  # the native loop's own layout, cut by the library (no Chunk objects)
                plan = _Plan.of_flat(targets, native.plan_bounce(
                    [t.placements for t in targets], [b.data_ptr() for b in backend.targets],
                    self.buffer_size, lib), finish)
            plan.ready()
            steps.append(time.monotonic())
            # Everything here comes before the first byte moves: say what each part cost.
            log.debug("bounce load: device memory %.2f ms, buffers and stream %.2f ms, plan "
                      "of %d chunks %.2f ms", (steps[1] - steps[0]) * 1e3,
                      (steps[2] - steps[1]) * 1e3, len(plan),
                      (steps[3] - steps[2]) * 1e3)
            if lib is None:
                pipe.run(plan.chunks, view.volume.address, plan.done)
            else:
                self._run_native(lib, backend, view, plan, pipe.threads)
        finally:
            backend.targets = []

    def _run_native(self, lib: Any, backend: _TorchBackend, view: ModelView, plan: _Plan,
                    threads: int) -> None:
        """The bounce load through the native loop (:mod:`.native`): the same chunks,
        buffers, stream and events as the Python pipeline, no Python work per chunk."""
        copy = backend._copy
        assert isinstance(copy, _DriverCopy) and plan.flat is not None
        arena = backend.arena
        ready = bytearray(1 if r else 0 for r in arena._ready)
        try:
            native.run(plan.flat, view.volume.address, backend.addresses, ready,
                       self.buffer_size, plan.done_index, events=[int(e) for e in copy.events],
                       stream=int(backend.stream.cuda_stream), ctx=int(copy._ctx),
                       threads=threads, cpus=node_cpus(view.volume.numa_node),
                       src_fd=native.source_fd(view.volume.read_fd()), lib=lib)
        finally:
            arena.adopt(ready)  # what the loop faulted in and registered

    def _load_node(self, view: ModelView, targets: list[FileTarget],
                   finish: Callable[[FileTarget, str], None],
                   socket_path: str) -> list[FileTarget] | None:
        """Have the node's copy service fill exportable allocations, one per file.
        Returns None when it did, else the targets (finished tensors left out) that
        still need copying in-pod; says why once per socket.

        One allocation per file, each sent as soon as it exists, and the first file's
        head (:data:`NODE_HEAD`) sent before the rest of it is made: the first copies
        start after 256 MiB of ``cuMemCreate`` and export (a few ms for 13 GB would
        otherwise come before the first byte moves), and the rest is allocated while
        the copy engine works.
        """
        torch = _torch()
        t0 = time.monotonic()
        try:
            session = nodecopy.Session(socket_path)
        except nodecopy.NodeCopyError as exc:
            self._node_fallback(socket_path, exc)
            return targets
        log.debug("node copy: connected in %.1f ms", (time.monotonic() - t0) * 1e3)
        # The first file's head is an allocation of its own (ExportableAllocation says
        # why); its copies stop at the cut, so that each lands in one allocation.
        head = NODE_HEAD if targets and targets[0].size >= 2 * NODE_HEAD else None
        plan = _Plan(targets, lambda ps, i, seq: planning.direct_chunks(
            ps, DIRECT_CHUNK, [], i, seq, cuts=[head] if head and i == 0 else []), finish)
        by_target: list[list[planning.Chunk]] = [[] for _ in targets]
        for c in plan.chunks:
            by_target[c.target].append(c)
        order = [c for cs in by_target for c in cs]  # the order the service reports
        reported = [0]
        fds: list[int] = []

        def requests() -> Iterator[tuple[int, protocol.CopyRequest]]:
            for i, target in enumerate(targets):
                t = time.monotonic()
                try:
                    alloc = nodecopy.ExportableAllocation(
                        self.device.index, target.size, head if i == 0 else None)
                except Exception as exc:  # no cuda-python, an allocation error
                    raise nodecopy.NodeCopyError(
                        f"cannot allocate exportable device memory ({exc}); install "
                        "cuda-bindings in the pod to use the node's GPU copy service") \
                        from exc
                if session.gpus is not None and alloc.uuid not in session.gpus:
                    raise nodecopy.NodeCopyError(
                        f"the node's GPU copy service cannot reach {alloc.uuid} (it sees "
                        f"{', '.join(session.gpus) or 'no GPU'})")
                chunks = by_target[i]
                for part, (off, n) in enumerate(alloc.parts):
                    try:
                        alloc.map_part(part)  # part 0 came with the allocation
                        t_alloc = time.monotonic()
                        fds.append(alloc.export_fd(part))
                    except Exception as exc:
                        raise nodecopy.NodeCopyError(
                            f"cannot allocate or export device memory for the node's GPU "
                            f"copy service ({exc})") from exc
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("node copy: %s part %d (%s) allocated in %.2f ms, "
                                  "exported in %.2f ms, sent at %.1f ms", target.name, part,
                                  format_size(n), (t_alloc - t) * 1e3,
                                  (time.monotonic() - t_alloc) * 1e3,
                                  (time.monotonic() - t0) * 1e3)
                    # The request goes out first, so the copy engine starts while this
                    # process makes the next part and the tensor views (no progress is
                    # read before every request is sent, so no tensor is reported before
                    # it has its view).
                    mine = [c for c in chunks if off <= c.dst < off + n]
                    if any(c.dst + c.nbytes > off + n for c in mine):
                        raise LoaderError(f"a copy of {target.name} crosses the end of "
                                          "its device allocation (a planning bug)")
                    yield fds[-1], protocol.CopyRequest(alloc.uuid, n, tuple(
                        protocol.Copy(c.pieces[0].src, c.dst - off, c.nbytes) for c in mine))
                    t = time.monotonic()
                    # Sent: the message holds the allocation now. Closed here, while
                    # the copies run: closing the fds after the last copy took 1.2-1.5
                    # ms of the load's end.
                    os.close(fds.pop())
                # Every part is mapped: the tensors keep the allocation alive from now on.
                t = time.monotonic()
                target.attach(torch.as_tensor(alloc, device=self.device)[:target.size])
                plan.ready(i)
                log.debug("node copy: %s views made in %.2f ms", target.name,
                          (time.monotonic() - t) * 1e3)

        def progress(k: int) -> None:
            if not reported[0]:
                log.debug("node copy: first copies done at %.1f ms",
                          (time.monotonic() - t0) * 1e3)
            for c in order[reported[0]:k]:
                plan.done(c)
            reported[0] = k

        try:
            report = session.copy(requests(), progress)
            log.debug("node copy: %d request(s), %.1f ms in all (the service: %.1f ms)",
                      len(targets), (time.monotonic() - t0) * 1e3,
                      float(report.get("seconds", 0)) * 1e3)
        except nodecopy.NodeCopyError as exc:
            self._node_fallback(socket_path, exc)
            return _unfinished(targets)
        finally:
            t = time.monotonic()
            session.close()
            for fd in fds:  # what a failed request left
                os.close(fd)
            log.debug("node copy: connection closed in %.2f ms", (time.monotonic() - t) * 1e3)
        self.node_copy_refused = None
        return None

    def _node_fallback(self, socket_path: str, exc: nodecopy.NodeCopyError) -> None:
        self.node_copy_refused = str(exc)
        level = logging.INFO if socket_path in self._node_warned else logging.WARNING
        self._node_warned.add(socket_path)
        log.log(level, "%s; loading in-pod instead", exc)

    def _load_hybrid(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None]) -> RegistrationError | None:
        """Registration from the front, bounce buffers from the back (see
        :class:`.plan.MeetInTheMiddle`). Returns the registration error that stopped
        the front side before it registered anything (the mapping is then treated as
        refused), else None."""
        torch = _torch()
        # One run of at most a bounce buffer each, never across a piece edge: every
        # chunk suits both sides.
        registration, pieces, plan = self._direct_plan(view, targets, finish,
                                                       self.buffer_size)
        plan.ready()
        starts = [p[0] for p in pieces]
        by_piece: list[list[planning.Chunk]] = [[] for _ in pieces]
        for c in sorted(plan.chunks, key=lambda c: c.pieces[0].src):
            by_piece[bisect.bisect_right(starts, c.pieces[0].src) - 1].append(c)
        sides = planning.MeetInTheMiddle(by_piece)
        on_done = plan.done

        alloc_stream = torch.cuda.current_stream(self.device)
        outcome: dict[str, BaseException] = {}
        populated = self._populate_ahead(view.volume, pieces, by_piece)
        front = threading.Thread(
            target=self._register_front,
            args=(registration, pieces, by_piece, sides, [t.buffer for t in targets],
                  alloc_stream, on_done, outcome, populated), name="register", daemon=True)
        front.start()
        try:
            if self.hybrid_bounce:
                pipe = self._pipeline(view.volume.numa_node)
                assert self._backend is not None
                self._backend.targets = [t.buffer for t in targets]
                self._backend.stream.wait_stream(alloc_stream)
                pipe.run(sides.take, view.volume.address, on_done)
            front.join()
            if sides.left:  # pieces the front side gave back (or left, without bounce)
                pipe = self._pipeline(view.volume.numa_node)
                assert self._backend is not None
                self._backend.targets = [t.buffer for t in targets]
                self._backend.stream.wait_stream(alloc_stream)
                pipe.run(sides.take, view.volume.address, on_done)
        finally:
            front.join()
            for futs in populated.values():
                for f in futs:
                    f.cancel()
            if self._backend is not None:
                self._backend.targets = []
        if "fatal" in outcome:
            raise outcome["fatal"]
        log.debug("hybrid load: %d of %d pieces registered and copied by the copy engine "
                  "(registration %.1f ms); bounce buffers %s", len(sides.front_pieces),
                  sum(1 for b in by_piece if b), registration.seconds * 1e3,
                  "on" if self.hybrid_bounce else "off")
        refused = outcome.get("refused")
        if refused is not None and not sides.front_pieces:
            assert isinstance(refused, RegistrationError)
            return refused
        if refused is not None:
            log.warning("%s; the rest of this load went through bounce buffers", refused)
        return None

    def _populate_ahead(self, volume: Volume, pieces: list[tuple[int, int]],
                        by_piece: list[list[planning.Chunk]]) -> dict[int, list[Any]]:
        """Fault the pieces in, front first, from the loader's threads (see
        :meth:`.volume.Volume.populate`); futures per piece index."""
        if self._populate_pool is None:
            self._populate_pool = ThreadPoolExecutor(self.threads,
                                                     thread_name_prefix="populate")
        out: dict[int, list[Any]] = {}
        for i, (start, end) in enumerate(pieces):
            if by_piece[i]:
                out[i] = [self._populate_pool.submit(volume.populate, o,
                                                     min(POPULATE_SLICE, end - o))
                          for o in range(start, end, POPULATE_SLICE)]
        return out

    def _register_front(self, registration: Registration, pieces: list[tuple[int, int]],
                        by_piece: list[list[planning.Chunk]],
                        sides: planning.MeetInTheMiddle, buffers: list[Any],
                        alloc_stream: Any, on_done: Callable[[planning.Chunk], None],
                        outcome: dict[str, BaseException],
                        populated: dict[int, list[Any]]) -> None:
        """The hybrid load's front side: wait until a piece is faulted in, register it,
        queue its copies, repeat."""
        torch = _torch()
        pending: Pending = []
        try:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(alloc_stream)
            src = registration.source
            with torch.cuda.stream(stream):
                while (i := sides.claim_front()) is not None:
                    for f in populated.get(i, []):
                        with contextlib.suppress(Exception):
                            f.result()
                    try:
                        registration.ensure(*pieces[i])
                    except RegistrationError as exc:
                        sides.give_back(i)
                        outcome["refused"] = exc
                        break
                    queue_copies(by_piece[i], buffers, src, stream, pending)
                    if len(sides.front_pieces) == 1:
                        log.debug("hybrid load: first piece registered and queued")
                    report_landed(pending, on_done)
            report_landed(pending, on_done, wait=True)
        except BaseException as exc:  # relayed to the load thread, which raises it
            outcome["fatal"] = exc

    def _direct_plan(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None], limit: int
                     ) -> tuple[Registration, list[tuple[int, int]], _Plan]:
        """The registration, its pieces and the transfers (at most ``limit`` bytes,
        never across a piece edge) of a load straight from the mapping; device memory
        allocated where the node path did not attach it."""
        registration = self._registration(view)
        pieces = self._pieces(view, [t.name for t in targets])
        edges = sorted({e for p in pieces for e in p})
        self._allocate(targets)
        return registration, pieces, _Plan(targets, lambda ps, i, seq: planning.direct_chunks(
            ps, limit, edges, i, seq), finish)

    def _load_registered(self, view: ModelView, targets: list[FileTarget],
                         finish: Callable[[FileTarget, str], None]) -> None:
        registration, pieces, plan = self._direct_plan(view, targets, finish, DIRECT_CHUNK)
        # Raises RegistrationError before any tensor is reported when the first piece
        # is refused, so the caller can still switch to bounce buffers.
        copy_direct(registration, pieces, sorted(plan.chunks, key=lambda c: c.pieces[0].src),
                    [t.buffer for t in targets], self.device, plan.done)
        plan.ready()
