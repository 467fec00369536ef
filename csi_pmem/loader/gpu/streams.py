"""CUDA streams that a fresh process can afford to make inside a load.

Why not ``torch.cuda.Stream``: a process's first one builds torch's stream pool for the
device, 3.7-4.7 ms holding the GIL in fresh processes on an H200 host, and a restarted
pod's load makes its streams while the copy engine waits for the first bytes. A driver
stream (cuda-python, imported with the loader) wrapped in ``torch.cuda.ExternalStream``
took 0.4-0.5 ms. The bounce path's copy stream and the device verifier's stream are
made here; without cuda-python both are torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


def driver_stream(device: Any) -> tuple[Any, Callable[[], None]]:
    """A torch stream on ``device`` (non-blocking, like torch's pool streams), and what
    releases it: waits for the work queued on it, destroys it, releases the primary
    context reference taken for it. The stream must not be used after that."""
    import torch

    try:
        from csi_pmem.gpucopy.cuda import check, driver

        cu = driver()
    except ImportError:
        return torch.cuda.Stream(device=device), lambda: None
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = check(cu, cu.cuDeviceGet(index), "cuDeviceGet")
    ctx = check(cu, cu.cuDevicePrimaryCtxRetain(dev), "retaining the GPU's primary context")
    try:
        check(cu, cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        handle = check(cu, cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value),
                       "cuStreamCreate")
    except BaseException:
        cu.cuDevicePrimaryCtxRelease(dev)
        raise

    def release() -> None:
        # Also after a failure with work still queued: it finishes first (the buffers
        # it reads or writes are about to be dropped).
        with contextlib.suppress(Exception):
            cu.cuStreamSynchronize(handle)
        with contextlib.suppress(Exception):
            cu.cuStreamDestroy(handle)
        with contextlib.suppress(Exception):
            cu.cuDevicePrimaryCtxRelease(dev)

    return torch.cuda.ExternalStream(int(handle), device=device), release
