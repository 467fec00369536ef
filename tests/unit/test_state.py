"""State store: atomic records that survive a crash and never lose a neighbour."""

import errno
import os
from dataclasses import replace

import grpc
import pytest

from csi_pmem import failpoints
from csi_pmem.driver import state
from csi_pmem.driver.servicers.status import status_for
from csi_pmem.driver.state import (
    CREATING,
    READY,
    Publication,
    RegionRecord,
    StateStore,
    VolumeRecord,
    write_atomic,
)
from csi_pmem.errors import (
    BackendError,
    CsiPmemError,
    FailedPrecondition,
    ResourceExhausted,
)


def record(vid="pmem-" + "a" * 32, **kw):
    return VolumeRecord(id=vid, name="n", state=CREATING, params={"align": "2Mi"},
                        required_bytes=1, **kw)


def test_round_trip_with_publications(tmp_path):
    store = StateStore(tmp_path)
    rec = record(publications={"/t": Publication(target="/t", readonly=True, pod_uid="u")})
    store.put(rec)
    assert store.get(rec.id) == rec
    rec.state = READY
    store.put(rec)
    assert store.get(rec.id).state == READY
    assert [r.id for r in store.all()] == [rec.id]
    store.delete(rec.id)
    store.delete(rec.id)  # idempotent
    assert store.get(rec.id) is None and store.all() == []


def test_no_temp_files_left_and_private(tmp_path):
    store = StateStore(tmp_path)
    store.put(record())
    names = os.listdir(store.root)
    assert names == ["pmem-" + "a" * 32 + ".json"]
    assert os.stat(store.root / names[0]).st_mode & 0o077 == 0


def test_unreadable_record_is_skipped_not_deleted(tmp_path):
    store = StateStore(tmp_path)
    store.put(record())
    bad = store.root / ("pmem-" + "b" * 32 + ".json")
    bad.write_text("{torn")
    assert [r.id for r in store.all()] == ["pmem-" + "a" * 32]
    assert bad.exists()


def test_ids_are_checked(tmp_path):
    store = StateStore(tmp_path)
    with pytest.raises(ValueError):
        store.path("../escape")


# ------------------------------------------------------------------ failing writes
# Failures are injected with the product's fail points (csi_pmem.failpoints): the
# ``state-write`` point raises the named OSError after the temp file is written.
VID = "pmem-" + "a" * 32


@pytest.fixture
def inject(monkeypatch):
    def arm(errno_name: str) -> None:
        monkeypatch.setitem(failpoints._ACTIVE, failpoints.STATE_WRITE, f"errno:{errno_name}")
    return arm


def leftovers(store: StateStore) -> list[str]:
    return sorted(p.name for d in (store.root, store.regions_root) for p in d.iterdir()
                  if p.name.startswith("."))


def test_write_atomic_failure_leaves_old_record_and_no_temp_file(tmp_path, inject):
    target = tmp_path / "x.json"
    write_atomic(target, b"old")
    inject("EIO")
    with pytest.raises(OSError) as info:
        write_atomic(target, b"new")
    assert info.value.errno == errno.EIO
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.json"]


def test_short_writes_are_continued_not_torn(tmp_path, monkeypatch):
    # What a nearly full file system does: write() takes fewer bytes than offered.
    real_write = os.write
    monkeypatch.setattr(state.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    store = StateStore(tmp_path)
    rec = record(publications={"/t": Publication(target="/t", readonly=False)})
    store.put(rec)
    assert store.get(rec.id) == rec


@pytest.mark.parametrize("name,kind,says", [
    ("ENOSPC", ResourceExhausted, "is full"),
    ("EDQUOT", ResourceExhausted, "quota"),
    ("EROFS", FailedPrecondition, "read-only"),
    ("EACCES", FailedPrecondition, "must run as root"),
    ("EMFILE", ResourceExhausted, "file descriptors"),
    ("EIO", BackendError, "Input/output error"),
])
def test_put_says_what_the_state_dir_needs(tmp_path, inject, name, kind, says):
    store = StateStore(tmp_path)
    store.put(record())
    inject(name)
    with pytest.raises(CsiPmemError) as info:
        store.put(replace(record(), state=READY))
    assert type(info.value) is kind
    message = str(info.value)
    assert f"state directory {tmp_path}" in message and says in message
    assert f"[{name}]" in message
    assert store.get(VID).state == CREATING  # the old record is intact
    assert leftovers(store) == []


def test_full_state_dir_message_says_what_it_needs(tmp_path, inject):
    store = StateStore(tmp_path)
    inject("ENOSPC")
    with pytest.raises(ResourceExhausted) as info:
        store.put(record())
    message = str(info.value)
    assert message.startswith(f"cannot save the record of volume {VID} in the state "
                              f"directory {tmp_path}")
    assert "free space on it: the driver writes a small record" in message
    code, text = status_for(info.value)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and text == message


def test_region_records_say_it_too(tmp_path, inject):
    store = StateStore(tmp_path)
    inject("ENOSPC")
    with pytest.raises(ResourceExhausted, match=f"region region0 in the state directory "
                       f"{tmp_path}"):
        store.put_region(RegionRecord(pool="region0", clean=True))
    assert leftovers(store) == [] and store.get_region("region0") is None


def test_removed_state_dir_is_a_failed_precondition(tmp_path):
    store = StateStore(tmp_path)
    store.root.rmdir()
    with pytest.raises(FailedPrecondition) as info:
        store.put(record())
    assert f"{store.root} is gone" in str(info.value)
    assert "Restart the driver" in str(info.value)


def test_stale_temp_files_of_a_crash_break_nothing(tmp_path):
    store = StateStore(tmp_path)
    store.put(record())
    # What a crash between create and rename leaves, and worse: a symlink out of the dir.
    torn = store.root / f".{VID}.json.0badc0de.tmp"
    torn.write_text("{torn")
    outside = tmp_path / "outside"
    outside.write_text("keep")
    (store.regions_root / ".region0.json.deadbeef.tmp").symlink_to(outside)
    store.put(replace(record(), state=READY))
    store.put_region(RegionRecord(pool="region0", clean=True))
    assert store.get(VID).state == READY and store.get_region("region0").clean
    assert [r.id for r in store.all()] == [VID]
    assert outside.read_text() == "keep"
    StateStore(tmp_path)  # the next start removes them
    assert leftovers(store) == []
    assert outside.read_text() == "keep"


def test_untranslated_os_error_still_names_errno_and_path():
    code, message = status_for(OSError(errno.EACCES, "Permission denied", "/some/where"))
    assert code == grpc.StatusCode.INTERNAL
    assert "Permission denied [EACCES] on /some/where" in message
    assert "see the driver log" not in message
