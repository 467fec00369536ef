"""CPU results backed by the volume itself: no copy, no allocation per tensor.

Why: on a DAX volume the weights already are memory; a CPU "load" is building views.
Ordinary code writes into the tensors it gets (``mul_``, ``nn.init``, fine-tuning), so
what a write does is chosen by ``writes`` (:data:`WRITES`):

- ``"private"``: views of a copy-on-write mapping (:meth:`Volume.private_mapping`): a
  write copies the page it touches into the process's own memory; the volume keeps the
  staged bytes. Files (tmpfs, fsdax images) and block devices.
- ``"copy"``: each tensor is copied into ordinary memory (the model's size in RAM).
- ``"readonly"``: views of the shared read-only mapping. Zero copy on every medium, but
  torch cannot refuse a write into one: the write kills the process (SIGSEGV). Only on
  request, for code that only reads (vLLM's weight loaders copy from them).
- ``"auto"`` (the default): ``"private"`` where the volume allows it, else ``"copy"``
  (devdax, hugetlbfs), so that no write a user may legally try can crash the process.

numpy arrays are read-only views whatever the mode (numpy raises ``ValueError`` on a
write), unless ``"private"`` or ``"copy"`` is asked explicitly. Every view holds a
buffer export of its mapping, so it stays mapped until the last view is freed. numpy
has no bf16/fp8: those come back as raw unsigned views (the logical dtype is in
``TensorInfo.dtype``); torch views get the real dtype.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from csi_pmem.weights.errors import LoaderError, VolumeError
from csi_pmem.weights.stformat import NUMPY_DTYPE, SUB_BYTE, TensorInfo
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

WRITES = ("auto", "private", "copy", "readonly")


def resolve_writes(volume: Volume, writes: str, framework: str) -> str:
    """The mode a CPU load runs in (never ``"auto"``); refuses what the volume cannot
    do, saying why and what to pick instead."""
    if writes not in WRITES:
        raise LoaderError(f"writes={writes!r} is not one of {', '.join(WRITES)}")
    if writes == "auto":
        if framework == "numpy":
            return "readonly"  # numpy refuses writes to a read-only view itself
        if volume.private_refused_reason is None:
            return "private"
        log.info("%s: CPU tensors are copies in ordinary memory, since %s; pass "
                 "writes='readonly' for zero-copy views that must never be written",
                 volume.source, volume.private_refused_reason)
        return "copy"
    if writes == "private" and volume.private_refused_reason is not None:
        raise LoaderError(f"writes='private' is not possible on {volume.source}: "
                          f"{volume.private_refused_reason}; use writes='copy' (writable "
                          "copies) or writes='readonly' (zero-copy, never written)")
    return writes


def source(volume: Volume, writes: str) -> Any:
    """The mapping the views of ``writes`` are made of (a rank's copier finds a slice's
    volume offset from its address in it)."""
    if writes == "private":
        try:
            return volume.private_mapping()
        except VolumeError as exc:
            raise LoaderError(f"{exc}; load with writes='copy' or writes='readonly'") \
                from exc
    return volume.mapped

TORCH_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
    "C64": "complex64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}


def numpy_view(volume: Volume, t: TensorInfo, writes: str = "readonly") -> Any:
    import numpy as np

    buf = source(volume, writes)
    if t.dtype in SUB_BYTE:
        out = np.frombuffer(buf, np.uint8, t.nbytes, t.offset)
    else:
        dtype = np.dtype(NUMPY_DTYPE[t.dtype])
        count = t.nbytes // dtype.itemsize
        out = np.frombuffer(buf, dtype, count, t.offset).reshape(t.shape)
    return out.copy() if writes == "copy" else out


def torch_dtype(name: str) -> Any:
    """The torch dtype for a safetensors dtype; raw uint8 when torch lacks it."""
    import torch

    attr = TORCH_DTYPE_NAMES.get(name)
    return getattr(torch, attr) if attr and hasattr(torch, attr) else torch.uint8


def torch_view(volume: Volume, t: TensorInfo, writes: str = "readonly") -> Any:
    import numpy as np
    import torch

    dtype = torch_dtype(t.dtype)
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype)
    # Through numpy, not torch.frombuffer: a numpy array holds a buffer export of the
    # mapping, so Volume.close() cannot unmap it under the tensor; torch.frombuffer
    # only keeps a reference and would leave the tensor dangling after close().
    raw = np.frombuffer(source(volume, writes), np.uint8, t.nbytes, t.offset)
    if writes == "copy":
        flat = torch.from_numpy(raw.copy())
    elif writes == "private":
        flat = torch.from_numpy(raw)  # writable: a write copies its page
    else:
        with warnings.catch_warnings():
            # "readonly" was asked for: torch warns that it cannot protect the buffer.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.from_numpy(raw)
    if dtype is torch.uint8 and t.dtype != "U8":
        return flat  # sub-byte types, or a dtype this torch lacks: flat raw bytes
    return flat.view(dtype).view(t.shape)
