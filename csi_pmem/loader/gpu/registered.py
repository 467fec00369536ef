"""The registered-mapping path: the copy engine reads the volume itself.

Why: ``cudaHostRegister`` makes a range of the mapping pinned memory, so
``cudaMemcpyAsync`` moves it at full link speed with no memcpy thread and no bounce
buffer. Registration costs about 0.03 s/GiB (2 MiB pages) to 0.1 s/GiB (4 KiB pages),
so it pays when the mapping is loaded from more than once (docs/design.md §3). We register
in 1 GiB pieces in volume order and start the copies of each piece as soon as it is
registered, so a first load pays roughly max(registration, copy) rather than their sum;
single registrations of 512 GiB or more fail on recent drivers anyway. Pieces stay
registered until :meth:`Registration.close`, and later loads skip straight to copying.
Read-only mappings need ``cudaHostRegisterReadOnly``. Registration is refused on fsdax
files (the GPU loader does not even try those, nor block devices: see
:func:`.volume.registration_refusal`) and in some sandboxes: every failure, an error
code or an exception from the binding, is a :class:`RegistrationError`, and the caller
falls back to bounce buffers and says so.
"""

from __future__ import annotations

import bisect
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.sizes import MiB, describe_size
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01  # registered for every device, not just the current one
HOST_REGISTER_READ_ONLY = 0x08
REGISTER_STEP = 1 << 30
DIRECT_CHUNK = 256 * MiB


class RegistrationError(RuntimeError):
    pass


def register_pieces(ranges: list[tuple[int, int]], step: int = REGISTER_STEP
                    ) -> list[tuple[int, int]]:
    """Cut each file's range into pieces of at most ``step`` bytes from its start.

    Per file and never merged, so a file always gets the same pieces whichever subset
    of files a load selects: CUDA refuses to register a range twice.
    """
    return [(o, min(o + step, b)) for a, b in sorted(ranges) for o in range(a, b, step)]


class Registration:
    """Registered pieces of one mapping; holds the mapping alive while registered."""

    def __init__(self, volume: Volume):
        import torch

        self.volume = volume
        try:
            self.cudart = torch.cuda.cudart()
        except Exception as exc:  # a torch build without the runtime bindings
            raise RegistrationError(f"cannot reach cudaHostRegister through torch: {exc}") \
                from exc
        self.flags = HOST_REGISTER_PORTABLE | (
            0 if volume.writable else HOST_REGISTER_READ_ONLY)
        # A buffer export: the volume cannot be unmapped while pieces are registered
        # (torch.frombuffer alone keeps only a reference, which close() ignores).
        self._export: memoryview | None = memoryview(volume.mapped)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            self.source = torch.frombuffer(self._export, dtype=torch.uint8)
        self.pieces: dict[int, int] = {}
        self.seconds = 0.0

    @property
    def nbytes(self) -> int:
        return sum(end - start for start, end in self.pieces.items())

    def ensure(self, start: int, end: int) -> None:
        if self.pieces.get(start) == end:
            return
        t = time.monotonic()
        try:
            err = self.cudart.cudaHostRegister(self.volume.address + start, end - start,
                                               self.flags)
        except Exception as exc:  # a binding may raise rather than return the error
            raise RegistrationError(
                f"cudaHostRegister of {describe_size(end - start)} at offset {start} of "
                f"{self.volume.source} raised {type(exc).__name__}: {exc}") from exc
        if int(err) != 0:
            raise RegistrationError(
                f"cudaHostRegister of {describe_size(end - start)} at offset {start} of "
                f"{self.volume.source} failed: {_cuda_error(self.cudart, err)}")
        self.pieces[start] = end
        self.seconds += time.monotonic() - t

    def close(self) -> None:
        for start in self.pieces:
            self.cudart.cudaHostUnregister(self.volume.address + start)
        self.pieces.clear()
        self.source = None
        if self._export is not None:
            try:
                self._export.release()
            except BufferError:  # a slice of it is still in use somewhere
                pass
            self._export = None


def _cuda_error(cudart: Any, err: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # not every torch binds cudaGetErrorString
        return f"cudaError {int(err)}"


def copy_direct(registration: Registration, pieces: list[tuple[int, int]],
                chunks: list[planning.Chunk], targets: list[Any], device: Any,
                on_done: Callable[[planning.Chunk], None]) -> None:
    """Register piece by piece and queue each piece's copies right after it.

    ``targets[i]`` is file ``i``'s device buffer, allocated on the caller's stream. A
    piece that cannot be registered after copies started is copied from pageable
    memory, with a warning.
    """
    import torch

    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    starts = [p[0] for p in pieces]
    by_piece: dict[int, list[planning.Chunk]] = {}
    for c in chunks:
        by_piece.setdefault(bisect.bisect_right(starts, c.pieces[0].src) - 1, []).append(c)
    pending: Pending = []
    src = registration.source
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for i, (start, end) in enumerate(pieces):
            if i not in by_piece:
                continue
            try:
                registration.ensure(start, end)
            except RegistrationError as exc:
                if not pending and not registration.pieces:
                    raise
                log.warning("%s; copying this %s from pageable memory (about 8 GB/s "
                            "instead of the link speed)", exc, describe_size(end - start))
            queue_copies(by_piece[i], targets, src, stream, pending)
            # Report what already landed without blocking the queueing.
            report_landed(pending, on_done)
    report_landed(pending, on_done, wait=True)


Pending = list[tuple[Any, planning.Chunk]]


def queue_copies(chunks: list[planning.Chunk], targets: list[Any], src: Any, stream: Any,
                 pending: Pending) -> None:
    """Queue each chunk's copy from the registered mapping ``src`` (a CPU uint8 tensor
    over it) on ``stream`` (current), with an event after each, onto ``pending``."""
    import torch

    for c in chunks:
        p = c.pieces[0]
        targets[c.target][c.dst:c.dst + c.nbytes].copy_(src[p.src:p.src + p.nbytes],
                                                        non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        pending.append((event, c))


def report_landed(pending: Pending, on_done: Callable[[planning.Chunk], None], *,
                  wait: bool = False) -> None:
    """``on_done`` for the chunks at the head of ``pending`` that have landed (all of
    them, waiting, with ``wait``), in queue order."""
    while pending and (wait or pending[0][0].query()):
        event, c = pending.pop(0)
        if wait:
            event.synchronize()
        on_done(c)
