"""Sizes the driver shows and sizes it accepts must agree (issue 45, item 4).

In-process over the emulated back end: ``capacity`` must never show more than a
CreateVolume can have, and a refusal whose cause is the devdax alignment must say so.
"""

from __future__ import annotations

import grpc
import pytest

from csi_pmem.client import output
from csi_pmem.csi import csi_pb2
from csi_pmem.sizes import GiB, MiB, human_size, parse_quantity

from inprocess import InProcessNode


def details_of(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code(), info.value.details()


@pytest.fixture
def node():
    n = InProcessNode(regions={0: 1536 * MiB})
    yield n
    n.close()


def largest(node: InProcessNode, params=None) -> int:
    cap = node.controller.GetCapacity(csi_pb2.GetCapacityRequest(parameters=params or {}))
    return cap.maximum_volume_size.value


def test_the_largest_volume_shown_is_one_that_can_be_created(node):
    """A 1.5 GiB region offers 1510 MiB to one devdax volume: shown rounded to one
    decimal that was "1.5 GiB", and --size 1.5Gi was then refused."""
    most = largest(node)
    assert most == 1510 * MiB
    shown = output.render("capacity", {"available_capacity": str(most),
                                       "maximum_volume_size": str(most)}, "table")
    assert shown.splitlines()[1].split()[-2:] == ["1510", "MiB"], shown
    number, unit = human_size(most).split()
    asked = parse_quantity(number + unit.removesuffix("B"))  # "1510 MiB" -> 1510Mi
    assert asked == most
    code, _ = details_of(node.create, "too-big", size=3 * GiB // 2)
    assert code == grpc.StatusCode.OUT_OF_RANGE
    assert node.create("fits", size=asked).volume.capacity_bytes >= asked


def test_an_alignment_that_inflates_a_small_volume_is_named_as_the_cause(node):
    code, details = details_of(node.create, "small", size=64 * MiB, params={"align": "1Gi"})
    assert code == grpc.StatusCode.OUT_OF_RANGE
    assert "64.0 MiB rounded up to the 1.0 GiB alignment is 1.0 GiB" in details, details
    assert "more than the largest region on this node (1.5 GiB" in details, details
    assert "use align 2Mi" in details


def test_the_alignment_is_named_when_the_free_space_is_short_too():
    node = InProcessNode(regions={0: 2 * GiB})
    try:
        node.create("first", size=16 * MiB)  # the 2 GiB region is no longer all free
        code, details = details_of(node.create, "small", size=64 * MiB,
                                   params={"align": "1Gi"})
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details.startswith("not enough free DAX memory for a volume of 64.0 MiB"), \
            details
        assert "rounded up to the 1.0 GiB alignment is 1.0 GiB, which takes 2.0 GiB" in details
    finally:
        node.close()


def test_a_request_the_alignment_does_not_change_keeps_the_plain_message(node):
    code, details = details_of(node.create, "big", size=2 * GiB)
    assert code == grpc.StatusCode.OUT_OF_RANGE
    assert "rounded up" not in details and "alignment included" in details
