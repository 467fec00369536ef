"""The bounce-buffer pipeline: memcpy threads fill reusable pinned buffers, one stream
drains them to the device, events say when a buffer may be filled again.

Why this shape (docs/design.md §3): pageable host-to-device copies reach about 7.8 GB/s on
an H200 host, pinned ones about 55; registering or allocating a model-sized pinned
buffer per load costs 0.03-0.4 s/GiB. A few pinned buffers allocated once, filled by
several threads on the volume's NUMA node (``ctypes.memmove`` releases the GIL), keep
one copy engine busy. The engine here knows nothing of CUDA: a backend enqueues a
transfer and waits for it, so the recycling logic is tested with a fake device that
performs the "DMA" only when waited on (a buffer reused too early shows up as wrong
bytes).

Order of events for one chunk: a worker claims the next chunk (from a list, or from a
``take()`` callable that another copy path shares: the hybrid first load takes chunks
from the back of the model while registration works from the front), takes a free
buffer, memcpys the chunk's pieces into it, enqueues the transfer and records the
buffer's event (under one lock, so the in-flight queue is in stream order), and hands
(buffer, chunk) to the caller's thread, which waits for the event, returns the buffer
to the free list and reports the chunk done. Every claimed chunk produces exactly one
in-flight item, also when it fails or is cancelled, and every worker one end marker, so
the caller never waits for an item that will not come.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from csi_pmem.loader.gpu.chunks import Chunk
from csi_pmem.numa import pin_current_thread

Memcpy = Callable[[int, int, int], object]
Take = Callable[[], "Chunk | None"]
_END = object()


class Backend(Protocol):
    def buffer_address(self, buf: int) -> int: ...

    def transfer(self, buf: int, chunk: Chunk) -> None:
        """Enqueue buffer ``buf``'s first ``chunk.nbytes`` to the device; record its event."""

    def wait(self, buf: int) -> None:
        """Block until buffer ``buf``'s last transfer finished."""


class Cancelled(Exception):
    pass


class BouncePipeline:
    """Reusable: the thread pool and buffers outlive loads; one load at a time."""

    def __init__(self, backend: Backend, nbuffers: int, buffer_size: int, threads: int,
                 cpus: list[int] | None = None, memcpy: Memcpy = ctypes.memmove,
                 thread_init: Callable[[], object] | None = None):
        if nbuffers < 1 or threads < 1 or buffer_size < 1:
            raise ValueError("need at least one buffer and one thread")
        self.backend = backend
        self.nbuffers = nbuffers
        self.buffer_size = buffer_size
        self.memcpy = memcpy
        self.threads = threads
        self._issue = threading.Lock()
        self._busy = threading.Lock()

        def init() -> None:
            if cpus:
                pin_current_thread(cpus)
            if thread_init is not None:
                thread_init()

        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bounce",
                                        initializer=init)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def run(self, chunks: Iterable[Chunk] | Take, src_base: int,
            on_done: Callable[[Chunk], None]) -> None:
        """Move ``chunks`` (pieces are offsets from ``src_base``); call ``on_done`` for
        each in the caller's thread once its bytes are on the device. ``chunks`` may be
        a ``take()`` callable returning the next chunk or None; it is called from the
        worker threads and must be thread-safe."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this pipeline is already running a load")
        try:
            if callable(chunks):
                take = chunks
            else:
                pending = list(chunks)
                pending.reverse()
                lock = threading.Lock()

                def take() -> Chunk | None:
                    with lock:
                        return pending.pop() if pending else None

            self._run(take, src_base, on_done)
        finally:
            self._busy.release()

    def _run(self, take: Take, src_base: int, on_done: Callable[[Chunk], None]) -> None:
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.nbuffers):
            free.put(i)
        inflight: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def copy(chunk: Chunk) -> None:
            buf = None
            try:
                if chunk.nbytes > self.buffer_size:
                    raise ValueError(f"chunk of {chunk.nbytes} bytes exceeds the buffer")
                buf = free.get()
                if stop.is_set():
                    raise Cancelled
                base = self.backend.buffer_address(buf)
                for p in chunk.pieces:
                    self.memcpy(base + p.buf_off, src_base + p.src, p.nbytes)
                with self._issue:
                    self.backend.transfer(buf, chunk)
                    inflight.put((buf, chunk, None))
            except BaseException as exc:  # every claimed chunk reports, or the caller hangs
                if buf is not None:
                    free.put(buf)
                inflight.put((None, chunk, exc))

        def worker() -> None:
            try:
                while not stop.is_set():
                    chunk = take()
                    if chunk is None:
                        break
                    copy(chunk)
            except BaseException as exc:  # take() itself failed
                inflight.put((None, None, exc))
            finally:
                inflight.put(_END)

        for _ in range(self.threads):
            self._pool.submit(worker)
        error: BaseException | None = None
        ended = 0
        while ended < self.threads:
            item = inflight.get()
            if item is _END:
                ended += 1
                continue
            buf, chunk, exc = item
            if buf is not None:
                self.backend.wait(buf)
                free.put(buf)
                if error is None:
                    try:
                        on_done(chunk)
                    except BaseException as cb_exc:
                        error = cb_exc
                        stop.set()
            elif error is None and not isinstance(exc, Cancelled):
                error = exc
                stop.set()
        if error is not None:
            raise error
