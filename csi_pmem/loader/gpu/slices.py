"""A tensor-parallel rank's copies from the volume: only the rank's bytes, through pinned
buffers, straight into the rank's parameters.

Why: vLLM's weight loaders cut each checkpoint tensor for their rank themselves. A
column-parallel layer takes a row range (``narrow(0, ...)``), a row-parallel one a column
range (``narrow(1, ...)``: every row, a stretch of each), a fused qkv or gate_up several
row ranges, and each ends in ``param.copy_(slice)``. Handing them CUDA tensors of whole
checkpoint tensors would make every rank read the whole model over its host link (on 8
GPUs, 8 times the model in host memory bandwidth). Handing them plain views of the
mapping reads only the slice, but ``copy_`` from pageable memory runs at a fraction of
the link: torch packs a strided slice into a temporary, then the driver bounces it again.

So the rank gets :class:`VolumeTensor`\\ s: views of the mapping that torch routes through
``__torch_function__``. Their narrowing, views and shape queries are torch's own
(a narrowed VolumeTensor is still a view of the mapping, so vLLM's code cannot tell the
difference), and a ``copy_`` of one into a tensor on the copier's device goes to
:class:`RankCopier`: the slice's elements are packed into a pinned buffer by a few
threads (reading only those bytes, wherever the rows lie), and copied to the parameter
on the current stream without waiting, while the next buffer fills. No device memory
beyond the parameters is used. Any other operation (a cast, a transpose copied
elsewhere) is torch's, on the same view: correct, and counted as bytes read outside the
copier so that a model whose loaders do that shows in the figures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from csi_pmem.sizes import MiB, describe_size

PATH = "rank-slices"  # the path's name in log lines and results
BUFFERS = 4  # pinned buffers in the ring: one packing, the others on the link
BUFFER = 32 * MiB  # per buffer: big enough that a copy's launch is noise beside it
THREADS = 4  # packing threads per rank: one core's memcpy is a fifth of the link


class RankCopier:
    """Copies VolumeTensor slices into tensors on ``device`` through a ring of pinned
    buffers, and counts the bytes read, for tensor-parallel rank ``rank`` of ``size``.

    One per load; :meth:`finish` waits for the last copy and frees the buffers. On the
    CPU (tests, and vLLM's CPU build) the buffers are ordinary memory and each copy is
    done when it returns; the packing, splitting and counting are the same code.
    """

    def __init__(self, device: torch.device, rank: int = 0, size: int = 1, *,
                 buffers: int = BUFFERS, buffer_size: int = BUFFER, threads: int = THREADS):
        self.device, self.rank, self.size = device, rank, size
        self.loaded: set[str] | None = None  # what the server's load_weights reported
        self.cuda = device.type == "cuda"
        self.buffer_size = buffer_size
        self.copied = 0  # bytes moved by this copier (the rank's slices)
        self.elsewhere = 0  # bytes of VolumeTensors copied by torch itself
        self.copies = 0
        self.path = PATH  # the path's name in the load's log line
        self._bufs = [torch.empty(buffer_size, dtype=torch.uint8, pin_memory=self.cuda)
                      for _ in range(max(1, buffers))]
        self._events: list[Any] = [None] * len(self._bufs)
        self._next = 0
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="slices") \
            if threads > 1 else None
        self._threads = max(1, threads)
        self._lock = threading.RLock()  # a subclass copies again under it

    def wants(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether ``dst.copy_(src)`` is one this copier does: onto its device, same
        shape (no broadcast), a slice whose rows fit a buffer."""
        if dst.device != self.device or src.device.type != "cpu":
            return False
        if tuple(dst.shape) != tuple(src.shape) or src.numel() == 0:
            return False
        return _row_bytes(src) <= self.buffer_size

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, block by block of whole leading rows through the ring."""
        plain = _plain(src)
        rows = plain.shape[0] if plain.dim() else 1
        per = max(1, self.buffer_size // max(1, _row_bytes(plain)))
        with self._lock:
            for start in range(0, rows, per):
                n = min(per, rows - start)
                part = plain if plain.dim() == 0 else plain.narrow(0, start, n)
                out = dst if dst.dim() == 0 else dst.narrow(0, start, n)
                self._through_buffer(out, part)
            self.copied += plain.numel() * plain.element_size()
            self.copies += 1

    def _through_buffer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()  # that buffer's last copy has left it
        nbytes = src.numel() * src.element_size()
        staged = self._bufs[i][:nbytes].view(src.dtype).view(src.shape)
        self._pack(staged, src)
        dst.copy_(staged, non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[i] = event

    def _pack(self, staged: torch.Tensor, src: torch.Tensor) -> None:
        """Gather ``src``'s elements into the contiguous ``staged``: split by leading
        rows over the threads (torch's copy releases the GIL), each reading only its
        rows' bytes of the slice."""
        rows = src.shape[0] if src.dim() else 1
        parts = min(self._threads, rows)
        if self._pool is None or parts < 2 or src.numel() * src.element_size() < MiB:
            staged.copy_(src)
            return
        step = -(-rows // parts)
        futures = [self._pool.submit(_copy_rows, staged, src, a, min(step, rows - a))
                   for a in range(0, rows, step)]
        for f in futures:
            f.result()

    def describe(self) -> str:
        """Where the load went and what it read, for the log line."""
        out = (f"{self.device}, rank {self.rank} of {self.size}: "
               f"{describe_size(self.copied)} of its slices through pinned buffers")
        if self.elsewhere:
            out += f", {describe_size(self.elsewhere)} copied by torch from the views"
        return out

    def finish(self) -> None:
        """Wait until every copy has landed, then free the pinned buffers."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events = [None] * len(self._bufs)
        self._bufs = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy_rows(staged: torch.Tensor, src: torch.Tensor, start: int, n: int) -> None:
    staged.narrow(0, start, n).copy_(src.narrow(0, start, n))


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one leading row (the unit a copy is split by)."""
    if t.dim() == 0:
        return t.element_size()
    return (t.numel() // max(1, t.shape[0])) * t.element_size()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


_current: list[RankCopier | None] = [None]
_current_lock = threading.Lock()


class VolumeTensor(torch.Tensor):
    """A view of the volume's mapping whose copies into the active
    :class:`RankCopier`'s device go through it (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2:
            dst, src = args[0], args[1]
            copier = _current[0]
            if isinstance(src, VolumeTensor) and not isinstance(dst, VolumeTensor):
                if copier is not None and copier.wants(dst, src):
                    copier.copy(dst, src)
                    return dst
                if copier is not None:
                    copier.elsewhere += src.numel() * src.element_size()
        return super().__torch_function__(func, types, args, kwargs)


def wrap(tensor: torch.Tensor) -> VolumeTensor:
    """``tensor`` (a view of the mapping) as a VolumeTensor sharing its storage."""
    return tensor.as_subclass(VolumeTensor)


class active:
    """``with active(copier):`` routes VolumeTensor copies through ``copier`` (one load
    at a time per process: vLLM loads one model per worker)."""

    def __init__(self, copier: RankCopier):
        self.copier = copier

    def __enter__(self) -> RankCopier:
        with _current_lock:
            if _current[0] is not None:
                raise RuntimeError("another rank-slice load is running in this process")
            _current[0] = self.copier
        return self.copier

    def __exit__(self, *exc: object) -> None:
        with _current_lock:
            _current[0] = None
