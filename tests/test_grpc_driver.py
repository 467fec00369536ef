"""The driver over real gRPC on a unix socket, with real tmpfs mounts and fd passing."""

from __future__ import annotations

import json
import mmap
import os

import grpc
import pytest

from csi_pmem.csi import csi_pb2
from csi_pmem.daxclient import DaxSocketError, open_volume
from csi_pmem.sizes import allocation_for

from conftest import GiB, MiB, Mode, block_cap, eventually, mount_cap, needs_root

pytestmark = needs_root()


def code_of(call, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code()


def test_identity(driver):
    info = driver.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == "csi-pmem.io" and info.vendor_version
    caps = driver.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    types = {c.service.type for c in caps.capabilities}
    assert types == {csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE,
                     csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS}
    assert driver.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True


def test_node_info_topology_and_limits(driver):
    info = driver.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
    assert info.node_id == "test-node"
    assert dict(info.accessible_topology.segments) == {"csi-pmem.io/node": "test-node"}
    assert info.max_volumes_per_node == 2 * 510


@pytest.mark.parametrize("size", [1, 62 * MiB, 63 * MiB, 250 * MiB, 251 * MiB])
@pytest.mark.parametrize("align", ["2Mi", "1Gi"])
def test_usable_size_never_below_request(driver_factory, size, align):
    d = driver_factory(regions="0=3Gi").start()
    vol = d.create(f"v-{size}-{align}", size=size, params={"align": align}).volume
    assert vol.capacity_bytes >= size
    assert vol.capacity_bytes == allocation_for(size, 1 << 30 if align == "1Gi" else 2 * MiB)[1]
    assert vol.volume_context["align"] == align
    d.delete(vol.volume_id)


def test_create_is_idempotent_and_checks_compatibility(driver):
    a = driver.create("same", size=100 * MiB, params={"numaNode": "1"}).volume
    b = driver.create("same", size=100 * MiB, params={"numaNode": "1"}).volume
    assert a == b
    auto = driver.create("same", size=90 * MiB).volume  # auto matches the chosen pool
    assert auto.volume_id == a.volume_id
    assert code_of(driver.create, "same", size=200 * MiB) == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(driver.create, "same", size=100 * MiB, params={"numaNode": "0"}) == \
        grpc.StatusCode.ALREADY_EXISTS
    assert code_of(driver.create, "same", size=100 * MiB, params={"align": "1Gi"}) == \
        grpc.StatusCode.ALREADY_EXISTS


def test_numa_placement_and_capacity(driver):
    before = {n: driver.capacity({"numaNode": str(n)}).available_capacity for n in (0, 1)}
    assert before[0] == before[1] > 0
    vol = driver.create("numa1", size=200 * MiB, params={"numaNode": "1"}).volume
    assert vol.volume_context["numaNode"] == "1"
    after = {n: driver.capacity({"numaNode": str(n)}).available_capacity for n in (0, 1)}
    assert after[0] == before[0]
    assert before[1] - after[1] >= 200 * MiB
    total = driver.capacity()
    assert total.available_capacity == after[0] + after[1]
    assert total.maximum_volume_size.value == after[0]  # the emptier pool
    # A NUMA node this node lacks: zero capacity, and RESOURCE_EXHAUSTED on create.
    assert driver.capacity({"numaNode": "7"}).available_capacity == 0
    assert code_of(driver.create, "numa7", params={"numaNode": "7"}) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    driver.delete(vol.volume_id)
    eventually(lambda: {n: driver.capacity({"numaNode": str(n)}).available_capacity
                        for n in (0, 1)} == before, "the deleted volume's space to be erased")


def test_size_errors(driver):
    assert code_of(driver.create, "huge", size=2 * GiB) == grpc.StatusCode.OUT_OF_RANGE
    big = driver.create("big", size=900 * MiB, params={"numaNode": "0"}).volume
    assert code_of(driver.create, "big2", size=900 * MiB, params={"numaNode": "0"}) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(driver.create, "lim", size=100 * MiB, limit=50 * MiB) == \
        grpc.StatusCode.INVALID_ARGUMENT
    # With 1Gi align sizes come in 1 GiB steps: nothing fits under a 10 MiB limit.
    assert code_of(driver.create, "lim2", size=1, limit=10 * MiB, params={"align": "1Gi"}) \
        == grpc.StatusCode.OUT_OF_RANGE
    # required == limit: the region align over-allocates, the volume advertises the limit.
    exact = driver.create("exact", size=64 * MiB, limit=64 * MiB, params={"numaNode": "1"})
    assert exact.volume.capacity_bytes == 64 * MiB
    assert exact.volume.volume_context["usableSize"] == str(64 * MiB)
    driver.delete(exact.volume.volume_id)
    assert code_of(driver.controller.CreateVolume, csi_pb2.CreateVolumeRequest(
        name="nosize", volume_capabilities=[mount_cap()])) == grpc.StatusCode.INVALID_ARGUMENT
    driver.delete(big.volume_id)


def test_block_on_devdax_is_refused_with_reason(driver):
    with pytest.raises(grpc.RpcError) as info:
        driver.create("blk", caps=[block_cap()])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loop" in info.value.details() and "Filesystem" in info.value.details()
    vol = driver.create("fsvol").volume
    resp = driver.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id,
                                                  volume_capabilities=[block_cap()]))
    assert not resp.HasField("confirmed") and "loop" in resp.message
    ok = driver.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id,
                                                  volume_capabilities=[mount_cap()]))
    assert ok.HasField("confirmed")
    assert code_of(driver.publish, vol.volume_id, driver.target("p"), cap=block_cap()) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_parameters_are_validated(driver):
    with pytest.raises(grpc.RpcError) as info:
        driver.create("bad", params={"numaNod": "0"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "numaNode" in info.value.details()  # the valid names are listed
    with pytest.raises(grpc.RpcError) as info:
        driver.create("fs", params={"deviceMode": "fsdax", "align": "2Mi"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "devdax only" in info.value.details()  # align is a devdax parameter
    for bad in ({"align": "4Ki"}, {"numaNode": "-1"}, {"eraseOnDelete": "maybe"}):
        assert code_of(driver.create, "bad", params=bad) == grpc.StatusCode.INVALID_ARGUMENT
    vol = driver.create("co-keys", params={"csi.storage.k8s.io/pvc/name": "claim"}).volume
    assert vol.volume_id


def test_requisite_topology_excluding_this_node(driver):
    other = csi_pb2.Topology(segments={"csi-pmem.io/node": "elsewhere"})
    req = csi_pb2.TopologyRequirement(requisite=[other], preferred=[other])
    assert code_of(driver.create, "topo", accessibility_requirements=req) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    here = csi_pb2.Topology(segments={"csi-pmem.io/node": "test-node"})
    vol = driver.create("topo", accessibility_requirements=csi_pb2.TopologyRequirement(
        requisite=[other, here])).volume
    assert dict(vol.accessible_topology[0].segments) == {"csi-pmem.io/node": "test-node"}
    gone = driver.controller.GetCapacity(csi_pb2.GetCapacityRequest(accessible_topology=other))
    assert gone.available_capacity == 0


def test_publish_delivers_fd_and_metadata(driver):
    vol = driver.create("pub", size=64 * MiB, params={"numaNode": "1"}).volume
    target = driver.target("pod-a")
    driver.publish(vol.volume_id, target, context={"csi.storage.k8s.io/pod.uid": ""})
    meta = json.loads(open(os.path.join(target, "volume.json")).read())
    assert meta["volume_id"] == vol.volume_id and meta["numa_node"] == 1
    assert meta["usable_size"] == vol.capacity_bytes and meta["readonly"] is False
    got, fd = open_volume(target)
    try:
        assert got == meta
        with mmap.mmap(fd, got["usable_size"], mmap.MAP_SHARED) as mm:
            mm[:5] = b"hello"
            mm[-5:] = b"world"
    finally:
        os.close(fd)
    # Publishing again with the same options is a no-op; with other options it conflicts.
    driver.publish(vol.volume_id, target)
    assert code_of(driver.publish, vol.volume_id, target, readonly=True) == \
        grpc.StatusCode.ALREADY_EXISTS
    # Deleting a published volume is refused.
    assert code_of(driver.delete, vol.volume_id) == grpc.StatusCode.FAILED_PRECONDITION
    stats = driver.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=target))
    assert stats.usage[0].total == vol.capacity_bytes and not stats.volume_condition.abnormal
    driver.unpublish(vol.volume_id, target)
    assert not os.path.exists(target)
    driver.unpublish(vol.volume_id, target)  # idempotent
    driver.delete(vol.volume_id)
    driver.delete(vol.volume_id)  # idempotent


def test_publish_targets_are_checked(driver, tmp_path):
    vol = driver.create("tgt").volume
    for bad in ["relative/path", "/", str(tmp_path / "outside"), driver.target("x") + "/../y",
                str(driver.kubelet)]:
        assert code_of(driver.publish, vol.volume_id, bad) == grpc.StatusCode.INVALID_ARGUMENT
    busy = driver.target("busy")
    os.makedirs(busy)
    open(os.path.join(busy, "data"), "w").close()
    assert code_of(driver.publish, vol.volume_id, busy) == grpc.StatusCode.FAILED_PRECONDITION
    assert os.path.exists(os.path.join(busy, "data"))
    assert code_of(driver.publish, "pmem-" + "0" * 32, driver.target("nf")) == \
        grpc.StatusCode.NOT_FOUND


def test_readonly_publish_cannot_be_mapped_writable(driver):
    vol = driver.create("ro").volume
    target = driver.target("ro-pod")
    driver.publish(vol.volume_id, target, readonly=True)
    meta, fd = open_volume(target)
    try:
        assert meta["readonly"] is True
        with pytest.raises(PermissionError):
            mmap.mmap(fd, meta["usable_size"], mmap.MAP_SHARED,
                      mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with mmap.mmap(fd, meta["usable_size"], mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[:4] == b"\0\0\0\0"
    finally:
        os.close(fd)
    # The published directory itself is sealed read-only.
    with pytest.raises(OSError):
        open(os.path.join(target, "volume.json"), "w")
    driver.unpublish(vol.volume_id, target)


def test_socket_refuses_peer_from_another_pod(driver):
    vol = driver.create("authz").volume
    target = driver.target("pod-b")
    driver.publish(vol.volume_id, target,
                   context={"csi.storage.k8s.io/pod.uid": "0b0e4c1e-1111-2222-3333-444455556666"})
    with pytest.raises(DaxSocketError) as info:
        open_volume(target)  # the test process is not in that pod's cgroup
    assert "pod" in str(info.value)
    driver.unpublish(vol.volume_id, target)


def test_erase_new_volume_over_deleted_space_reads_zeros(driver_factory):
    d = driver_factory(regions="0=64Mi").start()
    for round_ in range(2):
        vol = d.create(f"e{round_}", size=48 * MiB).volume
        target = d.target(f"erase{round_}")
        d.publish(vol.volume_id, target)
        meta, fd = open_volume(target)
        try:
            with mmap.mmap(fd, meta["usable_size"], mmap.MAP_SHARED) as mm:
                assert mm[:] == b"\0" * meta["usable_size"], "new volume must read as zeros"
                mm[:] = b"\xa5" * meta["usable_size"]
        finally:
            os.close(fd)
        d.unpublish(vol.volume_id, target)
        d.delete(vol.volume_id)
    assert d.pool_files() == []


def test_restart_serves_published_sockets_again(driver):
    vol = driver.create("restart").volume
    target = driver.target("pod-r")
    driver.publish(vol.volume_id, target)
    driver.kill()  # SIGKILL: the tmpfs stays, the listener dies
    with pytest.raises(DaxSocketError):
        open_volume(target, timeout=2)
    driver.start()
    meta, fd = open_volume(target)
    os.close(fd)
    assert meta["volume_id"] == vol.volume_id
    driver.unpublish(vol.volume_id, target)
    driver.delete(vol.volume_id)


def test_list_volumes_paginates_with_condition(driver):
    ids = sorted(driver.create(f"list-{i}", size=16 * MiB).volume.volume_id for i in range(5))
    resp = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=2))
    assert len(resp.entries) == 2 and resp.next_token
    assert driver.list_ids() == ids
    assert code_of(driver.controller.ListVolumes,
                   csi_pb2.ListVolumesRequest(starting_token="bogus")) == grpc.StatusCode.ABORTED
    # A vanished device shows up as an abnormal condition.
    victim = driver.pool_files()[0]
    victim.unlink()
    resp = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest())
    abnormal = [e for e in resp.entries if e.status.volume_condition.abnormal]
    assert len(abnormal) == 1 and "disappeared" in abnormal[0].status.volume_condition.message


def test_access_modes(driver):
    multi = mount_cap(Mode.MULTI_NODE_MULTI_WRITER)
    assert code_of(driver.create, "multi", caps=[multi]) == grpc.StatusCode.INVALID_ARGUMENT
    vol = driver.create("single", caps=[mount_cap(Mode.SINGLE_NODE_SINGLE_WRITER)]).volume
    cap = mount_cap(Mode.SINGLE_NODE_SINGLE_WRITER)
    driver.publish(vol.volume_id, driver.target("w1"), cap=cap)
    assert code_of(driver.publish, vol.volume_id, driver.target("w2"), cap=cap) == \
        grpc.StatusCode.FAILED_PRECONDITION
    driver.unpublish(vol.volume_id, driver.target("w1"))


def test_validate_matches_resolved_numa_node(driver):
    vol = driver.create("auto-numa", size=16 * MiB).volume  # numaNode: auto
    node = vol.volume_context["numaNode"]
    other = "1" if node == "0" else "0"

    def validate(params):
        return driver.controller.ValidateVolumeCapabilities(
            csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id=vol.volume_id, volume_capabilities=[mount_cap()], parameters=params))

    assert validate({"numaNode": node}).HasField("confirmed")
    assert validate({"numaNode": "auto"}).HasField("confirmed")
    refused = validate({"numaNode": other})
    assert not refused.HasField("confirmed") and "numaNode" in refused.message
    assert code_of(driver.controller.GetCapacity, csi_pb2.GetCapacityRequest(
        parameters={"bogus": "1"}, volume_capabilities=[block_cap()])) == \
        grpc.StatusCode.INVALID_ARGUMENT
