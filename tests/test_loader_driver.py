"""The loader through a real published volume: the driver's dax.sock hands out the fd,
``csi-pmem-weights stage`` writes through a read-write publish, a read-only publish
loads (and refuses staging), and the NUMA node comes from the volume's metadata. An
fsdax ``Filesystem`` volume (ext4 on a loop device with the emulated back end) takes the
same commands at its mount path: the weights go into the image file there."""

from __future__ import annotations

import gc
import json
import os

from safetensors.numpy import load_file

from csi_pmem.loader import ReadOnlyVolumeError, load_numpy, open_volume, staging
from csi_pmem.loader import cli as weights_cli
from csi_pmem.sizes import describe_size
from csi_pmem.weights import layout
from csi_pmem.weights.image import IMAGE_NAME

import loader_models as lm
from conftest import MiB, mount_cap, needs_root

pytestmark = needs_root()


def test_stage_and_load_through_a_published_volume(driver, tmp_path, capsys):
    ref = lm.sharded_model(tmp_path / "src")
    vol = driver.create("weights", size=64 * MiB, params={"numaNode": "1"}).volume
    rw = driver.target("stager")
    driver.publish(vol.volume_id, rw)
    assert weights_cli.main(["stage", str(tmp_path / "src"), rw, "-q", "-o", "table"]) == 0
    assert "staged src@fp-" in capsys.readouterr().out
    # A flipped byte on the volume: stage copies again only its chunk, through dax.sock.
    with open_volume(rw, writable=True) as v:
        f = layout.read_index(v).models[0].safetensors[-1]
        v.buffer[f.offset + 9] ^= 0x40
        v.persist(f.offset + 9, 1)
    assert weights_cli.main(["verify", rw, "-q"]) == weights_cli.EXIT_MISMATCH
    capsys.readouterr()
    assert weights_cli.main(["stage", str(tmp_path / "src"), rw, "-q", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["action"], doc["copied"], doc["repaired"]["files"]) == (
        "repaired", f.length, [f.name])  # a small file: one chunk
    assert weights_cli.main(["verify", rw, "-q"]) == 0
    driver.unpublish(vol.volume_id, rw)

    ro = driver.target("server")
    driver.publish(vol.volume_id, ro, readonly=True)
    try:
        with open_volume(ro) as v:
            assert v.numa_node == 1 and not v.writable
            assert v.metadata["volume_id"] == vol.volume_id
            got = load_numpy(v, verify=True)
        assert set(got) == set(ref)
        for name, arr in ref.items():
            assert got[name].tobytes() == arr.tobytes()
        shard = tmp_path / "src" / "model-00001-of-00003.safetensors"
        for name, arr in load_file(str(shard)).items():
            assert got[name].tobytes() == arr.tobytes()

        try:
            open_volume(ro, writable=True)
            raise AssertionError("a read-only publish was opened writable")
        except ReadOnlyVolumeError as exc:
            assert "published read-only" in str(exc)
        assert weights_cli.main(["stage", str(tmp_path / "src"), ro, "-q"]) == 1
        assert "published read-only" in capsys.readouterr().err
    finally:
        driver.unpublish(vol.volume_id, ro)
    driver.delete(vol.volume_id)


def ext4_cap():
    cap = mount_cap()
    cap.mount.fs_type = "ext4"
    return cap


def test_stage_and_load_through_an_fsdax_filesystem_volume(driver, tmp_path, capsys):
    ref = lm.sharded_model(tmp_path / "src")
    big = lm.large_model(tmp_path / "big", 8 * MiB)
    cap = ext4_cap()
    vid = driver.create("fs-weights", size=64 * MiB, params={"deviceMode": "fsdax"},
                        caps=[cap]).volume.volume_id
    globalmount = driver.staging("fs-weights")
    driver.stage(vid, globalmount, cap=cap)
    rw, ro = driver.target("stager"), driver.target("server")
    driver.publish(vid, rw, cap=cap, staging=globalmount)
    try:
        assert not os.path.exists(os.path.join(rw, "dax.sock"))
        assert weights_cli.main(["stage", str(tmp_path / "src"), rw, "--name", "llm",
                                 "-q", "-o", "table"]) == 0
        assert f"image {rw}/{IMAGE_NAME}" in capsys.readouterr().out
        image = os.path.join(rw, IMAGE_NAME)
        need = layout.required_size(layout.Index(),
                                    staging.scan_source(str(tmp_path / "src")))
        assert os.path.getsize(image) == need
        # The same file system under the staging path: the same image.
        assert os.path.getsize(os.path.join(globalmount, IMAGE_NAME)) == need
        assert weights_cli.main(["stage", str(tmp_path / "src"), rw, "--name", "llm",
                                 "-q", "-o", "table"]) == 0
        assert "already staged" in capsys.readouterr().out
        # A second model grows the image on ext4.
        assert weights_cli.main(["stage", str(tmp_path / "big"), rw, "-q"]) == 0
        assert os.path.getsize(image) > need

        driver.publish(vid, ro, readonly=True, cap=cap, staging=globalmount)
        with open_volume(ro) as v:
            assert v.image == os.path.join(ro, IMAGE_NAME) and not v.writable
            # ext4 on a loop device has no DAX: registration stays allowed here; on
            # real pmem (-o dax) the mount decides (tests/test_loader_image.py).
            assert v.registration_refused_reason is None
            lm.assert_same(load_numpy(v, model="llm", verify=True), ref)
        shard = tmp_path / "src" / "model-00002-of-00003.safetensors"
        got = load_numpy(ro, model="llm")
        for name, arr in load_file(str(shard)).items():
            assert got[name].tobytes() == arr.tobytes()
        del got
        lm.assert_same(load_numpy(ro, model="big"), big)
        assert weights_cli.main(["stage", str(tmp_path / "src"), ro, "--name", "x",
                                 "-q"]) == 1
        assert "read-only file system" in capsys.readouterr().err

        # More than the file system holds: ENOSPC from ext4 at stage time, clearly.
        huge = lm.large_model(tmp_path / "huge", 56 * MiB)
        assert huge
        before = os.path.getsize(image)
        assert weights_cli.main(["stage", str(tmp_path / "huge"), rw, "-q"]) == 1
        err = capsys.readouterr().err
        st = os.statvfs(rw)
        assert f"no space for {image}" in err
        assert f"has only {describe_size(st.f_bavail * st.f_frsize)} free" in err
        assert os.path.getsize(image) == before
        with open_volume(rw) as v:
            assert sorted(m.name for m in layout.read_index(v).models) == ["big", "llm"]
        lm.assert_same(load_numpy(rw, model="llm", verify=True), ref)
    finally:
        # Loads that are done may still map the image until the collector frees their
        # futures (reference cycles); a mapped file keeps the mount busy.
        gc.collect()
        for target in (ro, rw):
            if os.path.exists(target):
                driver.unpublish(vid, target)
        driver.unstage(vid, globalmount)
    driver.delete(vid)
