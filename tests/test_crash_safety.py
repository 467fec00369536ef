"""SIGKILL the real driver at every fail point, restart it, and check nothing is lost.

Why: the volume life cycle writes its intent to a per-volume record before acting so
that start-up can finish or roll back whatever a crash interrupted. The only honest
test is to kill the real process between two steps (``CSI_PMEM_FAILPOINTS``) and then
look at everything a user could notice: leaked pool space, lost volumes or data,
records stuck in a transient state, stray tmpfs mounts, and whether the CO's retry of
the interrupted call succeeds. Each fail point is also checked *at* the crash (before
the restart) so a fail point that fires in the wrong place, or not at all, is noticed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from csi_pmem import failpoints
from csi_pmem.daxclient import DaxSocketError, map_volume, open_volume
from csi_pmem.driver.core import volume_id_for
from csi_pmem.driver.host import mounts

from conftest import (
    DriverProcess,
    MiB,
    backing_ids,
    mounts_below,
    needs_root,
    record_state,
    records,
)

pytestmark = [needs_root(), pytest.mark.root]

BLOCK = 4096
NUMA_NODES = (0, 1)
VICTIM = "victim"
VICTIM_ID = volume_id_for(VICTIM)
VICTIM_SIZE = 48 * MiB


# --------------------------------------------------------------------------- helpers
def offsets(usable: int) -> tuple[int, ...]:
    """Where patterns go: the first, a middle and the last block of the volume."""
    return (0, (usable // 2) // BLOCK * BLOCK, usable - BLOCK)


def pattern(vid: str) -> bytes:
    return (hashlib.sha256(vid.encode()).digest() * (BLOCK // 32))[:BLOCK]


def write_pattern(target: str) -> dict:
    """Write the volume's pattern through its dax.sock (as a pod would); return metadata."""
    meta, mm = map_volume(target)
    with mm:
        for off in offsets(meta["usable_size"]):
            mm[off:off + BLOCK] = pattern(meta["volume_id"])
        mm.flush()
    return meta


def read_blocks(target: str) -> tuple[dict, list[bytes]]:
    """The pattern blocks read through the volume's dax.sock, read-only."""
    meta, mm = map_volume(target, writable=False)
    with mm:
        return meta, [bytes(mm[off:off + BLOCK]) for off in offsets(meta["usable_size"])]


def assert_pattern(target: str, vid: str) -> None:
    meta, blocks = read_blocks(target)
    assert meta["volume_id"] == vid
    assert blocks == [pattern(vid)] * 3, f"data of {vid} was not preserved"


def assert_zeros(target: str, vid: str) -> None:
    meta, blocks = read_blocks(target)
    assert meta["volume_id"] == vid
    assert blocks == [b"\0" * BLOCK] * 3, f"new volume {vid} does not read as zeros"


def backing_file(d: DriverProcess, vid: str) -> Path | None:
    found = [p for p in d.pool_files() if p.name.partition("~")[0] == vid]
    assert len(found) <= 1, f"{vid} has several backing files: {found}"
    return found[0] if found else None


def capacities(d: DriverProcess) -> dict[int, tuple[int, int]]:
    """(available, maximum volume size) per NUMA pool."""
    out = {}
    for n in NUMA_NODES:
        resp = d.capacity({"numaNode": str(n)})
        out[n] = (resp.available_capacity, resp.maximum_volume_size.value)
    return out


def assert_consistent(d: DriverProcess, expected: set[str]) -> None:
    """Volumes, backing files, records and mounts all tell the same story, nothing pending."""
    listed = d.list_ids()
    assert sorted(listed) == sorted(expected), "ListVolumes lost or invented a volume"
    assert backing_ids(d) == sorted(listed), "pool files differ from the volumes (leak?)"
    recs = records(d)
    assert sorted(recs) == sorted(listed), "state records differ from the volumes"
    for vid, rec in recs.items():
        assert rec["state"] == "ready", f"{vid} left in state {rec['state']}"
        for target, pub in rec["publications"].items():
            assert pub["state"] == "published", f"{vid} at {target} left in {pub['state']}"
    have = sorted((m.mount_point, m.source) for m in mounts_below(d))
    want = sorted((t, mounts.source_for(vid)) for vid, rec in recs.items()
                  for t in rec["publications"])
    assert have == want, "tmpfs mounts differ from the recorded publications"


def assert_unmounted(target: str) -> None:
    assert mounts.find(target) is None, f"{target} is still mounted"
    assert not os.path.exists(target), f"{target} was left behind"


# ------------------------------------------------------------- state at the crash
# What each fail point must leave on disk at the moment of the SIGKILL. Looking at it
# before the restart proves the fail point fired where its name says (and at all).
def _victim_record(d: DriverProcess) -> dict:
    rec = records(d).get(VICTIM_ID)
    assert rec is not None, "the victim's record is gone at the crash"
    return rec


def _file_blocks(path: Path, usable: int) -> list[bytes]:
    with open(path, "rb") as f:
        return [os.pread(f.fileno(), BLOCK, off) for off in offsets(usable)]


def _crashed_create(has_namespace: bool):
    def check(d: DriverProcess, target: str) -> None:
        assert _victim_record(d)["state"] == "creating"
        assert (backing_file(d, VICTIM_ID) is not None) == has_namespace
    return check


def _crashed_delete(stage: str):
    def check(d: DriverProcess, target: str) -> None:
        rec = _victim_record(d)
        assert rec["state"] == "deleting"
        path = backing_file(d, VICTIM_ID)
        if stage == "destroyed":
            assert path is None, "the namespace should be destroyed at this point"
            return
        assert path is not None, "the namespace should still exist at this point"
        blocks = _file_blocks(path, rec["usable_size"])
        if stage == "erased":
            assert blocks == [b"\0" * BLOCK] * 3, "the volume was not erased before destroy"
        else:
            assert blocks == [pattern(VICTIM_ID)] * 3, "the volume was erased too early"
    return check


def _crashed_publish(stage: str):
    def check(d: DriverProcess, target: str) -> None:
        pub = _victim_record(d)["publications"].get(target)
        assert pub is not None and pub["state"] == "publishing"
        m = mounts.find(target)
        sock = os.path.join(target, "dax.sock")
        if stage == "recorded":
            assert m is None, "nothing should be mounted yet"
            return
        assert m is not None and m.source == mounts.source_for(VICTIM_ID)
        if stage == "mounted":
            assert not os.path.exists(sock) and not os.path.exists(
                os.path.join(target, "volume.json"))
            return
        assert m.readonly and os.path.exists(sock)
        with pytest.raises(DaxSocketError):
            open_volume(target, timeout=2)  # its server died with the driver
    return check


def _crashed_unpublish(d: DriverProcess, target: str) -> None:
    pub = _victim_record(d)["publications"].get(target)
    assert pub is not None and pub["state"] == "unpublishing"
    assert mounts.find(target) is None and os.path.isdir(target)


AT_CRASH = {
    failpoints.CREATE_AFTER_RECORD: _crashed_create(has_namespace=False),
    failpoints.CREATE_AFTER_NAMESPACE: _crashed_create(has_namespace=True),
    failpoints.DELETE_AFTER_RECORD: _crashed_delete("recorded"),
    failpoints.DELETE_AFTER_ERASE: _crashed_delete("erased"),
    failpoints.DELETE_AFTER_DESTROY: _crashed_delete("destroyed"),
    failpoints.PUBLISH_AFTER_RECORD: _crashed_publish("recorded"),
    failpoints.PUBLISH_AFTER_MOUNT: _crashed_publish("mounted"),
    failpoints.PUBLISH_AFTER_SOCKET: _crashed_publish("socket"),
    failpoints.UNPUBLISH_AFTER_UMOUNT: _crashed_unpublish,
}


def test_every_fail_point_has_a_scenario():
    assert set(AT_CRASH) == set(failpoints.ALL)


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("point", failpoints.ALL)
def test_sigkill_at_fail_point(driver_factory, point):
    op = point.split("-")[0]
    d = driver_factory().start()
    initial = capacities(d)

    # A bystander volume, published and holding data, must survive every crash.
    keep = d.create("bystander", size=32 * MiB, params={"numaNode": "0"}).volume
    keep_target = d.target("bystander")
    d.publish(keep.volume_id, keep_target)
    write_pattern(keep_target)
    before = capacities(d)
    assert before[0] != initial[0] and before[1] == initial[1]

    target = d.target("victim")
    if op != "create":
        vol = d.create(VICTIM, size=VICTIM_SIZE, params={"numaNode": "1"}).volume
        assert vol.volume_id == VICTIM_ID
        seed = target if op == "unpublish" else d.target("seed")
        d.publish(VICTIM_ID, seed)
        write_pattern(seed)
        if op != "unpublish":
            d.unpublish(VICTIM_ID, seed)
            assert_unmounted(seed)

    calls = {
        "create": lambda: d.create(VICTIM, size=VICTIM_SIZE, params={"numaNode": "1"}),
        "delete": lambda: d.delete(VICTIM_ID),
        "publish": lambda: d.publish(VICTIM_ID, target),
        "unpublish": lambda: d.unpublish(VICTIM_ID, target),
    }
    d.restart(failpoints=point)
    with pytest.raises(grpc.RpcError) as info:
        calls[op]()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert d.wait_exit(10) == -signal.SIGKILL
    d.kill()  # drops the dead channel
    AT_CRASH[point](d, target)

    d.start()
    survivors = {keep.volume_id} | ({VICTIM_ID} if op in ("publish", "unpublish") else set())
    assert_consistent(d, survivors)
    assert_pattern(keep_target, keep.volume_id)  # served again after the restart, intact

    # The CO retries the interrupted call; it must succeed.
    if op == "create":
        vol = d.create(VICTIM, size=VICTIM_SIZE, params={"numaNode": "1"}).volume
        assert vol.volume_id == VICTIM_ID and vol.capacity_bytes >= VICTIM_SIZE
        assert_consistent(d, {keep.volume_id, VICTIM_ID})
        d.publish(VICTIM_ID, target)
        assert_zeros(target, VICTIM_ID)
        d.unpublish(VICTIM_ID, target)
    elif op == "delete":
        d.delete(VICTIM_ID)
    elif op == "publish":
        d.publish(VICTIM_ID, target)
        assert_consistent(d, survivors)
        assert mounts.find(target).source == mounts.source_for(VICTIM_ID)
        assert_pattern(target, VICTIM_ID)
        d.unpublish(VICTIM_ID, target)
    else:
        d.unpublish(VICTIM_ID, target)
        assert_consistent(d, survivors)
        republished = d.target("again")
        d.publish(VICTIM_ID, republished)
        assert_pattern(republished, VICTIM_ID)
        d.unpublish(VICTIM_ID, republished)
        assert_unmounted(republished)
    assert_unmounted(target)

    if op != "delete":
        d.delete(VICTIM_ID)
    assert_consistent(d, {keep.volume_id})
    assert capacities(d) == before, "space of the victim was not given back"
    assert_pattern(keep_target, keep.volume_id)

    d.unpublish(keep.volume_id, keep_target)
    d.delete(keep.volume_id)
    assert_consistent(d, set())
    assert capacities(d) == initial
    assert mounts_below(d) == []


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def test_sigkill_during_erase_of_large_volume(driver_factory):
    d = driver_factory(regions="0=1Gi").start()
    initial = d.capacity().available_capacity
    vol = d.create("big", size=512 * MiB).volume
    vid = vol.volume_id
    seed = d.target("big")
    d.publish(vid, seed)
    write_pattern(seed)
    d.unpublish(vid, seed)
    path = backing_file(d, vid)
    assert path is not None

    errors: list[grpc.RpcError] = []

    def delete() -> None:
        try:
            d.delete(vid)
        except grpc.RpcError as exc:
            errors.append(exc)

    # Stopped for certain in the middle of the erase (its first chunk zeroed), however
    # fast or loaded the machine: then killed.
    d.restart(failpoints=f"{failpoints.ERASE_MID}=stall")
    worker = threading.Thread(target=delete)
    worker.start()
    _wait_for(lambda: "failpoint erase-mid stalled" in d.log.read_text(), 30,
              "the erase to reach its middle")
    d.proc.send_signal(signal.SIGKILL)
    assert d.wait_exit(10) == -signal.SIGKILL
    worker.join(30)
    assert not worker.is_alive()
    # The RPC was cut by the kill, or had returned (the erase goes on in the background
    # after --delete-wait-seconds): either way the erase never finished.
    assert [e.code() for e in errors] in ([], [grpc.StatusCode.UNAVAILABLE])
    d.kill()

    # Killed mid-erase: the record says deleting, the namespace is still there.
    assert records(d)[vid]["state"] == "deleting"
    assert path.exists(), "the delete finished before the kill; the test proves nothing"
    assert f"erased {vid}" not in d.log.read_text()

    d.start()
    d.delete(vid)  # the CO's retry; returns after --delete-wait-seconds at the latest
    # record_state, not records(): the running driver's atomic writes leave a temp file
    # in the store for a moment, which records() (for a stopped driver) rejects.
    _wait_for(lambda: record_state(d, vid) is None, 60,
              "the resumed erase (slow on a loaded machine)")
    assert_consistent(d, set())
    assert not path.exists()
    assert d.capacity().available_capacity == initial
    log = d.log.read_text()
    assert f"finished interrupted deletion of {vid}" in log
    # One complete erase: the one start-up ran to finish the deletion.
    assert sum(f"erased {vid}:" in line for line in log.splitlines()) == 1
    assert mounts_below(d) == []
