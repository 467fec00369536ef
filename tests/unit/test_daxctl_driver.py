"""The driver over the daxctl back end, in-process: the same servicers, Driver, dax.sock
and fake mounter as tests/unit/inprocess.py, with the daxctl back end over the fake
kernel of tests/unit/fake_daxctl.py (each dax device a sparse file, mapped through
dax.sock like ``/dev/daxX.Y``). Covers the core workflow, erase before reuse, read-only
publications, identity across a driver restart, a lost device after a reboot carved
again by the volatile recovery, the ``media`` parameter, and set-up states."""

from __future__ import annotations

import grpc
import pytest
from fake_daxctl import FakeDaxKernel

from csi_pmem.csi import csi_pb2
from csi_pmem.daxclient import map_volume
from csi_pmem.driver.backends.daxctl import DaxctlBackend
from csi_pmem.driver.metrics import PoolCollector

from conftest import MiB, block_cap, mount_cap
from inprocess import PATTERN, InProcessNode, code_of, made_nodes, read_head, write_pattern

POD = "0b5e7c5e-3333-4a4a-9c9c-000000000003"


class DaxNode(InProcessNode):
    """An in-process node whose pools are dynamic dax regions 0 and 1 (NUMA 0 and 1)."""

    def __init__(self, boot_device: str | None = None, setup: str = "off", **kw) -> None:
        self.boot_device, self.setup = boot_device, setup
        super().__init__(**kw)

    def make_backend(self) -> DaxctlBackend:
        """The daxctl back end over the fake kernel, made at the first start; a restart
        keeps the kernel (its regions and devices), as a node does."""
        if not hasattr(self, "kernel"):
            self.kernel = FakeDaxKernel(self.base / "dev", self.proc)
            for rid in (0, 1):
                self.kernel.add_region(rid, 512 * MiB, target_node=rid,
                                       boot_device=self.boot_device)
            for node, cpus in ((0, "0-1"), (1, "2-3")):
                path = self.base / f"sys/devices/system/node/node{node}/cpulist"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(cpus + "\n")
        return DaxctlBackend(runner=self.kernel, sysfs_root=self.base / "sys",
                             proc_root=self.proc, dev_root=self.base / "dev",
                             state_path=self.state / "daxctl-devices.json",
                             setup=self.setup, cache_seconds=0)

    def reboot(self) -> DaxNode:
        self.stop()
        self.fake.reboot()
        self.kernel.reboot()
        return self.start()

    def device_of(self, vid: str) -> str:
        ns = self.backend.get(vid)
        assert ns is not None
        return ns.device


@pytest.fixture
def nodes():
    yield from made_nodes(DaxNode)


def capacity(node: DaxNode, **params: str) -> int:
    return node.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        parameters=params, volume_capabilities=[mount_cap()])).available_capacity


def test_core_workflow_on_dax_devices(nodes):
    node = nodes()
    assert capacity(node) == 1024 * MiB  # no metadata on the memory: all of it usable
    vol = node.create("v1", size=64 * MiB, params={"numaNode": "1"}).volume
    assert vol.capacity_bytes == 64 * MiB
    assert vol.volume_context["pool"] == "dax1"
    assert node.device_of(vol.volume_id).endswith("/dev/dax1.1")
    node.pod(POD)
    target = node.target("pod-a")
    node.publish(vol.volume_id, target, pod_uid=POD)
    write_pattern(target)
    assert read_head(target) == PATTERN
    ro = node.target("pod-ro")
    node.publish(vol.volume_id, ro, readonly=True, pod_uid=POD)
    with pytest.raises(Exception, match="read-only"):
        map_volume(ro, writable=True)
    assert read_head(ro) == PATTERN
    node.unpublish(vol.volume_id, ro)
    node.unpublish(vol.volume_id, target)

    # Erase before reuse: the device reads as zeros when it is destroyed.
    seen: list[bytes] = []
    destroy = node.kernel._destroy_device

    handle = node.backend.get(vol.volume_id).handle

    def look(argv):
        if argv[-1] == handle:  # not the scrubs' scratch devices
            seen.append((node.base / "dev" / handle).read_bytes()[:len(PATTERN)])
        return destroy(argv)

    node.kernel._destroy_device = look  # type: ignore[method-assign]
    node.delete(vol.volume_id)
    assert node.driver.eraser.wait(vol.volume_id, 60)  # the erase may finish after the RPC
    assert seen == [bytes(len(PATTERN))]
    assert node.backend.get(vol.volume_id) is None


def test_a_driver_restart_keeps_each_volume_on_its_device(nodes):
    node = nodes()
    vid = node.create("v1").volume.volume_id
    node.pod(POD)
    target = node.target("pod-a")
    node.publish(vid, target, pod_uid=POD)
    write_pattern(target)
    device = node.device_of(vid)
    node.restart()
    assert node.device_of(vid) == device and node.recreated == []
    assert read_head(target) == PATTERN  # dax.sock served again, same bytes
    assert not node.record(vid).contents_lost_at


def test_a_reboot_loses_the_device_and_recovery_carves_it_again(nodes, caplog):
    node = nodes()
    vol = node.create("cache", size=64 * MiB, params={"numaNode": "0"}).volume
    vid = vol.volume_id
    node.pod(POD)
    node.publish(vid, node.target("pod-a"), pod_uid=POD)
    write_pattern(node.target("pod-a"))
    # The new boot's first device in dax0 lands on the same number and ranges, holding
    # the last boot's bytes, as DRAM may: only the records' boot id tells it apart.
    node.reboot()
    rec = node.record(vid)
    assert rec.contents_lost_at > 0 and not rec.recreating and rec.pool == "dax0"
    assert node.recreated == ["dax0"]
    assert node.device_of(vid).endswith("/dev/dax0.1")  # same number: old bytes there
    node.publish(vid, node.target("pod-b"), pod_uid=POD)
    assert read_head(node.target("pod-b")) == bytes(len(PATTERN))
    assert any("carved again" in r.getMessage() for r in caplog.records)


def test_media_parameter_filters_pools(nodes):
    node = nodes()
    assert capacity(node, media="volatile") == 1024 * MiB
    assert capacity(node, media="persistent") == 0
    assert code_of(node.create, "p", params={"media": "persistent"}) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(node.create, "bad", params={"media": "dram"}) == \
        grpc.StatusCode.INVALID_ARGUMENT
    vid = node.create("v", params={"media": "volatile"}).volume.volume_id
    # Idempotent with an "any" class too: the volume is on a volatile pool either way.
    assert node.create("v", params={"media": "volatile"}).volume.volume_id == vid


def test_fsdax_is_refused_with_the_reason(nodes):
    node = nodes()
    params = {"deviceMode": "fsdax"}
    assert node.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        parameters=params, volume_capabilities=[block_cap()])).available_capacity == 0
    with pytest.raises(grpc.RpcError) as info:
        node.create("fs", params=params, caps=[block_cap()])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "devdax volumes only" in info.value.details()


def test_system_ram_regions_say_why_in_create_and_metrics(nodes):
    node = nodes(boot_device="system-ram")
    with pytest.raises(grpc.RpcError) as info:
        node.create("v")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "onlined as system RAM" in info.value.details()
    usable = next(m for m in PoolCollector(node.backend, lambda: []).collect()
                  if m.name == "csi_pmem_pool_usable")
    assert {(s.labels["pool"], s.labels["reason"], s.value) for s in usable.samples} == \
        {("dax0", "system_ram", 0), ("dax1", "system_ram", 0)}
    assert node.kernel.writes() == []  # never offlined without the opt-in


def test_with_the_opt_in_a_reboot_on_kernel_6_12_recovers_by_itself(nodes):
    node = nodes(boot_device="system-ram", setup="reconfigure")
    vid = node.create("cache").volume.volume_id
    node.reboot()  # the regions come back as system RAM
    assert node.recreated and node.record(vid).contents_lost_at > 0
    node.publish(vid, node.target("pod-a"))
    assert node.backend.get(vid) is not None
