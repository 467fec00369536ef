"""The clean-space ledger, the background eraser and scrubs, on a Driver in this process.

Why in-process: these rules are about ordering (what is zeroed when, which space shows
as free when), so the tests hold the erase at chosen points with events and look at
the bytes a new volume gets. The emulated back end runs with ``free_space="reuse"``:
a destroyed namespace's file is handed to the next namespace that fits, old bytes and
all, as persistent memory would. Crash points are in tests/test_erase_crash.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from csi_pmem.driver.backends.emulated import EmulatedBackend
from csi_pmem.driver.config import DriverConfig
from csi_pmem.driver.core import Driver
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.erasing.cleanspace import FIRST_SEEN, CleanSpace
from csi_pmem.driver.erasing.erase import EraseCancelled
from csi_pmem.driver.erasing.eraser import DELETE, EraseQueue
from csi_pmem.driver.params import parse
from csi_pmem.driver.servicers.status import status_for
from csi_pmem.driver.state import StateStore
from csi_pmem.errors import Aborted, BackendError, SpaceBeingErased

from conftest import MiB, eventually

REGION = 256 * MiB
BLOCK = 4096
PATTERN = b"tenant-A secret!" * (BLOCK // 16)


def make_driver(base: Path, *, scrub: bool = False, erase_wait: float = 5.0,
                reuse: bool = True, regions: dict[int, int] | None = None,
                delete_wait: float = 0.0) -> Driver:
    backend = EmulatedBackend(base / "pools", regions or {0: REGION},
                              free_space="reuse" if reuse else "fresh")
    d = Driver(DriverConfig(driver_name="csi-pmem.test", node_id="n", kubelet_dir=str(base),
                            erase_threads=2, scrub=scrub, erase_wait=erase_wait,
                            delete_wait=delete_wait),
               backend, StateStore(base / "state"), DaxSocketServer())
    d.reconcile()
    return d


@pytest.fixture
def drivers(tmp_path):
    made: list[Driver] = []

    def make(**kw) -> Driver:
        d = make_driver(tmp_path, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def params(**kw: str):
    return parse({"numaNode": "0", **kw})


def backing(d: Driver, vid: str) -> str:
    ns = d.backend.get(vid)
    assert ns is not None
    return ns.device


def write_pattern(d: Driver, vid: str) -> None:
    with open(backing(d, vid), "r+b") as f:
        for off in (0, d.store.get(vid).usable_size - BLOCK):
            os.pwrite(f.fileno(), PATTERN, off)


def first_and_last(d: Driver, vid: str) -> list[bytes]:
    with open(backing(d, vid), "rb") as f:
        return [os.pread(f.fileno(), BLOCK, off)
                for off in (0, d.store.get(vid).usable_size - BLOCK)]


def free_files(d: Driver) -> list[Path]:
    return sorted((d.backend.root / "region0").glob("*.free"))


class Erases:
    """Counts the driver's namespace erases, by what they erased; can hold those whose namespace
    name starts with ``held`` at an event."""

    def __init__(self, d: Driver, monkeypatch: pytest.MonkeyPatch, held: str = "") -> None:
        self.calls: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()
        real = d.namespace_eraser.erase

        def counted(ns, cancel=None):
            self.calls.append(ns.name)
            self.started.set()
            while ns.name.startswith(held) and not self.hold.wait(0.01):
                if cancel is not None and cancel.is_set():
                    raise EraseCancelled("test")
            real(ns, cancel)

        monkeypatch.setattr(d.namespace_eraser, "erase", counted)
        d.scrubber.erase = counted


# ------------------------------------------------------------------ the ledger
def test_first_seen_region_is_dirty_and_a_scrub_makes_it_clean(drivers):
    d = drivers(scrub=False)
    rec = d.ledger.record("region0")
    assert (rec.clean, rec.reason) == (False, FIRST_SEEN)
    assert d.store.get_region("region0").clean is False  # written at first start
    d.close()
    d = drivers(scrub=True)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    rec = d.store.get_region("region0")
    assert rec.clean and rec.scrub == [] and rec.free == REGION
    assert d.backend.pools()[0].free == REGION, "scratch namespaces were left behind"
    # The scrub's space is free again as one zeroed file that the next volume reuses.
    assert len(free_files(d)) == 1


def test_dirty_region_zeroes_on_create_clean_region_does_not(drivers, monkeypatch):
    d = drivers(scrub=False)
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("a", 64 * MiB, 0, params())
    assert erases.calls == [vol.id], "a first-seen region must zero new volumes"
    # Deleted with erase: the region is still dirty (its other free space is unknown).
    d.delete_volume(vol.id)
    eventually(lambda: d.store.get(vol.id) is None, "the background delete")
    assert not d.ledger.is_clean("region0")
    d.scrubber.enabled = True
    d.scrubber.schedule("region0")
    eventually(lambda: d.ledger.is_clean("region0"), "the scrub")
    erases.calls.clear()
    vol = d.create_volume("b", 64 * MiB, 0, params())
    assert erases.calls == [], "a clean region must not zero new volumes"
    assert first_and_last(d, vol.id) == [bytes(BLOCK)] * 2


def test_erased_delete_keeps_the_region_clean_and_hands_out_zeros(drivers, monkeypatch):
    d = drivers(scrub=True)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("a", 64 * MiB, 0, params())
    write_pattern(d, vol.id)
    d.delete_volume(vol.id)
    eventually(lambda: d.store.get(vol.id) is None, "the background delete")
    assert erases.calls == [vol.id] and d.ledger.is_clean("region0")
    erases.calls.clear()
    again = d.create_volume("b", 64 * MiB, 0, params())
    assert erases.calls == [], "a clean region zeroed on create"
    assert first_and_last(d, again.id) == [bytes(BLOCK)] * 2


def test_delete_without_erase_dirties_and_the_next_tenant_reads_zeros(drivers, monkeypatch):
    d = drivers(scrub=True)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    d.scrubber.enabled = False  # keep it dirty: the next create must pay the zeroing
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("a", 64 * MiB, 0, params(eraseOnDelete="false"))
    write_pattern(d, vol.id)
    d.delete_volume(vol.id)
    assert d.store.get(vol.id) is None, "a delete without erase finishes at once"
    assert erases.calls == []
    rec = d.store.get_region("region0")
    assert not rec.clean and "eraseOnDelete: false" in rec.reason
    # The old bytes are in the free file the next volume of that size gets.
    assert any(PATTERN in f.read_bytes()[:BLOCK] for f in free_files(d))
    again = d.create_volume("b", 64 * MiB, 0, params())
    assert erases.calls == [again.id], "the next tenant in a dirty region pays the zeroing"
    assert first_and_last(d, again.id) == [bytes(BLOCK)] * 2


def test_space_freed_behind_the_drivers_back_makes_the_region_dirty(drivers):
    d = drivers(scrub=True)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    vol = d.create_volume("a", 64 * MiB, 0, params())
    d.scrubber.enabled = False
    Path(d.backend.get(vol.id).handle).unlink()  # "ndctl destroy-namespace" by hand
    d.backend.invalidate()
    assert d.ledger.must_zero(d.backend.pools()[0])
    assert "freed outside the driver" in d.store.get_region("region0").reason


def test_orphans_dirty_their_region_at_start(tmp_path):
    d = make_driver(tmp_path, scrub=True)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    vol = d.create_volume("a", 64 * MiB, 0, params())
    d.close()
    os.unlink(d.store.path(vol.id))  # the record is lost: the namespace is an orphan
    d = make_driver(tmp_path, scrub=False)
    try:
        assert d.orphans == [vol.id]
        rec = d.store.get_region("region0")
        assert not rec.clean and vol.id in rec.reason
    finally:
        d.close()


def test_fresh_back_end_needs_no_ledger(drivers, monkeypatch):
    d = drivers(reuse=False, scrub=True)
    assert d.ledger.enabled is False and d.ledger.is_clean("region0")
    assert d.store.all_regions() == []
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("a", 64 * MiB, 0, params(eraseOnDelete="false"))
    d.delete_volume(vol.id)
    d.create_volume("b", 64 * MiB, 0, params())
    assert erases.calls == [] and d.store.all_regions() == []


# ------------------------------------------------------------------ background erase
def test_delete_returns_before_the_erase_and_space_comes_back_after(drivers, monkeypatch):
    d = drivers(scrub=True, erase_wait=0)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    full = d.capacity(params())
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("big", 200 * MiB, 0, params())
    write_pattern(d, vol.id)
    after_create = d.capacity(params())
    erases.hold.clear()
    d.delete_volume(vol.id)  # returns while the erase is held
    assert erases.started.wait(10)
    assert [r.id for r in d.list_volumes()] == [], "a deleted volume must leave ListVolumes"
    assert d.capacity(params()) == after_create, "space reported free before its erase"
    assert d.eraser.pending_bytes({"region0"}) == vol.size
    # A create that needs that space: RESOURCE_EXHAUSTED saying why.
    with pytest.raises(SpaceBeingErased) as info:
        d.create_volume("other", 200 * MiB, 0, params())
    code, message = status_for(info.value)
    assert code.name == "RESOURCE_EXHAUSTED" and "still being erased" in message
    # The same name again: ABORTED until the old namespace is gone.
    with pytest.raises(Aborted, match="still being erased"):
        d.create_volume("big", 200 * MiB, 0, params())
    d.delete_volume(vol.id)  # a retried DeleteVolume is fine and queues nothing twice
    assert len(d.eraser.jobs(DELETE)) == 1
    erases.hold.set()
    eventually(lambda: d.capacity(params()) == full, "the space after the erase")
    assert d.ledger.is_clean("region0")
    again = d.create_volume("big", 200 * MiB, 0, params())
    assert first_and_last(d, again.id) == [bytes(BLOCK)] * 2


def test_create_waits_briefly_for_space_being_erased(drivers, monkeypatch):
    d = drivers(scrub=True, erase_wait=30)
    eventually(lambda: d.ledger.is_clean("region0"), "the start-up scrub")
    erases = Erases(d, monkeypatch)
    vol = d.create_volume("big", 200 * MiB, 0, params())
    erases.hold.clear()
    d.delete_volume(vol.id)
    assert erases.started.wait(10)
    threading.Timer(0.3, erases.hold.set).start()
    other = d.create_volume("other", 200 * MiB, 0, params())  # waits for the erase
    assert other.state == "ready"


def test_scrub_gives_way_to_a_create_and_comes_back(drivers, monkeypatch):
    d = drivers(scrub=False)
    erases = Erases(d, monkeypatch, held="csi-pmem-scrub-")
    erases.hold.clear()
    d.scrubber.enabled = True
    d.scrubber.schedule("region0")
    assert erases.started.wait(10)
    # The scrub holds all free space in a scratch namespace; capacity still counts it.
    assert d.backend.pools()[0].free == 0
    assert d.capacity(params()).available > 200 * MiB
    vol = d.create_volume("a", 64 * MiB, 0, params())  # cancels the scrub, zeroes itself
    assert erases.calls[0].startswith("csi-pmem-scrub-") and vol.id in erases.calls
    assert d.store.get(vol.id).state == "ready" and not d.ledger.is_clean("region0")
    erases.hold.set()
    eventually(lambda: d.ledger.is_clean("region0"), "the scrub queued after the create")
    assert d.store.get_region("region0").scrub == []


def test_cleanspace_generation_stops_a_stale_scrub(tmp_path):
    backend = EmulatedBackend(tmp_path / "pools", {0: REGION}, free_space="reuse")
    ledger = CleanSpace(StateStore(tmp_path / "state"), backend)
    pool = backend.pools()[0]
    ledger.start([pool], {})
    generation = ledger.record("region0").generation
    ledger.mark_dirty("region0", "deleted without erase meanwhile")
    assert ledger.mark_clean(pool, generation) is False
    assert ledger.mark_clean(pool, ledger.record("region0").generation) is True


# ------------------------------------------------------------------ the queue
def test_queue_retries_a_failed_job_and_dedupes_keys(monkeypatch):
    monkeypatch.setattr("csi_pmem.driver.erasing.eraser.RETRY_FIRST", 0.05)
    q = EraseQueue(workers=1)
    attempts = []

    def flaky(cancel):
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError("transient")

    try:
        job = q.submit("v", DELETE, "region0", 10, flaky)
        assert q.submit("v", DELETE, "region0", 10, flaky) is job
        assert q.wait("v", 10)
        assert len(attempts) == 3 and job.error == "transient"
    finally:
        q.close()


def test_queue_close_cancels_running_jobs():
    q = EraseQueue(workers=1)
    running = threading.Event()

    def long(cancel):
        running.set()
        while not cancel.wait(0.01):
            pass
        raise EraseCancelled("stop")

    q.submit("v", DELETE, "region0", 10, long)
    assert running.wait(5)
    q.close(timeout=5)
    assert q.jobs() == []


def test_a_failed_scrub_leaves_the_region_dirty(drivers, monkeypatch):
    """An erase that fails (a verification or I/O error) must not mark the free space
    clean: it was not zeroed."""
    d = drivers(scrub=False)

    def failing(ns, cancel=None):
        raise BackendError(f"zeroing {ns.name} failed verification")

    monkeypatch.setattr(d.scrubber, "erase", failing)
    with pytest.raises(BackendError):
        d.scrubber.run("region0", threading.Event())
    assert not d.ledger.is_clean("region0")
    assert d.store.get_region("region0").scrub == [], "the scratch namespaces stayed"
    assert d.backend.pools()[0].free == REGION


def test_a_cancelled_job_waiting_in_the_queue_or_for_a_retry_is_done_at_once(monkeypatch):
    # the retry would be far off
    monkeypatch.setattr("csi_pmem.driver.erasing.eraser.RETRY_FIRST", 30.0)
    q = EraseQueue(workers=1)
    gate = threading.Event()
    try:
        q.submit("busy", DELETE, "region0", 10, lambda cancel: gate.wait(10))
        queued = q.submit("queued", DELETE, "region0", 10, lambda cancel: None)
        q.cancel("queued")  # behind the busy one: never started
        assert queued.done.is_set() and "queued" not in [j.key for j in q.jobs()]
        gate.set()

        def fails(cancel):
            raise OSError("transient")

        retrying = q.submit("retry", DELETE, "region0", 10, fails)
        eventually(lambda: retrying.attempts == 1 and not retrying.running, "a failed attempt")
        q.cancel("retry")  # waiting for its retry timer
        assert retrying.done.is_set() and q.jobs() == []
    finally:
        q.close()


# ------------------------------------------------------------------ stopping and resuming
def test_close_waits_for_a_namespace_destroy_in_flight(drivers, monkeypatch):
    """A destroy under way (here a DeleteVolume's, which gRPC's grace period may leave
    running) ends before close() returns, and none starts after it."""
    d = drivers(scrub=False)
    vol = d.create_volume("a", 64 * MiB, 0, params(eraseOnDelete="false"))
    inside, done = threading.Event(), threading.Event()
    real = d.backend.destroy

    def slow(name):
        inside.set()
        threading.Event().wait(0.5)  # an ndctl destroy takes about this long
        real(name)
        done.set()

    monkeypatch.setattr(d.backend, "destroy", slow)
    deleting = threading.Thread(target=d.delete_volume, args=(vol.id,))
    deleting.start()
    assert inside.wait(10)
    d.close(timeout=10)
    assert done.is_set(), "close() returned while a destroy was running"
    deleting.join(10)
    assert d.store.get(vol.id) is None
    assert not d.node_lock.acquire(blocking=False), "a create or destroy could start now"


def test_close_gives_up_within_its_bound_and_says_what_resumes(drivers, monkeypatch, caplog):
    d = drivers(scrub=False)
    vol = d.create_volume("a", 64 * MiB, 0, params())
    erases = Erases(d, monkeypatch)
    erases.hold.clear()

    def deaf(ns, cancel=None):  # an erase that does not look at its cancel event
        erases.started.set()
        erases.hold.wait(30)
        raise EraseCancelled("test")

    monkeypatch.setattr(d.namespace_eraser, "erase", deaf)
    d.delete_volume(vol.id)
    assert erases.started.wait(10)
    t = time.monotonic()
    d.close(timeout=1)
    assert time.monotonic() - t < 5
    erases.hold.set()
    assert f"stopping with the deletion of {vol.id} (a) unfinished (still running at the " \
        "stop); the next start erases it from the start" in caplog.text
    assert d.store.get(vol.id).state == "deleting"


@pytest.mark.parametrize("erase", ["true", "false"])
def test_a_resumed_delete_whose_first_attempt_fails_is_retried(tmp_path, monkeypatch, erase):
    """A DELETING record found at start-up goes through the queue, which retries it: a
    transient ndctl failure there (a listing, a destroy) must not strand the volume
    until the next restart."""
    monkeypatch.setattr("csi_pmem.driver.erasing.eraser.RETRY_FIRST", 0.05)
    d = make_driver(tmp_path, scrub=False)
    vol = d.create_volume("a", 64 * MiB, 0, params(eraseOnDelete=erase))
    d.close()
    rec = d.store.get(vol.id)
    rec.state = "deleting"  # as a crash right after DeleteVolume's intent leaves it
    d.store.put(rec)

    backend = EmulatedBackend(tmp_path / "pools", {0: REGION}, free_space="reuse")
    failures = []
    real_get = backend.get

    def flaky_get(name):
        if name == vol.id and not failures:
            failures.append(name)
            raise BackendError("ndctl list failed: exit 1 (transient)")
        return real_get(name)

    monkeypatch.setattr(backend, "get", flaky_get)
    d = Driver(DriverConfig(driver_name="csi-pmem.test", node_id="n",
                            kubelet_dir=str(tmp_path), erase_threads=2, scrub=False),
               backend, StateStore(tmp_path / "state"), DaxSocketServer())
    try:
        d.reconcile()
        eventually(lambda: d.store.get(vol.id) is None, "the retried resume")
        assert failures == [vol.id], "the failure this test is about never happened"
        assert backend.get(vol.id) is None
    finally:
        d.close()


def test_an_unerased_delete_during_a_scrub_gets_the_region_scrubbed_again(drivers,
                                                                          monkeypatch):
    """The running scrub covered the free space it found at its start; a delete without
    erase meanwhile frees unerased space it never saw. The region must not be called
    clean then, and must be scrubbed again without waiting for the next create."""
    d = drivers(scrub=False)
    vol = d.create_volume("a", 64 * MiB, 0, params(eraseOnDelete="false"))
    write_pattern(d, vol.id)
    erases = Erases(d, monkeypatch, held="csi-pmem-scrub-")
    erases.hold.clear()
    d.scrubber.enabled = True
    d.scrubber.schedule("region0")
    assert erases.started.wait(10)
    d.delete_volume(vol.id)  # during the scrub: the old bytes are now free space
    assert not d.ledger.is_clean("region0")
    scrubs_before = sum(n.startswith("csi-pmem-scrub-") for n in erases.calls)
    erases.hold.set()
    eventually(lambda: d.ledger.is_clean("region0") and not d.eraser.jobs(),
               "a second scrub over the freed space")
    assert sum(n.startswith("csi-pmem-scrub-") for n in erases.calls) > scrubs_before
    erases.calls.clear()
    again = d.create_volume("b", 64 * MiB, 0, params())
    assert erases.calls == [], "a clean region zeroed on create"
    assert first_and_last(d, again.id) == [bytes(BLOCK)] * 2, "the old bytes were handed out"
