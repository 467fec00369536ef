"""The loader through a real published volume: the driver's dax.sock hands out the fd,
``csi-pmem-weights stage`` writes through a read-write publish, a read-only publish
loads (and refuses staging), and the NUMA node comes from the volume's metadata."""

from __future__ import annotations

from safetensors.numpy import load_file

from csi_pmem import weights_cli
from csi_pmem.loader import ReadOnlyVolumeError, load_numpy, open_volume

import loader_models as lm
from conftest import MiB, needs_root

pytestmark = needs_root()


def test_stage_and_load_through_a_published_volume(driver, tmp_path, capsys):
    ref = lm.sharded_model(tmp_path / "src")
    vol = driver.create("weights", size=64 * MiB, params={"numaNode": "1"}).volume
    rw = driver.target("stager")
    driver.publish(vol.volume_id, rw)
    assert weights_cli.main(["stage", str(tmp_path / "src"), rw, "-q"]) == 0
    assert "staged src" in capsys.readouterr().out
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
