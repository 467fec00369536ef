"""Sizing: the devdax overhead formula against what the kernel gave in QEMU (docs/design.md §4)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import (
    REGION_ALIGN,
    GiB,
    MiB,
    allocation_for,
    devdax_usable,
    format_bytes,
    parse_quantity,
)


def test_usable_matches_kernel_observations():
    # Seen with ndctl create-namespace -m devdax --map=dev in a QEMU guest (kernel 6.1).
    assert devdax_usable(256 * MiB, 2 * MiB) == 250 * MiB
    assert devdax_usable(64 * MiB, 2 * MiB) == 62 * MiB
    assert devdax_usable(2 * GiB, GiB) == GiB  # the struct-page map rounds up to 1 GiB


@given(st.integers(min_value=1, max_value=1 << 42), st.sampled_from([2 * MiB, GiB]))
def test_allocation_is_minimal_and_sufficient(request, align):
    size, usable = allocation_for(request, align)
    assert usable >= request
    assert size % REGION_ALIGN == 0 and size % align == 0
    step = max(align, REGION_ALIGN)
    assert size == step or devdax_usable(size - step, align) < request  # nothing smaller works


@pytest.mark.parametrize("text,value", [("2Gi", 2 * GiB), ("512Mi", 512 * MiB), ("1000", 1000),
                                        ("1G", 10**9), (" 3Ki ", 3072)])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "-1Gi", "1.5Gi", "Gi", "1Gb", "1 G i", "1ki"])
def test_parse_quantity_rejects(text):
    with pytest.raises(InvalidArgument):
        parse_quantity(text)


def test_format_bytes():
    assert [format_bytes(n) for n in (2 * GiB, 250 * MiB, 4097, 0)] == ["2Gi", "250Mi", "4097",
                                                                        "0"]


def test_allocation_rejects_non_positive():
    with pytest.raises(InvalidArgument):
        allocation_for(0, 2 * MiB)
