"""Emulated back end: the same contract as ndctl, on files."""

import os

import pytest

from csi_pmem.driver.backends.emulated import EmulatedBackend, parse_regions
from csi_pmem.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from csi_pmem.sizes import GiB, MiB, devdax_usable


@pytest.fixture
def backend(tmp_path):
    return EmulatedBackend(tmp_path, {0: 256 * MiB, 1: 128 * MiB})


def test_parse_regions():
    assert parse_regions("0=2Gi, 1=1Gi") == {0: 2 * GiB, 1: GiB}
    assert parse_regions("0=100Mi") == {0: 96 * MiB}  # rounded down to the 16 MiB region align
    for bad in ("", "0", "x=1Gi", "0=1Gi,0=1Gi", "0=1Mi"):
        with pytest.raises(InvalidArgument):
            parse_regions(bad)


def test_pools_and_create_destroy(backend):
    pools = {p.name: p for p in backend.pools()}
    assert pools["region0"].numa_node == 0 and pools["region0"].free == 256 * MiB
    ns = backend.create("pmem-x", "region1", 64 * MiB, 2 * MiB)
    expected = (1, 64 * MiB, devdax_usable(64 * MiB, 2 * MiB))
    assert (ns.numa_node, ns.size, ns.usable_size) == expected
    assert os.path.getsize(ns.device) == 64 * MiB
    assert {p.name: p.free for p in backend.pools()}["region1"] == 64 * MiB
    assert [n.name for n in backend.namespaces()] == ["pmem-x"]
    with pytest.raises(AlreadyExists):
        backend.create("pmem-x", "region0", 16 * MiB, 2 * MiB)
    with pytest.raises(ResourceExhausted):
        backend.create("pmem-y", "region1", 80 * MiB, 2 * MiB)
    backend.destroy("pmem-x")
    backend.destroy("pmem-x")  # missing is fine
    assert backend.namespaces() == [] and backend.pools()[1].free == 128 * MiB


def test_fd_maps_from_offset_zero_and_readonly(backend):
    ns = backend.create("pmem-z", "region0", 16 * MiB, 2 * MiB)
    fd = backend.open_device(ns, readonly=True)
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")
    finally:
        os.close(fd)


def test_restart_sees_the_same_namespaces(tmp_path, backend):
    backend.create("pmem-a", "region0", 32 * MiB, 2 * MiB)
    again = EmulatedBackend(tmp_path, {0: 256 * MiB, 1: 128 * MiB})
    assert [n.name for n in again.namespaces()] == ["pmem-a"]


def test_shrunk_configuration_is_reported(tmp_path, backend):
    backend.create("pmem-a", "region0", 64 * MiB, 2 * MiB)
    smaller = EmulatedBackend(tmp_path, {0: 32 * MiB, 1: 128 * MiB})
    pool = smaller.pools()[0]
    assert not pool.usable and "enlarge" in pool.problem
    assert smaller.probe()[0] is True  # region1 still serves
