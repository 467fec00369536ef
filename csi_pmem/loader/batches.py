"""A model's tensors on the GPU in bounded batches, for a server that copies each one into
a parameter it allocated itself and keeps none of them (vLLM's ``load_weights``).

Why batches: such a server owns its parameters before it reads a byte, so a whole-model
load to the GPU would hold the model twice in device memory (a 45 GB model does not fit
an 80 GB card), and CPU views of the mapping make every parameter copy a pageable copy
(0.17 of the host link on an H100: docs/inference.md). Here each batch is one
:func:`~csi_pmem.loader.start_load` to the device, so it takes the path
``load_safetensors`` takes (the node's copy service where the volume has ``gpu.sock``,
else the in-pod bounce), and the consumer's copies from it are device-to-device.

The bound: at most two batches hold device memory, the one the consumer reads and the
next one loading, each at most ``budget / 2`` bytes of tensors; a tensor larger than
that is a batch alone, and the bound is then that tensor plus the next batch (a server
needs each checkpoint tensor whole). The next batch starts once the consumer took the
first tensor of the current one, so the previous batch's last tensor, which the
consumer's loop variable holds until then, is already dropped (the tensors are views of
one allocation per batch, freed with the last view).

Verification: every batch's checksums are checked beside its copy (on the device where
a batch holds whole files, else on the host) and :meth:`BatchedLoad.verified` raises
:class:`~csi_pmem.weights.errors.ChecksumError` after the last batch: a damaged chunk
fails the load before anything is served, as with ``load_safetensors``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from csi_pmem.loader.api import LoadHandle, start_load
from csi_pmem.loader.model import ModelView
from csi_pmem.sizes import GiB, describe_size
from csi_pmem.weights.stformat import TensorInfo

log = logging.getLogger(__name__)

#: Extra device memory a batched load may hold by default (two batches of half).
DEFAULT_BUDGET = 1 * GiB


def plan_batches(selection: dict[str, list[TensorInfo]],
                 limit: int) -> list[list[TensorInfo]]:
    """The tensors in volume order, cut into runs of at most ``limit`` bytes each (a
    larger tensor is a run alone). Runs do not cross files: a run within one file is
    one device allocation and, when it is the whole file, checked on the device."""
    batches: list[list[TensorInfo]] = []
    for tensors in selection.values():
        run: list[TensorInfo] = []
        size = 0
        for t in sorted(tensors, key=lambda t: t.offset):
            if run and size + t.nbytes > limit:
                batches.append(run)
                run, size = [], 0
            run.append(t)
            size += t.nbytes
        if run:
            batches.append(run)
    return batches


class BatchedLoad:
    """Iterate ``(name, tensor)`` on ``device``, in volume order, in bounded batches.

    ``budget``: the extra device memory in bytes (two batches of ``budget // 2``).
    ``names``/``predicate`` pick a subset, as in ``start_load``. After the iteration,
    :meth:`verified` waits for every batch's check; ``path`` names the copy path the
    batches took (``node``, ``bounce``, ...), ``nbytes`` and ``seconds`` what moved.
    """

    def __init__(self, view: ModelView, device: str, *, budget: int = DEFAULT_BUDGET,
                 verify: bool = True, names: Iterable[str] | None = None,
                 predicate: Callable[[str], bool] | None = None, loader: Any = None):
        if not device.startswith("cuda"):
            raise ValueError(f"a batched load is for a CUDA device, not {device!r}")
        if budget < 2:
            raise ValueError(f"budget must be a positive number of bytes, not {budget}")
        self.view, self.device, self.verify, self.loader = view, device, verify, loader
        self.budget = budget
        self.batches = plan_batches(view.select(names, predicate), budget // 2)
        self.nbytes = sum(t.nbytes for b in self.batches for t in b)
        self.largest = max((sum(t.nbytes for t in b) for b in self.batches), default=0)
        self.paths: set[str] = set()
        self.seconds: float | None = None
        self._checks: list[Future[None]] = []
        self._used = False

    @property
    def path(self) -> str:
        return "+".join(sorted(self.paths)) or "none"

    @property
    def gbps(self) -> float | None:
        return None if not self.seconds else self.nbytes / self.seconds / 1e9

    def _start(self, batch: list[TensorInfo]) -> LoadHandle:
        handle = start_load(self.view, self.device, names=[t.name for t in batch],
                            verify=self.verify, loader=self.loader)
        self._checks.append(handle.verified)
        return handle

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if self._used:
            raise RuntimeError("a BatchedLoad is iterated once")
        self._used = True
        if self.largest > self.budget // 2:
            log.info("the largest tensor batch is %s, over half the budget of %s: the "
                     "load holds up to %s of device memory beyond the model",
                     describe_size(self.largest), describe_size(self.budget),
                     describe_size(self.largest + self.budget // 2))
        started = time.monotonic()
        ahead: LoadHandle | None = self._start(self.batches[0]) if self.batches else None
        for i, batch in enumerate(self.batches):
            handle, ahead = ahead, None
            assert handle is not None  # started before its turn
            tensors = dict(handle.done.result())  # LoaderError: the copy failed
            self.paths.add(handle.path or "none")
            # From here only the consumer's references keep the batch's memory.
            handle.drop()
            del handle
            for k, t in enumerate(batch):
                tensor = tensors.pop(t.name)
                yield t.name, tensor
                del tensor
                if k == 0 and i + 1 < len(self.batches):
                    ahead = self._start(self.batches[i + 1])
            del tensors
        self.seconds = time.monotonic() - started

    def verified(self, timeout: float | None = None) -> None:
        """Wait for every batch's check; ChecksumError if a chunk does not match."""
        for fut in self._checks:
            fut.result(timeout)

    def settle(self) -> None:
        """Wait for the checks without raising (before the volume is unmapped)."""
        for fut in self._checks:
            fut.exception()
