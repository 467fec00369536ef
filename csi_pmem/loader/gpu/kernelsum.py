"""``wsum64`` on the device by the project's own kernel, through the CUDA driver.

Why not torch's reductions (:class:`.devsums.TorchSums`, the fallback): a fresh process
loads the code of every torch kernel the first time it launches it. The check's
reductions, arange, multiply and cat took tens of milliseconds to load on an H200 host,
and the loading held a driver lock that stopped the load's copy threads: the copy
engine sat idle for 5.5 ms in the middle of a fresh verified load (its trace). Run
before the copies instead, the same loading delayed the first copy by 60 ms. The kernel
here (``_native/wsum_kernel.cu``, compiled into :mod:`.wsum_kernel`) is one small module:
a cubin for the GPU's architecture loads in well under a millisecond (PTX, compiled by
the driver, is the fallback for other GPUs). It also sums in one pass over the data and
one launch per batch of whole chunks, where the reductions took two passes and a dozen
launches.

Results go into slots of device memory zeroed by the driver (no torch kernel) and are
read back together, one copy per page of slots, on the current stream.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

from csi_pmem.loader.gpu import wsum_kernel
from csi_pmem.weights.wsum import MASK

log = logging.getLogger(__name__)

PAGE = 1024  # slots (ranges) per page of results
MAX_BLOCKS = 128  # blocks per range
MAX_RANGES = 65535  # ranges per launch: CUDA's limit on a grid's y dimension
WORDS_PER_THREAD = 64  # at least, before a range gets a second block

_functions: dict[int, Any] = {}  # device ordinal -> the kernel, loaded once per process
_lock = threading.Lock()


def _driver() -> tuple[Any, Callable[[Any, Any, str], Any]]:
    from csi_pmem.gpucopy.cuda import check, driver

    return driver(), check


def image_for(capability: tuple[int, int]) -> tuple[bytes, str]:
    """The module image for a GPU of compute ``capability``: its cubin if there is
    one, else the PTX (NUL-terminated, as cuModuleLoadData wants it); and which."""
    cc = capability[0] * 10 + capability[1]
    if cc in wsum_kernel.CUBINS:
        return base64.b64decode(wsum_kernel.CUBINS[cc]), f"cubin sm_{cc}"
    return wsum_kernel.PTX.encode() + b"\0", "PTX"


def function(ordinal: int) -> Any:
    """The kernel on GPU ``ordinal``, loaded into its primary context (which must be
    current on this thread) on first use."""
    with _lock:
        fn = _functions.get(ordinal)
        if fn is None:
            cu, check = _driver()
            dev = check(cu, cu.cuDeviceGet(ordinal), "cuDeviceGet")
            attr = cu.CUdevice_attribute
            major = check(cu, cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
            minor = check(cu, cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
            image, kind = image_for((int(major), int(minor)))
            log.debug("loading the checksum kernel on GPU %d (%s)", ordinal, kind)
            module = check(cu, cu.cuModuleLoadData(image), "loading the checksum kernel")
            fn = check(cu, cu.cuModuleGetFunction(module, wsum_kernel.KERNEL.encode()),
                       "cuModuleGetFunction")
            _functions[ordinal] = fn
        return fn


def grid_x(range_bytes: int) -> int:
    """Blocks per range: one per BLOCK * WORDS_PER_THREAD words, 1 to MAX_BLOCKS."""
    return max(1, min(MAX_BLOCKS, range_bytes // 8 // (wsum_kernel.BLOCK * WORDS_PER_THREAD)))


def launches(ranges: int) -> list[tuple[int, int]]:
    """(first range, ranges) of each launch for ``ranges`` ranges: a tensor that lands
    whole completes all its chunks at once, more than one grid holds at small chunk
    sizes (10 GB of 32 KiB chunks is 320,000)."""
    return [(at, min(MAX_RANGES, ranges - at)) for at in range(0, ranges, MAX_RANGES)]


class KernelSums:
    """Sums of device buffers by the kernel, on the current torch stream; the getters
    each method returns read the results back (all slots of a page in one copy).

    The same interface as :class:`.devsums.TorchSums`: ``chunks(buf, chunk_bytes)`` for
    whole chunks back to back, ``range(buf)`` for one range summed as if it started a
    chunk. ``buf`` is a uint8 CUDA tensor whose first byte is 8-byte aligned; it must stay
    allocated until the results are read.
    """

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.ordinal = self.device.index if self.device.index is not None \
            else torch.cuda.current_device()
        self._cu, self._check = _driver()
        with torch.cuda.device(self.ordinal):
            self._fn = function(self.ordinal)
        self._pages: list[Any] = []  # int64 device tensors, 2 words per slot
        self._sizes: list[int] = []  # slots per page
        self._used = 0  # slots used in the last page
        self._read: list[tuple[int, list[int]]] = []  # per page: (slots read, values)

    def _slots(self, n: int) -> tuple[int, int]:
        """``n`` zeroed slots in one page: (page index, first slot)."""
        torch = self._torch
        if not self._pages or self._used + n > self._sizes[-1]:
            size = max(PAGE, n)
            page = torch.empty(2 * size, dtype=torch.int64, device=self.device)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self._check(self._cu, self._cu.cuMemsetD8Async(page.data_ptr(), 0, 16 * size,
                                                           stream), "cuMemsetD8Async")
            self._pages.append(page)
            self._sizes.append(size)
            self._read.append((0, []))
            self._used = 0
        first, self._used = self._used, self._used + n
        return len(self._pages) - 1, first

    def _launch(self, ptr: int, range_bytes: int, ranges: int, stride: int,
                out: int) -> None:
        if ptr % 8 or stride % 8:
            # The kernel reads 64-bit words: a misaligned one would be a device fault,
            # which poisons the whole CUDA context, not an error of this check.
            raise ValueError(f"the checksum kernel needs 8-byte aligned ranges, got "
                             f"address {ptr:#x} and stride {stride}")
        stream = self._torch.cuda.current_stream(self.device).cuda_stream
        self._check(self._cu, self._cu.cuLaunchKernel(
            self._fn, grid_x(range_bytes), ranges, 1, wsum_kernel.BLOCK, 1, 1, 0, stream,
            ((ptr, range_bytes, stride, out),
             (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p)), 0),
            "launching the checksum kernel")

    def _pair(self, page: int, slot: int) -> tuple[int, int]:
        read, values = self._read[page]
        if slot >= read:  # not read yet, or used after the last read
            used = self._used if page == len(self._pages) - 1 else self._sizes[page]
            values = self._pages[page][:2 * used].tolist()
            self._read[page] = (used, values)
        return values[2 * slot] & MASK, values[2 * slot + 1] & MASK

    def chunks(self, buf: Any, chunk_bytes: int) -> Callable[[], list[tuple[int, int]]]:
        n = buf.numel() // chunk_bytes
        if n == 0:
            return list
        page, first = self._slots(n)
        out = self._pages[page].data_ptr() + 16 * first
        for at, count in launches(n):
            self._launch(buf.data_ptr() + at * chunk_bytes, chunk_bytes, count, chunk_bytes,
                         out + 16 * at)
        return lambda: [self._pair(page, first + i) for i in range(n)]

    def range(self, buf: Any) -> Callable[[], tuple[int, int]]:
        n = buf.numel()
        if n == 0:
            return lambda: (0, 0)
        page, slot = self._slots(1)
        self._launch(buf.data_ptr(), n, 1, 0, self._pages[page].data_ptr() + 16 * slot)
        return lambda: self._pair(page, slot)
