"""The copy engine on real GPUs, through cuda-python's driver bindings (no torch).

Why the driver API: the node plugin's image carries no torch, and what the service
does is four driver calls: register host memory (``cuMemHostRegister``, read-only and
portable, so one registration serves every GPU), import a pod's allocation from its
POSIX fd (``cuMemImportFromShareableHandle``), map it into this process
(``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess``; mapping fails when the
allocation is smaller than announced, which is the size check), and
``cuMemcpyHtoDAsync`` (``cuMemcpy2DAsync`` for a tensor-parallel rank's stretch of
every row) on a stream of the allocation's own GPU, with an event after each
copy so progress is reported in order as the copy engine finishes. Copies are queued
as requests arrive, so the next allocation's copies line up behind the current ones.

The GPU a copy goes to is the one the allocation lives on
(``cuMemGetAllocationPropertiesFromHandle``), checked against the UUID the pod named:
device ordinals differ between processes (CUDA_VISIBLE_DEVICES), UUIDs do not.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from csi_pmem.gpucopy.copier import CopyError, HostCopy, Target

log = logging.getLogger(__name__)

EVENTS_AHEAD = 512  # per GPU: a 15 GB model is about 230 copies of 64 MiB


def driver() -> Any:
    from cuda.bindings import driver as cu

    return cu


def check(cu: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-python result tuple; raise CopyError naming the call and error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = cu.cuGetErrorName(err)
        text = name[1].decode() if int(name[0]) == 0 else f"CUresult {int(err)}"
        raise CopyError(f"{what} failed: {text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def grant_access(cu: Any, ptr: Any, size: int, ordinal: int) -> None:
    """Make a mapped VMM range readable and writable from GPU ``ordinal``."""
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu, cu.cuMemSetAccess(ptr, size, [desc], 1), "granting access (cuMemSetAccess)")


def uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class CudaTarget:
    def __init__(self, copier: CudaCopier, fd: int, size: int, gpu: str):
        cu = copier.cu
        self.gpu, self.size = gpu, size
        self._cu, self._copier = cu, copier
        self._stream: Any = None
        self.handle = check(cu, cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "importing the allocation (cuMemImportFromShareableHandle)")
        self.ptr = None
        try:
            prop = check(cu, cu.cuMemGetAllocationPropertiesFromHandle(self.handle),
                         "reading the allocation's properties")
            self.ordinal = int(prop.location.id)
            actual = copier.uuid_of(self.ordinal)
            if actual != gpu:
                raise CopyError(f"the allocation lives on {actual}, not on {gpu} as the "
                                "request says")
            copier.make_current(self.ordinal)
            gran = check(cu, cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "reading the allocation granularity")
            if size % int(gran):
                raise CopyError(f"the allocation size {size} is not a multiple of the "
                                f"GPU's granularity {int(gran)}")
            self.ptr = check(cu, cu.cuMemAddressReserve(size, 0, 0, 0),
                             "reserving address space")
            try:
                check(cu, cu.cuMemMap(self.ptr, size, 0, self.handle, 0),
                      f"mapping {size} bytes of the allocation (is it that large?)")
            except CopyError:
                cu.cuMemAddressFree(self.ptr, size)
                self.ptr = None
                raise CopyError(f"the allocation is smaller than the {size} bytes the "
                                "request names") from None
            grant_access(cu, self.ptr, size, self.ordinal)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> int:
        assert self.ptr is not None, "the allocation is closed"
        return int(self.ptr)

    def stream(self) -> Any:
        """This target's copy stream (taken from the copier's pool on first use)."""
        if self._stream is None:
            self._stream = self._copier.take_stream(self.ordinal)
        return self._stream

    def close(self) -> None:
        cu = self._cu
        if self._stream is not None:
            # Nothing may still write the memory once it is unmapped.
            if int(cu.cuStreamSynchronize(self._stream)[0]) == 0:
                self._copier.give_stream(self.ordinal, self._stream)
            else:  # a faulted stream is not handed to the next pod
                cu.cuStreamDestroy(self._stream)
            self._stream = None
        if self.ptr is not None:
            cu.cuMemUnmap(self.ptr, self.size)
            cu.cuMemAddressFree(self.ptr, self.size)
            self.ptr = None
        if self.handle is not None:
            cu.cuMemRelease(self.handle)
            self.handle = None


class CudaCopier:
    name = "cuda"

    def __init__(self) -> None:
        cu = self.cu = driver()
        check(cu, cu.cuInit(0), "cuInit")
        count = check(cu, cu.cuDeviceGetCount(), "counting GPUs")
        self._devices = [check(cu, cu.cuDeviceGet(i), "cuDeviceGet") for i in range(count)]
        self._uuids = [uuid_text(bytes(check(cu, cu.cuDeviceGetUuid(d), "cuDeviceGetUuid")
                                       .bytes)) for d in self._devices]
        self._contexts: dict[int, Any] = {}
        self._lock = threading.Lock()
        # Streams and events are made ahead and reused (per GPU: both belong to its
        # context). A fresh pod's first request used to create its stream and an event
        # per copy on the way to its first byte.
        self._streams: dict[int, list[Any]] = {}
        self._events: dict[int, list[Any]] = {}
        for ordinal in range(count):
            self.make_current(ordinal)
            self.give_stream(ordinal, self._new_stream())
            self._events[ordinal] = [self._new_event() for _ in range(EVENTS_AHEAD)]
        # Registrations are portable: made once, under the first GPU's context.
        if count:
            self.make_current(0)
        log.info("GPU copy service: %d GPU(s): %s", count, ", ".join(self._uuids))

    def gpus(self) -> list[str]:
        return list(self._uuids)

    def _new_stream(self) -> Any:
        cu = self.cu
        return check(cu, cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING),
                     "creating a stream")

    def _new_event(self) -> Any:
        cu = self.cu
        return check(cu, cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                     "creating an event")

    def take_stream(self, ordinal: int) -> Any:
        """An idle stream of GPU ``ordinal`` (its context current)."""
        with self._lock:
            free = self._streams.setdefault(ordinal, [])
            if free:
                return free.pop()
        self.make_current(ordinal)
        return self._new_stream()

    def give_stream(self, ordinal: int, stream: Any) -> None:
        """Return a stream with nothing queued on it."""
        with self._lock:
            self._streams.setdefault(ordinal, []).append(stream)

    def _take_event(self, ordinal: int) -> Any:
        with self._lock:
            free = self._events.setdefault(ordinal, [])
            if free:
                return free.pop()
        return self._new_event()  # the caller made the context current

    def uuid_of(self, ordinal: int) -> str:
        if not 0 <= ordinal < len(self._uuids):
            raise CopyError(f"the allocation is on a GPU (ordinal {ordinal}) this node's "
                            "copy service cannot see")
        return self._uuids[ordinal]

    def make_current(self, ordinal: int) -> None:
        cu = self.cu
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                ctx = self._contexts[ordinal] = check(
                    cu, cu.cuDevicePrimaryCtxRetain(self._devices[ordinal]),
                    "retaining the GPU's primary context")
        check(cu, cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def register(self, address: int, length: int) -> None:
        cu = self.cu
        self.make_current(0)
        check(cu, cu.cuMemHostRegister(
            address, length, cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_READ_ONLY),
            f"registering {length} bytes of the volume (cuMemHostRegister)")

    def unregister(self, address: int) -> None:
        cu = self.cu
        self.make_current(0)
        cu.cuMemHostUnregister(address)

    def open_target(self, fd: int, size: int, gpu: str) -> CudaTarget:
        if gpu not in self._uuids:
            raise CopyError(f"this node's copy service cannot reach GPU {gpu} (it sees "
                            f"{', '.join(self._uuids) or 'none'})")
        return CudaTarget(self, fd, size, gpu)

    def enqueue(self, target: Target, copies: Sequence[HostCopy]) -> list[Any]:
        assert isinstance(target, CudaTarget), "a target of another copier"
        cu = self.cu
        self.make_current(target.ordinal)
        stream = target.stream()
        base = target.address
        tokens: list[Any] = []
        try:
            for src, dst, n, rows, pitch in copies:
                if rows == 1:
                    check(cu, cu.cuMemcpyHtoDAsync(base + dst, src, n, stream),
                          "cuMemcpyHtoDAsync")
                else:
                    check(cu, cu.cuMemcpy2DAsync(self._rows(src, base + dst, n // rows,
                                                            rows, pitch), stream),
                          "cuMemcpy2DAsync")
                ev = self._take_event(target.ordinal)
                tokens.append((target, ev))  # spent by discard below if the record fails
                check(cu, cu.cuEventRecord(ev, stream), "recording an event")
        except BaseException:
            for token in tokens:  # the caller never sees them
                self.discard(token)
            raise
        return tokens

    def _rows(self, src: int, dst: int, width: int, rows: int, pitch: int) -> Any:
        """``rows`` rows of ``width`` bytes, one every ``pitch`` on the host from
        ``src``, packed at device address ``dst``."""
        cu = self.cu
        m = cu.CUDA_MEMCPY2D()
        m.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
        m.srcHost = src
        m.srcPitch = pitch
        m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        m.dstDevice = cu.CUdeviceptr(dst)
        m.dstPitch = width
        m.WidthInBytes = width
        m.Height = rows
        return m

    def wait(self, token: Any) -> None:
        cu = self.cu
        target, ev = token
        self.make_current(target.ordinal)
        err, = cu.cuEventSynchronize(ev)
        if int(err) != 0:
            cu.cuEventDestroy(ev)  # not reused: it may belong to a faulted stream
            check(cu, (err,), "waiting for a copy")
        with self._lock:  # complete: reusable by the next copy
            self._events.setdefault(target.ordinal, []).append(ev)

    def discard(self, token: Any) -> None:
        """An event nobody will wait for: back to the pool when it has completed, else
        destroyed (the driver frees a pending event once it completes; one of a
        faulted stream is never reused)."""
        cu = self.cu
        target, ev = token
        try:
            self.make_current(target.ordinal)
            done = int(cu.cuEventQuery(ev)[0]) == 0
        except Exception:  # never raises: a context that cannot be made current
            done = False
        if done:
            with self._lock:
                self._events.setdefault(target.ordinal, []).append(ev)
        else:
            with contextlib.suppress(Exception):
                cu.cuEventDestroy(ev)
