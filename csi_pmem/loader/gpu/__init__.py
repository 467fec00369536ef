"""The GPU load of the pod-side loader: one module per job, layered (pyproject.toml).

- :mod:`.loader`: :class:`GpuLoader`, the choice of path (:func:`choose_path`) and the
  registered and hybrid paths, which share its registrations.
- :mod:`.nodecopy`: the node path, the pod's half of the node's GPU copy service.
- :mod:`.bounce`, :mod:`.pipeline`, :mod:`.native` (and ``_native/``): pinned bounce
  buffers, the Python pipeline and the native loop that fill them.
- :mod:`.registered`: the mapping registered with CUDA in pieces.
- :mod:`.targets`: the device buffers per file and the :class:`~.targets.CopyPlan` that
  reports tensors as they land, for every path.
- :mod:`.chunks`: copy planning, pure arithmetic (placement, transfers, completion).
- :mod:`.streams`: CUDA streams a fresh process can afford.
- :mod:`.verify`, :mod:`.batchcheck`, :mod:`.kernelsum`, :mod:`.devsums`,
  :mod:`.wsum_kernel`: checksums summed on the device.

``from csi_pmem.loader.gpu import GpuLoader`` keeps working. The names are resolved at
first use, not when the package is imported: ``csi_pmem.loader`` imports :mod:`.verify`
with itself, and a CPU-only process must not pay for :mod:`.loader`, which imports
cuda-python's driver module with itself (so that a GPU load does not pay for it on its
clock).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from csi_pmem.loader.gpu.loader import (
        AUTO,
        BOUNCE,
        HYBRID,
        NODE,
        REGISTERED,
        GpuLoader,
        choose_path,
    )

__all__ = ["AUTO", "BOUNCE", "HYBRID", "NODE", "REGISTERED", "GpuLoader", "choose_path"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("csi_pmem.loader.gpu.loader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
