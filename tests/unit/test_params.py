"""StorageClass parameters: defaults, validation, and the CO-added prefix."""

import pytest

from csi_pmem.driver import params
from csi_pmem.driver.params import VolumeParams, parse
from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import GiB, MiB


def test_defaults():
    p = parse({})
    assert p == VolumeParams(device_mode="devdax", numa_node=None, align=2 * MiB,
                             erase_on_delete=True)
    assert p.to_dict() == {"deviceMode": "devdax", "numaNode": "auto", "align": "2Mi",
                           "eraseOnDelete": "true"}


def test_explicit_values():
    p = parse({"numaNode": "1", "align": "1Gi", "eraseOnDelete": "false",
               "csi.storage.k8s.io/pvc/name": "claim"})
    assert (p.numa_node, p.align, p.erase_on_delete) == (1, GiB, False)
    assert p.co_labels == {"csi.storage.k8s.io/pvc/name": "claim"}


def test_fsdax():
    p = parse({"deviceMode": "fsdax", "numaNode": "0", "eraseOnDelete": "false"})
    assert (p.device_mode, p.numa_node, p.align, p.erase_on_delete) == ("fsdax", 0, 2 * MiB,
                                                                      False)
    assert p.to_dict()["deviceMode"] == "fsdax"


@pytest.mark.parametrize("params,needle", [
    ({"numa": "0"}, "valid parameters are deviceMode, numaNode, align, eraseOnDelete"),
    ({"deviceMode": "fsdax", "align": "2Mi"}, "apply to deviceMode devdax only"),
    ({"deviceMode": "fsdax", "align": "1Gi"}, "fsdax volumes always use the 2Mi"),
    ({"deviceMode": "FSDAX"}, "valid values: devdax"),
    ({"deviceMode": "raw"}, "deviceMode"),
    ({"numaNode": "-1"}, "non-negative integer"),
    ({"numaNode": "one"}, "non-negative integer"),
    ({"numaNode": "١"}, "non-negative integer"),  # noqa: RUF001 (a non-ASCII digit, on purpose)
    ({"align": "4Ki"}, "2Mi or 1Gi"),
    ({"eraseOnDelete": "sure"}, "true"),
])
def test_invalid(params, needle):
    with pytest.raises(InvalidArgument) as info:
        parse(params)
    assert needle in str(info.value)


def test_compatible_with_is_one_rule_for_create_and_validate():
    stored = params.parse({"numaNode": "auto"}).to_dict()  # created with auto ...
    assert params.parse({}).compatible_with(stored, 1) == []          # auto: any node
    assert params.parse({"numaNode": "1"}).compatible_with(stored, 1) == []  # ... landed on 1
    assert params.parse({"numaNode": "0"}).compatible_with(stored, 1) == [
        "numaNode: the volume's '1', requested '0'"]
    problems = params.parse({"align": "1Gi"}).compatible_with(stored, 1)
    assert problems == ["align: the volume's '2Mi', requested '1Gi'"]
    fsdax = params.parse({"deviceMode": "fsdax"})
    assert fsdax.compatible_with(stored, 0)[0].startswith("deviceMode:")
