"""CPU results backed by the mapping itself: no copy, no allocation per tensor.

Why: on a DAX volume the weights already are memory; a CPU "load" is building views.
The mapping is PROT_READ for loads, so a write through one of these views faults
instead of silently altering the staged model, and every view holds a buffer export
of the mapping, so it stays mapped until the last view is freed. numpy has no
bf16/fp8: those come back as raw unsigned views (the logical dtype is in
``TensorInfo.dtype``); torch views get the real dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

from csi_pmem.weights.stformat import NUMPY_DTYPE, SUB_BYTE, TensorInfo
from csi_pmem.weights.volume import Volume

TORCH_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
    "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
    "C64": "complex64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}


def numpy_view(volume: Volume, t: TensorInfo) -> Any:
    import numpy as np

    if t.dtype in SUB_BYTE:
        return np.frombuffer(volume.mapped, np.uint8, t.nbytes, t.offset)
    dtype = np.dtype(NUMPY_DTYPE[t.dtype])
    count = t.nbytes // dtype.itemsize
    return np.frombuffer(volume.mapped, dtype, count, t.offset).reshape(t.shape)


def torch_dtype(name: str) -> Any:
    """The torch dtype for a safetensors dtype; raw uint8 when torch lacks it."""
    import torch

    attr = TORCH_DTYPE_NAMES.get(name)
    return getattr(torch, attr) if attr and hasattr(torch, attr) else torch.uint8


def torch_view(volume: Volume, t: TensorInfo) -> Any:
    import numpy as np
    import torch

    dtype = torch_dtype(t.dtype)
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype)
    # Through numpy, not torch.frombuffer: a numpy array holds a buffer export of the
    # mapping, so Volume.close() cannot unmap it under the tensor; torch.frombuffer
    # only keeps a reference and would leave the tensor dangling after close().
    raw = np.frombuffer(volume.mapped, np.uint8, t.nbytes, t.offset)
    with warnings.catch_warnings():
        # PROT_READ on purpose; torch warns that it cannot protect the buffer.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.from_numpy(raw)
    if dtype is torch.uint8 and t.dtype != "U8":
        return flat  # sub-byte types, or a dtype this torch lacks: flat raw bytes
    return flat.view(dtype).view(t.shape)
