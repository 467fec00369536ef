"""The safetensors format, parsed from any buffer (a mapping), without the library.

Why our own parser: safetensors and torch open files by name, and a devdax volume has
none (docs/design.md §3). The format is small: an 8-byte little-endian header length, a
JSON header mapping each tensor name to dtype, shape and ``data_offsets`` (relative to
the end of the header), then the data. We validate everything a malicious or truncated
file could get wrong before any view is made over it, because a view past the end of a
mapping is a SIGBUS, not an exception.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from csi_pmem.weights.errors import SafetensorsFormatError

# The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER = 100_000_000
_LEN = struct.Struct("<Q")

# Bits per element of each dtype name the format defines.
BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# numpy has no bf16/fp8/fp4: those stay raw unsigned views of the right width (the
# caller reads the logical dtype from TensorInfo.dtype). Sub-byte types are flat bytes.
NUMPY_DTYPE = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
    "C64": "<c8",
    "BF16": "<u2", "F8_E5M2": "|u1", "F8_E4M3": "|u1", "F8_E8M0": "|u1",
    "F4": "|u1", "F6_E2M3": "|u1", "F6_E3M2": "|u1",
}
SUB_BYTE = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are; ``offset`` is absolute in the buffer parsed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A parsed file: tensors in data order, ``__metadata__``, and where data starts."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    end: int


def _fail(source: str, why: str) -> SafetensorsFormatError:
    return SafetensorsFormatError(f"{source}: not a valid safetensors file: {why}")


def _shape(source: str, name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise _fail(source, f"tensor {name!r} has shape {value!r}")
    return tuple(value)


def _tensor(source: str, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(source, f"entry {name!r} is not an object")
    dtype = entry.get("dtype")
    if dtype not in BITS:
        raise _fail(source, f"tensor {name!r} has unknown dtype {dtype!r}")
    shape = _shape(source, name, entry.get("shape"))
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise _fail(source, f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise _fail(source, f"tensor {name!r} spans bytes [{begin}, {end}) of a data "
                            f"section of {data_len} bytes (truncated file?)")
    bits = math.prod(shape) * BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise _fail(source, f"tensor {name!r}: {dtype} {list(shape)} needs {bits / 8:g} "
                            f"bytes, data_offsets give {end - begin}")
    return TensorInfo(name, dtype, shape, data_start + begin, end - begin)


def _build(source: str, raw: bytes, data_start: int, data_len: int) -> Header:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(source, f"header is not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _fail(source, "header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(source, "__metadata__ must map strings to strings")
    infos = sorted((_tensor(source, n, e, data_start, data_len) for n, e in doc.items()),
                   key=lambda t: (t.offset, t.nbytes))
    for prev, cur in itertools.pairwise(infos):
        if cur.offset < prev.offset + prev.nbytes:
            raise _fail(source, f"tensors {prev.name!r} and {cur.name!r} overlap")
    return Header({t.name: t for t in infos}, metadata, data_start, data_start + data_len)


def _header_len(source: str, head: bytes, length: int) -> int:
    if length < 8 or len(head) < 8:
        raise _fail(source, f"{length} bytes is too short for a header")
    (hlen,) = _LEN.unpack_from(head)
    if hlen > MAX_HEADER or 8 + hlen > length:
        raise _fail(source, f"header length {hlen} does not fit in {length} bytes "
                            "(truncated file?)")
    return hlen


def parse_header(buf: Any, base: int = 0, length: int | None = None,
                 source: str = "<buffer>") -> Header:
    """Parse the safetensors file occupying ``buf[base:base+length]``.

    Offsets in the result are absolute in ``buf``, ready for views over the mapping.
    """
    view = memoryview(buf)
    length = len(view) - base if length is None else length
    if base < 0 or base + length > len(view):
        raise _fail(source, f"bytes [{base}, {base + length}) lie outside the buffer")
    hlen = _header_len(source, bytes(view[base:base + 8]), length)
    raw = bytes(view[base + 8:base + 8 + hlen])
    return _build(source, raw, base + 8 + hlen, length - 8 - hlen)


def read_header(read: Any, size: int, source: str) -> Header:
    """Parse the header of a safetensors file of ``size`` bytes that only ``read(offset,
    length) -> bytes`` reaches (an object in a store, read by range): two reads."""
    hlen = _header_len(source, read(0, min(8, size)), size)
    return _build(source, read(8, hlen), 8 + hlen, size - 8 - hlen)


def read_header_file(path: str) -> Header:
    """Parse a safetensors file on disk (a staging source), reading its header only."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hlen = _header_len(path, f.read(8), size)
        raw = f.read(hlen)
    return _build(path, raw, 8 + hlen, size - 8 - hlen)
