"""Make stores into a volume mapping durable, the way each kind of mapping needs.

Why one module: staging's commit protocol (a file's bytes durable, then the index entry
that says it is done, then the commit record) is only as good as the primitive under
it, and the right primitive depends on what the mapping is:

- a **device-dax** character device has no page cache and no ``fsync``: ``msync`` of its
  mapping fails with EINVAL. Stores reach the persistence domain only when the CPU
  caches are written back (``clwb``/``clflushopt``/``clflush``) and fenced (``sfence``),
  or need no flush at all on a platform with eADR. PMDK's libpmem
  (``pmem_persist``, Debian package ``libpmem1``) picks the instruction for this CPU and
  skips the flushes under eADR; we call it through ctypes rather than guess;
- a **file on a DAX file system** (fsdax ``-o dax``) mapped with ``MAP_SYNC``: the file
  system keeps its metadata for the mapping durable at fault time, so the same cache
  flush is the whole story (and cheaper than ``msync``, which would also work);
- a **page-cache file** (the emulated back end, tmpfs or hugetlbfs stand-ins, a non-DAX
  file system) or the raw **block device** of an fsdax ``volumeMode: Block`` volume
  (whose mapping is page cache): ``msync(MS_SYNC)`` writes the dirty pages back; a
  cache flush would persist nothing there.

A read-only mapping never persists anything. What the loader guarantees per kind is in
docs/weights-durability.md; the choice is logged once per writable open, and
``csi-pmem-weights stage`` prints it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from dataclasses import dataclass

from csi_pmem.weights.errors import VolumeError

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
LIBPMEM = "libpmem.so.1"

# What kind of memory a mapping is, as open_volume decides it from the fd.
KIND_DEVDAX = "devdax"
KIND_DAX_FILE = "dax-file"        # a DAX file mapped MAP_SYNC
KIND_PAGE_CACHE = "page-cache"    # a regular file, or a block device

_LIB: ctypes.CDLL | None = None


def libpmem() -> ctypes.CDLL:
    """The loaded libpmem, or :class:`VolumeError` saying how to get it."""
    global _LIB
    if _LIB is None:
        name = ctypes.util.find_library("pmem") or LIBPMEM
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise VolumeError(
                f"cannot load PMDK's libpmem ({exc}): stores into persistent memory are "
                "made durable with its pmem_persist (CPU cache flush + fence; msync does "
                "not work on device-dax). Install it (Debian/Ubuntu: apt-get install "
                "libpmem1) in the image that stages weights") from exc
        lib.pmem_persist.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_persist.restype = None
        lib.pmem_drain.argtypes = []
        lib.pmem_drain.restype = None
        lib.pmem_has_auto_flush.argtypes = []
        lib.pmem_has_auto_flush.restype = ctypes.c_int
        # The driver's erase (csi_pmem.driver.erasing.erase) zeroes with it: non-temporal
        # stores, then the same fence, so the zeros are durable when the call returns.
        lib.pmem_memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                    ctypes.c_uint]
        lib.pmem_memset.restype = ctypes.c_void_p
        _LIB = lib
    return _LIB


def _cpu_flush_instruction() -> str:
    """The cache write-back instruction libpmem picks on this CPU (it prefers clwb,
    then clflushopt, then clflush), read from /proc/cpuinfo for the log line."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    for insn in ("clwb", "clflushopt"):
                        if insn in flags:
                            return insn
                    return "clflush"
    except OSError:
        pass
    return "cache flush"


@dataclass(frozen=True)
class Persistence:
    """How stores into one mapping become durable.

    ``primitive`` is ``"pmem_persist"`` (libpmem: cache flush + fence, or fence alone
    under eADR), ``"msync"`` or ``"none"`` (read-only); ``detail`` is the sentence the
    log and the CLI print.
    """

    kind: str
    primitive: str
    detail: str

    def persist(self, mapping: mmap.mmap, address: int, offset: int, length: int) -> None:
        """Make ``[offset, offset + length)`` of the mapping durable before returning.

        Thread-safe and GIL-free for pmem_persist (ctypes releases the GIL), so
        staging's copy threads persist their own chunks in parallel; the fence orders
        the calling thread's flushes, which is why each thread persists what it wrote.
        """
        if length <= 0 or self.primitive == "none":
            return
        if self.primitive == "pmem_persist":
            libpmem().pmem_persist(address + offset, length)
            return
        start = offset - offset % PAGE
        try:
            mapping.flush(start, length + offset - start)
        except OSError as exc:
            raise VolumeError(f"msync of [{offset}, {offset + length}) failed: {exc} "
                              f"(a {self.kind} mapping)") from exc


NONE = Persistence("read-only", "none", "read-only mapping: nothing to persist")


def for_mapping(kind: str, writable: bool) -> Persistence:
    """The primitive for a writable mapping of ``kind``; :data:`NONE` when read-only.

    Loading libpmem happens here, at open, so a stager without it fails before it
    writes a byte, with the package to install.
    """
    if not writable:
        return NONE
    if kind == KIND_PAGE_CACHE:
        return Persistence(kind, "msync",
                           "msync(MS_SYNC) of each written range (page-cache mapping)")
    if kind not in (KIND_DEVDAX, KIND_DAX_FILE):
        raise ValueError(f"unknown mapping kind {kind!r}")
    lib = libpmem()
    what = "device-dax mapping" if kind == KIND_DEVDAX else "DAX file mapped MAP_SYNC"
    if lib.pmem_has_auto_flush() == 1:
        how = "libpmem pmem_persist: fence only (the platform has eADR)"
    else:
        how = f"libpmem pmem_persist: {_cpu_flush_instruction()} of each cache line + sfence"
    return Persistence(kind, "pmem_persist", f"{how} ({what})")
