"""A directory source: its pages leave the page cache once staged, and a dangling
link in it is named with its target.

Why: the cache a read fills is charged to the reader's memory cgroup; the cluster tier
saw a 256Mi staging pod pinned at its limit while it staged a 1 GiB model. Measured
with util-linux's ``fincore`` (pages of the file resident in the cache), on a disk file
system (tmpfs pages are the file itself and cannot be dropped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from csi_pmem.loader import load_numpy, open_volume, staging

import loader_models as lm

MiB = lm.MiB


def resident(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          str(path)], capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore missing")
def test_staging_drops_the_source_pages_it_copied(tmp_path, monkeypatch):
    if subprocess.run(["findmnt", "-no", "FSTYPE", "--target", str(tmp_path)],
                      capture_output=True, text=True).stdout.strip() in ("tmpfs", ""):
        pytest.skip("needs a disk file system under tmp_path")
    src = tmp_path / "src"
    lm.large_model(src, 32 * MiB)
    shard = src / "model.safetensors"
    os.sync()  # clean pages, as a finished download's are (dirty ones cannot be dropped)
    ref = lm.reference(src)
    with open(shard, "rb") as f:
        while f.read(8 * MiB):  # the whole file in the cache, as a fresh download is
            pass
    assert resident(shard) >= 16 * MiB
    with lm.shm_scratch(tmp_path, "csi-pmem-cache") as shm:
        vol = lm.volume_file(shm / "vol", 64 * MiB)
        with open_volume(vol, writable=True) as v:
            staging.stage(v, str(src), name="m")
        assert resident(shard) <= 1 * MiB  # the header the scan read, at most
        lm.assert_same(load_numpy(str(vol)), ref)


def test_a_dangling_link_in_a_source_names_where_it_points(tmp_path):
    src = tmp_path / "src"
    lm.large_model(src, 1 * MiB)
    (src / "model-2.safetensors").symlink_to("/blobs/sha256-gone")
    vol = lm.volume_file(tmp_path / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v, pytest.raises(staging.SourceError) as info:
        staging.stage(v, str(src), name="m")
    assert str(info.value) == (
        f"{src}/model-2.safetensors is a symbolic link to /blobs/sha256-gone, which does "
        "not exist (in an image or a copied snapshot, links must be relative and point "
        "inside it)")


def test_a_source_file_that_cannot_be_opened_closes_the_others(tmp_path, monkeypatch):
    """The copy opens a reader per file first; when one open fails (the file vanished
    between the scan and the copy), the readers already open are closed."""
    src = tmp_path / "src"
    lm.sharded_model(src, shards=3, per_shard=2)
    real = staging.open_file
    opened: list = []

    def open_file(f):
        if f.name.startswith("model-00002"):
            raise FileNotFoundError(f"{f.path} vanished")
        reader = real(f)
        opened.append(reader)
        return reader

    monkeypatch.setattr(staging, "open_file", open_file)
    vol = lm.volume_file(tmp_path / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v, pytest.raises(FileNotFoundError):
        staging.stage(v, str(src), name="m")
    assert opened
    for reader in opened:
        with pytest.raises(OSError):
            os.fstat(reader.fd)  # closed
