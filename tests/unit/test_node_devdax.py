"""devdax node RPCs in-process: publish, idempotency, target checks, dax.sock, reconcile.

The driver runs here as an ordinary user over the emulated back end and the fake mounter
(``inprocess.py``); the same paths through real tmpfs mounts are in the integration tier
(``tests/test_grpc_driver.py``, ``tests/test_crash_safety.py``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os

import grpc
import pytest

from csi_pmem.daxclient import DaxSocketError, open_volume
from csi_pmem.driver.host import mounts
from csi_pmem.driver.node import busy
from csi_pmem.driver.state import PUBLISHED, PUBLISHING, UNPUBLISHING

from conftest import MiB, Mode, block_cap, mount_cap
from inprocess import InProcessNode, code_of, node_fixture  # noqa: F401 (the fixture)

POD = "0b5e7c5e-1111-4a4a-9c9c-000000000001"


def details_of(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code(), info.value.details()


def test_publish_mounts_a_sealed_tmpfs_that_hands_out_the_device(node):
    vol = node.create("vol", size=64 * MiB).volume
    vid, target = vol.volume_id, node.target("pod-a")
    node.pod(POD)
    node.publish(vid, target, pod_uid=POD)
    mount = node.fake.find(target)
    assert (mount.fstype, mount.source, mount.readonly) == ("tmpfs", mounts.source_for(vid),
                                                             True)
    with open(os.path.join(target, "volume.json")) as f:
        meta = json.load(f)
    assert meta["volume_id"] == vid and meta["readonly"] is False
    got, fd = open_volume(target)
    try:
        assert got["usable_size"] == vol.capacity_bytes
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    finally:
        os.close(fd)
    assert node.record(vid).publications[target].state == PUBLISHED
    node.unpublish(vid, target)
    assert node.fake.find(target) is None and not os.path.lexists(target)
    assert node.record(vid).publications == {}
    with pytest.raises(DaxSocketError):
        open_volume(target)


def test_a_peer_outside_the_pod_gets_no_fd(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.pod("another-pod-uid")
    node.publish(vid, target, pod_uid=POD)
    with pytest.raises(DaxSocketError) as info:
        open_volume(target)
    assert "pod" in str(info.value)
    node.unpublish(vid, target)


def test_read_only_publication_hands_out_a_read_only_fd(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("reader")
    node.publish(vid, target, cap=mount_cap(Mode.SINGLE_NODE_READER_ONLY))
    assert node.record(vid).publications[target].readonly
    meta, fd = open_volume(target)
    try:
        assert meta["readonly"] is True
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    finally:
        os.close(fd)
    node.unpublish(vid, target)


def test_publish_and_unpublish_are_idempotent(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.publish(vid, target)
    done = len(node.fake.calls)
    node.publish(vid, target)  # the same request again: nothing to do
    assert node.fake.calls[done:] == []
    # The same target with other options: ALREADY_EXISTS, and the publication stays.
    assert code_of(node.publish, vid, target, readonly=True) == grpc.StatusCode.ALREADY_EXISTS
    assert node.fake.find(target) is not None
    node.unpublish(vid, target)
    node.unpublish(vid, target)  # gone already: OK
    node.unpublish(vid, node.target("never-published"))  # unknown target: OK
    assert code_of(node.publish, "pmem-" + "0" * 32, target) == grpc.StatusCode.NOT_FOUND


def test_a_socket_that_went_away_is_served_again_by_a_repeated_publish(node):
    vol = node.create("vol").volume
    vid, target = vol.volume_id, node.target("pod-a")
    node.publish(vid, target)
    node.dax.stop(os.path.join(target, "dax.sock"))
    with pytest.raises(DaxSocketError):  # gone: nothing serves the volume now
        open_volume(target)
    node.publish(vid, target)
    meta, fd = open_volume(target)
    try:  # served again, and by this volume's publication
        assert (meta["volume_id"], meta["usable_size"]) == (vid, vol.capacity_bytes)
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    finally:
        os.close(fd)
    assert node.record(vid).publications[target].state == PUBLISHED
    node.unpublish(vid, target)


@pytest.mark.parametrize("target", ["relative/mount", "/", "{k}/pods/../../escape",
                                    "{k}/pods/a//mount", "/elsewhere/mount", "{k}",
                                    "{k}/" + "x" * 256])
def test_targets_outside_the_kubelet_directory_or_malformed_are_refused(node, target):
    """By every node call alike: unpublish and unstage too answer INVALID_ARGUMENT, not
    "done", for a path that publish and stage refuse (issue 45: unpublish /etc was OK)."""
    vid = node.create("vol").volume.volume_id
    target = target.format(k=node.kubelet)
    for call in (node.publish, node.unpublish, node.stage, node.unstage):
        code, details = details_of(call, vid, target)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (call.__name__, details)
        field = "target_path" if "publish" in call.__name__ else "staging_target_path"
        assert details.startswith(f"{field} "), details
    assert node.fake.mounts() == []


def test_unpublish_of_etc_is_invalid_argument_naming_the_kubelet_directory(node):
    vid = node.create("vol").volume.volume_id
    code, details = details_of(node.unpublish, vid, "/etc")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the kubelet directory" in details and str(node.kubelet) in details


def test_a_symlink_out_of_the_kubelet_directory_is_refused(node):
    vid = node.create("vol").volume.volume_id
    outside = node.base / "outside"
    outside.mkdir()
    (node.kubelet / "pods").mkdir()
    (node.kubelet / "pods" / "link").symlink_to(outside)
    assert code_of(node.publish, vid, str(node.kubelet / "pods" / "link" / "mount")) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_what_already_occupies_a_target_is_never_mounted_over(node):
    vid = node.create("vol").volume.volume_id
    other = node.create("other").volume.volume_id
    full, file_, foreign, taken = (node.target(p) for p in ("full", "file", "foreign",
                                                            "taken"))
    os.makedirs(full)
    open(os.path.join(full, "data"), "w").close()
    os.makedirs(os.path.dirname(file_))
    open(file_, "w").close()
    os.makedirs(foreign)
    node.fake.mount_tmpfs(foreign, "somebody-else")
    node.publish(other, taken)
    for target in (full, file_, foreign):
        assert code_of(node.publish, vid, target) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(node.publish, vid, taken) == grpc.StatusCode.ALREADY_EXISTS
    assert os.listdir(full) == ["data"]
    assert node.fake.find(foreign).source == "somebody-else"
    assert vid not in {m.source.removeprefix(mounts.SOURCE_PREFIX)
                       for m in node.fake.mounts()}
    assert node.record(vid).publications == {}
    node.unpublish(vid, foreign)  # not ours: left alone
    assert node.fake.find(foreign).source == "somebody-else"


def test_block_access_on_a_devdax_volume_is_refused(node):
    vid = node.create("vol").volume.volume_id
    assert code_of(node.publish, vid, node.block_target("p"), cap=block_cap()) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_unpublish_retries_while_the_target_is_busy_for_a_moment(node, monkeypatch):
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.publish(vid, target)
    node.fake.busy(target, times=2)  # e.g. a fork holding the socket's fd
    node.unpublish(vid, target)
    assert node.fake.find(target) is None
    node.publish(vid, target)
    monkeypatch.setattr(busy, "UMOUNT_BUSY_SECONDS", 0.05)
    node.fake.busy(target, times=10**6)
    assert code_of(node.unpublish, vid, target) == grpc.StatusCode.INTERNAL
    assert node.record(vid).publications[target].state == UNPUBLISHING
    node.fake.busy(target, times=0)
    node.unpublish(vid, target)
    assert node.record(vid).publications == {}


def test_delete_refuses_a_published_volume(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.publish(vid, target)
    assert code_of(node.delete, vid) == grpc.StatusCode.FAILED_PRECONDITION
    node.unpublish(vid, target)
    node.delete(vid)
    assert node.backend.namespaces() == []


# ------------------------------------------------------------------ reconcile
def test_a_restart_serves_every_publication_again(node):
    vid = node.create("vol").volume.volume_id
    targets = [node.target(p) for p in ("a", "b")]
    for t in targets:
        node.publish(vid, t)
    node.restart()
    for t in targets:
        assert node.fake.find(t).readonly  # still mounted and sealed
        _, fd = open_volume(t)
        os.close(fd)
    assert set(node.record(vid).publications) == set(targets)


def test_a_reboot_drops_the_publications_whose_mounts_are_gone(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("a")
    node.publish(vid, target)
    node.reboot()
    assert node.record(vid).publications == {}
    node.publish(vid, target)  # kubelet publishes again
    node.unpublish(vid, target)
    node.delete(vid)


def test_a_restart_finishes_an_interrupted_publish_and_unpublish(node):
    vid = node.create("vol").volume.volume_id
    half_published, half_unpublished = node.target("p"), node.target("u")
    for t in (half_published, half_unpublished):
        node.publish(vid, t)
    # What a crash leaves: the records say publishing / unpublishing, the mounts stay.
    rec = node.record(vid)
    rec.publications[half_published].state = PUBLISHING
    rec.publications[half_unpublished].state = UNPUBLISHING
    node.driver.store.put(rec)
    node.restart()
    pubs = node.record(vid).publications
    assert list(pubs) == [half_published] and pubs[half_published].state == PUBLISHED
    _, fd = open_volume(half_published)
    os.close(fd)
    assert node.fake.find(half_unpublished) is None
    assert not os.path.lexists(half_unpublished)


def test_a_publish_that_left_no_mount_is_dropped_at_restart(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("p")
    node.publish(vid, target)
    node.fake.umount(target)  # as if the crash came before the mount
    rec = node.record(vid)
    rec.publications[target].state = PUBLISHING
    node.driver.store.put(rec)
    node.restart()
    assert node.record(vid).publications == {}
    assert not os.path.lexists(target)


def test_reconcile_reports_orphans_and_rolls_back_interrupted_creates(node):
    kept = node.create("kept").volume.volume_id
    lost = node.create("lost").volume.volume_id
    half = node.create("half").volume.volume_id
    node.driver.store.delete(lost)  # a namespace without a record
    rec = node.record(half)
    rec.state = "creating"
    node.driver.store.put(rec)
    node.restart()
    assert node.driver.orphans == [lost]
    assert {ns.name for ns in node.backend.namespaces()} == {kept, lost}
    assert node.record(half) is None


# ---------------------------------------------------------------- device_node (NRI)
def _meta(target: str) -> dict:
    with open(os.path.join(target, "volume.json")) as f:
        return json.load(f)


def test_volume_json_names_no_device_node_unless_asked(node):
    vid = node.create("vol").volume.volume_id
    target = node.target("pod-a")
    node.publish(vid, target, pod_uid=POD)
    assert "device_node" not in _meta(target)


@pytest.fixture(name="nri_node")
def nri_node_fixture():
    n = InProcessNode(device_node=True)
    yield n
    n.close()


def test_a_file_backed_volume_gets_no_device_node_and_says_why(nri_node, caplog):
    vid = nri_node.create("vol").volume.volume_id
    target = nri_node.target("pod-a")
    nri_node.publish(vid, target, pod_uid=POD)
    assert "device_node" not in _meta(target)
    assert any("is not a device node" in r.getMessage() and vid in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("readonly", [False, True])
def test_a_device_node_is_named_with_its_number_and_path_in_the_container(
        nri_node, monkeypatch, readonly):
    vid = nri_node.create("vol").volume.volume_id
    real_get = nri_node.backend.get

    def get(name):  # the volume's device is a real character device (not a devdax name)
        ns = real_get(name)
        return dataclasses.replace(ns, device="/dev/null") if ns is not None else None

    monkeypatch.setattr(nri_node.backend, "get", get)
    target = nri_node.target("pod-a")
    nri_node.publish(vid, target, pod_uid=POD, readonly=readonly)
    st = os.stat("/dev/null")
    meta = _meta(target)
    assert meta["device_node"] == {"path": f"/dev/csi-pmem/{vid}", "type": "c",
                                   "major": os.major(st.st_rdev),
                                   "minor": os.minor(st.st_rdev)}
    assert meta["readonly"] is readonly
    assert nri_node.fake.find(target).readonly  # sealed: what the plugin checks


def test_a_devdax_device_keeps_its_name(nri_node, monkeypatch):
    vid = nri_node.create("vol").volume.volume_id
    real_get = nri_node.backend.get
    fake_dax = nri_node.base / "dax3.1"
    os.symlink("/dev/zero", fake_dax)  # a character device whose name is a devdax name
    monkeypatch.setattr(nri_node.backend, "get", lambda name: dataclasses.replace(
        real_get(name), device=str(fake_dax)))
    target = nri_node.target("pod-a")
    nri_node.publish(vid, target, pod_uid=POD)
    assert _meta(target)["device_node"]["path"] == "/dev/dax3.1"
    assert _meta(target)["device_node"]["type"] == "c"
