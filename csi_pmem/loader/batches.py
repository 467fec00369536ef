"""A model's tensors on the GPU in bounded batches, for a server that copies each one into
a parameter it allocated itself and keeps none of them (vLLM's ``load_weights``).

Why batches: such a server owns its parameters before it reads a byte, so a whole-model
load to the GPU would hold the model twice in device memory (a 45 GB model does not fit
an 80 GB card), and CPU views of the mapping make every parameter copy a pageable copy
(0.17 of the host link on an H100: docs/inference.md). Here each batch is one
:func:`~csi_pmem.loader.start_load` to the device, so it takes the path
``load_safetensors`` takes (the node's copy service where the volume has ``gpu.sock``,
else the in-pod bounce), and the consumer's copies from it are device-to-device.

The bound: every batch is counted from its start until the consumer has provably let
go of it, which is when it comes back for the second tensor after it (its loop variable
held the last one until then; the tensors are views of one allocation per batch, freed
with the last view). A batch starts only while the batches counted plus its bytes fit
the budget, so the extra device memory is ``budget`` whatever the model. Runs are cut
at ``budget / (ahead + 1)`` bytes; a tensor larger than that is a batch alone (a server
needs each checkpoint tensor whole), and the runs beside it are cut to fit the room it
leaves (a Llama-3-8B embedding is 1002 MiB of a 1 GiB budget). Only a tensor that
cannot fit the budget beside its neighbours is loaded beyond it, and the load says so:
:attr:`BatchedLoad.bound` is the most it holds, counted before it starts. On an H100
the earlier rule (count batches, not bytes) held 1428 MiB against a 1 GiB budget.

Why two ahead on the node path: a batch's request (a connection, an exportable
allocation, the service mapping it) costs milliseconds in which the link idles unless
another batch is copying. On an H100 16 GB went at 37.5 GB/s unverified with one
batch ahead against a 55 GB/s ceiling (benchmarks/results/vllm-bench-2026-12-06.json);
node-path loads run outside the GPU loader's lock, so the next request is made while
the service copies the one before. In-pod batches share the loader's pinned buffers
and run one at a time: one ahead is all they can use.

Verification: every batch's bytes are summed on the device as it lands, a chunk two
batches share in two pieces (:mod:`.gpu.batchcheck` says why), and the files that check
cannot take (a subset of a file, SHA-256 volumes, no CUDA) are hashed on the host beside
each batch's copy. :meth:`BatchedLoad.verified` raises
:class:`~csi_pmem.weights.errors.ChecksumError` after the last batch: a damaged chunk
fails the load before anything is served, as with ``load_safetensors``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from csi_pmem.loader.api import LoadHandle, damaged, default_loader, start_load
from csi_pmem.loader.gpu import nodecopy
from csi_pmem.loader.gpu.batchcheck import BatchCheck, for_load
from csi_pmem.loader.gpu.chunks import place
from csi_pmem.loader.model import ModelView
from csi_pmem.sizes import GiB, MiB, describe_size, round_up
from csi_pmem.weights.stformat import TensorInfo

log = logging.getLogger(__name__)

#: Extra device memory a batched load may hold by default (its batches share it).
DEFAULT_BUDGET = 1 * GiB
#: What a batch's allocation is rounded up to when it is counted: the node path's
#: cuMemCreate granularity, and torch's caching allocator for blocks over 1 MiB.
ALLOCATION_GRAIN = 2 * MiB


def plan_batches(selection: dict[str, list[TensorInfo]], limit: int,
                 budget: int | None = None,
                 size: Callable[[list[TensorInfo]], int] | None = None
                 ) -> list[list[TensorInfo]]:
    """The tensors in volume order, cut into runs of at most ``limit`` bytes each (a
    larger tensor is a run alone). Runs do not cross files: a run within one file is
    one device allocation, its bytes as on the volume, which :mod:`.gpu.batchcheck` sums.
    With ``budget``, the runs beside a lone large tensor are cut further, to share the
    room it leaves in the budget (see :func:`_make_room`), each run counted as ``size``
    says (by default its tensors' bytes; a batched load counts its allocation)."""
    batches: list[list[TensorInfo]] = []
    for tensors in selection.values():
        run: list[TensorInfo] = []
        total = 0
        for t in sorted(tensors, key=lambda t: t.offset):
            if run and total + t.nbytes > limit:
                batches.append(run)
                run, total = [], 0
            run.append(t)
            total += t.nbytes
        if run:
            batches.append(run)
    if budget is None:
        return batches
    return _make_room(batches, limit, budget, size or _nbytes)


def _nbytes(batch: list[TensorInfo]) -> int:
    return sum(t.nbytes for t in batch)


def _make_room(batches: list[list[TensorInfo]], limit: int, budget: int,
               size: Callable[[list[TensorInfo]], int]) -> list[list[TensorInfo]]:
    """Split the neighbours of every batch over ``limit`` so that the part touching it
    fits half the room it leaves (all of it with one neighbour): a big batch can then
    start while the one before it is read, and the one after it can load beside it.
    Where the tensor touching it does not fit the half, the part is what fits the whole
    room, else that one tensor: only the pairs of neighbours decide the bound, and the
    half share only buys the overlap. Without this, the big batch would wait for its
    predecessor's whole run, or the bound would be broken. Batches are counted as
    ``size`` says, as the window counts them."""
    out = [list(b) for b in batches]
    i = 0
    while i < len(out):
        big = size(out[i])
        if _nbytes(out[i]) <= limit:
            i += 1
            continue
        room = max(budget - big, 0)
        share = room // max((i > 0) + (i + 1 < len(out)), 1)
        if i + 1 < len(out):
            after = out[i + 1]
            k = _fits(after, share, size) or _fits(after, room, size) or 1
            if k < len(after):
                out[i + 1:i + 2] = [after[:k], after[k:]]
        if i > 0:
            before = out[i - 1]
            k = len(before) - (_fits(before, share, size, True)
                               or _fits(before, room, size, True) or 1)
            if 0 < k:
                out[i - 1:i] = [before[:k], before[k:]]
                i += 1
        i += 1
    return out


def _fits(tensors: list[TensorInfo], room: int, size: Callable[[list[TensorInfo]], int],
          from_end: bool = False) -> int:
    """How many of ``tensors``, from the first (or the last), fit ``room`` as counted
    (a longer run never counts less: found by bisection, as a run may hold thousands)."""
    lo, hi = 0, len(tensors)  # lo fit; the answer is in [lo, hi]
    while lo < hi:
        k = (lo + hi + 1) // 2
        if size(tensors[len(tensors) - k:] if from_end else tensors[:k]) <= room:
            lo = k
        else:
            hi = k - 1
    return lo


class Window:
    """Which batches may start, given how far the consumer has read: a pure rule, so
    that :class:`BatchedLoad` can count its bound before the load and follow the same
    steps during it. Batches ``[max(current, 0), next)`` hold device memory: the one
    the consumer reads and those loading."""

    def __init__(self, sizes: list[int], budget: int, ahead: int):
        self.sizes, self.budget, self.ahead = sizes, budget, ahead
        self.current, self.next, self.peak = -1, 0, 0

    def _held(self) -> int:
        return sum(self.sizes[max(self.current, 0):self.next])

    def _take(self) -> int:
        self.peak = max(self.peak, self._held() + self.sizes[self.next])
        self.next += 1
        return self.next - 1

    def fill(self) -> list[int]:
        """Batches to start now: at most ``ahead`` loading, within the budget."""
        started = []
        while (self.next < len(self.sizes) and self.next - self.current - 1 < self.ahead
               and self._held() + self.sizes[self.next] <= self.budget):
            started.append(self._take())
        return started

    def need(self, i: int) -> list[int]:
        """The consumer waits for batch ``i``: start it if the budget kept it back
        (its predecessor is still held: the bound is then the two of them)."""
        return [self._take()] if self.next == i else []

    def first_taken(self, i: int) -> list[int]:
        """The consumer came back after batch ``i``'s first tensor: the batches before
        it are free."""
        self.current = i
        return self.fill()


def peak_held(sizes: list[int], budget: int, ahead: int) -> int:
    """The most device memory the batches hold at once, following the window's rule."""
    window = Window(sizes, budget, ahead)
    window.fill()
    for i in range(len(sizes)):
        window.need(i)
        window.first_taken(i)
    return window.peak


class BatchedLoad:
    """Iterate ``(name, tensor)`` on ``device``, in volume order, in bounded batches.

    ``budget``: the extra device memory in bytes, ``ahead + 1`` batches of an equal
    share; ``ahead``: batches loading while the consumer reads one (default: 2 where
    the node's copy service will serve them, else 1). ``bound``: the most the batches
    hold at once, ``budget`` or less unless one tensor and its neighbours cannot fit;
    each batch counted as its allocation, rounded up to ``grain`` bytes.
    ``names``/``predicate`` pick a subset, as in ``start_load``. After the iteration,
    :meth:`verified` waits for every batch's check; ``path`` names the copy path the
    batches took (``node``, ``bounce``, ...), ``nbytes`` and ``seconds`` what moved.
    """

    def __init__(self, view: ModelView, device: str, *, budget: int = DEFAULT_BUDGET,
                 verify: bool = True, names: Iterable[str] | None = None,
                 predicate: Callable[[str], bool] | None = None, loader: Any = None,
                 ahead: int | None = None, grain: int = ALLOCATION_GRAIN):
        if not device.startswith("cuda"):
            raise ValueError(f"a batched load is for a CUDA device, not {device!r}")
        if budget < 2:
            raise ValueError(f"budget must be a positive number of bytes, not {budget}")
        self.view, self.device, self.verify, self.loader = view, device, verify, loader
        self.budget = budget
        self.ahead = ahead if ahead is not None else self._default_ahead()
        if self.ahead < 1:
            raise ValueError(f"ahead must be 1 or more batches, not {self.ahead}")
        self.limit = budget // (self.ahead + 1)
        selection = view.select(names, predicate)
        def allocated(batch: list[TensorInfo]) -> int:  # as the device holds it
            return round_up(place(batch)[1], grain)

        self.batches = plan_batches(selection, self.limit, budget, allocated)
        owner = {t.name: f for f, ts in selection.items() for t in ts}
        self._files = [owner[b[0].name] for b in self.batches]
        self.check: BatchCheck | None = for_load(view, selection, device) if verify \
            else None
        self._bad: list[Any] | None = None
        self.nbytes = sum(t.nbytes for b in self.batches for t in b)
        # Counted as allocated: the tensors as placed on the device, rounded up.
        self.sizes = [allocated(b) for b in self.batches]
        self.bound = peak_held(self.sizes, budget, self.ahead)
        self.paths: set[str] = set()
        self.seconds: float | None = None
        self.waited = 0.0  # seconds the consumer waited for batches
        self._checks: list[Future[None]] = []
        self._used = False

    @property
    def path(self) -> str:
        return "+".join(sorted(self.paths)) or "none"

    @property
    def gbps(self) -> float | None:
        return None if not self.seconds else self.nbytes / self.seconds / 1e9

    def _default_ahead(self) -> int:
        node = self.loader.node_socket(self.view) if self.loader is not None \
            else nodecopy.service_socket(self.view.volume)
        return 2 if node is not None else 1

    def _on_device(self, i: int) -> bool:
        return self.check is not None and self.check.covers(self._files[i])

    def _start(self, i: int) -> LoadHandle:
        log.debug("batch %d of %d (%s) starts", i, len(self.batches),
                  describe_size(self.sizes[i]))
        handle = start_load(self.view, self.device, names=[t.name for t in self.batches[i]],
                            verify=self.verify and not self._on_device(i),
                            loader=self.loader)
        self._checks.append(handle.verified)
        return handle

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if self._used:
            raise RuntimeError("a BatchedLoad is iterated once")
        self._used = True
        if not self.batches:
            self.seconds = 0.0
            return
        gpu = self.loader if self.loader is not None else default_loader(self.device)
        # The batches are one load of the model: the first one's path for all of them
        # (GpuLoader.one_load says why).
        one_load = getattr(gpu, "one_load", None)
        cap = max(self.bound, self.budget)  # what the node path's slots may hold
        # Only the batches of the window's share: a slot made larger for a lone big
        # tensor's size would be counted at more than its batch beside the others.
        sizes = [s for s in self.sizes if s <= self.limit]
        with one_load(self.view, cap=cap, sizes=sizes) if one_load is not None \
                else contextlib.nullcontext():
            yield from self._batches()

    def _batches(self) -> Iterator[tuple[str, Any]]:
        if self.bound > self.budget:
            log.info("a tensor batch of %s does not fit the budget of %s beside its "
                     "neighbours: the load holds up to %s of device memory beyond the "
                     "model", describe_size(max(self.sizes)), describe_size(self.budget),
                     describe_size(self.bound))
        started = time.monotonic()
        window = Window(self.sizes, self.budget, self.ahead)
        loading: deque[LoadHandle] = deque(self._start(j) for j in window.fill())
        if self.check is not None:
            self.check.prepare()  # while the first batches copy
        for i, batch in enumerate(self.batches):
            loading.extend(self._start(j) for j in window.need(i))
            handle = loading.popleft()
            waited = time.monotonic()
            tensors = dict(handle.done.result())  # LoaderError: the copy failed
            waited = time.monotonic() - waited
            self.waited += waited
            log.debug("batch %d in after %.2f ms waiting", i, waited * 1e3)
            self.paths.add(handle.path or "none")
            held = self.check is not None and self._on_device(i) and \
                self.check.submit(self._files[i], batch, tensors)
            # From here only the consumer's references keep the batch's memory.
            handle.drop()
            del handle
            for k, t in enumerate(batch):
                tensor = tensors.pop(t.name)
                yield t.name, tensor
                del tensor
                if k == 0:
                    if self.check is not None:  # the previous batches' sums ran
                        self.check.release(keep=1 if held else 0)
                    loading.extend(self._start(j) for j in window.first_taken(i))
            del tensors
        self.seconds = time.monotonic() - started

    def verified(self, timeout: float | None = None) -> None:
        """Wait for every batch's check; ChecksumError if a chunk does not match."""
        for fut in self._checks:
            fut.result(timeout)
        if self.check is not None and self._bad is None:
            self._bad = self.check.mismatches()
        if self._bad:
            raise damaged(self.view, self._bad)

    def settle(self) -> None:
        """Wait for the checks without raising (before the volume is unmapped)."""
        for fut in self._checks:
            fut.exception()
        if self.check is not None:
            self.check.close()
