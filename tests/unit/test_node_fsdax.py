"""fsdax node RPCs in-process: block devices, file systems, staging, reconcile.

Over the emulated back end (each namespace a loop device, here the fake's) and the fake
mounter; the real loop devices, mkfs and mounts are in ``tests/test_fsdax.py``.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from csi_pmem.driver.state import BLOCK, MOUNT, PUBLISHED, STAGED, STAGING

from conftest import Mode, block_cap, mount_cap
from inprocess import InProcessNode, code_of, node_fixture  # noqa: F401 (the fixture)

FSDAX = {"deviceMode": "fsdax"}


def details_of(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code(), info.value.details()


def fs_cap(fs_type: str = "", mode=Mode.SINGLE_NODE_WRITER, flags=(), group: str = ""):
    cap = mount_cap(mode)
    cap.mount.fs_type = fs_type
    cap.mount.mount_flags.extend(flags)
    if group:
        cap.mount.volume_mount_group = group
    return cap


def device_of(node: InProcessNode, vid: str) -> str:
    return node.backend.get(vid).device


# ------------------------------------------------------------------ block
def test_block_publication_binds_the_device_onto_a_file(node):
    vid = node.create("blk", params=FSDAX, caps=[block_cap()]).volume.volume_id
    device = device_of(node, vid)
    target = node.block_target("pod-a")
    node.stage(vid, node.staging("blk"), cap=block_cap())  # nothing to stage for block
    assert node.fake.mounts() == []
    node.publish(vid, target, cap=block_cap())
    assert os.path.isfile(target)
    assert node.fake.device_number(target) == node.fake.device_number(device)
    pub = node.record(vid).publications[target]
    assert (pub.kind, pub.state, pub.view) == (BLOCK, PUBLISHED, "")
    done = len(node.fake.calls)
    node.publish(vid, target, cap=block_cap())  # idempotent
    assert node.fake.calls[done:] == []
    assert code_of(node.publish, vid, target, readonly=True, cap=block_cap()) == \
        grpc.StatusCode.ALREADY_EXISTS
    # A block volume's stats are the device's: whole and free.
    usage = node.stats(vid, target).usage
    assert [(u.total, u.used) for u in usage] == [(node.record(vid).usable_size, 0)]
    node.unpublish(vid, target)
    assert node.fake.find(target) is None and not os.path.lexists(target)


def test_read_only_block_publication_is_a_read_only_loop_view(node):
    vid = node.create("blk", params=FSDAX, caps=[block_cap()]).volume.volume_id
    device = device_of(node, vid)
    rw, ro = node.block_target("w"), node.block_target("r")
    node.publish(vid, rw, cap=block_cap())
    node.publish(vid, ro, readonly=True, cap=block_cap(Mode.SINGLE_NODE_READER_ONLY))
    view = node.record(vid).publications[ro].view
    assert node.fake.loop_devices()[view] == device
    assert node.fake.device_number(ro) == node.fake.device_number(view) != \
        node.fake.device_number(device)
    assert node.fake.find(ro).readonly
    assert [u.total for u in node.stats(vid, ro).usage] == [node.record(vid).usable_size]
    node.unpublish(vid, ro)
    assert view not in node.fake.loop_devices()
    node.unpublish(vid, rw)
    node.delete(vid)
    assert node.fake.loop_devices() == {}  # the namespace's own loop device went too


@pytest.mark.parametrize("what", ["directory", "non-empty file", "missing parent"])
def test_a_block_target_must_be_an_empty_file_or_creatable(node, what):
    vid = node.create("blk", params=FSDAX, caps=[block_cap()]).volume.volume_id
    target = node.block_target("p")
    if what == "directory":
        os.mkdir(target)
    elif what == "non-empty file":
        with open(target, "w") as f:
            f.write("data")
    else:
        target = str(node.kubelet / "devices" / "nowhere" / "dev")
    assert code_of(node.publish, vid, target, cap=block_cap()) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert node.fake.mounts() == [] and node.record(vid).publications == {}


# ------------------------------------------------------------------ file systems
def test_a_file_system_is_made_once_staged_and_bound_into_pods(node):
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    device, staging, target = device_of(node, vid), node.staging("fs"), node.target("pod")
    assert code_of(node.publish, vid, target, cap=fs_cap()) == \
        grpc.StatusCode.INVALID_ARGUMENT  # no staging path
    assert code_of(node.publish, vid, target, cap=fs_cap(), staging=staging) == \
        grpc.StatusCode.FAILED_PRECONDITION  # not staged
    node.stage(vid, staging, cap=fs_cap())
    assert node.fake.fs_signature(device) == "ext4"
    staged = node.fake.find(staging)
    assert (staged.fstype, staged.source) == ("ext4", device)
    assert not {"dax", "dax=always"} & staged.options  # a loop device has no DAX
    assert node.record(vid).stages[staging].state == STAGED
    done = len(node.fake.calls)
    node.stage(vid, staging, cap=fs_cap())  # idempotent
    assert node.fake.calls[done:] == []
    node.publish(vid, target, cap=fs_cap(), staging=staging)
    bound = node.fake.find(target)
    assert (bound.dev, bound.fstype, bound.readonly) == (staged.dev, "ext4", False)
    pub = node.record(vid).publications[target]
    assert (pub.kind, pub.staging) == (MOUNT, staging)
    fs_usage = {u.unit: u.total for u in node.stats(vid, target).usage}
    assert len(fs_usage) == 2 and all(v > 0 for v in fs_usage.values())
    node.unstage(vid, node.staging("elsewhere"))  # never staged there: OK, nothing done
    assert node.fake.find(staging) is not None
    assert code_of(node.delete, vid) == grpc.StatusCode.FAILED_PRECONDITION
    node.unpublish(vid, target)
    assert not os.path.lexists(target)
    node.unstage(vid, staging)
    node.unstage(vid, staging)  # idempotent
    assert node.fake.mounts() == []
    assert [c[0] for c in node.fake.calls].count("make_fs") == 1
    node.delete(vid)


def test_restage_keeps_the_data_and_never_formats_again(node):
    vid = node.create("keep", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging = node.staging("keep")
    node.stage(vid, staging, cap=fs_cap("ext4"))
    with open(os.path.join(staging, "kept"), "w") as f:
        f.write("still here")
    node.unstage(vid, staging)
    assert not os.path.exists(os.path.join(staging, "kept"))  # unmounted
    code, details = details_of(node.stage, vid, staging, cap=fs_cap("xfs"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already holds ext4" in details
    node.stage(vid, staging, cap=fs_cap("ext4"))
    with open(os.path.join(staging, "kept")) as f:
        assert f.read() == "still here"
    assert [c[0] for c in node.fake.calls].count("make_fs") == 1
    # Staged already, with other settings: ALREADY_EXISTS, as for publish.
    assert code_of(node.stage, vid, staging, cap=fs_cap("ext4", flags=["noatime"])) == \
        grpc.StatusCode.ALREADY_EXISTS


def test_the_file_system_named_at_create_is_the_one_staged(node):
    """Issue 45: `volume create --fs-type xfs` then `stage` made ext4. CreateVolume's
    fsType is recorded; a stage naming none makes it, one naming another is refused
    before anything is formatted."""
    vid = node.create("x", params=FSDAX, caps=[fs_cap("xfs")],
                      size=320 * 1024 * 1024).volume.volume_id
    assert node.record(vid).fs_type == "xfs"
    staging = node.staging("x")
    code, details = details_of(node.stage, vid, staging, cap=fs_cap("ext4"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"volume {vid} was created for xfs (CreateVolume's fsType), not ext4" in details
    assert [c[0] for c in node.fake.calls].count("make_fs") == 0
    node.stage(vid, staging, cap=fs_cap())  # names none: the recorded one
    assert node.fake.fs_signature(device_of(node, vid)) == "xfs"
    assert node.fake.find(staging).fstype == "xfs"
    target = node.target("pod")
    node.publish(vid, target, cap=fs_cap(), staging=staging)
    assert node.fake.find(target).fstype == "xfs"
    # The same name with another file system is another volume.
    assert code_of(node.create, "x", params=FSDAX, caps=[fs_cap("ext4")],
                   size=320 * 1024 * 1024) == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(node.create, "y", params=FSDAX, caps=[fs_cap("xfs"), fs_cap("ext4")],
                   size=320 * 1024 * 1024) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_volume_staged_at_one_path_is_refused_at_another(node):
    """CSI: one staging_target_path per volume; a second would mount the same file
    system twice (issue 45: staging at s3 while staged at s2 succeeded)."""
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    s2, s3 = node.staging("s2"), node.staging("s3")
    node.stage(vid, s2, cap=fs_cap())
    mounts = node.fake.mounts()
    code, details = details_of(node.stage, vid, s3, cap=fs_cap())
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert f"already staged at {s2}" in details and s3 in details
    assert node.fake.mounts() == mounts and list(node.record(vid).stages) == [s2]
    node.stage(vid, s2, cap=fs_cap())  # the same path again: idempotent
    node.unstage(vid, s2)
    node.stage(vid, s3, cap=fs_cap())  # unstaged there: another path is fine now
    assert list(node.record(vid).stages) == [s3]
    node.unstage(vid, s3)


def test_a_devdax_volume_stages_anywhere_it_is_asked(node):
    """kubelet stages every volume of a driver with STAGE_UNSTAGE_VOLUME: a devdax
    volume has nothing to stage, so every such call succeeds and mounts nothing."""
    vid = node.create("dd").volume.volume_id
    for path in (node.staging("a"), node.staging("b"), node.staging("a")):
        node.stage(vid, path)
    assert node.fake.mounts() == [] and node.record(vid).stages == {}
    node.unstage(vid, node.staging("a"))


def test_unstage_is_refused_while_a_pod_is_published_from_the_stage(node):
    """Unmounting the stage under a publication would leave the pod's bind mount with
    no file system behind the driver's back (issue 45)."""
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging, a, b = node.staging("fs"), node.target("pod-a"), node.target("pod-b")
    node.stage(vid, staging, cap=fs_cap())
    node.publish(vid, a, cap=fs_cap(), staging=staging)
    node.publish(vid, b, cap=fs_cap(), staging=staging)
    code, details = details_of(node.unstage, vid, staging)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"published from staging path {staging} at {a}, {b}" in details, details
    assert node.fake.find(staging) is not None
    assert node.record(vid).stages[staging].state == STAGED
    node.unpublish(vid, a)
    code, details = details_of(node.unstage, vid, staging)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and a not in details and b in details
    node.unpublish(vid, b)
    node.unstage(vid, staging)
    assert node.fake.mounts() == [] and node.record(vid).stages == {}


def test_mount_options_are_applied_and_bad_ones_blamed_on_the_class(node):
    vid = node.create("opts", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging = node.staging("opts")
    node.stage(vid, staging, cap=fs_cap("ext4", flags=["noatime", "nodiscard"]))
    assert {"noatime", "nodiscard"} <= node.fake.find(staging).options
    node.unstage(vid, staging)
    for bad in (["no_such_option"], ["dax"]):  # dax: the emulated device has none
        code, details = details_of(node.stage, vid, staging, cap=fs_cap("ext4", flags=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "mountOptions" in details
        assert node.fake.mounts() == [] and node.record(vid).stages == {}
    assert code_of(node.stage, vid, staging, cap=fs_cap("ext4", flags=["a,b"])) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_a_staging_path_that_is_taken_is_refused(node):
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    taken, a_file = node.staging("taken"), node.staging("file")
    os.makedirs(taken)
    node.fake.mount_tmpfs(taken, "somebody-else")
    os.makedirs(os.path.dirname(a_file))
    open(a_file, "w").close()
    for path in (taken, a_file):
        assert code_of(node.stage, vid, path, cap=fs_cap()) == \
            grpc.StatusCode.FAILED_PRECONDITION
    assert node.record(vid).stages == {}


def test_a_volume_used_as_a_block_device_is_not_formatted(node):
    vid = node.create("raw", params=FSDAX, caps=[block_cap()]).volume.volume_id
    target = node.block_target("p")
    node.publish(vid, target, cap=block_cap())
    staging = node.staging("raw")
    code, details = details_of(node.stage, vid, staging, cap=fs_cap())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "raw block device" in details
    node.unpublish(vid, target)
    code, details = details_of(node.stage, vid, staging, cap=fs_cap())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "used as a raw block" in details
    assert node.fake.fs_signature(device_of(node, vid)) is None


def test_a_pod_group_gets_the_file_system(node):
    gid = os.getgid()  # an unprivileged process may hand files to its own group only
    vid = node.create("grp", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging, target = node.staging("grp"), node.target("pod")
    node.stage(vid, staging, cap=fs_cap())
    os.mkdir(os.path.join(staging, "sub"))
    node.publish(vid, target, cap=fs_cap(group=str(gid)), staging=staging)
    for path in (staging, os.path.join(staging, "sub")):
        st = os.stat(path)
        assert st.st_gid == gid and st.st_mode & stat.S_ISGID and st.st_mode & stat.S_IWGRP
    assert node.record(vid).publications[target].mount_group == gid
    assert code_of(node.publish, vid, target, cap=fs_cap(group="x"), staging=staging) == \
        grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------ reconcile
def test_a_restart_keeps_stages_and_publications(node):
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging, target = node.staging("fs"), node.target("pod")
    node.stage(vid, staging, cap=fs_cap())
    node.publish(vid, target, cap=fs_cap(), staging=staging)
    node.restart()
    rec = node.record(vid)
    assert list(rec.stages) == [staging] and list(rec.publications) == [target]
    node.publish(vid, target, cap=fs_cap(), staging=staging)  # still idempotent
    node.unpublish(vid, target)
    node.unstage(vid, staging)
    node.delete(vid)


def test_a_reboot_drops_what_lost_its_mounts_and_keeps_the_data(node):
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    staging, target, blk = node.staging("fs"), node.target("pod"), node.block_target("b")
    node.stage(vid, staging, cap=fs_cap())
    with open(os.path.join(staging, "kept"), "w") as f:
        f.write("on the device")
    node.publish(vid, target, cap=fs_cap(), staging=staging)
    other = node.create("blk", params=FSDAX, caps=[block_cap()]).volume.volume_id
    node.publish(other, blk, readonly=True, cap=block_cap())
    node.reboot()
    for v in (vid, other):
        assert node.record(v).stages == {} and node.record(v).publications == {}
    assert node.fake.mounts() == []
    node.stage(vid, staging, cap=fs_cap())  # kubelet stages again: same file system
    with open(os.path.join(staging, "kept")) as f:
        assert f.read() == "on the device"
    node.unstage(vid, staging)
    for v in (vid, other):
        node.delete(v)
    assert node.backend.namespaces() == []


def test_an_interrupted_stage_is_finished_or_dropped_at_restart(node):
    vid = node.create("fs", params=FSDAX, caps=[fs_cap()]).volume.volume_id
    mounted, lost = node.staging("mounted"), node.staging("lost")
    node.stage(vid, lost, cap=fs_cap())
    node.fake.umount(lost)  # as if the crash came before the mount
    node.stage(vid, mounted, cap=fs_cap())  # the lost stage holds no mount: no refusal
    rec = node.record(vid)
    for path in (mounted, lost):
        rec.stages[path].state = STAGING
    node.driver.store.put(rec)
    node.restart()
    stages = node.record(vid).stages
    assert list(stages) == [mounted] and stages[mounted].state == STAGED
