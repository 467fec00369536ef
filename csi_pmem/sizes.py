"""Quantities, alignment and the devdax usable-size arithmetic.

Why this module exists: a devdax namespace keeps its struct-page map on the device
(``map=dev``), so a namespace of N bytes offers less than N to the client (a 256 MiB
namespace gives 250 MiB, see docs/design.md §4). The driver promises that a pod always
gets at least what it asked for, so it must over-allocate by exactly the metadata and
alignment the kernel will take. The formula mirrors ``nd_pfn_init()`` in
``drivers/nvdimm/pfn_devs.c``: an 8 KiB info block, 64 bytes of struct page per 4 KiB
page, the data offset rounded up to the devdax alignment.

Every size a user types (``csi-pmem volume create --size``, ``--emulated-regions``,
``csi-pmem-weights stage --size``) is a Kubernetes quantity read by
:func:`parse_quantity`, because users write the same numbers in manifests: ``16G`` is
16·10⁹ bytes, ``16Gi`` is 16 GiB, and ``500m`` is half a byte (refused). Standard
library only: the weight loader and its CLI share this module with the driver.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

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

# Kubernetes' resource.Quantity (k8s.io/apimachinery/pkg/api/resource/quantity.go):
#   <quantity> ::= <signedNumber><suffix>;  <number> ::= <digits> | <digits>.<digits>
#                  | <digits>. | .<digits>
#   <suffix>   ::= <binarySI> | <decimalExponent> | <decimalSI>
#   <binarySI> ::= Ki | Mi | Gi | Ti | Pi | Ei;  <decimalSI> ::= m | "" | k | M | G | T | P | E
#   <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>
# No library: the Kubernetes client is far too big a dependency for the loader's pods.
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -1, "": 0, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
_QUANTITY = re.compile(
    r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|m|k|M|G|T|P|E)?")
# What people type instead: 16GB, 16g, 16gi, 16GiB, 16K.
_NEAR_MISS = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgtpe])i?b?", re.IGNORECASE)

_GRAMMAR = ("a Kubernetes quantity: a number with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei "
            "(powers of 1024) or k, M, G, T, P, E (powers of 1000)")


def parse_quantity(text: str) -> int:
    """A byte count from a Kubernetes quantity ("2Gi", "512Mi", "16G", "1.5Gi", "1e9").

    Raises :class:`InvalidArgument` naming ``text`` and a good example when the text is
    not a quantity, is negative, or is not a whole number of bytes ("500m" is 0.5).
    """
    raw = str(text)
    m = _QUANTITY.fullmatch(raw.strip())
    if not m:
        raise InvalidArgument(f"invalid size {raw!r}: use {_GRAMMAR}, for example "
                              f"{_suggest(raw.strip())}")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix in _BINARY:
        value *= 1024 ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= Fraction(1000) ** _DECIMAL[suffix]
    else:  # an exponent: e9, E-3
        value *= Fraction(10) ** int(suffix[1:])
    if sign == "-" and value:
        raise InvalidArgument(f"invalid size {raw!r}: a size cannot be negative; for "
                              f"example {number}{suffix}")
    if value.denominator != 1:
        hint = (f"'m' means milli (a thousandth) in Kubernetes quantities; for {number} "
                f"mebibytes write {number}Mi" if suffix == "m" else
                f"for example {math.ceil(value)}")
        raise InvalidArgument(f"invalid size {raw!r}: that is {float(value):g} bytes, not "
                              f"a whole number of bytes ({hint})")
    return int(value)


def _suggest(text: str) -> str:
    """The quantity the user probably meant ("16gb" -> "16Gi"), else a plain example."""
    m = _NEAR_MISS.fullmatch(text)
    if not m:
        return "2Gi"
    return f"{m.group(1)}{m.group(2).upper()}i"


def format_bytes(n: int) -> str:
    """Render bytes with the largest exact binary suffix ("2Gi", "250Mi", "4097")."""
    for suffix, unit in (("Ti", TiB), ("Gi", GiB), ("Mi", MiB), ("Ki", KiB)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


_UNITS = (("PiB", 1 << 50), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def human_size(n: int) -> str:
    """Bytes for people, in binary units with one decimal ("2.0 GiB", "250.0 MiB",
    "512 bytes"): what tables and messages show, beside the exact count where it matters
    (:func:`describe_size`).

    Never rounded up: a size a user reads as "how much there is" must not promise more
    (issue 45: 2111832064 bytes showed as "2.0 GiB", and a 2Gi volume did not fit). A
    size that one decimal cannot say exactly is a whole number of the next smaller
    unit where it is one ("2014 MiB", which a user can type as 2014Mi), else cut
    down to one decimal ("1.9 GiB").
    """
    for i, (unit, scale) in enumerate(_UNITS):
        if abs(n) >= scale:
            tenths, rest = divmod(abs(n) * 10, scale)
            sign = "-" if n < 0 else ""
            if rest and i + 1 < len(_UNITS) and n % _UNITS[i + 1][1] == 0:
                smaller, sub = _UNITS[i + 1]
                return f"{sign}{abs(n) // sub} {smaller}"
            return f"{sign}{tenths // 10}.{tenths % 10} {unit}"
    return f"{n} bytes"


def describe_size(n: int) -> str:
    """Bytes in a message a user acts on: readable and exact ("1.0 GiB (1073741824 bytes)")."""
    readable = human_size(n)
    return readable if abs(n) < KiB else f"{readable} ({n} bytes)"


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (integers only: no float error)."""
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
