"""fsdax volumes end to end through real gRPC: raw block devices and ext4/xfs mounts.

The emulated back end makes each fsdax namespace a loop device limited to the usable
size, so everything here is real: the device node bound onto the target file, the
read-only loop device of a read-only publication, mkfs, mount, bind mounts, statvfs,
ownership for fsGroup. What the emulation lacks is DAX itself (a loop device has none):
the ``-o dax`` mount and MAP_SYNC are checked on real libnvdimm in the VM tier.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess

import grpc
import pytest

from csi_pmem import failpoints
from csi_pmem.csi import csi_pb2
from csi_pmem.driver.host import mounts

from conftest import MiB, Mode, block_cap, mount_cap, mounts_below, needs_root, records

pytestmark = needs_root()

FSDAX = {"deviceMode": "fsdax"}
PATTERN = b"csi-pmem fsdax\n" * 300


def fs_cap(fs_type: str = "", mode=Mode.SINGLE_NODE_WRITER, flags=(), group: str = ""):
    cap = mount_cap(mode)
    cap.mount.fs_type = fs_type
    cap.mount.mount_flags.extend(flags)
    if group:
        cap.mount.volume_mount_group = group
    return cap


def code_of(call, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code()


def block_target(d, pod: str) -> str:
    """Like kubelet: the parent exists, the driver creates the file."""
    parent = d.kubelet / "plugins" / "volumeDevices" / "publish" / pod
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent / "dev")


def loops_of(d) -> list[str]:
    """Loop devices attached to something below this driver's base directory or to one
    of its emulated loop devices (read-only views)."""
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                         capture_output=True, text=True, check=True).stdout
    pairs = [line.split(None, 1) for line in out.splitlines() if line.strip()]
    ours = {name for name, back in pairs if back.startswith(str(d.base))}
    views = {name for name, back in pairs if back.strip() in ours}
    return sorted(ours | views)


def stats(d, vid: str, path: str) -> dict:
    resp = d.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vid, volume_path=path), timeout=30)
    return {csi_pb2.VolumeUsage.Unit.Name(u.unit): (u.total, u.available, u.used)
            for u in resp.usage}


# ------------------------------------------------------------------ block
def test_block_volume_is_a_device_the_pod_can_read_and_write(driver):
    vol = driver.create("blk", size=64 * MiB, params=FSDAX, caps=[block_cap()]).volume
    assert vol.volume_context["deviceMode"] == "fsdax"
    assert vol.capacity_bytes >= 64 * MiB
    vid, target = vol.volume_id, block_target(driver, "pod-a")
    staging = driver.staging("blk")
    driver.stage(vid, staging, cap=block_cap())  # nothing to do for block, but accepted
    driver.publish(vid, target, cap=block_cap(), staging=staging)
    st = os.stat(target)
    assert stat.S_ISBLK(st.st_mode)
    fd = os.open(target, os.O_RDWR)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == vol.capacity_bytes
        os.pwrite(fd, PATTERN, vol.capacity_bytes - len(PATTERN) - 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
    driver.publish(vid, target, cap=block_cap(), staging=staging)  # idempotent
    # A second pod on the node sees the same bytes.
    other = block_target(driver, "pod-b")
    driver.publish(vid, other, cap=block_cap(), staging=staging)
    with open(other, "rb") as f:
        f.seek(vol.capacity_bytes - len(PATTERN) - 4096)
        assert f.read(len(PATTERN)) == PATTERN
    total, available, used = stats(driver, vid, target)["BYTES"]
    assert (total, available, used) == (vol.capacity_bytes, vol.capacity_bytes, 0)
    for t in (target, other):
        driver.unpublish(vid, t)
        assert not os.path.lexists(t)
    driver.unstage(vid, staging)
    assert mounts_below(driver) == []
    driver.delete(vid)
    assert loops_of(driver) == []


@pytest.mark.parametrize("kind", ["block", "filesystem"])
def test_single_node_single_writer_is_enforced_for_fsdax(driver, kind):
    """One writable publication of a SINGLE_NODE_SINGLE_WRITER fsdax volume; a second
    writable one is FAILED_PRECONDITION, a read-only one and a repeat are fine."""
    single = Mode.SINGLE_NODE_SINGLE_WRITER
    cap = block_cap(single) if kind == "block" else fs_cap(mode=single)
    vid = driver.create(f"snsw-{kind}", params=FSDAX, caps=[cap]).volume.volume_id
    staging = driver.staging(vid)
    driver.stage(vid, staging, cap=cap)
    target = (block_target if kind == "block" else lambda d, p: d.target(p))
    first, second, reader = target(driver, "w1"), target(driver, "w2"), target(driver, "r")
    driver.publish(vid, first, cap=cap, staging=staging)
    driver.publish(vid, first, cap=cap, staging=staging)  # idempotent
    assert code_of(driver.publish, vid, second, cap=cap, staging=staging) == \
        grpc.StatusCode.FAILED_PRECONDITION
    driver.publish(vid, reader, readonly=True, cap=cap, staging=staging)
    for t in (first, reader):
        driver.unpublish(vid, t)
    driver.publish(vid, second, cap=cap, staging=staging)  # the writer is gone now
    driver.unpublish(vid, second)
    driver.unstage(vid, staging)
    driver.delete(vid)


def test_readonly_block_publication_refuses_writes(driver):
    vol = driver.create("ro-blk", params=FSDAX, caps=[block_cap()]).volume
    vid = vol.volume_id
    rw, ro = block_target(driver, "writer"), block_target(driver, "reader")
    driver.publish(vid, rw, cap=block_cap())
    with open(rw, "r+b") as f:
        f.write(PATTERN)
    driver.publish(vid, ro, readonly=True, cap=block_cap(Mode.SINGLE_NODE_READER_ONLY))
    assert code_of(driver.publish, vid, ro, cap=block_cap()) == grpc.StatusCode.ALREADY_EXISTS
    # A read-only bind of a device node would still accept writes; the driver binds a
    # read-only loop device instead, which the kernel refuses to write.
    fd = os.open(ro, os.O_RDWR)
    try:
        with pytest.raises(OSError) as info:
            os.pwrite(fd, b"x" * 4096, 0)
            os.fsync(fd)
        assert info.value.errno in (errno.EPERM, errno.EROFS, errno.EACCES)
        assert os.pread(fd, len(PATTERN), 0) == PATTERN
    finally:
        os.close(fd)
    assert len(loops_of(driver)) == 2  # the namespace and the read-only view
    driver.unpublish(vid, ro)
    assert len(loops_of(driver)) == 1  # the view is detached with its publication
    driver.unpublish(vid, rw)
    driver.delete(vid)
    assert loops_of(driver) == []


# ------------------------------------------------------------------ file systems
@pytest.mark.parametrize("fs_type,size", [("", 64 * MiB), ("ext4", 64 * MiB),
                                          ("xfs", 320 * MiB)])
def test_filesystem_volume_is_staged_once_and_bound_into_pods(driver, fs_type, size):
    cap = fs_cap(fs_type)
    vol = driver.create(f"fs-{fs_type}", size=size, params=FSDAX, caps=[cap]).volume
    vid, staging = vol.volume_id, driver.staging(f"fs-{fs_type}")
    driver.stage(vid, staging, cap=cap)
    driver.stage(vid, staging, cap=cap)  # idempotent
    staged = mounts.find(staging)
    assert staged is not None and staged.fstype == (fs_type or "ext4")
    # A loop device has no DAX: the emulated back end mounts without it, and says so.
    assert not {"dax", "dax=always"} & staged.options
    assert records(driver)[vid]["stages"][staging]["dax"] is False
    target = driver.target("pod-fs")
    group_cap = fs_cap(fs_type, group="2000")
    driver.publish(vid, target, cap=group_cap, staging=staging)
    driver.publish(vid, target, cap=group_cap, staging=staging)  # idempotent
    st = os.stat(target)
    assert st.st_gid == 2000 and st.st_mode & stat.S_ISGID and st.st_mode & stat.S_IWGRP
    with open(os.path.join(target, "weights.bin"), "wb") as f:
        f.write(PATTERN * 100)
    with open(os.path.join(staging, "weights.bin"), "rb") as f:
        assert f.read() == PATTERN * 100  # the same file system
    usage = stats(driver, vid, target)
    total, available, used = usage["BYTES"]
    assert vol.capacity_bytes * 0.8 < total <= vol.capacity_bytes
    assert used >= len(PATTERN) * 100 and available < total
    assert usage["INODES"][0] > 0 and usage["INODES"][2] >= 2
    # A read-only publication of the same volume is a read-only bind.
    ro_target = driver.target("pod-ro")
    driver.publish(vid, ro_target, readonly=True, cap=cap, staging=staging)
    with pytest.raises(OSError) as info:
        open(os.path.join(ro_target, "new"), "w")
    assert info.value.errno == errno.EROFS
    for t in (target, ro_target):
        driver.unpublish(vid, t)
        assert not os.path.lexists(t)
    assert code_of(driver.delete, vid) == grpc.StatusCode.FAILED_PRECONDITION  # staged
    driver.unstage(vid, staging)
    driver.unstage(vid, staging)  # idempotent
    assert mounts_below(driver) == []
    driver.delete(vid)
    assert loops_of(driver) == []


def test_restage_keeps_data_and_never_reformats(driver):
    cap = fs_cap("ext4")
    vid = driver.create("keep", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging = driver.staging("keep")
    driver.stage(vid, staging, cap=cap)
    with open(os.path.join(staging, "kept"), "w") as f:
        f.write("still here")
    driver.unstage(vid, staging)
    driver.stage(vid, staging, cap=cap)
    with open(os.path.join(staging, "kept")) as f:
        assert f.read() == "still here"
    driver.unstage(vid, staging)
    # The volume holds ext4: staging it as xfs must not format it.
    with pytest.raises(grpc.RpcError) as info:
        driver.stage(vid, staging, cap=fs_cap("xfs"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already holds ext4" in info.value.details()
    driver.stage(vid, staging, cap=cap)
    with open(os.path.join(staging, "kept")) as f:
        assert f.read() == "still here"
    # Staged already, with other settings: ALREADY_EXISTS, as for publish.
    assert code_of(driver.stage, vid, staging, cap=fs_cap("ext4", flags=["noatime"])) == \
        grpc.StatusCode.ALREADY_EXISTS
    driver.unstage(vid, staging)
    driver.delete(vid)


def test_the_file_system_named_at_create_is_made_by_a_stage_naming_none(driver):
    """Issue 45: created for xfs, staged without an fsType (as `csi-pmem volume stage`
    does): real mkfs.xfs, a real xfs mount; another file system is refused first."""
    vid = driver.create("xfs-named", size=320 * MiB, params=FSDAX,
                        caps=[fs_cap("xfs")]).volume.volume_id
    staging = driver.staging("xfs-named")
    with pytest.raises(grpc.RpcError) as info:
        driver.stage(vid, staging, cap=fs_cap("ext4"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "was created for xfs" in info.value.details()
    assert mounts_below(driver) == []
    driver.stage(vid, staging, cap=fs_cap())
    assert mounts.find(staging).fstype == "xfs"
    driver.unstage(vid, staging)
    driver.delete(vid)


def test_mount_options_are_applied_and_bad_ones_refused(driver):
    cap = fs_cap("ext4", flags=["noatime", "nodiscard"])
    vid = driver.create("opts", params=FSDAX, caps=[cap]).volume.volume_id
    staging = driver.staging("opts")
    driver.stage(vid, staging, cap=cap)
    assert "noatime" in mounts.find(staging).options
    driver.unstage(vid, staging)
    with pytest.raises(grpc.RpcError) as info:
        driver.stage(vid, staging, cap=fs_cap("ext4", flags=["no_such_option"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mountOptions" in info.value.details()
    assert code_of(driver.stage, vid, staging, cap=fs_cap("ext4", flags=["ro,exec"])) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert mounts_below(driver) == [] and records(driver)[vid]["stages"] == {}
    driver.delete(vid)


def test_publish_of_a_filesystem_volume_needs_a_stage(driver):
    cap = fs_cap()
    vid = driver.create("unstaged", params=FSDAX, caps=[cap]).volume.volume_id
    target = driver.target("pod")
    assert code_of(driver.publish, vid, target, cap=cap) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(driver.publish, vid, target, cap=cap, staging=driver.staging("none")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert not os.path.lexists(target) and records(driver)[vid]["publications"] == {}
    driver.delete(vid)


# ------------------------------------------------------------------ bad input
def test_bad_input_names_the_fix(driver):
    def details(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as info:
            call(*args, **kw)
        return info.value.code(), info.value.details()

    code, msg = details(driver.create, "btrfs", params=FSDAX, caps=[fs_cap("btrfs")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ext4 or xfs" in msg
    code, msg = details(driver.create, "aligned", params={**FSDAX, "align": "1Gi"})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "devdax only" in msg
    code, msg = details(driver.create, "devdax-block", caps=[block_cap()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "deviceMode: fsdax" in msg
    code, msg = details(driver.create, "devdax-ext4", caps=[fs_cap("ext4")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "deviceMode: fsdax" in msg
    # GetCapacity answers per class and capability: 0 where the class cannot serve it.
    cap_of = driver.controller.GetCapacity
    assert cap_of(csi_pb2.GetCapacityRequest(parameters=FSDAX,
                                             volume_capabilities=[block_cap()])
                  ).available_capacity > 0
    assert cap_of(csi_pb2.GetCapacityRequest(volume_capabilities=[block_cap()])
                  ).available_capacity == 0
    assert cap_of(csi_pb2.GetCapacityRequest(parameters=FSDAX,
                                             volume_capabilities=[fs_cap("btrfs")])
                  ).available_capacity == 0
    vid = driver.create("fine", params=FSDAX, caps=[block_cap()]).volume.volume_id
    code, msg = details(driver.stage, vid, driver.staging("x"), cap=fs_cap("vfat"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ext4 or xfs" in msg
    code, _ = details(driver.publish, vid, block_target(driver, "p"), cap=fs_cap("ntfs"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    validate = driver.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vid,
                                                  volume_capabilities=[block_cap()]))
    assert validate.HasField("confirmed")
    # A target that exists and is a directory cannot take a block device.
    busy = driver.target("dir")
    os.makedirs(busy)
    assert code_of(driver.publish, vid, busy, cap=block_cap()) == \
        grpc.StatusCode.FAILED_PRECONDITION
    driver.delete(vid)


# ------------------------------------------------------------------ restarts, crashes
def test_restart_keeps_staged_and_published_fsdax_volumes(driver):
    cap = fs_cap("ext4")
    fs_vid = driver.create("fs", params=FSDAX, caps=[cap]).volume.volume_id
    blk_vid = driver.create("blk", params=FSDAX, caps=[block_cap()]).volume.volume_id
    staging, target = driver.staging("fs"), driver.target("pod")
    driver.stage(fs_vid, staging, cap=cap)
    driver.publish(fs_vid, target, cap=cap, staging=staging)
    blk, blk_ro = block_target(driver, "pod"), block_target(driver, "pod-ro")
    driver.publish(blk_vid, blk, cap=block_cap())
    driver.publish(blk_vid, blk_ro, readonly=True, cap=block_cap())
    with open(os.path.join(target, "f"), "w") as f:
        f.write("survives")
    driver.kill()
    driver.start()
    with open(os.path.join(target, "f")) as f:
        assert f.read() == "survives"
    rec = records(driver)
    assert rec[fs_vid]["stages"][staging]["state"] == "staged"
    assert {t: p["state"] for t, p in rec[blk_vid]["publications"].items()} == \
        {blk: "published", blk_ro: "published"}
    driver.publish(fs_vid, target, cap=cap, staging=staging)  # still idempotent
    driver.publish(blk_vid, blk_ro, readonly=True, cap=block_cap())
    driver.unpublish(fs_vid, target)
    driver.unstage(fs_vid, staging)
    for t in (blk, blk_ro):
        driver.unpublish(blk_vid, t)
    for v in (fs_vid, blk_vid):
        driver.delete(v)
    assert mounts_below(driver) == [] and loops_of(driver) == [] and records(driver) == {}


@pytest.mark.parametrize("point", failpoints.FSDAX)
def test_crash_on_the_fsdax_paths_heals_on_restart(driver_factory, point):
    d = driver_factory().start()
    cap = fs_cap("ext4")
    vid = d.create("crash", params=FSDAX, caps=[cap]).volume.volume_id
    staging, target = d.staging("crash"), d.target("pod")
    if point != failpoints.STAGE_AFTER_MKFS:
        d.stage(vid, staging, cap=cap)
    if point == failpoints.UNPUBLISH_AFTER_UMOUNT:
        d.publish(vid, target, cap=cap, staging=staging)
    d.restart(failpoints=point)
    with pytest.raises(grpc.RpcError):
        if point == failpoints.STAGE_AFTER_MKFS:
            d.stage(vid, staging, cap=cap)
        elif point == failpoints.UNPUBLISH_AFTER_UMOUNT:
            d.unpublish(vid, target)
        else:
            d.publish(vid, target, cap=cap, staging=staging)
    d.wait_exit()
    d.start()
    # The CO retries what it asked for; everything completes and nothing leaks.
    d.stage(vid, staging, cap=cap)
    d.publish(vid, target, cap=cap, staging=staging)
    with open(os.path.join(target, "ok"), "w") as f:
        f.write("ok")
    d.unpublish(vid, target)
    d.unstage(vid, staging)
    d.delete(vid)
    assert mounts_below(d) == [] and loops_of(d) == [] and records(d) == {}
    assert not os.path.lexists(target)


# ------------------------------------------------------------------ data safety
def test_two_readonly_views_of_one_volume_are_both_detached(driver):
    vid = driver.create("two-ro", params=FSDAX, caps=[block_cap()]).volume.volume_id
    targets = [block_target(driver, f"reader-{i}") for i in range(2)]
    for t in targets:
        driver.publish(vid, t, readonly=True, cap=block_cap(Mode.SINGLE_NODE_READER_ONLY))
    assert len(loops_of(driver)) == 3  # the namespace and one view per publication
    for t in targets:
        driver.unpublish(vid, t)
    assert len(loops_of(driver)) == 1
    driver.delete(vid)  # nothing holds the device any more
    assert loops_of(driver) == []


def test_raw_block_data_is_never_formatted(driver):
    vid = driver.create("raw", params=FSDAX, caps=[block_cap()]).volume.volume_id
    target, staging = block_target(driver, "raw"), driver.staging("raw")
    driver.publish(vid, target, cap=block_cap())
    with open(target, "r+b") as f:
        f.write(PATTERN)  # raw data: no file-system signature for blkid to find
    with pytest.raises(grpc.RpcError) as info:
        driver.stage(vid, staging, cap=fs_cap("ext4"))  # while published as a device
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "raw block device" in info.value.details()
    driver.unpublish(vid, target)
    with pytest.raises(grpc.RpcError) as info:
        driver.stage(vid, staging, cap=fs_cap("ext4"))  # later, too
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not formatted" in info.value.details()
    driver.publish(vid, target, cap=block_cap())
    with open(target, "rb") as f:
        assert f.read(len(PATTERN)) == PATTERN
    driver.unpublish(vid, target)
    driver.delete(vid)


def test_delete_never_erases_under_a_mounted_file_system(driver, tmp_path):
    vol = driver.create("mounted", params=FSDAX, caps=[block_cap()]).volume
    device = vol.volume_context["device"]
    subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
    where = tmp_path / "mnt"
    where.mkdir()
    subprocess.run(["mount", device, str(where)], check=True)
    try:
        with pytest.raises(grpc.RpcError) as info:
            driver.delete(vol.volume_id)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "in use" in info.value.details()
        assert vol.volume_id in driver.list_ids()
    finally:
        subprocess.run(["umount", str(where)], check=True)
    driver.delete(vol.volume_id)
    assert driver.list_ids() == [] and loops_of(driver) == []


def test_fsgroup_walk_does_not_follow_symlinks_out_of_the_volume(driver, tmp_path):
    outside = tmp_path / "someone-elses"
    outside.write_text("not yours")
    os.chmod(outside, 0o600)
    before = os.stat(outside)
    cap = fs_cap("ext4")
    vid = driver.create("links", params=FSDAX, caps=[cap]).volume.volume_id
    staging = driver.staging("links")
    driver.stage(vid, staging, cap=cap)
    os.symlink(outside, os.path.join(staging, "escape"))
    os.makedirs(os.path.join(staging, "sub"))
    target = driver.target("grp")
    driver.publish(vid, target, cap=fs_cap("ext4", group="3000"), staging=staging)
    after = os.stat(outside)
    assert (after.st_gid, after.st_mode) == (before.st_gid, before.st_mode)
    sub = os.stat(os.path.join(target, "sub"))
    assert sub.st_gid == 3000 and sub.st_mode & stat.S_ISGID
    driver.unpublish(vid, target)
    driver.unstage(vid, staging)
    driver.delete(vid)


def test_block_target_holding_data_is_refused(driver):
    vid = driver.create("busy-file", params=FSDAX, caps=[block_cap()]).volume.volume_id
    target = block_target(driver, "data")
    with open(target, "w") as f:
        f.write("someone's data")
    assert code_of(driver.publish, vid, target, cap=block_cap()) == \
        grpc.StatusCode.FAILED_PRECONDITION
    driver.unpublish(vid, target)  # unknown to the driver: nothing happens to the file
    with open(target) as f:
        assert f.read() == "someone's data"
    driver.delete(vid)
