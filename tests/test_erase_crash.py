"""SIGKILL the driver at the clean-space ledger's and the eraser's steps; nothing leaks.

Why: "erase each byte once" is only safe if no crash point can release unerased space
or call a region clean that is not. Each test kills the real process at a fail point
(``CSI_PMEM_FAILPOINTS``), checks what is on disk at that moment (so a point that fires
in the wrong place is noticed), restarts, and then looks at what a tenant would see:
the bytes of the next volume over that space, the region's record, and capacity. The
emulated back end runs with ``--emulated-free-space reuse``, so a destroyed namespace's
bytes really are handed to the next one, as on persistent memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from csi_pmem import failpoints
from csi_pmem.driver.core import volume_id_for
from csi_pmem.sizes import devdax_usable

from conftest import DriverProcess, MiB, backing_ids, eventually, record_state, records

REGIONS = "0=256Mi"
BLOCK = 4096
SIZE = 48 * MiB
VICTIM = "victim"
VICTIM_ID = volume_id_for(VICTIM)
PATTERN = b"previous tenant!" * (BLOCK // 16)
NO_ERASE = {"eraseOnDelete": "false"}


def reuse(*extra: str) -> list[str]:
    return ["--emulated-free-space", "reuse", *extra]


def region(d: DriverProcess) -> dict:
    return json.loads((d.state / "regions" / "region0.json").read_text())


def pool_dir(d: DriverProcess) -> Path:
    return d.base / "pools" / "region0"


def backing(d: DriverProcess, vid: str) -> Path | None:
    found = [p for p in d.pool_files() if p.name.partition("~")[0] == vid]
    return found[0] if found else None


def blocks(path: Path, usable: int) -> list[bytes]:
    with open(path, "rb") as f:
        return [os.pread(f.fileno(), BLOCK, off) for off in (0, usable // 2, usable - BLOCK)]


def write_pattern(d: DriverProcess, vid: str) -> int:
    usable = records(d)[vid]["usable_size"]
    with open(backing(d, vid), "r+b") as f:
        for off in (0, usable // 2 // BLOCK * BLOCK, usable - BLOCK):
            os.pwrite(f.fileno(), PATTERN, off)
    return usable


def wait_clean(d: DriverProcess) -> None:
    eventually(lambda: region(d)["clean"], "the region to be scrubbed clean")


def available(d: DriverProcess) -> int:
    return d.capacity().available_capacity


def crashed(d: DriverProcess) -> None:
    assert d.wait_exit(30) == -signal.SIGKILL
    d.kill()


def start_expecting_crash(d: DriverProcess, point: str) -> None:
    """Start with a fail point that may fire before the driver answers Probe."""
    try:
        d.start(failpoints=point)
    except RuntimeError:
        pass
    crashed(d)


def assert_new_volume_reads_zeros(d: DriverProcess, name: str = "next") -> str:
    vid = d.create(name, size=SIZE).volume.volume_id
    path = backing(d, vid)
    assert blocks(path, records(d)[vid]["usable_size"]) == [bytes(BLOCK)] * 3, \
        "a new volume shows the previous tenant's bytes"
    return vid


def zeroed_on_create(d: DriverProcess, vid: str) -> bool:
    return any(f"created volume {vid}" in line and "zeroed (dirty region)" in line
               for line in d.log.read_text().splitlines())


# ------------------------------------------------------------------ delete without erase
def test_crash_after_dirty_before_destroy(driver_factory):
    d = driver_factory(regions=REGIONS, extra=reuse()).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=SIZE, params=NO_ERASE)
    write_pattern(d, VICTIM_ID)
    d.restart(failpoints=failpoints.DELETE_AFTER_DIRTY)
    with pytest.raises(grpc.RpcError) as info:
        d.delete(VICTIM_ID)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    crashed(d)
    # At the crash: dirty written, the namespace (with its data) not yet destroyed.
    rec = region(d)
    assert not rec["clean"] and "eraseOnDelete: false" in rec["reason"]
    assert records(d)[VICTIM_ID]["state"] == "deleting"
    assert backing(d, VICTIM_ID) is not None

    d.extra = reuse("--scrub", "off")  # stays dirty: the next create must zero
    d.start()
    assert backing_ids(d) == [] and records(d) == {}
    assert available(d) == initial
    assert any(PATTERN in f.read_bytes()[:BLOCK] for f in pool_dir(d).glob("*.free")), \
        "the test proves nothing: the old bytes are not in the free space"
    vid = assert_new_volume_reads_zeros(d)
    assert zeroed_on_create(d, vid)


def test_crash_after_record_of_delete_without_erase(driver_factory):
    d = driver_factory(regions=REGIONS, extra=reuse()).start()
    wait_clean(d)
    d.create(VICTIM, size=SIZE, params=NO_ERASE)
    write_pattern(d, VICTIM_ID)
    d.restart(failpoints=failpoints.DELETE_AFTER_RECORD)
    with pytest.raises(grpc.RpcError):
        d.delete(VICTIM_ID)
    crashed(d)
    assert region(d)["clean"], "nothing was released yet: the region is still clean"
    d.extra = reuse("--scrub", "off")
    d.start()
    eventually(lambda: records(d) == {}, "start-up to finish the delete")
    assert not region(d)["clean"]
    vid = assert_new_volume_reads_zeros(d)
    assert zeroed_on_create(d, vid)


# ------------------------------------------------------------------ background erase
def test_sigkill_mid_background_erase_resumes_and_keeps_the_region_clean(driver_factory):
    # One erase thread: the fail point fires after the first 64 MiB chunk, before the
    # others, so the volume's last block still holds the old data at the crash.
    d = driver_factory(regions=REGIONS, extra=reuse("--delete-wait-seconds", "0",
                                                    "--erase-threads", "1")).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=160 * MiB)
    usable = write_pattern(d, VICTIM_ID)
    d.restart(failpoints=failpoints.ERASE_MID)
    d.delete(VICTIM_ID)  # returns at once; the erase runs in the background and dies
    crashed(d)
    assert records(d)[VICTIM_ID]["state"] == "deleting"
    path = backing(d, VICTIM_ID)
    assert path is not None, "the namespace must outlive an unfinished erase"
    first, _, last = blocks(path, usable)
    assert first == bytes(BLOCK) and last == PATTERN, "the fail point is not mid-erase"
    assert region(d)["clean"]

    d.start()
    eventually(lambda: records(d) == {}, "the resumed erase")
    assert backing_ids(d) == [] and available(d) == initial
    assert region(d)["clean"], "an erased delete must keep the region clean"
    vid = assert_new_volume_reads_zeros(d)
    assert not zeroed_on_create(d, vid), "a clean region zeroed on create"


def test_restart_during_background_erase_reports_no_space_early(driver_factory):
    d = driver_factory(regions=REGIONS, extra=reuse("--delete-wait-seconds", "0",
                                                    "--erase-wait-seconds", "1")).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=SIZE)
    write_pattern(d, VICTIM_ID)
    with_victim = available(d)
    d.restart(failpoints=f"{failpoints.ERASE_MID}=stall")
    d.delete(VICTIM_ID)
    eventually(lambda: "failpoint erase-mid stalled" in d.log.read_text(), "the erase")
    assert d.list_ids() == [], "a deleted volume must leave ListVolumes at once"
    assert available(d) == with_victim, "space reported free while still being erased"
    with pytest.raises(grpc.RpcError) as info:  # needs the victim's space
        d.create("needs-it", size=200 * MiB)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "still being erased" in info.value.details()
    d.kill()
    assert record_state(d, VICTIM_ID) == "deleting"
    d.start()
    eventually(lambda: available(d) == initial, "the space after the resumed erase")
    assert records(d) == {} and region(d)["clean"]
    vid = d.create("needs-it", size=200 * MiB).volume.volume_id
    assert not zeroed_on_create(d, vid)


# ------------------------------------------------------------------ scrubs
@pytest.mark.parametrize("point", [failpoints.SCRUB_AFTER_RECORD,
                                   failpoints.SCRUB_AFTER_CREATE,
                                   failpoints.SCRUB_AFTER_ERASE])
def test_sigkill_during_a_scrub(driver_factory, point):
    d = driver_factory(regions=REGIONS, extra=reuse())
    start_expecting_crash(d, point)  # the first-start scrub runs into the fail point
    rec = region(d)
    assert not rec["clean"] and rec["scrub"] == ["csi-pmem-scrub-region0-0"]
    scratch = list(pool_dir(d).glob("csi-pmem-scrub-region0-0~*.raw"))
    assert len(scratch) == (0 if point == failpoints.SCRUB_AFTER_RECORD else 1)
    if point == failpoints.SCRUB_AFTER_ERASE:
        assert blocks(scratch[0], scratch[0].stat().st_size) == [bytes(BLOCK)] * 3

    d.start()
    wait_clean(d)
    assert list(pool_dir(d).glob("*.raw")) == [], "scratch namespaces were left behind"
    assert region(d)["scrub"] == []
    whole = devdax_usable(256 * MiB, 2 * MiB)  # all of the region, as on a fresh start
    assert available(d) == d.capacity().maximum_volume_size.value == whole


# ------------------------------------------------------------------ the volume crash points
@pytest.mark.parametrize("point", [failpoints.CREATE_AFTER_RECORD,
                                   failpoints.CREATE_AFTER_NAMESPACE,
                                   failpoints.DELETE_AFTER_RECORD,
                                   failpoints.DELETE_AFTER_ERASE,
                                   failpoints.DELETE_AFTER_DESTROY])
def test_volume_crash_points_keep_a_clean_region_clean(driver_factory, point):
    """Rolling back a create or finishing an erased delete must not look like space
    freed behind the driver's back (which would dirty the region for nothing)."""
    d = driver_factory(regions=REGIONS, extra=reuse()).start()
    wait_clean(d)
    initial = available(d)
    if point.startswith("delete"):
        d.create(VICTIM, size=SIZE)
        write_pattern(d, VICTIM_ID)
    d.restart(failpoints=point)
    with pytest.raises(grpc.RpcError):
        d.delete(VICTIM_ID) if point.startswith("delete") else d.create(VICTIM, size=SIZE)
    crashed(d)
    d.start()
    eventually(lambda: records(d) == {} and backing_ids(d) == [], "start-up to finish")
    assert available(d) == initial
    rec = region(d)
    assert rec["clean"], f"the region became dirty: {rec['reason']}"
    vid = assert_new_volume_reads_zeros(d)
    assert not zeroed_on_create(d, vid)


# ------------------------------------------------------------------ stopping
def erase_lines(d: DriverProcess, vid: str) -> int:
    return sum(1 for line in d.log.read_text().splitlines() if f" erased {vid}:" in line)


def test_sigkill_after_the_erase_resumes_with_the_destroy_alone(driver_factory):
    """The verified erase is recorded before the destroy: the resumed delete does not
    erase again (on ndctl a destroy cut short after disable-namespace leaves no device
    that could be erased again)."""
    d = driver_factory(regions=REGIONS, extra=reuse("--delete-wait-seconds", "0")).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=SIZE)
    write_pattern(d, VICTIM_ID)
    d.restart(failpoints=failpoints.DELETE_AFTER_ERASE)
    with contextlib.suppress(grpc.RpcError):
        d.delete(VICTIM_ID)
    crashed(d)
    rec = records(d)[VICTIM_ID]
    assert rec["state"] == "deleting" and rec["erased"] is True, rec
    assert erase_lines(d, VICTIM_ID) == 1
    d.start()
    eventually(lambda: records(d) == {} and backing_ids(d) == [], "the resumed destroy")
    assert erase_lines(d, VICTIM_ID) == 1, "the resumed delete erased again"
    assert available(d) == initial and region(d)["clean"]
    assert_new_volume_reads_zeros(d)


def test_sigterm_waits_for_a_background_delete_in_its_destroy_step(driver_factory):
    """SIGTERM while a background delete is past its erase: the process exits only once
    the destroy is done (it used to exit as soon as the stop began, cutting ndctl off
    in the middle of a destroy)."""
    d = driver_factory(regions=REGIONS, extra=reuse("--delete-wait-seconds", "0")).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=SIZE)
    d.restart(failpoints=f"{failpoints.DELETE_AFTER_ERASE}=sleep:3")
    d.delete(VICTIM_ID)  # returns at once; the job sleeps between erase and destroy
    eventually(lambda: "failpoint delete-after-erase sleeping" in d.log.read_text(),
               "the delete to reach its destroy step")
    d.proc.send_signal(signal.SIGTERM)
    assert d.wait_exit(30) == 0
    d.kill()
    assert records(d) == {} and backing(d, VICTIM_ID) is None, \
        "the driver exited with the delete half done"
    text = d.log.read_text()
    assert text.index(f"deleted volume {VICTIM_ID}") < text.rindex("stopped;")
    d.start()
    assert available(d) == initial and region(d)["clean"]


def test_stop_during_an_erase_leaves_a_resumable_delete_and_says_so(driver_factory):
    """SIGTERM in the middle of an erase: the erase stops at its next chunk, the process
    exits at once, and the log says what the next start does; it then does it."""
    # One erase thread and three chunks: the stop is seen before the second one.
    d = driver_factory(regions=REGIONS, extra=reuse("--delete-wait-seconds", "0",
                                                    "--erase-threads", "1")).start()
    wait_clean(d)
    initial = available(d)
    d.create(VICTIM, size=160 * MiB)
    d.restart(failpoints=f"{failpoints.ERASE_MID}=sleep:1")
    d.delete(VICTIM_ID)
    eventually(lambda: "failpoint erase-mid sleeping" in d.log.read_text(), "the erase")
    d.proc.send_signal(signal.SIGTERM)
    assert d.wait_exit(30) == 0
    d.kill()
    rec = records(d)[VICTIM_ID]
    assert rec["state"] == "deleting" and rec["erased"] is False
    assert backing(d, VICTIM_ID) is not None, "destroyed without a finished erase"
    assert (f"stopping with the deletion of {VICTIM_ID} ({VICTIM}) unfinished; the next "
            "start erases it from the start") in d.log.read_text()
    d.start()
    eventually(lambda: records(d) == {} and available(d) == initial, "the resumed delete")
    assert region(d)["clean"]
    assert_new_volume_reads_zeros(d)
