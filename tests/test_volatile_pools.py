"""Volatile pools with real mounts and the real driver process.

The bug this holds shut: the emulated back end on a tmpfs (what the README offers GPU
nodes without PMEM) stranded its volumes when the tmpfs was replaced, as a node restart
does to RAM: the volume stayed abnormal and every NodePublishVolume failed, forever.
Now a volume of a volatile pool comes back under its id, empty, and is published again;
a persistent pool keeps reporting the loss and never recreates anything.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from test_observability import free_port, scrape

from csi_pmem.csi import csi_pb2
from csi_pmem.daxclient import map_volume

from conftest import MiB, eventually, needs_root

pytestmark = needs_root()

PATTERN = b"weights!" * (128 * 1024)  # 1 MiB


def mount_tmpfs(point: Path) -> None:
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1G,mode=0700", "csi-pmem-pool",
                    str(point)], check=True, timeout=30)


def replace_tmpfs(point: Path) -> None:
    """What a node restart does to the RAM under the pool root."""
    subprocess.run(["umount", str(point)], check=True, timeout=30)
    mount_tmpfs(point)


def condition(d, vid: str) -> csi_pb2.VolumeCondition:
    entries = d.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries
    return next(e.status.volume_condition for e in entries if e.volume.volume_id == vid)


def head(target: str, writable: bool = False) -> bytes:
    _, m = map_volume(target, writable=writable)
    with m:
        if writable:
            m[:len(PATTERN)] = PATTERN
        return m[:len(PATTERN)]


def published(d, vid: str, target: str) -> str:
    """Try NodePublishVolume once; '' when it succeeded, else its error (for polling)."""
    try:
        d.publish(vid, target)
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return ""


def test_a_volume_on_a_replaced_tmpfs_comes_back_empty(driver_factory):
    port = free_port()
    d = driver_factory(regions="0=512Mi", extra=["--metrics-address", f"127.0.0.1:{port}"])
    pools = d.base / "pools"
    mount_tmpfs(pools)
    d.start()
    vol = d.create("weights-cache", size=128 * MiB).volume
    vid, target = vol.volume_id, d.target("pod-a")
    d.publish(vid, target)
    assert head(target, writable=True) == PATTERN

    d.stop()
    replace_tmpfs(pools)
    started = time.monotonic()
    d.start()
    # Kubelet retries NodePublishVolume; it must succeed, well within a minute.
    attempts: list[str] = []

    def attempt() -> bool:
        attempts.append(published(d, vid, target))
        return not attempts[-1]

    eventually(attempt, "NodePublishVolume to succeed after the tmpfs was replaced",
               timeout=60, interval=0.2)
    seconds = time.monotonic() - started
    assert head(target) == bytes(len(PATTERN))  # zeros, never the old bytes

    cond = condition(d, vid)
    assert not cond.abnormal and "contents were lost at a node restart at" in cond.message
    m = scrape(port)
    assert m['csi_pmem_volumes_recreated_total{pool="region0"}'] == 1
    assert m['csi_pmem_pool_volatile{numa_node="0",pool="region0"}'] == 1
    log = d.log.read_text()
    warnings = [line for line in log.splitlines()
                if "contents lost at a node restart" in line and vid in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "region0" in warnings[0]
    print(f"\n[volatile] publish again after {seconds:.2f} s (driver start included); "
          f"publish attempts: {attempts}")
    for line in log.splitlines():
        if re.search(r"volatile|contents lost|serving .* again|dax socket", line):
            print(f"[volatile] log: {line}")
    print(f"[volatile] condition: abnormal={cond.abnormal} message={cond.message!r}")

    # A driver restart keeps the fact and recreates nothing.
    d.restart()
    assert "contents were lost" in condition(d, vid).message
    assert scrape(port)['csi_pmem_volumes_recreated_total{pool="region0"}'] == 0  # new process
    assert head(target) == bytes(len(PATTERN))
    d.unpublish(vid, target)
    d.delete(vid)


@pytest.mark.parametrize("root", ["tmpfs-persistent", "disk-auto"])
def test_a_persistent_pool_keeps_the_lost_volume_abnormal(driver_factory, root):
    """A tmpfs declared persistent, and a disk root with auto: the loss is reported,
    never papered over with an empty volume."""
    extra = ["--emulated-media", "persistent"] if root == "tmpfs-persistent" else []
    d = driver_factory(regions="0=512Mi", extra=extra)
    pools = d.base / "pools"
    if root == "tmpfs-persistent":
        mount_tmpfs(pools)
    d.start()
    vid = d.create("keep", size=64 * MiB).volume.volume_id
    target = d.target("pod-a")
    d.publish(vid, target)
    head(target, writable=True)
    d.stop()
    if root == "tmpfs-persistent":
        replace_tmpfs(pools)
    else:
        for f in d.pool_files():
            f.unlink()
    d.start()
    cond = condition(d, vid)
    assert cond.abnormal and "disappeared" in cond.message
    with pytest.raises(grpc.RpcError) as info:
        d.publish(vid, target)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "disappeared" in info.value.details()
    assert d.pool_files() == []
    assert "contents lost at a node restart" not in d.log.read_text()
