"""Sizing: the devdax overhead formula against what the kernel gave in QEMU (docs/design.md §4)."""

from fractions import Fraction

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
    human_size,
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


@pytest.mark.parametrize("text,value", [
    ("2Gi", 2 * GiB), ("512Mi", 512 * MiB), ("1000", 1000), ("1G", 10**9), (" 3Ki ", 3072),
    ("16G", 16 * 10**9), ("16Gi", 16 * GiB), ("1.5Gi", 3 * GiB // 2), ("0.5k", 500),
    ("1e9", 10**9), ("1E3", 1000), ("2E", 2 * 10**18), ("1Ei", 1 << 60), ("+1k", 1000),
    ("1.", 1), (".5Ki", 512), ("0", 0), ("2000m", 2)])
def test_parse_quantity_has_kubernetes_semantics(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text,hint", [
    ("", "2Gi"), ("-1Gi", "cannot be negative"), ("Gi", "2Gi"), ("1Gb", "1Gi"),
    ("1 G i", "2Gi"), ("1ki", "1Ki"), ("16g", "16Gi"), ("16GiB", "16Gi"), ("1K", "1Ki"),
    ("500m", "500Mi"), ("1.0001k", "1001"), ("1e-3", "not a whole number of bytes"),
    ("lots", "2Gi")])
def test_parse_quantity_refuses_with_the_value_and_a_good_example(text, hint):
    with pytest.raises(InvalidArgument) as exc:
        parse_quantity(text)
    message = str(exc.value)
    assert f"invalid size {text!r}" in message and hint in message, message


def test_format_bytes():
    assert [format_bytes(n) for n in (2 * GiB, 250 * MiB, 4097, 0)] == ["2Gi", "250Mi", "4097",
                                                                        "0"]


@pytest.mark.parametrize("n, shown", [
    (2 * GiB, "2.0 GiB"), (3 * GiB // 2, "1.5 GiB"), (250 * MiB, "250.0 MiB"),
    (512, "512 bytes"), (1024, "1.0 KiB"),
    # issue 45: capacity's LARGEST VOLUME, then --size 2Gi was OUT_OF_RANGE
    (2111832064, "2014 MiB"),
    (2 * GiB - 1, "1.9 GiB"), (GiB - 1, "1023.9 MiB"), (10**9, "953.6 MiB"),
    (4 * MiB + 224, "4.0 MiB"), (-2111832064, "-2014 MiB"),
])
def test_human_size_never_rounds_up(n, shown):
    assert human_size(n) == shown


@given(st.integers(min_value=0, max_value=1 << 52))
def test_human_size_never_shows_more_than_there_is(n):
    number, unit = human_size(n).split()
    scale = {"bytes": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40,
             "PiB": 1 << 50}[unit]
    shown = Fraction(number) * scale
    assert shown <= n  # exact when whole ("2014 MiB"), else cut down, by under 0.1 unit
    assert "." not in number or n < shown + scale / 10


def test_allocation_rejects_non_positive():
    with pytest.raises(InvalidArgument):
        allocation_for(0, 2 * MiB)
