"""A full or read-only state directory, through the real driver over gRPC.

Why: every mutating RPC writes a state record before it acts (csi_pmem.driver.state), so a
full state directory stops them all. The operator must read what is short and where in
the RPC's status (RESOURCE_EXHAUSTED or FAILED_PRECONDITION naming the state directory),
not an INTERNAL "see the driver log"; nothing may be left behind (no temp files, no
namespace, no mount), and the driver must carry on once there is room, without a
restart. The state directory is a real 256 KiB tmpfs, filled with a real file.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from conftest import DriverProcess, MiB, mounts_below, needs_root, records

pytestmark = needs_root()
C = grpc.StatusCode
PAGE = os.sysconf("SC_PAGE_SIZE")  # what tmpfs allocates in


def fail(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its file system is full."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def temp_files(d: DriverProcess) -> list[str]:
    return sorted(str(p) for p in d.state.rglob(".*.tmp"))


@pytest.fixture
def small_state(driver_factory):
    """A started driver whose state directory is a 256 KiB tmpfs (unmounted afterwards,
    also when the test fails)."""
    d = driver_factory(regions="0=256Mi")
    d.state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "csi-pmem-test-state",
                    str(d.state)], check=True)
    try:
        yield d.start()
    finally:
        d.kill()
        subprocess.run(["umount", "-l", str(d.state)], check=False)


def test_create_with_a_full_state_dir_says_so_and_recovers(small_state):
    d = small_state
    filler = fill(d.state)
    err = fail(d.create, "full", size=16 * MiB)
    assert err.code() == C.RESOURCE_EXHAUSTED, err.details()
    assert f"state directory {d.state}" in err.details()
    assert "No space left on device" in err.details() and "free space" in err.details()
    assert temp_files(d) == []
    assert d.pool_files() == [] and records(d) == {}  # nothing carved, nothing recorded
    filler.unlink()
    vol = d.create("full", size=16 * MiB).volume  # the same driver, no restart
    assert vol.capacity_bytes >= 16 * MiB
    assert list(records(d)) == [vol.volume_id] and temp_files(d) == []


def test_publish_with_a_full_state_dir_says_so_and_recovers(small_state):
    d = small_state
    vol = d.create("pub", size=16 * MiB).volume
    target = d.target("pod-a")
    filler = fill(d.state)
    err = fail(d.publish, vol.volume_id, target)
    assert err.code() == C.RESOURCE_EXHAUSTED, err.details()
    assert f"state directory {d.state}" in err.details()
    assert temp_files(d) == []
    assert not os.path.lexists(target) and target not in [m.mount_point
                                                          for m in mounts_below(d)]
    assert records(d)[vol.volume_id]["publications"] == {}
    filler.unlink()
    d.publish(vol.volume_id, target)
    assert os.path.exists(os.path.join(target, "dax.sock"))
    d.unpublish(vol.volume_id, target)
    d.delete(vol.volume_id)


def test_delete_with_a_full_state_dir_keeps_the_volume(small_state):
    d = small_state
    vol = d.create("del", size=16 * MiB).volume
    filler = fill(d.state)
    err = fail(d.delete, vol.volume_id)
    assert err.code() == C.RESOURCE_EXHAUSTED, err.details()
    assert f"state directory {d.state}" in err.details()
    assert records(d)[vol.volume_id]["state"] == "ready" and len(d.pool_files()) == 1
    assert temp_files(d) == []
    filler.unlink()
    d.delete(vol.volume_id)
    assert d.list_ids() == []


def test_read_only_state_dir_is_a_failed_precondition(driver_factory):
    """The records' directory on a tmpfs of its own: the driver keeps its lock file
    open for writing in the state directory, which a remount,ro refuses (busy)."""
    d = driver_factory(regions="0=256Mi")
    volumes = d.state / "volumes"
    volumes.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "csi-pmem-test-state",
                    str(volumes)], check=True)
    try:
        d.start()
        subprocess.run(["mount", "-o", "remount,ro", str(volumes)], check=True)
        err = fail(d.create, "ro", size=16 * MiB)
        assert err.code() == C.FAILED_PRECONDITION, err.details()
        assert f"state directory {d.state}" in err.details()
        assert f"the file system holding {volumes} is read-only" in err.details()
        assert d.pool_files() == []
        subprocess.run(["mount", "-o", "remount,rw", str(volumes)], check=True)
        assert d.create("ro", size=16 * MiB).volume.volume_id in records(d)
        assert temp_files(d) == []
    finally:
        d.kill()
        subprocess.run(["umount", "-l", str(volumes)], check=False)


def test_io_error_names_the_record_not_the_log(driver_factory):
    """EIO cannot be had from a real file system on cue: the state-write fail point
    raises it in the driver process, after the temp file is written."""
    d = driver_factory(regions="0=256Mi").start(failpoints="state-write=errno:EIO")
    err = fail(d.create, "eio", size=16 * MiB)
    assert err.code() == C.INTERNAL
    assert "Input/output error [EIO]" in err.details()
    assert f"state directory {d.state}" in err.details()
    assert "see the driver log" not in err.details()
    assert temp_files(d) == [] and d.pool_files() == []


def test_create_rolls_back_when_the_outcome_cannot_be_recorded(small_state):
    """Room for the intent record (one tmpfs page) but not for the outcome: the
    namespace carved in between is given back at once, not left to a retry."""
    d = small_state
    filler = fill(d.state)
    os.truncate(filler, filler.stat().st_size - PAGE)  # exactly one page free
    err = fail(d.create, "half", size=16 * MiB)
    assert err.code() == C.RESOURCE_EXHAUSTED, err.details()
    assert d.pool_files() == [] and records(d) == {} and temp_files(d) == []
    # It was the outcome that failed (the intent fit), and the roll-back gave it back:
    assert "rolled back interrupted creation" in d.log.read_text()
    filler.unlink()
    assert d.create("half", size=16 * MiB).volume.volume_id in records(d)
