"""Zero a volume's memory before anyone else can read it.

Why this exists (docs/design.md §4): persistent memory keeps its contents when a namespace
is destroyed, and the next namespace carved from the same region maps the same media.
Without an explicit erase, a new volume would hand the previous tenant's data (model
weights, KV caches, secrets) to whoever claims it next. intel/pmem-csi used ``shred``
and measured about 2 s/GB in a VM; a multi-threaded ``memset`` of the mapping is far
faster, and a verification pass proves the range really reads back as zeros.

How, and why this way:

* The device is mapped ``MAP_SHARED`` with ``PROT_READ | PROT_WRITE``: devdax devices
  accept only shared, aligned mappings and have no ``read()``/``write()``, so this
  module never uses ``write()``. For devdax the length must be a multiple of the
  namespace align (2 MiB by default; 1 GiB possible).
* Each worker pre-faults its chunk with ``madvise(MADV_POPULATE_WRITE)`` before the
  stores: for the tmpfs-backed emulated back end one call replaces a page fault per
  4 KiB page, which otherwise costs more than the stores. ``MAP_POPULATE`` would do the
  same for the whole volume inside ``mmap.mmap()``, which holds the GIL and so froze
  every other driver thread (Probe, dax.sock, ABORTED replies) for up to seconds.
* The range is split into chunks that a thread pool zeroes with PMDK libpmem's
  ``pmem_memset(..., PMEM_F_MEM_NONTEMPORAL)``: non-temporal stores that skip the
  read-for-ownership of the cache lines (measured 35 GB/s against 22 GB/s for libc
  ``memset`` on the same tmpfs mapping, 2 threads) followed by the fence that libpmem's
  ``pmem_persist`` ends with, so on device-dax the zeros are in the persistence domain
  when the call returns: the same library and primitive the loader persists weights
  with (:mod:`csi_pmem.weights.persist`). Without libpmem, ``ctypes.memset`` zeroes and
  the result says the zeros were not persisted. Calls through ctypes release the GIL,
  so the threads run in parallel; each one pins itself to the CPUs it is given (the
  region's NUMA node), since stores that cross the socket interconnect run at a
  fraction of local bandwidth.
* Verification compares with libc ``memcmp`` against a zero buffer; calls through
  ``ctypes.CDLL`` also release the GIL. The zero buffer is an anonymous mapping that is
  only ever read, so all of it maps the kernel's shared zero page: it costs no memory
  and stays in cache. A full read-back runs at about 10 GB/s here and would make the
  erase three times slower than the stores, so by default it is *sampled*
  (:data:`SAMPLED`): the first :data:`SAMPLE` bytes of every :data:`STRIDE`, and the
  last :data:`SAMPLE` bytes of the range, are compared. The guarantee: any run of
  surviving non-zero bytes at least ``STRIDE`` long is always found (it covers a whole
  window), so a chunk a worker skipped or left half done, or an erase of the wrong
  length, cannot pass; a shorter run is found when it touches a window (probability
  at least SAMPLE/STRIDE for a single byte). ``verify="full"`` reads every byte.
* Every ctypes object that exports the mmap's buffer is dropped before the mmap is
  closed (``mmap.close()`` raises ``BufferError`` while exports exist).

* Block devices (fsdax namespaces, ``/dev/pmemX.Y``, and their emulated loop devices)
  are zeroed with the ``BLKZEROOUT`` ioctl instead: a shared mapping of a block device
  goes through the page cache, so a memset would fill the node's memory with dirty
  pages and write them back later. ``BLKZEROOUT`` makes the kernel write zeros straight
  to the device (for pmem: a memcpy of the zero page onto the media) and drops the
  cached pages. Verification then reads the device back with ``pread`` in threads and
  drops what it read from the page cache again.
* The read-back buffers come from one bounded pool (:data:`READ_BUFFERS`): anonymous
  mappings, at most :func:`default_threads` (one per usable CPU, capped) at a time in
  the whole process, unmapped when the worker using them is done. ``bytearray``/``bytes`` of 16
  MiB per thread per erase looked harmless, but glibc serves them from per-thread
  arenas (its mmap threshold rises to 32 MiB once such a block is freed) and keeps the
  freed memory there: a node plugin that had erased 32 fsdax volumes of 64 MiB stayed
  at 385 MiB resident instead of 50. ``munmap`` gives the pages back at once, and a
  sampled verification only ever faults in the 64 KiB windows it reads. The zeros that
  reads are compared with and that ``pwrite`` writes are one shared anonymous mapping
  that is never written, so all of it is the kernel's zero page.

Confidentiality is the goal here: after ``zero_fd`` returns, every later reader of the
media sees zeros through cache coherency. Durability across a power loss is promised
where :attr:`EraseResult.persisted` says so: a device-dax mapping zeroed through
libpmem (non-temporal stores + fence), or a block device after ``BLKZEROOUT`` and
``fsync`` (the pmem driver's flush). A regular file (the emulated back end) is not
flushed: it is not persistent memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from csi_pmem import failpoints
from csi_pmem.errors import BackendError

log = logging.getLogger(__name__)

__all__ = ["FULL", "OFF", "READ_BUFFERS", "SAMPLED", "EraseCancelled", "EraseResult",
           "ScratchBuffers", "default_threads", "zero_block_fd", "zero_fd", "zero_path"]

# Verification modes (``verify=``): every byte, the sampled windows, or none.
FULL, SAMPLED, OFF = "full", "sampled", "off"
STRIDE = 1 << 20   # sampled verification: one window per MiB ...
SAMPLE = 64 << 10  # ... of its first 64 KiB (6.25% of the bytes are read back)
PMEM_F_MEM_NONTEMPORAL = 1 << 1  # libpmem.h
BLOCK_ZERO_PIECE = 1 << 30  # BLKZEROOUT per ioctl, so a cancel is seen within a piece


class EraseCancelled(Exception):
    """The erase was asked to stop (driver shutdown, a scrub giving way to a create)."""

DEVDAX_MIN_ALIGN = 2 << 20
DEFAULT_CHUNK = 64 << 20
# On a regular file (page cache), how much of a chunk an erase worker holds mapped at
# once: the pages it zeroed or checked leave its mapping after each step (zero_fd).
RELEASE_STEP = 8 << 20
# Zeroing is memory-bandwidth bound: beyond a handful of threads per socket more
# threads only add contention, and the node plugin must not monopolise the host.
MAX_DEFAULT_THREADS = 16

_libc = ctypes.CDLL(None, use_errno=True)
_memcmp = _libc.memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL and memset faults
BLKZEROOUT = 0x127F  # _IO(0x12, 127): include/uapi/linux/fs.h
BLOCK_CHUNK = 16 << 20  # read-back buffer per verifying thread


@dataclass(frozen=True)
class EraseResult:
    """What one erase did: bytes zeroed, wall time, threads used, whether verified
    (``verify`` names how: full, sampled or off), whether the zeros were persisted and
    with what (``method``)."""

    bytes: int
    seconds: float
    threads: int
    verified: bool
    verify: str = FULL
    persisted: bool = False
    method: str = "memset"


def default_threads() -> int:
    """CPUs this process may run on (respects cpusets/container limits), capped."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_THREADS))


_PMEM_MEMSET: Callable[[int, int, int, int], object] | None = None
_PMEM_LOADED = False


def pmem_memset() -> Callable[[int, int, int, int], object] | None:
    """libpmem's pmem_memset (loaded once, through the loader's handle), or None."""
    global _PMEM_MEMSET, _PMEM_LOADED
    if not _PMEM_LOADED:
        _PMEM_LOADED = True
        try:
            from csi_pmem.weights.persist import libpmem

            _PMEM_MEMSET = libpmem().pmem_memset
        except Exception as exc:  # any load failure means "not there"
            log.warning("libpmem is not available (%s): erases zero with memset and "
                        "cannot flush the zeros to the persistence domain of device-dax",
                        exc)
    return _PMEM_MEMSET


def _zero_range(addr: int, size: int) -> None:
    """Zero ``size`` bytes at ``addr``; releases the GIL (ctypes calls).

    The range is pre-faulted first with one madvise() per chunk, in the worker thread:
    mmap(MAP_POPULATE) would fault the whole volume inside mmap.mmap(), which holds
    the GIL and so freezes every other thread of the driver for the duration. (On
    device-dax the call fails with EINVAL or does nothing: its pages need no faulting
    from a page cache.)
    """
    _madvise(addr, size, MADV_POPULATE_WRITE)
    fn = pmem_memset()
    if fn is not None:
        fn(addr, 0, size, PMEM_F_MEM_NONTEMPORAL)  # stores + sfence: persisted on return
    else:
        ctypes.memset(addr, 0, size)


def _windows(off: int, size: int, verify: str) -> list[tuple[int, int]]:
    """The (offset, length) ranges of chunk [off, off+size) that verification reads:
    all of it (full), or SAMPLE bytes at the chunk's start, at every STRIDE boundary in
    it and at its end (sampled)."""
    if verify == FULL:
        return [(off, size)]
    end = off + size
    first = -(-off // STRIDE) * STRIDE  # the first stride boundary at or after off
    starts = sorted({off, *range(first, end, STRIDE), max(off, end - SAMPLE)})
    return [(o, min(SAMPLE, end - o)) for o in starts]


def _pinner(cpus: list[int] | None) -> Callable[[], None]:
    def pin() -> None:
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # pid 0: the calling thread
            except OSError as exc:
                log.debug("erase thread not pinned to %s: %s", cpus, exc)
    return pin


def _range_is_zero(addr: int, size: int, zeros_addr: int) -> bool:
    """True if ``size`` bytes at ``addr`` are all zero; releases the GIL (CDLL call)."""
    return _memcmp(addr, zeros_addr, size) == 0


def _first_nonzero(addr: int, size: int) -> int:
    """Index of the first non-zero byte in the range, ``size`` if none (slow path,
    failures only). Read in SAMPLE pieces: a copy of a whole chunk would cost its size
    in fresh heap memory."""
    for off in range(0, size, SAMPLE):
        n = min(SAMPLE, size - off)
        rest = ctypes.string_at(addr + off, n).lstrip(b"\0")
        if rest:
            return off + n - len(rest)
    return size


def _chunks(length: int, chunk: int) -> Iterator[tuple[int, int]]:
    for off in range(0, length, chunk):
        yield off, min(chunk, length - off)


def _check_target(fd: int, length: int) -> None:
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise BackendError(f"erase: cannot stat fd {fd}: {e.strerror}") from e
    # devdax: st_size is 0 and the kernel refuses unaligned mappings with EINVAL;
    # say why instead.
    if stat.S_ISCHR(st.st_mode) and length % DEVDAX_MIN_ALIGN:
        raise BackendError(
            f"erase: length {length} of a character device (devdax) is not a "
            f"multiple of {DEVDAX_MIN_ALIGN >> 20} MiB")
    # Touching a mapping beyond the end of a regular file kills the process with
    # SIGBUS; refuse up front.
    if stat.S_ISREG(st.st_mode) and st.st_size < length:
        raise BackendError(
            f"erase: file is {st.st_size} bytes, shorter than the {length} bytes to erase")
    if stat.S_ISBLK(st.st_mode):
        size = os.lseek(fd, 0, os.SEEK_END)
        if size < length:
            raise BackendError(
                f"erase: block device is {size} bytes, shorter than the {length} bytes to "
                "erase")


def verify_mode(verify: bool | str) -> str:
    """``True`` means full (the historical meaning), ``False`` off; names pass through."""
    if verify is True:
        return FULL
    if verify is False:
        return OFF
    if verify not in (FULL, SAMPLED, OFF):
        raise ValueError(f"erase: verify must be {FULL}, {SAMPLED} or {OFF}, got {verify!r}")
    return verify


def zero_fd(fd: int, length: int, *, threads: int | None = None,
            verify: bool | str = True, chunk: int = DEFAULT_CHUNK,
            cpus: list[int] | None = None,
            cancel: threading.Event | None = None) -> EraseResult:
    """Zero the first ``length`` bytes of ``fd`` through a shared mapping.

    ``fd`` must be open read-write (a devdax device, a block device or a regular file).
    ``threads`` defaults to :func:`default_threads`; it is never more than the number of
    chunks. ``verify`` (full, sampled or off; True is full) reads the range back, and
    :class:`BackendError` names the offset of the first non-zero byte found. The worker
    threads pin themselves to ``cpus`` when given. A set ``cancel`` event stops the
    erase between chunks with :class:`EraseCancelled` (the range is then partly zeroed).
    """
    # Bad arguments are bugs in the caller (ValueError -> INTERNAL); a target that
    # cannot be erased as asked is a back-end fault (BackendError).
    if length < 0:
        raise ValueError(f"erase: negative length {length}")
    if chunk <= 0:
        raise ValueError(f"erase: chunk size must be positive, got {chunk}")
    if threads is not None and threads < 1:
        raise ValueError(f"erase: threads must be at least 1, got {threads}")
    mode = verify_mode(verify)
    nthreads = threads if threads is not None else default_threads()
    if length == 0:
        return EraseResult(bytes=0, seconds=0.0, threads=0, verified=mode != OFF,
                           verify=mode)
    st_mode = os.fstat(fd).st_mode
    if stat.S_ISBLK(st_mode):
        return zero_block_fd(fd, length, threads=nthreads, verify=mode, cpus=cpus,
                             cancel=cancel)  # checks too
    _check_target(fd, length)
    chunks = list(_chunks(length, chunk))
    nthreads = min(nthreads, len(chunks))
    method = "pmem_memset" if pmem_memset() is not None else "memset"

    # A regular file (the emulated back end) is page cache: every page this mapping
    # touches counts in the driver's RSS until the map closes, so two erase workers on
    # two 80 MiB files held 160 MiB. Each chunk's pages leave this mapping once done (the
    # data stays in the file; dirty pages stay dirty in the cache). Device memory is not
    # page cache, and a device-dax mapping may refuse the advice: left as it is.
    step = RELEASE_STEP if stat.S_ISREG(st_mode) else 0

    def pieces(c: tuple[int, int]) -> list[tuple[int, int]]:
        if not step:
            return [c]
        off, size = c
        return [(o, min(step, off + size - o)) for o in range(off, off + size, step)]

    def done(c: tuple[int, int]) -> None:
        if step:
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(mmap.MADV_DONTNEED, c[0], c[1])

    def zero(c: tuple[int, int]) -> None:
        if cancel is not None and cancel.is_set():
            raise EraseCancelled(f"erase cancelled at offset {c[0]}")
        for p in pieces(c):
            _zero_range(base + p[0], p[1])
            done(p)
        if c[0] == 0:
            failpoints.hit(failpoints.ERASE_MID)  # the first chunk done, others not

    def check(c: tuple[int, int]) -> bool:
        for p in pieces(c):
            ok = all(_range_is_zero(base + o, n, zaddr) for o, n in _windows(*p, mode))
            done(p)
            if not ok:
                return False
        return True

    flags = mmap.MAP_SHARED
    start = time.perf_counter()
    try:
        mm = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise BackendError(f"erase: cannot map {length} bytes of fd {fd}: {e.strerror}") from e
    zeros: mmap.mmap | None = None
    try:
        # The ctypes exports live in locals that are deleted before the maps close.
        anchor = ctypes.c_char.from_buffer(mm)
        zeros_anchor: ctypes.c_char | None = None
        try:
            base = ctypes.addressof(anchor)
            with ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="erase",
                                    initializer=_pinner(cpus)) as pool:
                # list() re-raises the first worker exception, if any.
                list(pool.map(zero, chunks))
                if mode != OFF:
                    # Writable (ctypes.from_buffer needs that) but never written: every
                    # read fault maps the kernel's shared zero page.
                    zeros = mmap.mmap(-1, min(chunk, length),
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    zeros_anchor = ctypes.c_char.from_buffer(zeros)
                    zaddr = ctypes.addressof(zeros_anchor)
                    ok = list(pool.map(check, chunks))
                    bad = [c for c, good in zip(chunks, ok, strict=True) if not good]
                    if bad:
                        off, size = bad[0]
                        # The first window of the chunk that failed, then its byte.
                        off, size = next((o, n) for p in pieces((off, size))
                                         for o, n in _windows(*p, mode)
                                         if not _range_is_zero(base + o, n, zaddr))
                        first = off + _first_nonzero(base + off, size)
                        raise BackendError(
                            f"erase verification failed: byte at offset {first} "
                            f"(0x{first:x}) is not zero after zeroing {length} bytes; "
                            f"{len(bad)} of {len(chunks)} chunks affected")
        finally:
            del zeros_anchor
            del anchor
    finally:
        mm.close()
        if zeros is not None:
            zeros.close()
    return EraseResult(bytes=length, seconds=time.perf_counter() - start,
                       threads=nthreads, verified=mode != OFF, verify=mode,
                       persisted=method == "pmem_memset" and stat.S_ISCHR(st_mode),
                       method=method)


def zero_block_fd(fd: int, length: int, *, threads: int | None = None,
                  verify: bool | str = True, cpus: list[int] | None = None,
                  cancel: threading.Event | None = None) -> EraseResult:
    """Zero the first ``length`` bytes of block device ``fd`` (see the module docstring).

    ``fd`` must be open read-write. Without ``BLKZEROOUT`` support (EOPNOTSUPP, ENOTTY,
    EINVAL from old or unusual drivers) the zeros are written with ``pwrite``. Either
    way the device is then fsynced, which for pmem is the driver's flush to the
    persistence domain. The ioctl goes in pieces so that ``cancel`` is seen.
    """
    import fcntl
    import struct

    _check_target(fd, length)
    mode = verify_mode(verify)
    nthreads = threads if threads is not None else default_threads()
    start = time.perf_counter()
    method = "BLKZEROOUT"
    for off, size in _chunks(length, BLOCK_ZERO_PIECE):
        if cancel is not None and cancel.is_set():
            raise EraseCancelled(f"erase cancelled at offset {off}")
        try:
            fcntl.ioctl(fd, BLKZEROOUT, struct.pack("QQ", off, size))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                raise BackendError(f"erase: BLKZEROOUT of {length} bytes failed: "
                                   f"{e.strerror}") from e
            _pwrite_zeros(fd, length, nthreads)
            method = "pwrite"
            break
        if off == 0:
            failpoints.hit(failpoints.ERASE_MID)
    os.fsync(fd)
    if mode != OFF:
        _verify_block(fd, length, nthreads, mode, cpus)
    return EraseResult(bytes=length, seconds=time.perf_counter() - start,
                       threads=nthreads, verified=mode != OFF, verify=mode,
                       persisted=True, method=method)


def _pwrite_zeros(fd: int, length: int, nthreads: int) -> None:
    zeros, _ = _zeros()

    def write(c: tuple[int, int]) -> None:
        off, size = c
        view = zeros[:size]
        while size:
            done = os.pwrite(fd, view, off)
            off, size, view = off + done, size - done, view[done:]

    with ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="erase") as pool:
        list(pool.map(write, _chunks(length, BLOCK_CHUNK)))
    os.fsync(fd)


def _verify_block(fd: int, length: int, nthreads: int, mode: str = FULL,
                  cpus: list[int] | None = None) -> None:
    """Read the range back (``pread`` and ``memcmp`` release the GIL) and drop it from
    the page cache, so verifying a large volume does not evict the node's working set.
    Sampled: the same windows as for mappings (first SAMPLE bytes of every STRIDE).

    Each worker holds one buffer of :data:`READ_BUFFERS` for all the windows it takes
    from the shared list, so a verify maps at most one buffer per worker."""
    chunks = [w for c in _chunks(length, BLOCK_CHUNK) for w in _windows(*c, mode)]
    _, zaddr = _zeros()
    todo = iter(chunks)
    todo_lock = threading.Lock()

    def worker() -> list[int]:
        bad: list[int] = []
        with READ_BUFFERS.buffer() as (view, addr):
            while True:
                with todo_lock:
                    c = next(todo, None)
                if c is None:
                    return bad
                off, size = c
                with view[:size] as window:
                    got = os.preadv(fd, [window], off)
                os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
                if got != size:
                    bad.append(off + got)
                elif _memcmp(addr, zaddr, size) != 0:
                    bad.append(off + _first_nonzero(addr, size))

    workers = min(nthreads, len(chunks))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="erase",
                            initializer=_pinner(cpus)) as pool:
        futures = [pool.submit(worker) for _ in range(workers)]
        # result() re-raises a worker's exception (a failed read), as before.
        bad = sorted(off for f in futures for off in f.result())
    if bad:
        raise BackendError(
            f"erase verification failed: byte at offset {bad[0]} (0x{bad[0]:x}) of the block "
            f"device is not zero (or unreadable) after zeroing {length} bytes; {len(bad)} "
            f"of {len(chunks)} chunks affected")


class ScratchBuffers:
    """Anonymous mappings of ``size`` bytes, at most ``limit`` mapped at a time in the
    process; each one is unmapped when its user is done (see the module docstring for
    why not ``bytearray``). A caller that finds ``limit`` in use waits for one: a worker
    holds one buffer at a time and never waits while holding one, so this cannot
    deadlock; concurrent erases share the bound instead of each adding their own.

    ``mapped`` (now), ``peak`` (most at once) and ``made`` (since start) are for tests
    and benchmarks."""

    def __init__(self, size: int, limit: int) -> None:
        if size <= 0 or limit < 1:
            raise ValueError(f"scratch buffers: size {size} and limit {limit} must be positive")
        self.size, self.limit = size, limit
        self._cond = threading.Condition()
        self.mapped = self.peak = self.made = 0

    @contextlib.contextmanager
    def buffer(self) -> Iterator[tuple[memoryview, int]]:
        """A writable view of a fresh buffer and its address, valid inside the block."""
        with self._cond:
            while self.mapped >= self.limit:
                self._cond.wait()
            self.mapped += 1
            self.made += 1
            self.peak = max(self.peak, self.mapped)
        try:
            buf = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                anchor = ctypes.c_char.from_buffer(buf)
                view = memoryview(buf)
                try:
                    yield view, ctypes.addressof(anchor)
                finally:
                    # Every export goes before close(), which raises BufferError otherwise.
                    view.release()
                    del anchor
            finally:
                buf.close()  # munmap: the pages are the kernel's again
        finally:
            with self._cond:
                self.mapped -= 1
                self._cond.notify()


# One bound for the whole process: erases on several eraser workers share it.
READ_BUFFERS = ScratchBuffers(BLOCK_CHUNK, default_threads())

_ZEROS: tuple[mmap.mmap, ctypes.c_char] | None = None
_ZEROS_LOCK = threading.Lock()


def _zeros() -> tuple[memoryview, int]:
    """A view of BLOCK_CHUNK zero bytes and its address: one anonymous mapping for the
    process, writable (ctypes.from_buffer needs that) but never written, so every page
    of it is the kernel's shared zero page and it costs no memory. Never unmapped."""
    global _ZEROS
    with _ZEROS_LOCK:
        if _ZEROS is None:
            mm = mmap.mmap(-1, BLOCK_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _ZEROS = (mm, ctypes.c_char.from_buffer(mm))
        mm, anchor = _ZEROS
    return memoryview(mm).toreadonly(), ctypes.addressof(anchor)


def zero_path(path: str | os.PathLike[str], length: int, **kw: object) -> EraseResult:
    """Open ``path`` read-write, :func:`zero_fd` it, close it. Keywords as for zero_fd."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise BackendError(f"erase: cannot open {os.fspath(path)}: {e.strerror}") from e
    try:
        return zero_fd(fd, length, **kw)  # type: ignore[arg-type]
    finally:
        os.close(fd)
