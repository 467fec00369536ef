"""Many CSI calls at once against the real driver: nothing lost, nothing doubled.

Why: external-provisioner and kubelet retry aggressively and in parallel. The driver
promises per-volume in-flight slots (a second call on a busy volume fails fast with
ABORTED, never queues or doubles the work), a node-wide lock around namespace
create/destroy, and capacity that adds up afterwards. These tests hammer those
promises over real gRPC with threads released together, then check the pools, the
state records and the mounts directly.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from csi_pmem.daxclient import map_volume, open_volume
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

NUMA_NODES = (0, 1)
ABORTED = grpc.StatusCode.ABORTED


# --------------------------------------------------------------------------- helpers
def capacities(d: DriverProcess) -> dict[int, tuple[int, int]]:
    out = {}
    for n in NUMA_NODES:
        resp = d.capacity({"numaNode": str(n)})
        out[n] = (resp.available_capacity, resp.maximum_volume_size.value)
    return out


def assert_empty(d: DriverProcess, initial: dict) -> None:
    assert d.list_ids() == []
    assert d.pool_files() == []
    assert records(d) == {}
    assert mounts_below(d) == []
    assert capacities(d) == initial


def retry_aborted(call, *args, timeout: float = 60, **kw):
    """Call until it returns something other than ABORTED; return (result, abort count)."""
    deadline = time.monotonic() + timeout
    aborted = 0
    while True:
        try:
            return call(*args, **kw), aborted
        except grpc.RpcError as exc:
            if exc.code() != ABORTED or time.monotonic() > deadline:
                raise
            aborted += 1
            time.sleep(random.uniform(0.005, 0.03))


def run_all(fn, items, workers: int) -> list:
    """Run fn over items in a thread pool; re-raise the first failure."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


# ---------------------------------------------------------------------------- tests
def test_same_name_created_concurrently(driver):
    d = driver
    n = 16
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def create(i: int) -> None:
        barrier.wait()
        try:
            results[i] = d.create("one-name", size=64 * MiB).volume
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)

    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    oks = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert [e.code() for e in errors] == [ABORTED] * len(errors), \
        [(e.code(), e.details()) for e in errors]
    assert oks, "no call succeeded"
    vid = volume_id_for("one-name")
    assert {v.volume_id for v in oks} == {vid}
    assert len({v.SerializeToString(deterministic=True) for v in oks}) == 1
    assert backing_ids(d) == [vid], "exactly one backing file"
    log = d.log.read_text()
    assert log.count(f"created volume {vid} (one-name)") == 1, "the volume was created twice"
    assert "rolled back" not in log, "one call undid another's creation"
    final = d.create("one-name", size=64 * MiB).volume
    assert final == oks[0]
    assert d.list_ids() == [vid]
    assert list(records(d)) == [vid] and records(d)[vid]["state"] == "ready"


def test_many_volumes_created_then_deleted_concurrently(driver):
    d = driver
    initial = capacities(d)
    rng = random.Random(7)
    names = [f"many-{i:02d}" for i in range(50)]
    sizes = {name: rng.randint(1, 12) * MiB for name in names}

    def create(name: str) -> int:
        vol, aborted = retry_aborted(d.create, name, size=sizes[name])
        assert vol.volume.volume_id == volume_id_for(name)
        assert vol.volume.capacity_bytes >= sizes[name]
        return aborted

    run_all(create, names, 16)
    ids = sorted(volume_id_for(n) for n in names)
    assert sorted(d.list_ids()) == ids
    assert backing_ids(d) == ids
    recs = records(d)
    assert sorted(recs) == ids and {r["state"] for r in recs.values()} == {"ready"}
    after = capacities(d)
    assert all(after[n][0] < initial[n][0] for n in NUMA_NODES), "auto placement is unbalanced"

    run_all(lambda vid: retry_aborted(d.delete, vid), ids, 16)
    assert_empty(d, initial)


def test_concurrent_creates_never_overcommit_a_pool(driver_factory):
    """Twelve 64 MiB volumes race for a 256 MiB pool: exactly four win, the rest are told."""
    d = driver_factory(regions="0=256Mi").start()
    initial = d.capacity().available_capacity
    n = 12
    barrier = threading.Barrier(n)

    def create(i: int):
        barrier.wait()
        try:
            return d.create(f"race-{i}", size=60 * MiB).volume.volume_id
        except grpc.RpcError as exc:
            return exc.code()

    results = run_all(create, range(n), n)
    won = sorted(r for r in results if isinstance(r, str))
    lost = [r for r in results if not isinstance(r, str)]
    assert len(won) == 4 and lost == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (n - 4), results
    assert sorted(d.list_ids()) == won and backing_ids(d) == won
    assert sum(p.stat().st_size for p in d.pool_files()) == 256 * MiB
    assert d.capacity().available_capacity == 0
    run_all(d.delete, won, len(won))
    assert d.capacity().available_capacity == initial
    assert d.pool_files() == [] and records(d) == {}


def test_create_and_delete_interleaved(driver):
    """Deleters remove volumes while creators are still making the others."""
    d = driver
    initial = capacities(d)
    names = [f"churn-{i:02d}" for i in range(50)]
    created: queue.Queue[str | None] = queue.Queue()
    deleted: list[str] = []
    failures: list[BaseException] = []
    overlap = threading.Event()  # a delete ran while creates were still going
    creating_done = threading.Event()

    def creator(chunk: list[str]) -> None:
        try:
            for name in chunk:
                vol, _ = retry_aborted(d.create, name, size=4 * MiB)
                created.put(vol.volume.volume_id)
        except BaseException as exc:
            failures.append(exc)

    def deleter() -> None:
        try:
            while (vid := created.get()) is not None:
                retry_aborted(d.delete, vid)
                if not creating_done.is_set():
                    overlap.set()
                deleted.append(vid)
        except BaseException as exc:
            failures.append(exc)

    def watcher() -> None:
        # Capacity and listing are read concurrently with the churn and must not fail.
        try:
            while not creating_done.is_set() or len(deleted) < len(names):
                d.capacity()
                d.list_ids()
                if failures:
                    return
        except BaseException as exc:
            failures.append(exc)

    creators = [threading.Thread(target=creator, args=(names[i::8],)) for i in range(8)]
    deleters = [threading.Thread(target=deleter) for _ in range(6)]
    watch = threading.Thread(target=watcher)
    for t in [*creators, *deleters, watch]:
        t.start()
    for t in creators:
        t.join(120)
    creating_done.set()
    for _ in deleters:
        created.put(None)
    for t in [*deleters, watch]:
        t.join(120)
    assert not failures, failures
    assert sorted(deleted) == sorted(volume_id_for(n) for n in names)
    assert overlap.is_set(), "no delete overlapped the creates; the test proved nothing"
    assert_empty(d, initial)


def test_publish_and_unpublish_concurrently(driver):
    d = driver
    initial = capacities(d)
    vols = [d.create(f"pub-{i}", size=8 * MiB).volume.volume_id for i in range(4)]
    jobs = [(vid, d.target(f"pod-{i}-{j}")) for i, vid in enumerate(vols) for j in range(3)]
    aborts: list[int] = []

    def publish(job) -> None:
        vid, target = job
        aborts.append(retry_aborted(d.publish, vid, target)[1])
        meta, fd = open_volume(target)
        os.close(fd)
        assert meta["volume_id"] == vid and meta["readonly"] is False

    def unpublish(job) -> None:
        vid, target = job
        aborts.append(retry_aborted(d.unpublish, vid, target)[1])
        assert mounts.find(target) is None and not os.path.exists(target)

    for _ in range(2):
        run_all(publish, jobs, len(jobs))
        have = sorted((m.mount_point, m.source) for m in mounts_below(d))
        assert have == sorted((t, mounts.source_for(v)) for v, t in jobs)
        for vid, rec in records(d).items():
            pubs = rec["publications"]
            assert sorted(pubs) == sorted(t for v, t in jobs if v == vid)
            assert {p["state"] for p in pubs.values()} == {"published"}
        # Each target hands out its own volume: write through one, read through another.
        for i, vid in enumerate(vols):
            first, second = [t for v, t in jobs if v == vid][:2]
            _, mm = map_volume(first)
            with mm:
                mm[:16] = f"volume-{i:09d}".encode()
            _, mm = map_volume(second, writable=False)
            with mm:
                assert mm[:16] == f"volume-{i:09d}".encode()
        run_all(unpublish, jobs, len(jobs))
        assert mounts_below(d) == []
        assert all(rec["publications"] == {} for rec in records(d).values())

    # Mixed: half the targets are unpublished while the other half is published.
    published, fresh = jobs[::2], [(v, t + "-b") for v, t in jobs[1::2]]
    run_all(publish, published, len(published))
    mixed = [(unpublish, j) for j in published] + [(publish, j) for j in fresh]
    run_all(lambda fj: fj[0](fj[1]), mixed, len(mixed))
    assert sorted(m.mount_point for m in mounts_below(d)) == sorted(t for _, t in fresh)
    run_all(unpublish, fresh, len(fresh))
    assert mounts_below(d) == []
    assert sum(aborts) > 0, "publishing one volume at several targets never collided"

    for vid in vols:
        d.delete(vid)
    assert_empty(d, initial)


def _start_delete(d: DriverProcess, vid: str) -> tuple[threading.Thread, list]:
    """DeleteVolume in a thread; returns once the driver has recorded the deletion."""
    outcome: list = []

    def delete() -> None:
        try:
            d.delete(vid)
            outcome.append("ok")
        except grpc.RpcError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=delete)
    worker.start()
    deadline = time.monotonic() + 10
    while record_state(d, vid) != "deleting":
        assert time.monotonic() < deadline, "the delete did not start"
        time.sleep(0.002)
    return worker, outcome


def test_second_operation_on_busy_volume_is_aborted(driver):
    d = driver
    initial = capacities(d)
    vid = d.create("busy", size=512 * MiB, params={"numaNode": "0"}).volume.volume_id
    worker, outcome = _start_delete(d, vid)

    # The erase of 512 MiB takes a good fraction of a second: every other call on this
    # volume gets ABORTED, while other volumes are served.
    for call in (lambda: d.delete(vid),
                 lambda: d.create("busy", size=512 * MiB, params={"numaNode": "0"}),
                 lambda: d.publish(vid, d.target("busy")),
                 lambda: d.unpublish(vid, d.target("busy"))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == ABORTED, info.value.details()
        assert "in progress" in info.value.details()
    other = d.create("other", size=16 * MiB, params={"numaNode": "1"}).volume
    assert worker.is_alive(), "the erase ended before the checks; they proved nothing"

    worker.join(60)
    assert outcome == ["ok"]
    d.delete(vid)  # idempotent once it is gone
    assert d.list_ids() == [other.volume_id]
    assert backing_ids(d) == [other.volume_id]
    assert not os.path.exists(d.target("busy"))
    d.delete(other.volume_id)
    assert_empty(d, initial)

