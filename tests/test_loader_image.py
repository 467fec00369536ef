"""Directory volumes: a directory without ``dax.sock`` (an fsdax ``Filesystem`` volume's
mount) whose volume is the image file ``csi-pmem-weights.img`` in it. No torch, no GPU.

What is held here: ``stage`` creates the image sized by the planner and allocated up
front, restaging is a no-op, an interrupted stage resumes, a larger model grows the
image (never shrinks it), a full file system is a clear error at stage time (a real
small tmpfs, root only), every reader (``open_volume``, ``load_numpy``, ``ls``,
``verify``, ``export``) takes the directory, a directory with neither socket nor image
is refused with what to do, and an image on a DAX mount is never registered with CUDA.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from csi_pmem.loader import (
    NoModelError,
    ReadOnlyVolumeError,
    VolumeError,
    VolumeTooSmallError,
    load_numpy,
    open_model,
    open_volume,
    stage,
    staging,
    start_load,
)
from csi_pmem.loader import cli as weights_cli
from csi_pmem.loader.gpu import AUTO, BOUNCE, REGISTERED, choose_path
from csi_pmem.sizes import describe_size
from csi_pmem.weights import image as image_mod
from csi_pmem.weights import layout
from csi_pmem.weights import mapping as mapping_mod
from csi_pmem.weights.image import IMAGE_NAME

import loader_models as lm

MiB = lm.MiB
needs_mount = pytest.mark.skipif(not lm.can_mount(), reason="needs root to mount a tmpfs")


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-image") as d:
        yield d


def cli(*argv: object) -> int:
    return weights_cli.main([str(a) for a in argv])


def models_dir(base: Path) -> Path:
    d = base / "models"
    d.mkdir()
    return d


def planned(src: Path, keep: list[layout.ModelEntry] | None = None) -> int:
    """What the planner says a volume needs for ``src`` beside ``keep``."""
    return layout.required_size(layout.Index(models=keep or []),
                                staging.scan_source(str(src)))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def index_of(volume: Path) -> layout.Index:
    with open_volume(volume) as v:
        index = layout.read_index(v)
    assert index is not None
    return index


# --- stage, load, resume, grow -----------------------------------------------------

def test_stage_into_a_directory_creates_the_image_and_loads_byte_exact(shm, capsys):
    ref = lm.sharded_model(shm / "src")
    ref.update(lm.numpy_tensors())
    lm.save_numpy_model(shm / "src", lm.numpy_tensors(), name="extra.safetensors")
    models = models_dir(shm)
    assert cli("stage", shm / "src", models, "--name", "llm", "-q", "-o", "table") == 0
    image = models / IMAGE_NAME
    assert f"image {image}" in capsys.readouterr().out
    assert sorted(os.listdir(models)) == [IMAGE_NAME]  # no temporary file left
    # Sized by the planner: index area, then the files at their aligned offsets, rounded
    # up to the 2 MiB align; and allocated, not sparse.
    st = image.stat()
    assert st.st_size == planned(shm / "src") and st.st_size % (2 * MiB) == 0
    assert st.st_blocks * 512 >= st.st_size
    with open_volume(models) as v:
        assert v.source == str(image) and v.image == str(image) and not v.writable
        assert v.size == st.st_size and v.registration_refused_reason is None
        (model,) = layout.read_index(v).models
        assert model.end <= v.size < model.end + 2 * MiB
    lm.assert_same(load_numpy(models, verify=True), ref)
    lm.assert_same(load_numpy(str(models), model="llm"), ref)
    handle = start_load(models, "cpu", framework="numpy",
                        predicate=lambda n: n.startswith("layers.2."))
    assert set(handle.result()) == {k for k in ref if k.startswith("layers.2.")}
    view = open_model(models)
    try:
        assert view.model.name == "llm"
    finally:
        view.volume.close()

    assert cli("ls", models, "-o", "table") == 0
    out = capsys.readouterr().out
    assert f"{models} (image {image})" in out and "llm@fp-" in out
    assert "  [committed]  7 files" in out
    assert cli("ls", models, "--json") == 0
    assert json.loads(capsys.readouterr().out)["image"] == str(image)
    assert cli("verify", models, "-q", "-o", "table") == 0
    assert re.search(r"^llm@fp-\w+: OK$", capsys.readouterr().out, re.M)
    assert cli("export", models, shm / "out", "-q") == 0
    assert lm.tree_digest(shm / "out") == lm.tree_digest(shm / "src")


def test_restaging_the_same_model_writes_nothing(shm, capsys):
    lm.sharded_model(shm / "src")
    models = models_dir(shm)
    assert cli("stage", shm / "src", models, "--revision", "r1", "-q") == 0
    image = models / IMAGE_NAME
    before = (image.stat().st_size, image.stat().st_mtime_ns, digest(image))
    capsys.readouterr()
    assert cli("stage", shm / "src", models, "--revision", "r1", "-q", "-o", "table") == 0
    assert "already staged" in capsys.readouterr().out
    assert (image.stat().st_size, image.stat().st_mtime_ns, digest(image)) == before


def test_an_interrupted_stage_resumes_in_the_same_image(shm, monkeypatch):
    lm.sharded_model(shm / "src")
    models = models_dir(shm)
    with lm.staging_interrupted_at(monkeypatch, "model-00003"), \
            staging.open_for_staging(models) as v, \
            pytest.raises(KeyboardInterrupt):
        stage(v, str(shm / "src"), threads=1)
    with pytest.raises(NoModelError, match="interrupted"):
        load_numpy(models)
    entry = index_of(models).models[0]
    done = [f for f in entry.files if f.done]
    assert entry.state == layout.STAGING and 0 < len(done) < len(entry.files)
    size = (models / IMAGE_NAME).stat().st_size
    assert size == planned(shm / "src")  # grown before the plan was written

    with staging.open_for_staging(models) as v:
        result = stage(v, str(shm / "src"))
    assert result.reused == sum(f.length for f in done) and result.copied > 0
    assert (models / IMAGE_NAME).stat().st_size == size
    lm.assert_same(load_numpy(models, verify=True), lm.reference(shm / "src"))


def test_a_larger_model_grows_the_image_and_nothing_shrinks_it(shm, capsys):
    small = lm.sharded_model(shm / "small")
    big = lm.large_model(shm / "big", 12 * MiB)
    models = models_dir(shm)
    image = models / IMAGE_NAME
    assert cli("stage", shm / "small", models, "-q") == 0
    first = image.stat().st_size
    assert first == planned(shm / "small")

    # Another model goes after the committed one: the image grows to hold both.
    assert cli("stage", shm / "big", models, "-q") == 0
    both = image.stat().st_size
    (kept,) = [m for m in index_of(models).models if m.name == "small"]
    assert both == planned(shm / "big", [kept]) > first
    assert image.stat().st_blocks * 512 >= both
    lm.assert_same(load_numpy(models, model="small", verify=True), small)
    lm.assert_same(load_numpy(models, model="big", verify=True), big)

    # The same name with other content needs --replace, which starts over at the index
    # area: this model alone fits, the image keeps its size (pods may still map it).
    capsys.readouterr()
    assert cli("stage", shm / "big", models, "--name", "small", "-q") == 1
    assert "--replace" in capsys.readouterr().err
    assert cli("stage", shm / "big", models, "--name", "small", "--replace", "-q") == 0
    assert image.stat().st_size == both
    (only,) = index_of(models).models
    assert (only.name, min(f.offset for f in only.files)) == ("small", layout.INDEX_AREA)
    lm.assert_same(load_numpy(models, verify=True), big)

    # --size pre-sizes (grows) the image; a smaller --size is not a shrink.
    assert cli("stage", shm / "small", models, "--name", "s2", "--size", "64Mi", "-q") == 0
    assert image.stat().st_size == 64 * MiB
    assert cli("stage", shm / "small", models, "--name", "s3", "--size", "16Mi", "-q") == 0
    assert image.stat().st_size == 64 * MiB
    lm.assert_same(load_numpy(models, model="s3", verify=True), small)


def test_the_library_grows_an_image_opened_writable(shm):
    lm.sharded_model(shm / "a")
    big = lm.large_model(shm / "b", 6 * MiB)
    models = models_dir(shm)
    with staging.open_for_staging(models) as v:
        assert v.growable and v.size == layout.INDEX_AREA  # just the index area yet
        stage(v, str(shm / "a"))
        assert v.size == planned(shm / "a")
    with open_volume(models, writable=True) as v:
        assert v.growable
        stage(v, str(shm / "b"))
        assert v.size == os.path.getsize(models / IMAGE_NAME) > planned(shm / "a")
    with open_volume(models) as v:
        assert not v.growable
        with pytest.raises(VolumeError, match="cannot grow"):
            v.grow(v.size + 2 * MiB)
    # A stager that waited for the lock maps what another one grew the image to.
    with open_volume(models, writable=True) as a, open_volume(models, writable=True) as b:
        assert b.grow(b.size + 1) and b.size == a.size + 2 * MiB
        assert a.refresh() and a.size == b.size and not a.refresh()
        assert not b.grow(b.size)
    lm.assert_same(load_numpy(models, model="b"), big)

    # An image made sparse by hand gets its holes allocated before anything is staged.
    (shm / "hand").mkdir()
    hand = models_dir(shm / "hand")
    lm.volume_file(hand / IMAGE_NAME, 32 * MiB)
    assert (hand / IMAGE_NAME).stat().st_blocks == 0
    with staging.open_for_staging(hand) as v:
        assert v.size == 32 * MiB
    assert (hand / IMAGE_NAME).stat().st_blocks * 512 >= 32 * MiB


# --- refusals ------------------------------------------------------------------------

def test_a_directory_with_neither_socket_nor_image_says_to_stage_first(shm, capsys):
    empty = models_dir(shm)
    for call in (lambda: open_volume(empty), lambda: open_volume(empty, writable=True),
                 lambda: load_numpy(empty)):
        with pytest.raises(VolumeError) as err:
            call()
        msg = str(err.value)
        assert "neither dax.sock" in msg and IMAGE_NAME in msg
        assert f"csi-pmem-weights stage SRC_DIR {empty}" in msg
    for argv in (("ls", empty), ("verify", empty), ("export", empty, shm / "out")):
        assert cli(*argv) == 1
        err = capsys.readouterr().err
        assert "stage a model first" in err and "Traceback" not in err
    assert os.listdir(empty) == []  # readers never create the image

    # An image that is not a file, and one that holds nothing yet.
    (empty / IMAGE_NAME).mkdir()
    with pytest.raises(VolumeError, match="not a regular file"):
        open_volume(empty)
    (empty / IMAGE_NAME).rmdir()
    with staging.open_for_staging(empty):
        pass
    with pytest.raises(NoModelError, match="no staged model; run csi-pmem-weights stage"):
        load_numpy(empty)


def test_a_devdax_publish_directory_never_gets_an_image(shm, capsys):
    # volume.json without dax.sock: a devdax publish while its node plugin restarts.
    lm.sharded_model(shm / "src")
    pub = models_dir(shm)
    (pub / "volume.json").write_text(json.dumps({"volume_id": "v1"}))
    assert image_mod.volume_image(pub) is None
    assert cli("stage", shm / "src", pub, "-q") == 1
    assert "dax.sock does not exist" in capsys.readouterr().err
    assert os.listdir(pub) == ["volume.json"]


@needs_mount
def test_a_full_file_system_fails_the_stage_with_the_space_needed_and_free(shm, capsys):
    lm.large_model(shm / "big", 24 * MiB)
    small = lm.sharded_model(shm / "small")
    with lm.tmpfs(shm / "fs", 20 * MiB) as fs:
        assert cli("stage", shm / "big", fs, "-q") == 1
        err = capsys.readouterr().err
        image = fs / IMAGE_NAME
        need = planned(shm / "big")
        assert err.startswith(f"csi-pmem-weights: error: no space for {image}")
        assert f"must be {describe_size(need)}" in err
        free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
        assert f"has only {describe_size(free)} free" in err
        assert "Traceback" not in err
        # Refused before the plan was written; the image keeps its (index-only) size.
        assert image.stat().st_size == layout.INDEX_AREA
        assert sorted(os.listdir(fs)) == [IMAGE_NAME]
        with open_volume(fs) as v:
            assert layout.read_index(v) is None
        with staging.open_for_staging(fs) as v, pytest.raises(VolumeTooSmallError) as info:
            stage(v, str(shm / "big"))
        assert info.value.needed > info.value.available == free
        # A model that fits still stages into the same image.
        assert cli("stage", shm / "small", fs, "-q") == 0
        lm.assert_same(load_numpy(fs, verify=True), small)


@needs_mount
def test_a_read_only_mount_is_refused_for_staging_and_loads(shm, capsys):
    ref = lm.sharded_model(shm / "src")
    models = models_dir(shm)
    with lm.read_only_bind(models, shm / "ro") as ro:
        with pytest.raises(ReadOnlyVolumeError, match="needs a writable mount"):
            staging.open_for_staging(ro)
        assert cli("stage", shm / "src", models, "-q") == 0
        with pytest.raises(ReadOnlyVolumeError, match="read-only file system"):
            staging.open_for_staging(ro)
        lm.assert_same(load_numpy(ro, verify=True), ref)


# --- registration --------------------------------------------------------------------

def test_an_image_on_a_dax_mount_takes_the_bounce_path(shm, tmp_path, monkeypatch):
    ref = lm.sharded_model(shm / "src")
    models = models_dir(shm)
    assert cli("stage", shm / "src", models, "-q") == 0
    image = models / IMAGE_NAME
    fake = lm.fake_mountinfo(tmp_path / "mountinfo",
                             [(str(models), "ext4", "/dev/pmem0", "rw,dax=always")], image)
    monkeypatch.setattr(mapping_mod, "MOUNTINFO", str(fake))
    with open_volume(models) as v:
        reason = v.registration_refused_reason
        assert reason and str(image) in reason and "DAX file system" in reason
        assert "cudaHostRegister" in reason
        for mode in (AUTO, REGISTERED):
            assert choose_path(mode, v, 3, False, 2) == (BOUNCE, reason)
    handle = start_load(models, "cpu", framework="numpy")
    assert handle.view.volume.registration_refused_reason == reason
    lm.assert_same(handle.result(), ref)
