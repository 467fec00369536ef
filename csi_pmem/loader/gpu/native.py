"""The native bounce loop (``_native/bounce.c``), loaded with ctypes.

Why: see ``_native/bounce.c``. In short, the Python pipeline pays Python work per
chunk, shared through the GIL by a dozen threads, which caps how small (and how many)
chunks can be; the native loop runs every worker without the GIL and reports landed
chunks through a pipe, which the caller's thread reads and turns into finished tensors.

The library is built by ``pip install`` as an optional extension (setup.py): without a
C compiler the package installs without it and :func:`library` returns None, and the
loader uses the Python pipeline. ``CSI_PMEM_BOUNCE_NATIVE=off`` does the same on
purpose. It uses no Python API, so it is loaded with ctypes (which releases the GIL for
the call) rather than imported; it is built into ``_native/``, a directory that is not
a package, so that nothing that walks the loader's modules mistakes it for one.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import importlib.machinery
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.weights.errors import LoaderError

log = logging.getLogger(__name__)

ENV = "CSI_PMEM_BOUNCE_NATIVE"
SOURCE_ENV = "CSI_PMEM_BOUNCE_SOURCE"
_NAME = "bounce"


class Job(ctypes.Structure):
    """``struct csi_job`` of ``_native/bounce.c`` (every field 8 bytes wide)."""

    _fields_ = [
        ("chunks", ctypes.c_void_p), ("nchunks", ctypes.c_uint64),
        ("pieces", ctypes.c_void_p), ("src_base", ctypes.c_uint64),
        ("buffers", ctypes.c_void_p), ("ready", ctypes.c_void_p),
        ("nbuffers", ctypes.c_uint64), ("buffer_size", ctypes.c_uint64),
        ("events", ctypes.c_void_p), ("stream", ctypes.c_uint64), ("ctx", ctypes.c_uint64),
        ("threads", ctypes.c_uint64), ("cpus", ctypes.c_void_p), ("ncpus", ctypes.c_uint64),
        ("notify_fd", ctypes.c_int64), ("fake", ctypes.c_int64), ("src_fd", ctypes.c_int64),
        ("stop", ctypes.c_int64),
        ("error", ctypes.c_int64), ("what", ctypes.c_char * 128),
    ]


class NativeError(LoaderError):
    """The native loop failed: ``code`` is the CUresult (or -errno) of ``what``."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed (error {code})")
        self.what, self.code = what, code


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
_lib_tried = False


def _path() -> Path | None:
    here = Path(__file__).resolve().parent / "_native"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{_NAME}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (not built, or turned off by ``CSI_PMEM_BOUNCE_NATIVE``)."""
    global _lib, _lib_tried
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "off"):
        raise LoaderError(f"{ENV}={choice!r}: use auto (the native bounce loop when it is "
                          "built, the default) or off (the Python pipeline)")
    if choice == "off":
        return None
    with _lib_lock:
        if not _lib_tried:
            _lib_tried = True
            path = _path()
            if path is None:
                log.debug("the native bounce loop is not built; using the Python pipeline")
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    lib.csi_bounce_run.argtypes = [ctypes.POINTER(Job)]
                    lib.csi_bounce_run.restype = ctypes.c_int
                    lib.csi_bounce_plan.restype = ctypes.c_int
                    _lib = lib
                except OSError as exc:
                    log.warning("cannot load the native bounce loop %s (%s); using the "
                                "Python pipeline", path, exc)
        return _lib


def source_fd(read_fd: int | None) -> int:
    """The ``src_fd`` for :func:`run`: ``read_fd`` (a volume's
    :meth:`~csi_pmem.weights.volume.Volume.read_fd`) unless ``CSI_PMEM_BOUNCE_SOURCE=map``
    says to copy from the mapping; -1 (the mapping) when there is none."""
    choice = os.environ.get(SOURCE_ENV, "auto")
    if choice not in ("auto", "map"):
        raise LoaderError(f"{SOURCE_ENV}={choice!r}: use auto (read 4 KiB-page files with "
                          "pread, copy from the mapping otherwise; the default) or map "
                          "(always copy from the mapping)")
    return -1 if choice == "map" or read_fd is None else read_fd


def _u64(values: Sequence[int]) -> array.array:
    return array.array("Q", values)


class Flat:
    """A bounce load's chunks in the native loop's own layout, and where each came from.

    ``chunks`` holds four words per chunk (device address, bytes, first piece, pieces),
    ``pieces`` three per piece (source offset, buffer offset, bytes); the chunks of
    target ``t`` are ``first[t]`` up to ``first[t + 1]``, with device addresses from
    ``bases[t]``. A chunk's index is its ``seq``: :meth:`span` says where it lands
    relative to its target, which is all that completion needs, so no per-chunk Python
    object is made for a load of thousands of chunks.
    """

    def __init__(self, chunks: array.array, pieces: array.array, first: list[int],
                 bases: Sequence[int]):
        self.chunks, self.pieces, self.first = chunks, pieces, first
        self.bases = list(bases)

    def __len__(self) -> int:
        return self.first[-1]

    def target(self, index: int) -> int:
        return bisect.bisect_right(self.first, index) - 1

    def span(self, index: int) -> tuple[int, int, int]:
        """``(target, dst, nbytes)`` of chunk ``index``, ``dst`` relative to its target."""
        t = self.target(index)
        return t, self.chunks[4 * index] - self.bases[t], self.chunks[4 * index + 1]

    def bounds(self, target: int) -> tuple[list[int], list[int]]:
        """Starts and ends (relative) of ``target``'s chunks, in plan (device) order."""
        lo, hi = self.first[target], self.first[target + 1]
        base = self.bases[target]
        starts = [a - base for a in self.chunks[4 * lo:4 * hi:4]]
        sizes = self.chunks[4 * lo + 1:4 * hi:4]
        return starts, [s + n for s, n in zip(starts, sizes, strict=True)]


def flatten(chunks_by_target: Sequence[Sequence[planning.Chunk]],
            bases: Sequence[int]) -> Flat:
    """:class:`Flat` from chunks planned in Python (tests; any chunk shape)."""
    flat_chunks: list[int] = []
    flat_pieces: list[int] = []
    first = [0]
    for target, chunks in enumerate(chunks_by_target):
        for c in chunks:
            flat_chunks += (bases[target] + c.dst, c.nbytes, len(flat_pieces) // 3,
                            len(c.pieces))
            for p in c.pieces:
                flat_pieces += (p.src, p.buf_off, p.nbytes)
        first.append(first[-1] + len(chunks))
    return Flat(_u64(flat_chunks), _u64(flat_pieces), first, bases)


def plan_bounce(placements_by_target: Sequence[list[planning.Placement]],
                bases: Sequence[int], buffer_size: int,
                lib: ctypes.CDLL | None = None) -> Flat:
    """The chunks :func:`csi_pmem.loader.gpu.chunks.bounce_chunks` would make for each
    target, cut by the native library straight into its own layout."""
    lib = lib or library()
    if lib is None:
        raise LoaderError("the native bounce loop is not available")
    if buffer_size <= 0:
        raise ValueError("buffer_size must be positive")
    all_runs = [planning.runs(ps) for ps in placements_by_target]
    cap = sum(-(-n // buffer_size) for rs in all_runs for _, _, n in rs)
    chunks, pieces = _u64(bytes(8 * 4 * cap)), _u64(bytes(8 * 3 * cap))
    nchunks, npieces = ctypes.c_uint64(0), ctypes.c_uint64(0)
    first = [0]
    for rs, base in zip(all_runs, bases, strict=True):
        flat_runs = _u64([x for run in rs for x in run] or [0])
        rc = lib.csi_bounce_plan(
            ctypes.c_void_p(flat_runs.buffer_info()[0]), ctypes.c_uint64(len(rs)),
            ctypes.c_uint64(buffer_size), ctypes.c_uint64(base),
            ctypes.c_void_p(chunks.buffer_info()[0]), ctypes.byref(nchunks),
            ctypes.c_void_p(pieces.buffer_info()[0]), ctypes.byref(npieces),
            ctypes.c_uint64(cap))
        if rc != 0:  # the bound above is exact arithmetic: a bug, not an input error
            raise LoaderError("the native planner ran out of room")
        first.append(nchunks.value)
    del chunks[4 * nchunks.value:]
    del pieces[3 * npieces.value:]
    return Flat(chunks, pieces, first, bases)


def run(plan: Flat, src_base: int, buffers: Sequence[int], ready: bytearray,
        buffer_size: int, on_done: Callable[[int], None], *, events: Sequence[int] = (),
        stream: int = 0,
        ctx: int = 0, threads: int = 1, cpus: Sequence[int] = (), fake: bool = False,
        src_fd: int = -1, lib: ctypes.CDLL | None = None) -> None:
    """Move ``plan``'s chunks through ``buffers``; call ``on_done`` in this thread with
    each chunk's index once its bytes landed.

    ``ready[i]`` says pinned buffer ``i`` is faulted in and registered; the native loop
    prepares the others on first use and sets their flag (the caller records them for
    unregistering). ``src_fd`` >= 0: the workers pread() each piece from that file at
    its offset (``piece.src``) instead of copying from ``src_base``. ``fake``: device
    addresses are host memory (tests). Raises
    :class:`NativeError` when the loop failed, or what ``on_done`` raised (the loop is
    then stopped: no new chunk starts, the queued ones land).
    """
    lib = lib or library()
    if lib is None:
        raise LoaderError("the native bounce loop is not available")
    if len(ready) != len(buffers):
        raise ValueError("one ready flag per buffer")
    started = time.monotonic()
    # The arrays live in this frame (or in plan) until the call returns.
    a_chunks, a_pieces = plan.chunks or _u64([0]), plan.pieces or _u64([0])
    a_buffers, a_events = _u64(buffers), _u64(events or [0] * len(buffers))
    a_cpus = array.array("q", cpus or [0])
    a_ready = (ctypes.c_uint8 * len(ready)).from_buffer(ready)
    # The workers read through their own fd: a close() of the caller's (the volume's)
    # meanwhile cannot pull it from under them or hand its number to another file.
    src_fd = os.dup(src_fd) if src_fd >= 0 else -1
    try:
        read_fd, write_fd = os.pipe()
    except BaseException:
        if src_fd >= 0:
            os.close(src_fd)
        raise
    job = Job(chunks=a_chunks.buffer_info()[0], nchunks=len(plan),
              pieces=a_pieces.buffer_info()[0], src_base=src_base,
              buffers=a_buffers.buffer_info()[0], ready=ctypes.addressof(a_ready),
              nbuffers=len(buffers), buffer_size=buffer_size,
              events=a_events.buffer_info()[0], stream=stream, ctx=ctx,
              threads=max(1, threads), cpus=a_cpus.buffer_info()[0], ncpus=len(cpus),
              notify_fd=write_fd, fake=1 if fake else 0, src_fd=src_fd)
    outcome: list[int] = []

    def call() -> None:
        try:
            outcome.append(lib.csi_bounce_run(ctypes.byref(job)))
        finally:
            os.close(write_fd)  # EOF for the reader once every worker has returned

    log.debug("native loop: %d chunks handed over in %.2f ms", len(plan),
              (time.monotonic() - started) * 1e3)
    runner = threading.Thread(target=call, name="bounce-native", daemon=True)
    error: BaseException | None = None
    try:
        runner.start()
    except BaseException:
        for fd in (write_fd, read_fd, src_fd):
            if fd >= 0:
                os.close(fd)
        raise
    try:
        rest, first = b"", True
        while True:
            data = os.read(read_fd, 65536)  # releases the GIL while it waits
            if not data:
                break
            if first:
                first = False
                log.debug("native loop: first chunk on the device %.2f ms after the "
                          "hand-over began", (time.monotonic() - started) * 1e3)
            data, rest = rest + data, b""
            cut = len(data) - len(data) % 4
            data, rest = data[:cut], data[cut:]
            if error is not None:
                continue  # drain, so that no worker blocks on a full pipe
            for index in array.array("I", data):
                try:
                    on_done(index)
                except BaseException as exc:
                    error = exc
                    job.stop = 1
                    break
    finally:
        runner.join()
        os.close(read_fd)
        if src_fd >= 0:
            os.close(src_fd)
        del a_ready  # the bytearray may be resized again
    if error is not None:
        raise error
    if not outcome or outcome[0] != 0:
        raise NativeError(job.what.decode(errors="replace") or "the native bounce loop",
                          int(job.error))
