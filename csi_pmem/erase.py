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
* The range is split into chunks that a thread pool zeroes with ``ctypes.memset``.
  ``ctypes.memset`` is a ``CFUNCTYPE`` foreign function, so the GIL is released for the
  duration of each call and the threads really run in parallel (see
  ``benchmarks/bench_erase.py`` for the measured speed-up).
* Verification compares each chunk with libc ``memcmp`` against a zero buffer; calls
  through ``ctypes.CDLL`` also release the GIL. The zero buffer is an anonymous mapping
  that is only ever read, so all of it maps the kernel's shared zero page: it costs no
  memory and stays in cache, and ``memcmp`` runs at the speed of reading the volume.
* Every ctypes object that exports the mmap's buffer is dropped before the mmap is
  closed (``mmap.close()`` raises ``BufferError`` while exports exist).

* Block devices (fsdax namespaces, ``/dev/pmemX.Y``, and their emulated loop devices)
  are zeroed with the ``BLKZEROOUT`` ioctl instead: a shared mapping of a block device
  goes through the page cache, so a memset would fill the node's memory with dirty
  pages and write them back later. ``BLKZEROOUT`` makes the kernel write zeros straight
  to the device (for pmem: a memcpy of the zero page onto the media) and drops the
  cached pages. Verification then reads the device back with ``pread`` in threads and
  drops what it read from the page cache again.

Confidentiality is the goal here: after ``zero_fd`` returns, every later reader of the
media sees zeros through cache coherency. Durability of the zeros across a power loss
on platforms without eADR is not something this module promises.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from csi_pmem.errors import BackendError

__all__ = ["EraseResult", "default_threads", "zero_block_fd", "zero_fd", "zero_path"]

DEVDAX_MIN_ALIGN = 2 << 20
DEFAULT_CHUNK = 64 << 20
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
    """What one erase did: bytes zeroed, wall time, threads used, whether verified."""

    bytes: int
    seconds: float
    threads: int
    verified: bool

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def default_threads() -> int:
    """CPUs this process may run on (respects cpusets/container limits), capped."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_THREADS))


def _zero_range(addr: int, size: int) -> None:
    """Zero ``size`` bytes at ``addr``; releases the GIL (ctypes CFUNCTYPE call).

    The range is pre-faulted first with one madvise() per chunk, in the worker thread:
    mmap(MAP_POPULATE) would fault the whole volume inside mmap.mmap(), which holds
    the GIL and so freezes every other thread of the driver for the duration.
    """
    _madvise(addr, size, MADV_POPULATE_WRITE)
    ctypes.memset(addr, 0, size)


def _range_is_zero(addr: int, size: int, zeros_addr: int) -> bool:
    """True if ``size`` bytes at ``addr`` are all zero; releases the GIL (CDLL call)."""
    return _memcmp(addr, zeros_addr, size) == 0


def _first_nonzero(addr: int, size: int) -> int:
    """Index of the first non-zero byte in the range (slow path, failures only)."""
    data = ctypes.string_at(addr, size)
    return len(data) - len(data.lstrip(b"\0"))


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


def zero_fd(fd: int, length: int, *, threads: int | None = None, verify: bool = True,
            chunk: int = DEFAULT_CHUNK) -> EraseResult:
    """Zero the first ``length`` bytes of ``fd`` through a shared mapping.

    ``fd`` must be open read-write (a devdax device or a regular file). ``threads``
    defaults to :func:`default_threads`; it is never more than the number of chunks.
    With ``verify`` the range is read back and :class:`BackendError` names the offset
    of the first non-zero byte if any survived.
    """
    # Bad arguments are bugs in the caller (ValueError -> INTERNAL); a target that
    # cannot be erased as asked is a back-end fault (BackendError).
    if length < 0:
        raise ValueError(f"erase: negative length {length}")
    if chunk <= 0:
        raise ValueError(f"erase: chunk size must be positive, got {chunk}")
    if threads is not None and threads < 1:
        raise ValueError(f"erase: threads must be at least 1, got {threads}")
    nthreads = threads if threads is not None else default_threads()
    if length == 0:
        return EraseResult(bytes=0, seconds=0.0, threads=0, verified=verify)
    if stat.S_ISBLK(os.fstat(fd).st_mode):
        return zero_block_fd(fd, length, threads=nthreads, verify=verify)  # checks too
    _check_target(fd, length)
    chunks = list(_chunks(length, chunk))
    nthreads = min(nthreads, len(chunks))

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
            with ThreadPoolExecutor(max_workers=nthreads,
                                    thread_name_prefix="erase") as pool:
                # list() re-raises the first worker exception, if any.
                list(pool.map(lambda c: _zero_range(base + c[0], c[1]), chunks))
                if verify:
                    # Writable (ctypes.from_buffer needs that) but never written: every
                    # read fault maps the kernel's shared zero page.
                    zeros = mmap.mmap(-1, min(chunk, length),
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    zeros_anchor = ctypes.c_char.from_buffer(zeros)
                    zaddr = ctypes.addressof(zeros_anchor)
                    ok = list(pool.map(
                        lambda c: _range_is_zero(base + c[0], c[1], zaddr), chunks))
                    bad = [c for c, good in zip(chunks, ok, strict=True) if not good]
                    if bad:
                        off, size = bad[0]
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
                       threads=nthreads, verified=verify)


def zero_block_fd(fd: int, length: int, *, threads: int | None = None,
                  verify: bool = True) -> EraseResult:
    """Zero the first ``length`` bytes of block device ``fd`` (see the module docstring).

    ``fd`` must be open read-write. Without ``BLKZEROOUT`` support (EOPNOTSUPP, ENOTTY,
    EINVAL from old or unusual drivers) the zeros are written with ``pwrite`` and synced.
    """
    import fcntl
    import struct

    _check_target(fd, length)
    nthreads = threads if threads is not None else default_threads()
    start = time.perf_counter()
    try:
        fcntl.ioctl(fd, BLKZEROOUT, struct.pack("QQ", 0, length))
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
            raise BackendError(f"erase: BLKZEROOUT of {length} bytes failed: "
                               f"{e.strerror}") from e
        _pwrite_zeros(fd, length, nthreads)
    if verify:
        _verify_block(fd, length, nthreads)
    return EraseResult(bytes=length, seconds=time.perf_counter() - start,
                       threads=nthreads, verified=verify)


def _pwrite_zeros(fd: int, length: int, nthreads: int) -> None:
    zeros = bytes(BLOCK_CHUNK)

    def write(c: tuple[int, int]) -> None:
        off, size = c
        view = memoryview(zeros)[:size]
        while size:
            done = os.pwrite(fd, view, off)
            off, size, view = off + done, size - done, view[done:]

    with ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="erase") as pool:
        list(pool.map(write, _chunks(length, BLOCK_CHUNK)))
    os.fsync(fd)


def _verify_block(fd: int, length: int, nthreads: int) -> None:
    """Read the range back (``pread`` and ``memcmp`` release the GIL) and drop it from
    the page cache, so verifying a large volume does not evict the node's working set."""
    chunks = list(_chunks(length, BLOCK_CHUNK))
    zeros = bytes(BLOCK_CHUNK)
    local = threading.local()

    def check(c: tuple[int, int]) -> int | None:
        off, size = c
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(BLOCK_CHUNK)
        got = os.preadv(fd, [memoryview(buf)[:size]], off)
        os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
        if got != size:
            return off + got
        if _memcmp((ctypes.c_char * size).from_buffer(buf), zeros, size) == 0:
            return None
        return off + _first_nonzero(ctypes.addressof(ctypes.c_char.from_buffer(buf)), size)

    with ThreadPoolExecutor(max_workers=min(nthreads, len(chunks)),
                            thread_name_prefix="erase") as pool:
        bad = [r for r in pool.map(check, chunks) if r is not None]
    if bad:
        raise BackendError(
            f"erase verification failed: byte at offset {bad[0]} (0x{bad[0]:x}) of the block "
            f"device is not zero (or unreadable) after zeroing {length} bytes; {len(bad)} "
            f"of {len(chunks)} chunks affected")


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
