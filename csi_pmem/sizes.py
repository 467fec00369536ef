"""Quantities, alignment and the devdax usable-size arithmetic.

Why this module exists: a devdax namespace keeps its struct-page map on the device
(``map=dev``), so a namespace of N bytes offers less than N to the client (a 256 MiB
namespace gives 250 MiB, see docs/design.md §4). The driver promises that a pod always
gets at least what it asked for, so it must over-allocate by exactly the metadata and
alignment the kernel will take. The formula mirrors ``nd_pfn_init()`` in
``drivers/nvdimm/pfn_devs.c``: an 8 KiB info block, 64 bytes of struct page per 4 KiB
page, the data offset rounded up to the devdax alignment.
"""

from __future__ import annotations

import re

from csi_pmem.errors import InvalidArgument

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

REGION_ALIGN = 16 * MiB  # libnvdimm region alignment (per interleave way)
PAGE_SIZE = 4096
INFO_BLOCK = 8 * KiB
STRUCT_PAGE = 64
DEVDAX_ALIGNS = {"2Mi": 2 * MiB, "1Gi": GiB}

_SUFFIX = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": KiB, "Mi": MiB, "Gi": GiB, "Ti": TiB,
}
_QUANTITY = re.compile(r"^\s*(\d+)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?\s*$")


def parse_quantity(text: str) -> int:
    """Parse a Kubernetes-style byte quantity ("2Gi", "512Mi", "1000000")."""
    m = _QUANTITY.match(str(text))
    if not m:
        raise InvalidArgument(
            f"invalid size {text!r}: use an integer with an optional suffix "
            "(Ki, Mi, Gi, Ti, K, M, G, T), for example 2Gi")
    return int(m.group(1)) * _SUFFIX[m.group(2) or ""]


def format_bytes(n: int) -> str:
    """Render bytes with the largest exact binary suffix ("2Gi", "250Mi", "4097")."""
    for suffix, unit in (("Ti", TiB), ("Gi", GiB), ("Mi", MiB), ("Ki", KiB)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def round_down(n: int, align: int) -> int:
    return n // align * align


def devdax_usable(size: int, align: int) -> int:
    """Bytes a client can map from a devdax namespace of ``size`` bytes (map=dev)."""
    if size <= INFO_BLOCK:
        return 0
    npfns = (size - INFO_BLOCK) // PAGE_SIZE
    offset = round_up(INFO_BLOCK + STRUCT_PAGE * npfns, align)
    return max(0, round_down(size - offset, align))


def allocation_step(align: int, region_align: int = REGION_ALIGN) -> int:
    """Granularity of namespace sizes: a multiple of both the region and devdax aligns."""
    import math

    return math.lcm(align, region_align)


def allocation_for(request: int, align: int, region_align: int = REGION_ALIGN) -> tuple[int, int]:
    """Smallest (namespace size, usable size) whose usable size is at least ``request``.

    ``request`` must be positive. The search starts at an estimate that already
    includes the 1/64 struct-page overhead, so it takes one or two steps.
    """
    if request <= 0:
        raise InvalidArgument(f"requested size must be positive, got {request}")
    step = allocation_step(align, region_align)
    size = round_up(request + request // 63 + INFO_BLOCK, step)
    size = max(step, size - 2 * step)
    while devdax_usable(size, align) < request:
        size += step
    return size, devdax_usable(size, align)
