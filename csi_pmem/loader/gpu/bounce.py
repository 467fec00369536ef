"""Pinned bounce buffers and how their bytes cross to the device: the host side of the
in-pod bounce path (:mod:`.loader` chooses the path and runs the load).

Why a module of its own: the buffers (:class:`PinnedArena`), the copy stream and the
two ways a filled buffer reaches the device (:class:`DriverCopy`, cuda-python's driver
calls that release the GIL, or :class:`_TorchCopy`) are what every bounce load shares,
whoever fills the buffers (the Python pipeline, :mod:`.pipeline`, or the native loop,
:mod:`.native`); the hybrid path uses them from the back of the model. They know nothing
of files or tensors: a transfer is (buffer, device buffer, offset, bytes).
:func:`run_native` drives them from the native loop, which reads the back end's buffers,
stream, events and context directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from typing import Any, Protocol

from csi_pmem.gpucopy.copier import CopyError
from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu import native, streams
from csi_pmem.loader.gpu.registered import HOST_REGISTER_PORTABLE
from csi_pmem.loader.gpu.targets import CopyPlan
from csi_pmem.loader.model import ModelView
from csi_pmem.numa import node_cpus
from csi_pmem.sizes import describe_size
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.mapping import libc
from csi_pmem.weights.volume import MADV_POPULATE_WRITE

log = logging.getLogger(__name__)


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
            raise RuntimeError(f"cudaHostRegister of a {describe_size(n)} bounce buffer "
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


class TorchBackend:
    """Pinned buffers, the copy stream of one device, and how chunks cross to it (a
    :class:`DriverCopy`, or a :class:`_TorchCopy` without cuda-python)."""

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
                  "in %.2f ms", nbuffers, describe_size(buffer_size), self.arena.kind,
                  self.arena.seconds, (time.monotonic() - started) * 1e3)

    @property
    def driver_copy(self) -> DriverCopy | None:
        """The driver-call transfer when that is how chunks cross (the native loop drives
        only that one), else None (torch's ``copy_``)."""
        return self._copy if isinstance(self._copy, DriverCopy) else None

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


def _driver_copy(device: Any, stream: Any, addresses: list[int]) -> DriverCopy | None:
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
        return DriverCopy(index, stream.cuda_stream, addresses)
    except ImportError as exc:
        log.debug("bounce copies through torch: cuda-python is not importable (%s)", exc)
    except CopyError as exc:
        log.warning("bounce copies through torch: %s", exc)
    return None


class DriverCopy:
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


def run_native(lib: Any, backend: TorchBackend, view: ModelView, plan: CopyPlan,
               threads: int, buffer_size: int) -> None:
    """The bounce load through the native loop (:mod:`.native`): the same chunks,
    buffers, stream and events as the Python pipeline, no Python work per chunk."""
    copy = backend.driver_copy
    assert copy is not None and plan.flat is not None
    arena = backend.arena
    ready = bytearray(1 if r else 0 for r in arena._ready)
    try:
        native.run(plan.flat, view.volume.address, backend.addresses, ready,
                   buffer_size, plan.done_index, events=[int(e) for e in copy.events],
                   stream=int(backend.stream.cuda_stream), ctx=int(copy._ctx),
                   threads=threads, cpus=node_cpus(view.volume.numa_node),
                   src_fd=native.source_fd(view.volume.read_fd()), lib=lib)
    finally:
        arena.adopt(ready)  # what the loop faulted in and registered
