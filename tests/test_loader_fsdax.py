"""fsdax sources for the loader, without torch or a GPU (CI): a weight file on a file
system mounted ``-o dax``, and a raw block device (``volumeMode: Block``).

What is held here: the cheap up-front decision that such mappings are never registered
with CUDA (the kernel refuses FOLL_LONGTERM pins of fsdax pages; a block device's
mapping is page cache, docs/design.md §1 and §3), the reason the loader records, and
that a model staged onto a block device loads byte-exact. No DAX-capable device exists
here, so DAX mounts are fed as mountinfo text; the block device is a real loop device
(root only, like the fd-delivery tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi_pmem.driver.host.mounts import MountInfo, mountinfo
from csi_pmem.loader import (
    VolumeError,
    export,
    load_numpy,
    open_model,
    open_volume,
    stage,
    start_load,
)
from csi_pmem.loader.gpu import AUTO, BOUNCE, HYBRID, REGISTERED, choose_path
from csi_pmem.weights import mapping as mapping_mod
from csi_pmem.weights.mapping import registration_refusal, statx_dax

import loader_models as lm

MiB = lm.MiB

needs_loop = pytest.mark.skipif(not lm.can_make_loop_devices(),
                                reason="needs root and losetup to create a loop device")


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-fsdax") as d:
        yield d









def refusal(path: Path, mounts: list[MountInfo] | None = None) -> str | None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return registration_refusal(fd, str(path), mounts=mounts)
    finally:
        os.close(fd)


def dax_mounts(tmp_path: Path, *mounts: tuple[str, str], dev_of: Path) -> list[MountInfo]:
    """(mount point, super options) pairs as ext4 on /dev/pmem0, through the real
    mountinfo parser."""
    text = lm.fake_mountinfo(tmp_path / "mountinfo",
                             [(p, "ext4", "/dev/pmem0", o) for p, o in mounts], dev_of)
    return mountinfo(str(text))


# --- the decision ------------------------------------------------------------------

def test_a_tmpfs_or_plain_file_may_be_registered(shm):
    vol = lm.volume_file(shm / "vol", 4 * MiB)
    fd = os.open(vol, os.O_RDONLY)
    try:
        assert statx_dax(fd) is not True
    finally:
        os.close(fd)
    assert refusal(vol) is None  # this process's real mountinfo
    with open_volume(vol) as v:
        assert v.registration_refused_reason is None
        # Today's behaviour is kept: registered on demand, or from the second load.
        assert choose_path(REGISTERED, v, 1, False, 2) == (REGISTERED, None)
        # A first load goes through bounce buffers, on small pages and on large ones
        # (registering piece by piece is only what mode="hybrid" asks for).
        assert choose_path(AUTO, v, 1, False, 2) == (BOUNCE, None)
        v.large_pages = True
        assert choose_path(AUTO, v, 1, False, 2) == (BOUNCE, None)
        assert choose_path(HYBRID, v, 1, False, 2) == (HYBRID, None)
        assert choose_path(AUTO, v, 2, False, 2) == (REGISTERED, None)
        assert choose_path(AUTO, v, 5, False, None) == (BOUNCE, None)
        assert choose_path(BOUNCE, v, 5, True, 2) == (BOUNCE, None)


@pytest.mark.parametrize(("fstype", "options", "large"), [
    ("tmpfs", "rw,huge=always", True), ("tmpfs", "rw,huge=within_size", True),
    ("tmpfs", "rw,size=1g", False), ("hugetlbfs", "rw,pagesize=2M", True),
    ("ext4", "rw,dax=always", False)])
def test_large_page_mappings_are_recognised(shm, tmp_path, fstype, options, large):
    from csi_pmem.mountinfo import MountInfo
    from csi_pmem.weights.mapping import large_pages

    vol = lm.volume_file(shm / "vol", 4 * MiB)
    st = os.stat(vol)
    mounts = [MountInfo(str(shm), fstype, "none", frozenset(options.split(",")),
                        dev=f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")]
    fd = os.open(vol, os.O_RDONLY)
    try:
        assert large_pages(fd, str(vol), mounts=mounts) is large
    finally:
        os.close(fd)


@pytest.mark.parametrize("options", ["rw,dax=always", "rw,dax", "rw,relatime,dax=always"])
def test_a_file_on_a_dax_mount_is_refused_with_the_reason(shm, tmp_path, options):
    vol = lm.volume_file(shm / "vol", 4 * MiB)
    mounts = dax_mounts(tmp_path, (str(shm), options), dev_of=vol)
    reason = refusal(vol, mounts)
    assert reason is not None
    assert str(vol) in reason and f"at {shm}" in reason and "ext4 /dev/pmem0" in reason
    assert "dax" in reason and "fsdax" in reason and "cudaHostRegister" in reason


@pytest.mark.parametrize("options", ["rw", "rw,dax=never", "rw,dax=inode"])
def test_a_mount_without_dax_everywhere_keeps_registration(shm, tmp_path, options):
    # dax=inode leaves it to each file: statx answers for those (not DAX here).
    vol = lm.volume_file(shm / "vol", 4 * MiB)
    assert refusal(vol, dax_mounts(tmp_path, (str(shm), options), dev_of=vol)) is None


def test_the_mount_holding_the_file_decides(shm, tmp_path):
    inner = shm / "inner"
    inner.mkdir()
    vol = lm.volume_file(inner / "vol", 4 * MiB)

    def check(*mounts: tuple[str, str]) -> bool:
        return refusal(vol, dax_mounts(tmp_path, *mounts, dev_of=vol)) is not None

    # The deepest mount point above the file wins, whatever the order.
    assert not check((str(shm), "rw,dax=always"), (str(inner), "rw"))
    assert check((str(inner), "rw,dax=always"), (str(shm), "rw"))
    # A mount point that merely shares a prefix does not hold the file.
    assert not check((f"{inner}-other", "rw,dax=always"), (str(shm), "rw"))
    # Stacked on one point: the last listed is on top.
    assert not check((str(inner), "rw,dax=always"), (str(inner), "rw"))
    assert check((str(inner), "rw"), (str(inner), "rw,dax=always"))
    # Trailing slashes and symlinks to the file do not matter.
    link = shm / "link"
    link.symlink_to(vol)
    assert refusal(link, dax_mounts(tmp_path, (f"{inner}/", "rw,dax"), dev_of=vol))


def test_the_file_system_is_found_by_device_too(shm, tmp_path):
    vol = lm.volume_file(shm / "vol", 4 * MiB)
    # An fd received over a socket has no path here: its device finds the mount.
    mounts = dax_mounts(tmp_path, ("/somewhere/else", "rw,dax=always"), dev_of=vol)
    fd = os.open(vol, os.O_RDONLY)
    try:
        assert "DAX file system" in (registration_refusal(fd, None, mounts=mounts) or "")
    finally:
        os.close(fd)
    # A DAX mount over the path that is another file system (mounted over the file's
    # directory after it was opened, say) is not where the file is.
    other = lm.fake_mountinfo(tmp_path / "other", [(str(shm), "ext4", "/dev/pmem0",
                                                   "rw,dax=always")], dev="259:99")
    assert refusal(vol, mountinfo(str(other))) is None


def test_open_volume_records_the_refusal_and_loads_on_the_cpu(shm, tmp_path, monkeypatch):
    lm.sharded_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    fake = lm.fake_mountinfo(tmp_path / "mountinfo",
                             [(str(shm), "xfs", "/dev/pmem1", "rw,attr2,dax=always")], vol)
    monkeypatch.setattr(mapping_mod, "MOUNTINFO", str(fake))
    with open_volume(vol) as v:
        reason = v.registration_refused_reason
        assert reason and "xfs /dev/pmem1" in reason and "dax=always" in reason
        for mode in (AUTO, REGISTERED, BOUNCE):
            for loads in (1, 2, 3):
                assert choose_path(mode, v, loads, False, 2) == (BOUNCE, reason)
        lm.assert_same(load_numpy(v), lm.reference(shm / "src"))
    handle = start_load(str(vol), "cpu", framework="numpy")
    assert handle.view.volume.registration_refused_reason == reason
    lm.assert_same(handle.result(), lm.reference(shm / "src"))


def test_a_failed_registration_is_remembered():
    class V:
        registration_refused_reason = None

    why = "cudaHostRegister ... failed: operation not supported"
    for mode in (AUTO, REGISTERED):
        assert choose_path(mode, V(), 3, True, 2, refused=why) == (BOUNCE, why)


# --- raw block devices -------------------------------------------------------------

@pytest.fixture
def loop(shm):
    """A loop device over a 33 MiB file: not a multiple of the 2 MiB align."""
    if not lm.can_make_loop_devices():
        pytest.skip("needs root and losetup to create a loop device")
    backing = shm / "backing.img"
    with open(backing, "wb") as f:
        f.truncate(33 * MiB)
    with lm.loop_device(backing) as device:
        yield device


@needs_loop
def test_a_block_device_is_refused(loop):
    assert os.stat(loop).st_size == 0
    reason = refusal(Path(loop))
    assert reason and loop in reason and "block device" in reason
    with open_volume(loop) as v:
        # The size comes from the device (st_size is 0), rounded down to the align.
        assert v.size == 32 * MiB and v.align == 2 * MiB
        assert v.registration_refused_reason == reason
        assert v.metadata["block_device"] is True
        assert choose_path(REGISTERED, v, 1, False, 2) == (BOUNCE, reason)


@needs_loop
def test_a_model_staged_on_a_block_device_loads_byte_exact(shm, loop):
    ref = lm.sharded_model(shm / "src")
    with open_volume(loop, writable=True) as v:
        assert v.size == 32 * MiB
        result = stage(v, str(shm / "src"), name="llm")
        assert result.copied > 0
    lm.assert_same(load_numpy(loop, verify=True), ref)
    handle = start_load(loop, "cpu", framework="numpy",
                        predicate=lambda n: n.startswith("layers.1."))
    assert set(handle.result()) == {k for k in ref if k.startswith("layers.1.")}
    assert handle.path == "cpu-view"
    assert "block device" in (handle.view.volume.registration_refused_reason or "")
    view = open_model(loop)
    try:
        assert view.model.name == "llm"
    finally:
        view.volume.close()
    with open_volume(loop) as v:
        export(v, str(shm / "out"))
    assert lm.tree_digest(shm / "out") == lm.tree_digest(shm / "src")
    # The bytes went through the device into its backing file.
    with open_volume(shm / "backing.img", align=MiB) as v:
        lm.assert_same(load_numpy(v), ref)


@needs_loop
def test_a_block_device_smaller_than_the_align_is_refused(shm):
    backing = shm / "tiny.img"
    with open(backing, "wb") as f:
        f.truncate(1 * MiB)
    with lm.loop_device(backing) as device, pytest.raises(VolumeError, match="smaller than"):
        open_volume(device)
