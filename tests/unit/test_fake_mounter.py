"""The fake mounter's own controls: busy targets and reboots.

What it shares with the kernel is checked against the kernel in
``tests/test_mounter_contract.py`` (root); these are the parts only tests drive.
"""

from __future__ import annotations

import os

import pytest

from csi_pmem.errors import CommandError

from fake_mounter import FakeMounter


@pytest.fixture
def fake(tmp_path):
    return FakeMounter(tmp_path / "host")


def test_busy_fails_as_many_umounts_and_seals_as_asked(fake, tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    fake.mount_tmpfs(str(target), "csi-pmem:x")
    fake.busy(str(target), times=2)
    fake.remount(str(target), readonly=False)  # making it writable is never busy
    with pytest.raises(CommandError) as info:
        fake.remount(str(target), readonly=True)
    assert "busy" in info.value.stderr
    with pytest.raises(CommandError) as info:
        fake.umount(str(target))
    assert "busy" in info.value.stderr
    fake.umount(str(target))
    assert fake.find(str(target)) is None


def test_a_reboot_forgets_mounts_and_loop_devices_but_not_file_systems(fake, tmp_path):
    disk = tmp_path / "disk"
    disk.write_bytes(bytes(1 << 20))
    device = fake.attach_loop(str(disk))
    fake.make_fs(device, "ext4")
    staging, tmpfs = tmp_path / "staging", tmp_path / "tmpfs"
    staging.mkdir()
    tmpfs.mkdir()
    fake.mount(device, str(staging), "ext4", [])
    (staging / "data").write_text("kept")
    fake.mount_tmpfs(str(tmpfs), "csi-pmem:x")
    (tmpfs / "volume.json").write_text("{}")
    fake.reboot()
    assert fake.mounts() == [] and fake.loop_devices() == {}
    assert not os.path.lexists(device)
    assert os.listdir(staging) == [] and os.listdir(tmpfs) == []
    device = fake.attach_loop(str(disk))
    assert fake.fs_signature(device) == "ext4"
    fake.mount(device, str(staging), "ext4", [])
    assert (staging / "data").read_text() == "kept"
