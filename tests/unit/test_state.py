"""State store: atomic records that survive a crash and never lose a neighbour."""

import os

import pytest

from csi_pmem.state import CREATING, READY, Publication, StateStore, VolumeRecord


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
