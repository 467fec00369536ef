"""Device buffers per file and the plan that reports tensors as they land: what every
GPU path (bounce, registered, hybrid, node) fills, whatever does the copies.

Device placement: one device buffer per file, tensors are views into it (see
:func:`.chunks.place`), so a whole-file load is a stream of large transfers. One
allocation for the whole load, sliced per file (:func:`allocate`), unless the node path
attached exportable allocations first. Apart from :mod:`.loader` so that the node path
(:mod:`.nodecopy`) plans and reports the same way without importing the loader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from csi_pmem.loader.cpu import torch_dtype
from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu import native
from csi_pmem.sizes import describe_size, round_up
from csi_pmem.weights.stformat import TensorInfo

log = logging.getLogger(__name__)


def torch_module() -> Any:
    """torch, imported at first use (every GPU path needs it; importing this module does not)."""
    import torch

    return torch


@dataclass
class FileTarget:
    """One file's placements, device buffer (a slice of the load's allocation) and
    tensor views."""

    name: str
    infos: dict[str, TensorInfo]
    placements: list[planning.Placement]
    size: int
    buffer: Any = None
    tensors: dict[str, Any] = field(default_factory=dict)
    unaligned: dict[str, planning.Placement] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    # Buffer offset of the file's first tensor byte (kept when a partial target is
    # made from this one: its own placements may start later).
    first_dst: int = 0

    def attach(self, buffer: Any) -> None:
        """Take ``buffer`` (this file's slice of the load's allocation); make the views."""
        self.buffer = buffer
        for p in self.placements:
            view = self._view(p, self.infos[p.name])
            if view is None:
                self.unaligned[p.name] = p
            else:
                self.tensors[p.name] = view


    def _view(self, p: planning.Placement, t: TensorInfo) -> Any:
        torch = torch_module()
        dtype = torch_dtype(t.dtype)
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dtype, device=self.buffer.device)
        raw = self.buffer[p.dst:p.dst + p.nbytes]
        if dtype is torch.uint8 and t.dtype != "U8":
            return raw  # sub-byte types, or a dtype this torch lacks: flat raw bytes
        if p.dst % dtype.itemsize:
            return None  # a file without padding: copied into its own tensor when done
        return raw.view(dtype).view(t.shape)

    def finish(self, name: str) -> Any:
        """The finished tensor (copying an unaligned one into a tensor of its own)."""
        self.finished.add(name)
        p = self.unaligned.pop(name, None)
        if p is not None:
            torch = torch_module()
            t = self.infos[name]
            device = self.buffer.device
            # The bytes are on the device already (we waited for their transfer); copy on
            # the default stream so the copy stream keeps its queue.
            stream = torch.cuda.default_stream(device)
            with torch.cuda.stream(stream):
                out = torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device)
                out.view(-1).view(torch.uint8).copy_(self.buffer[p.dst:p.dst + p.nbytes])
            stream.synchronize()
            self.tensors[name] = out
        return self.tensors[name]


class CopyPlan:
    """One load's transfers, cut by ``split``, and which tensors each completes.

    Every path (bounce, registered, hybrid, node) plans the same way and differs only
    in how it cuts runs into transfers; ``done`` may be called from several threads.
    The native bounce loop's plan is :meth:`of_flat`: its chunks stay in the loop's
    own arrays (``flat``) and are reported by index (:meth:`done_index`).
    """

    def __init__(self, targets: list[FileTarget],
                 split: Callable[[list[planning.Placement], int, int], list[planning.Chunk]],
                 finish: Callable[[FileTarget, str], None]):
        self.targets, self._finish = targets, finish
        self.chunks: list[planning.Chunk] = []
        self.flat: native.Flat | None = None
        self.completions: list[planning.Completion] = []
        for i, target in enumerate(targets):
            file_chunks = split(target.placements, i, len(self.chunks))
            self.completions.append(planning.Completion(target.placements, file_chunks))
            self.chunks += file_chunks
        self._lock = threading.Lock()

    @classmethod
    def of_flat(cls, targets: list[FileTarget], flat: native.Flat,
                finish: Callable[[FileTarget, str], None]) -> CopyPlan:
        plan = cls(targets, lambda ps, i, seq: [], finish)
        plan.flat = flat
        plan.completions = [planning.Completion.of_spans(t.placements, *flat.bounds(i))
                            for i, t in enumerate(targets)]
        return plan

    def __len__(self) -> int:
        return len(self.flat) if self.flat is not None else len(self.chunks)

    def ready(self, target: int | None = None) -> None:
        """Finish the zero-byte tensors (of one target, or of all)."""
        for i in range(len(self.targets)) if target is None else [target]:
            for name in self.completions[i].ready:
                self._finish(self.targets[i], name)

    def done(self, chunk: planning.Chunk) -> None:
        self._done(chunk.seq, chunk.target, chunk.dst, chunk.nbytes)

    def done_index(self, index: int) -> None:
        """Chunk ``index`` of the flat plan landed."""
        assert self.flat is not None
        self._done(index, *self.flat.span(index))

    def _done(self, seq: int, target: int, dst: int, nbytes: int) -> None:
        with self._lock:
            for name in self.completions[target].done_span(seq, dst, nbytes):
                self._finish(self.targets[target], name)


def unfinished(targets: list[FileTarget]) -> list[FileTarget]:
    """What is left of a load after a node-side copy stopped: the targets, sharing
    their buffers, with only the placements whose tensors did not finish."""
    out = []
    for t in targets:
        if t.buffer is None:
            out.append(t)
            continue
        left = [p for p in t.placements if p.name not in t.finished]
        if left:
            out.append(FileTarget(t.name, t.infos, left, t.size, t.buffer, t.tensors,
                                  t.unaligned, t.finished, t.first_dst))
    return out


def load_bytes(sizes: Iterable[int]) -> int:
    """Device bytes one load of files with these placed sizes takes (see allocate)."""
    total = 0
    for size in sizes:
        total = round_up(total + size, 4096)
    return total


def allocate(targets: list[FileTarget], device: Any, arena: Any = None) -> None:
    """One device allocation for the whole load, sliced per file, before any copy.

    Fresh device memory costs about 2.3 ms/GB to allocate on an H200 (34 ms for a
    14.7 GB model); allocating per file between copies hid only a few ms of that, so
    the simpler single allocation stays. Tensors are views into it: the memory is
    returned when the last tensor of the load is freed.
    """
    targets = [t for t in targets if t.buffer is None]  # the node path may have some
    if not targets:
        return
    torch = torch_module()
    bases, total = [], 0
    for t in targets:
        bases.append(total)
        total = round_up(total + t.size, 4096)  # keeps each file's mod-256 layout
    if arena is not None and arena.numel() >= total:
        whole = arena[:total]  # reserved ahead of the load (GpuLoader.reserve)
    else:
        if arena is not None:
            log.warning("reserved device memory (%d bytes) is smaller than this load "
                        "(%d bytes); allocating afresh", arena.numel(), total)
        started = time.monotonic()
        whole = torch.empty(total, dtype=torch.uint8, device=device)
        log.debug("allocated %s of device memory in %.2f ms", describe_size(total),
                  (time.monotonic() - started) * 1e3)
    for t, base in zip(targets, bases, strict=True):
        t.attach(whole[base:base + t.size])
