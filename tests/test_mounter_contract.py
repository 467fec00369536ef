"""The fake mounter against the kernel: one set of checks, run on both.

Why: the unit tier trusts ``tests/fake_mounter.py`` to refuse and report what the kernel
refuses and reports; every check here runs once with :class:`HostMounter` (real mounts,
loop devices, mkfs; root) and once with the fake, so a difference between them fails
here rather than hiding in the unit tier.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from csi_pmem.driver.host import mounts
from csi_pmem.driver.host.mounter import HostMounter, LoopDevices, Mounter
from csi_pmem.errors import CommandError, Unavailable

from conftest import MiB, needs_root
from fake_mounter import FakeMounter

pytestmark = [needs_root(), pytest.mark.root]


@pytest.fixture(params=["host", "fake"])
def host(request, tmp_path):
    """(mounter, scratch directory); whatever a check leaves mounted is cleaned up."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    m = HostMounter() if request.param == "host" else FakeMounter(tmp_path / "fake")
    yield m, scratch
    if request.param == "fake":
        return
    for info in reversed(mounts.mountinfo()):
        if info.mount_point.startswith(str(scratch) + "/"):
            subprocess.run(["umount", "-l", info.mount_point], check=False)
    attached = m.loop_devices()
    ours = {d for d, back in attached.items() if back.startswith(str(tmp_path) + "/")}
    views = {d for d, back in attached.items() if back in ours}
    for device in sorted(views) + sorted(ours):
        subprocess.run(["losetup", "-d", device], check=False)

def backing(scratch: Path, name: str = "disk", size: int = 64 * MiB) -> str:
    path = scratch / name
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def refused(call, *args) -> str:
    with pytest.raises(CommandError) as info:
        call(*args)
    return info.value.stderr


def test_both_implement_the_interface(host):
    m, _ = host
    assert isinstance(m, Mounter) and isinstance(m, LoopDevices)


def test_tmpfs_hides_the_target_and_is_gone_after_umount(host):
    m, scratch = host
    missing = str(scratch / "missing")
    assert "does not exist" in refused(m.mount_tmpfs, missing, "csi-pmem:x")
    target = scratch / "t"
    target.mkdir()
    (target / "underneath").write_text("kept")
    m.mount_tmpfs(str(target), "csi-pmem:x")
    info = m.find(str(target))
    assert (info.fstype, info.source, info.readonly) == ("tmpfs", "csi-pmem:x", False)
    assert os.listdir(target) == []
    (target / "volume.json").write_text("{}")
    m.remount(str(target), readonly=True)
    assert m.find(str(target)).readonly
    m.remount(str(target), readonly=False)
    assert not m.find(str(target)).readonly
    m.umount(str(target))
    assert m.find(str(target)) is None
    assert os.listdir(target) == ["underneath"]


def test_umount_and_remount_refuse_what_is_not_mounted(host):
    m, scratch = host
    target = scratch / "t"
    target.mkdir()
    assert "not mounted" in refused(m.umount, str(target))
    assert "not mounted" in refused(m.remount, str(target), True)


def test_a_mount_with_a_mount_below_it_is_busy(host):
    m, scratch = host
    outer = scratch / "outer"
    outer.mkdir()
    m.mount_tmpfs(str(outer), "csi-pmem:outer")
    (outer / "inner").mkdir()
    m.mount_tmpfs(str(outer / "inner"), "csi-pmem:inner")
    assert "busy" in refused(m.umount, str(outer))
    m.umount(str(outer / "inner"))
    m.umount(str(outer))
    assert m.find(str(outer)) is None


def test_loop_devices_are_block_devices_that_a_bind_carries(host):
    m, scratch = host
    with pytest.raises(Unavailable):
        m.attach_loop(str(scratch / "missing"))
    disk = backing(scratch)
    device = m.attach_loop(disk)
    assert m.loop_devices()[device] == os.path.realpath(disk)
    rdev = m.device_number(device)
    assert rdev is not None and os.major(rdev) == 7
    assert m.device_number(disk) is None  # a regular file is no block device
    with pytest.raises(FileNotFoundError):
        m.device_number(str(scratch / "missing"))
    view = m.attach_loop(device, readonly=True)
    assert m.loop_devices()[view] == device
    target = scratch / "dev"
    target.touch()
    m.bind(device, str(target), readonly=False)
    assert m.device_number(str(target)) == rdev
    # A bound device node is not a file system on the device: fsdax tells them apart.
    assert m.find(str(target)).dev != mounts.dev_of(rdev)
    m.umount(str(target))
    assert m.device_number(str(target)) is None
    for d in (view, device):
        m.detach_loop(d)
    assert device not in m.loop_devices()
    assert refused(m.detach_loop, device)


def test_a_file_system_lives_on_its_device(host):
    m, scratch = host
    device = m.attach_loop(backing(scratch))
    rdev = m.device_number(device)
    staging = scratch / "staging"
    staging.mkdir()
    assert m.fs_signature(device) is None
    assert "wrong fs type" in refused(m.mount, device, str(staging), "ext4", [])
    m.make_fs(device, "ext4")
    assert m.fs_signature(device) == "ext4"
    assert "wrong fs type" in refused(m.mount, device, str(staging), "xfs", [])
    assert "wrong fs type" in refused(m.mount, device, str(staging), "ext4", ["bogus"])
    assert "wrong fs type" in refused(m.mount, device, str(staging), "ext4", ["dax"])
    assert "does not exist" in refused(m.mount, device, str(scratch / "no"), "ext4", [])
    m.mount(device, str(staging), "ext4", ["noatime"])
    info = m.find(str(staging))
    assert (info.fstype, info.dev, info.readonly) == ("ext4", mounts.dev_of(rdev), False)
    assert "noatime" in info.options
    assert refused(m.make_fs, device, "ext4")  # mounted: mkfs refuses
    (staging / "data").write_text("persisted")
    target = scratch / "pod"
    target.mkdir()
    m.bind(str(staging), str(target), readonly=True)
    bound = m.find(str(target))
    assert (bound.dev, bound.fstype, bound.readonly) == (info.dev, "ext4", True)
    disk = str(scratch / "disk")
    assert "not a directory" in refused(m.bind, str(staging), disk, False)
    assert "Not a directory" in refused(m.bind, disk, str(target), False)
    assert "does not exist" in refused(m.bind, str(scratch / "no"), str(target), False)
    m.umount(str(target))
    m.umount(str(staging))
    assert not (staging / "data").exists()  # the file system is not mounted any more
    m.mount(device, str(staging), "ext4", [])
    assert (staging / "data").read_text() == "persisted"
    m.umount(str(staging))
    m.detach_loop(device)


def test_xfs_turns_dax_off_on_a_device_without_it(host):
    m, scratch = host
    device = m.attach_loop(backing(scratch, size=320 * MiB))
    m.make_fs(device, "xfs")
    staging = scratch / "staging"
    staging.mkdir()
    m.mount(device, str(staging), "xfs", ["dax"])
    assert "dax" not in m.find(str(staging)).options
    m.umount(str(staging))
    m.detach_loop(device)
