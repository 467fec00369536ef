"""Volatile pools in-process: a volume whose memory was lost comes back, empty.

A node restart empties volatile memory (and a remounted tmpfs the emulated pools on it).
Here the pools' directory is removed while the driver is stopped, as that does, and the
driver started again over the same state (``InProcessNode`` keeps the fake kernel's
mounts, as the host keeps the publication tmpfs when only the pool root is replaced).
On a volatile pool the volume must be carved again under the same id, zeroed, served
and reported; on a persistent pool it must stay abnormal and never be recreated. The
same story with real mounts and a real driver process: tests/test_volatile_pools.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import grpc
import pytest

from csi_pmem.csi import csi_pb2
from csi_pmem.daxclient import open_volume
from csi_pmem.driver.backends.base import PERSISTENT, VOLATILE
from csi_pmem.driver.backends.emulated import media_of
from csi_pmem.driver.state import StateStore, VolumeRecord
from csi_pmem.loader import NoModelError, load_numpy, stage
from csi_pmem.loader import open_volume as open_weights
from csi_pmem.sizes import format_bytes

import loader_models as lm
from conftest import MiB, block_cap
from inprocess import PATTERN, InProcessNode, code_of, made_nodes, read_head, write_pattern

POD = "0b5e7c5e-2222-4a4a-9c9c-000000000002"


@pytest.fixture
def nodes():
    yield from made_nodes()


def backing(node: InProcessNode, vid: str) -> Path:
    files = sorted((node.base / "pools").glob(f"region*/{vid}~*"))
    assert len(files) == 1, files
    return files[0]


def reset_pools(node: InProcessNode) -> None:
    """What a node restart does to volatile memory: the driver is stopped and the pool
    root comes back empty (a fresh tmpfs)."""
    node.stop()
    shutil.rmtree(node.base / "pools")
    (node.base / "pools").mkdir()


def condition(node: InProcessNode, vid: str) -> csi_pb2.VolumeCondition:
    entries = node.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
    return next(e.status.volume_condition for e in entries if e.volume.volume_id == vid)


def test_a_volatile_volume_comes_back_empty_and_served_under_its_id(nodes, caplog):
    node = nodes(media=VOLATILE)
    vol = node.create("cache", size=64 * MiB, params={"numaNode": "1"}).volume
    vid, target = vol.volume_id, node.target("pod-a")
    node.pod(POD)
    node.publish(vid, target, pod_uid=POD)
    write_pattern(target)
    before = node.record(vid)
    reset_pools(node)
    node.start()

    rec = node.record(vid)
    assert (rec.pool, rec.size, rec.align, rec.numa_node) == \
        (before.pool, before.size, before.align, 1)
    assert rec.contents_lost_at > 0 and not rec.recreating
    assert backing(node, vid).stat().st_size == before.size
    # The publication's tmpfs survived; its dax.sock is served again, over zeros.
    assert read_head(target) == bytes(len(PATTERN))
    node.publish(vid, target, pod_uid=POD)  # kubelet's retry: idempotent, no error
    cond = condition(node, vid)
    assert not cond.abnormal
    assert "contents were lost at a node restart at 20" in cond.message
    stats = node.stats(vid, target)
    assert not stats.volume_condition.abnormal and "lost" in stats.volume_condition.message
    assert node.recreated == ["region1"]
    lines = [r for r in caplog.records if "contents lost at a node restart" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"
    assert vid in lines[0].getMessage() and "region1" in lines[0].getMessage()
    assert f" {format_bytes(rec.usable_size)} in region1" in lines[0].getMessage()

    # The fact outlives driver restarts; nothing is carved a second time.
    node.restart()
    assert node.recreated == ["region1"]
    cond = condition(node, vid)
    assert not cond.abnormal and "contents were lost" in cond.message
    node.unpublish(vid, target)
    node.delete(vid)
    assert not list((node.base / "pools").glob(f"region*/{vid}~*"))


def test_after_a_reboot_the_volume_is_published_again(nodes):
    node = nodes(media=VOLATILE)
    vid = node.create("cache").volume.volume_id
    node.publish(vid, node.target("pod-a"))
    node.stop()
    node.fake.reboot()  # mounts gone too
    shutil.rmtree(node.base / "pools")
    node.start()
    assert node.record(vid).publications == {}  # dropped; kubelet publishes again
    node.publish(vid, node.target("pod-b"))
    meta, fd = open_volume(node.target("pod-b"))
    os.close(fd)
    assert meta["volume_id"] == vid and not condition(node, vid).abnormal


def test_a_persistent_pool_reports_the_lost_volume_and_never_recreates_it(nodes):
    node = nodes(media=PERSISTENT)
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.publish(vid, target)
    reset_pools(node)
    node.start()
    assert not list((node.base / "pools").glob(f"region*/{vid}~*"))
    cond = condition(node, vid)
    assert cond.abnormal and "has disappeared" in cond.message
    with pytest.raises(grpc.RpcError) as info:
        node.publish(vid, node.target("pod-b"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "disappeared" in info.value.details()
    assert not list((node.base / "pools").glob(f"region*/{vid}~*"))
    assert node.recreated == [] and node.record(vid).contents_lost_at == 0


def test_no_room_keeps_it_abnormal_until_a_publish_finds_room(nodes):
    node = nodes(media=VOLATILE, regions={0: 512 * MiB})
    vid = node.create("cache", size=200 * MiB).volume.volume_id
    reset_pools(node)
    # After the restart something else holds the memory: a namespace the driver has no
    # record of (it never touches those).
    (node.base / "pools" / "region0").mkdir()
    squatter = node.base / "pools" / "region0" / f"pmem-{'0' * 32}~2097152.dax"
    with open(squatter, "wb") as f:
        f.truncate(400 * MiB)
    node.start()
    cond = condition(node, vid)
    assert cond.abnormal
    assert "cannot be carved again" in cond.message and "region0" in cond.message
    assert "free" in cond.message and "retries" in cond.message
    with pytest.raises(grpc.RpcError) as info:
        node.publish(vid, node.target("pod-a"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot be carved again" in info.value.details()
    assert node.record(vid).recreating is False and node.recreated == []

    squatter.unlink()  # room again: the next publish carves it
    node.publish(vid, node.target("pod-a"))
    assert not condition(node, vid).abnormal and node.recreated == ["region0"]


def test_a_vanished_pool_is_reported_and_retried_at_the_next_start(nodes):
    node = nodes(media=VOLATILE)
    vid = node.create("cache", params={"numaNode": "1"}).volume.volume_id
    reset_pools(node)
    node.regions = {0: 512 * MiB}  # NUMA node 1's memory did not come back
    node.start()
    cond = condition(node, vid)
    assert cond.abnormal and "its pool region1" in cond.message and "gone" in cond.message
    assert code_of(node.publish, vid, node.target("pod-a")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert vid in [v.volume.volume_id for v in node.controller.ListVolumes(
        csi_pb2.ListVolumesRequest()).entries]  # never dropped
    node.stop()
    node.regions = {0: 512 * MiB, 1: 512 * MiB}
    node.start()
    assert not condition(node, vid).abnormal and node.recreated == ["region1"]


def test_a_recreated_volume_is_zeroed_where_new_space_is_not(nodes, caplog):
    """``--emulated-free-space reuse``: new namespaces get old bytes, as real memory
    does after a restart. The recreated volume must still read as zeros."""
    node = nodes(media=VOLATILE, free_space="reuse", regions={0: 512 * MiB})
    vol = node.create("cache", size=64 * MiB).volume
    reset_pools(node)
    region = node.base / "pools" / "region0"
    region.mkdir()
    with open(region / "free-0.free", "wb") as f:  # another tenant's bytes
        f.write(b"\xab" * (128 * MiB))
    node.start()
    data = backing(node, vol.volume_id).read_bytes()
    assert data == bytes(len(data))
    assert any("carved again" in r.getMessage() and "zeroed" in r.getMessage()
               for r in caplog.records)


def test_a_recreate_cut_short_before_the_erase_is_zeroed_at_the_next_start(nodes):
    node = nodes(media=VOLATILE, free_space="reuse")
    vid = node.create("cache", size=64 * MiB).volume.volume_id
    node.stop()
    # As if the last start carved it and died before zeroing it: old bytes, the intent.
    path = backing(node, vid)
    with open(path, "r+b") as f:
        f.write(PATTERN)
    store = StateStore(str(node.state))
    rec = store.get(vid)
    rec.recreating, rec.contents_lost_at = True, 1.0
    store.put(rec)
    node.start()
    with open(path, "rb") as f:
        assert f.read(len(PATTERN)) == bytes(len(PATTERN))
    rec = node.record(vid)
    assert not rec.recreating and rec.contents_lost_at == 1.0
    assert not condition(node, vid).abnormal


def test_a_recreated_fsdax_block_volume_comes_back(nodes):
    node = nodes(media=VOLATILE)
    vid = node.create("blk", size=64 * MiB, caps=[block_cap()],
                      params={"deviceMode": "fsdax", "numaNode": "0"}).volume.volume_id
    reset_pools(node)
    node.start()
    assert backing(node, vid).suffix == ".fsdax"
    assert not condition(node, vid).abnormal and node.recreated == ["region0"]


def test_the_loader_refuses_a_recreated_volume_as_holding_no_model(nodes, tmp_path):
    node = nodes(media=VOLATILE)
    vol = node.create("weights", size=64 * MiB).volume
    target = node.target("pod-a")
    node.publish(vol.volume_id, target)
    lm.save_numpy_model(tmp_path / "src", lm.numpy_tensors())
    with open_weights(target, writable=True) as v:
        stage(v, str(tmp_path / "src"), name="m")
    assert load_numpy(target)  # staged and loadable
    reset_pools(node)
    node.start()
    with pytest.raises(NoModelError, match="holds no staged model"):
        load_numpy(target)


def test_auto_media_follows_the_file_system_of_the_root(tmp_path):
    table = lm.fake_mountinfo(tmp_path / "mountinfo", [
        ("/run/pools", "tmpfs", "tmpfs", "rw"),
        ("/run/pools/huge", "hugetlbfs", "none", "rw,pagesize=2M"),
        ("/mnt/disk", "xfs", "/dev/sdb", "rw"),
        ("/run/poolsx", "ext4", "/dev/sdc", "rw"),
    ])
    assert media_of("/run/pools/emulated", table=str(table)) == VOLATILE
    assert media_of("/run/pools/huge/x", table=str(table)) == VOLATILE
    assert media_of("/run/poolsx/emulated", table=str(table)) == PERSISTENT
    assert media_of("/mnt/disk/emulated", table=str(table)) == PERSISTENT
    assert media_of("/var/lib/csi-pmem", table=str(table)) == PERSISTENT  # ext4 root
    assert media_of("/run/pools", "persistent", table=str(table)) == PERSISTENT
    assert media_of("/mnt/disk", "volatile", table=str(table)) == VOLATILE


def test_a_pool_reset_under_a_running_driver_is_healed_by_the_next_publish(nodes):
    node = nodes(media=VOLATILE)
    vid = node.create("cache", params={"numaNode": "0"}).volume.volume_id
    node.publish(vid, node.target("pod-a"))
    write_pattern(node.target("pod-a"))
    shutil.rmtree(node.base / "pools" / "region0")  # the memory is reset meanwhile
    cond = condition(node, vid)
    assert cond.abnormal and "carved again, empty, at its next publish" in cond.message
    node.publish(vid, node.target("pod-b"))
    assert read_head(node.target("pod-b")) == bytes(len(PATTERN))
    assert read_head(node.target("pod-a")) == bytes(len(PATTERN))  # its socket serves it
    assert node.recreated == ["region0"] and not condition(node, vid).abnormal


def test_records_written_before_volatile_pools_still_load():
    old = ('{"id": "pmem-0", "name": "n", "state": "ready", "params": {}, '
           '"required_bytes": 1, "publications": {}, "stages": {}}')
    rec = VolumeRecord.from_json(old)
    assert rec.contents_lost_at == 0 and rec.recreating is False
    assert VolumeRecord.from_json(rec.to_json()) == rec
