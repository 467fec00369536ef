"""The loader's CPU path, staging and on-volume layout, without torch (CI).

Volumes are plain files on tmpfs (``/dev/shm``) or the test's tmp dir: they map exactly
like a devdax namespace (MAP_SHARED from offset 0, 2 MiB-aligned size). Correctness is
byte-exact against ``safetensors.numpy.load_file`` (bf16/fp8, which numpy lacks, against
the raw bytes written). Every bad input must raise a clear error and leave nothing a
later load would trust.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from csi_pmem.loader import (
    AlignmentError,
    ChecksumError,
    LayoutError,
    LoaderError,
    NoModelError,
    ReadOnlyVolumeError,
    SafetensorsFormatError,
    VolumeTooSmallError,
    export,
    load_numpy,
    open_model,
    open_volume,
    stage,
    staging,
    start_load,
    verify,
)
from csi_pmem.weights import layout, wsum
from csi_pmem.weights import volume as volume_mod
from csi_pmem.weights.stformat import parse_header

import loader_models as lm

MiB = lm.MiB


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-loader") as d:
        yield d









# --- correctness -------------------------------------------------------------------

def test_dtypes_and_empty_tensors_match_safetensors(shm):
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    vol = lm.staged_volume(shm / "src", shm / "vol")
    lm.assert_same(load_numpy(str(vol)), lm.reference(shm / "src"))


def test_cpu_views_are_backed_by_the_read_only_mapping(shm):
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    vol = lm.staged_volume(shm / "src", shm / "vol")
    with open_volume(vol) as v:
        got = load_numpy(v)
        arr = got["f32"]
        assert v.address <= arr.ctypes.data < v.address + v.size  # no copy
        assert not arr.flags.writeable
    # The arrays outlive close(): the mapping goes when they do.
    assert arr.sum() == lm.reference(shm / "src")["f32"].sum()


def test_dropping_the_tensors_unmaps_a_volume_the_load_opened(shm):
    """No reference cycle holds a load's tensors: once the caller drops them, the
    mapping goes at once (an fsdax mount can be unmounted), garbage collector or not."""
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    vol = os.path.realpath(lm.staged_volume(shm / "src", shm / "vol"))

    def mapped() -> bool:
        return vol in lm.mapped_files()

    gc.collect()
    gc.disable()
    try:
        got = load_numpy(vol)
        assert mapped()
        del got
        # The host check's thread lets go of the handle just after result() returned.
        deadline = time.monotonic() + 10
        while mapped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not mapped(), "the mapping outlived the tensors: a reference cycle holds them"
    finally:
        gc.enable()


def test_bf16_fp8_and_unaligned_tensors_are_raw_views(shm):
    written = lm.bf16_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    got = load_numpy(str(vol))
    view = open_model(str(vol))
    infos = {t.name: t for h in view.headers.values() for t in h.tensors.values()}
    for name, (dtype, shape, data) in written.items():
        assert infos[name].dtype == dtype and infos[name].shape == shape
        assert got[name].tobytes() == data, name
    assert got["w_bf16"].dtype == np.uint16 and got["w_bf16"].shape == (8, 16)
    assert got["w_fp8"].dtype == np.uint8
    assert got["unaligned_f32"].dtype == np.float32
    assert got["empty_bf16"].shape == (0, 3)


def test_many_small_tensors(shm):
    lm.many_small_model(shm / "src", 2000)
    vol = lm.staged_volume(shm / "src", shm / "vol")
    lm.assert_same(load_numpy(str(vol)), lm.reference(shm / "src"))


def test_one_large_tensor(shm):
    lm.large_model(shm / "src", 64 * MiB)
    vol = lm.staged_volume(shm / "src", shm / "vol", size=96 * MiB)
    got = load_numpy(str(vol), verify=True)
    ref = lm.reference(shm / "src")
    assert got["big"].nbytes == 64 * MiB
    lm.assert_same(got, ref)


def test_sharded_model_subsets_and_futures(shm):
    ref = lm.sharded_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    lm.assert_same(load_numpy(str(vol)), ref)
    subset = load_numpy(str(vol), predicate=lambda n: n.startswith("layers.1."))
    assert set(subset) == {k for k in ref if k.startswith("layers.1.")}
    names = ["layers.0.0.weight", "layers.2.3.weight"]
    assert set(load_numpy(str(vol), names=names)) == set(names)
    with pytest.raises(LoaderError, match="no tensor"):
        load_numpy(str(vol), names=["nope"])
    handle = start_load(str(vol), "cpu", framework="numpy")
    first = "model-00001-of-00003.safetensors"
    assert set(handle.files[first].result()) == {k for k in ref if k.startswith("layers.0.")}
    assert handle.tensors["layers.2.0.weight"].result().tobytes() == \
        ref["layers.2.0.weight"].tobytes()
    assert handle.verified.result() is None
    assert handle.path == "cpu-view"


def test_stage_export_round_trip_is_byte_identical(shm):
    lm.sharded_model(shm / "src")
    lm.volume_file(shm / "vol", 64 * MiB)
    with open_volume(shm / "vol", writable=True) as v:
        result = stage(v, str(shm / "src"), name="llm", revision="abc")
        assert (result.model.name, result.model.revision) == ("llm", "abc")
        again = stage(v, str(shm / "src"), name="llm", revision="abc")
        assert again.already and again.copied == 0
    with open_volume(shm / "vol") as v:
        written = export(v, str(shm / "out"))
    assert len(written) == 6
    assert lm.tree_digest(shm / "out") == lm.tree_digest(shm / "src")
    # New stages checksum 64 MiB chunks with wsum64 (the file digest is the SHA-256
    # of the chunk checksums).
    with open_volume(shm / "vol") as v:
        model = layout.read_index(v).models[0]
    data = (shm / "src" / "config.json").read_bytes()
    assert model.algo == "wsum64"
    assert model.file("config.json").chunks == [wsum.digest(data)]


def test_layout_offsets_are_aligned(shm):
    lm.sharded_model(shm / "src")
    vol = lm.staged_volume(shm / "src", shm / "vol")
    with open_volume(vol) as v:
        model = layout.read_index(v).select()
    for f in model.files:
        align = 2 * MiB if f.kind == "safetensors" else 4096
        assert f.offset % align == 0 and f.offset >= layout.INDEX_AREA


def test_two_models_on_one_volume(shm):
    lm.save_numpy_model(shm / "a", lm.numpy_tensors(0))
    lm.save_numpy_model(shm / "b", lm.numpy_tensors(1))
    lm.volume_file(shm / "vol", 32 * MiB)
    with open_volume(shm / "vol", writable=True) as v:
        stage(v, str(shm / "a"))
        stage(v, str(shm / "b"))
    with pytest.raises(NoModelError, match="several models"):
        load_numpy(str(shm / "vol"))
    lm.assert_same(load_numpy(str(shm / "vol"), model="b"), lm.reference(shm / "b"))


# --- bad input ---------------------------------------------------------------------

def staged_np(shm: Path) -> Path:
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    return lm.staged_volume(shm / "src", shm / "vol")


def newest_slot(vol: Path) -> int:
    with open_volume(vol) as v:
        return layout.read_index(v).generation % layout.SLOTS


def test_corrupt_newest_index_falls_back_to_an_uncommitted_generation(shm):
    vol = staged_np(shm)
    slot = newest_slot(vol)
    with open(vol, "r+b") as f:
        f.seek(slot * layout.SLOT_SIZE + layout.HEADER_SIZE + 10)
        f.write(b"#")
    # The previous generation is the one written just before the commit: not trusted.
    with pytest.raises(NoModelError, match="not committed"):
        load_numpy(str(vol))


def test_corrupt_or_truncated_index_is_refused(shm):
    vol = staged_np(shm)
    with open(vol, "r+b") as f:
        for slot in range(layout.SLOTS):
            f.seek(slot * layout.SLOT_SIZE + 24)  # the JSON length field
            f.write(struct.pack("<Q", layout.SLOT_SIZE * 2))
    with pytest.raises(LayoutError, match="truncated or corrupt"):
        load_numpy(str(vol))
    with pytest.raises(LayoutError, match="--replace"):
        with open_volume(vol, writable=True) as v:
            stage(v, str(shm / "src"))
    with open_volume(vol, writable=True) as v:
        stage(v, str(shm / "src"), replace=True)
    lm.assert_same(load_numpy(str(vol)), lm.reference(shm / "src"))


def test_foreign_data_is_not_an_index(shm):
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open(vol, "r+b") as f:
        f.write(b"\x7fELF" + os.urandom(100))
    with pytest.raises(LayoutError, match="no csi-pmem index"):
        load_numpy(str(vol))


def test_blank_volume_has_no_model(shm):
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with pytest.raises(NoModelError, match="no staged model"):
        load_numpy(str(vol))


def rewrite_index(vol: Path, change) -> None:
    """Edit the newest index and write it back with a valid checksum (a buggy or
    malicious writer, not a torn write)."""
    with open_volume(vol, writable=True) as v:
        index = layout.read_index(v)
        change(index)
        blob = layout.encode(index, index.generation + 1)
        start = ((index.generation + 1) % layout.SLOTS) * layout.SLOT_SIZE
        v.view(start, len(blob))[:] = blob


def test_wrong_checksum_is_detected_everywhere(shm):
    vol = staged_np(shm)
    with open_volume(vol) as v:
        f = layout.read_index(v).models[0].files[0]
    with open(vol, "r+b") as fh:
        fh.seek(f.offset + f.length - 2)
        fh.write(b"\xfe\xfd")  # not a valid bool either: certainly changed
    with pytest.raises(ChecksumError, match="stage the model again"):
        load_numpy(str(vol), verify=True)
    with open_volume(vol) as v:
        report = verify(v)
    assert len(report["m"]) == 1
    with open_volume(vol) as v, pytest.raises(ChecksumError):
        export(v, str(shm / "out"))
    assert not list((shm / "out").rglob("*.safetensors*"))  # no partial file left


def test_misaligned_offset_in_index_is_refused(shm):
    vol = staged_np(shm)

    def shift(index):
        index.models[0].files[-1].offset += 4096

    rewrite_index(vol, shift)
    with pytest.raises(LayoutError, match="misaligned"):
        load_numpy(str(vol))


def test_index_entry_outside_the_volume_is_refused(shm):
    vol = staged_np(shm)

    def grow(index):
        index.models[0].files[-1].length = 1 << 40

    rewrite_index(vol, grow)
    with pytest.raises(LayoutError, match="outside the data area"):
        load_numpy(str(vol))


def test_unsafe_file_name_in_index_is_refused(shm):
    vol = staged_np(shm)

    def evil(index):
        index.models[0].files[0].name = "../../etc/passwd"

    rewrite_index(vol, evil)
    with pytest.raises(LayoutError, match="unsafe file name"):
        load_numpy(str(vol))


def rewrite_raw(vol: Path, edit) -> None:
    """Write the next index generation as the document ``edit(doc)`` returns (bytes
    as they are), behind a valid header checksum: damage only the parser can catch."""
    with open_volume(vol, writable=True) as v:
        index = layout.read_index(v)
        body = edit(index.to_json())
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        generation = index.generation + 1
        fields = layout._FIELDS.pack(layout.MAGIC, layout.VERSION, layout.HEADER_SIZE,
                                     generation, len(body))
        blob = fields + hashlib.sha256(fields + body).digest() + body
        start = (generation % layout.SLOTS) * layout.SLOT_SIZE
        v.view(start, len(blob))[:] = blob


def _model(doc: dict, **fields) -> dict:
    doc["models"][0].update(fields)
    return doc


@pytest.mark.parametrize("fields, message", [
    ({"updated": "yesterday"}, "invalid updated"),
    ({"updated": [1]}, "invalid updated"),
    ({"updated": float("inf")}, "invalid updated"),
    ({"chunk_size": 1}, "checksum chunks of 1 bytes"),
])
def test_an_index_with_bad_model_fields_is_a_layout_error(shm, fields, message):
    """Not a ValueError or TypeError from deep inside: the copy service and the loader
    turn LayoutError into a message, anything else into a traceback. A chunk size of
    1 byte would also have made the check list one range per byte of the file."""
    vol = staged_np(shm)
    rewrite_raw(vol, lambda doc: _model(doc, **fields))
    with pytest.raises(LayoutError, match=message):
        load_numpy(str(vol))


def test_a_deeply_nested_newer_index_is_skipped_for_the_valid_one(shm):
    vol = staged_np(shm)
    rewrite_raw(vol, lambda doc: b"[" * 200_000 + b"]" * 200_000)
    lm.assert_same(load_numpy(str(vol)), lm.reference(shm / "src"))
    with open_volume(vol) as v:
        assert layout.read_index(v).generation == newest_generation(vol) - 1


def newest_generation(vol: Path) -> int:
    with open(vol, "rb") as f:
        heads = []
        for slot in range(layout.SLOTS):
            f.seek(slot * layout.SLOT_SIZE)
            heads.append(layout._FIELDS.unpack(f.read(layout._FIELDS.size))[3])
    return max(heads)


def test_misaligned_volume_size_is_refused(shm):
    path = shm / "vol"
    path.write_bytes(b"\0" * (3 * MiB + 5))
    with pytest.raises(AlignmentError, match="not a multiple of the volume align"):
        open_volume(path)
    with pytest.raises(AlignmentError, match="power of two"):
        open_volume(lm.volume_file(shm / "vol2", 4 * MiB), align=3 * MiB)


def test_model_bigger_than_volume_is_refused_before_writing(shm):
    lm.large_model(shm / "src", 16 * MiB)
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v, pytest.raises(VolumeTooSmallError) as err:
        stage(v, str(shm / "src"))
    e = err.value
    assert e.needed > e.available
    assert "does not fit" in str(e) and f"({e.needed} bytes)" in str(e)
    assert "at least" in str(e)
    with pytest.raises(NoModelError, match="no staged model"):
        load_numpy(str(vol))


def test_staging_a_read_only_volume_is_refused(shm):
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol) as v, pytest.raises(ReadOnlyVolumeError, match="read-only"):
        stage(v, str(shm / "src"))
    if os.geteuid() != 0:
        os.chmod(vol, 0o444)
        with pytest.raises(ReadOnlyVolumeError):
            open_volume(vol, writable=True)


def test_interrupted_stage_is_not_trusted_and_resumes(shm, monkeypatch):
    lm.sharded_model(shm / "src")
    lm.volume_file(shm / "vol", 64 * MiB)
    real = staging._copy_chunk
    calls = []

    def flaky(volume, reader, entry, off, length, algo):
        calls.append(entry.name)
        if len(calls) == 5:
            raise OSError("simulated I/O error mid-copy")
        return real(volume, reader, entry, off, length, algo)

    monkeypatch.setattr(staging, "_copy_chunk", flaky)
    with open_volume(shm / "vol", writable=True) as v, pytest.raises(OSError, match="mid-copy"):
        stage(v, str(shm / "src"), threads=1)
    with pytest.raises(NoModelError, match="interrupted"):
        load_numpy(str(shm / "vol"))
    with open_volume(shm / "vol") as v:
        entry = layout.read_index(v).models[0]
    assert entry.state == layout.STAGING
    done_before = {f.name for f in entry.files if f.done}
    assert 0 < len(done_before) < len(entry.files)

    monkeypatch.setattr(staging, "_copy_chunk", real)
    with open_volume(shm / "vol", writable=True) as v:
        result = stage(v, str(shm / "src"))
    assert result.reused == sum(f.length for f in entry.files if f.name in done_before)
    lm.assert_same(load_numpy(str(shm / "vol")), lm.reference(shm / "src"))


def test_resume_recopies_a_done_file_that_was_damaged(shm, monkeypatch):
    lm.sharded_model(shm / "src")
    lm.volume_file(shm / "vol", 64 * MiB)
    with lm.staging_interrupted_at(monkeypatch, "model-00003"), \
            open_volume(shm / "vol", writable=True) as v, \
            pytest.raises(KeyboardInterrupt):
        stage(v, str(shm / "src"), threads=1)
    with open_volume(shm / "vol") as v:
        first = layout.read_index(v).models[0].file("model-00001-of-00003.safetensors")
    assert first.done
    with open(shm / "vol", "r+b") as fh:
        fh.seek(first.offset + 100)
        fh.write(b"garbage")
    with open_volume(shm / "vol", writable=True) as v:
        result = stage(v, str(shm / "src"))
    assert result.copied >= first.length
    lm.assert_same(load_numpy(str(shm / "vol"), verify=True), lm.reference(shm / "src"))


def test_source_changes_restart_the_plan(shm, monkeypatch):
    lm.sharded_model(shm / "src")
    lm.volume_file(shm / "vol", 64 * MiB)
    monkeypatch.setattr(staging, "_copy_chunk", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with open_volume(shm / "vol", writable=True) as v, pytest.raises(OSError):
        stage(v, str(shm / "src"))
    monkeypatch.undo()
    (shm / "src" / "config.json").write_text(json.dumps({"changed": True, "pad": "x" * 50}))
    with open_volume(shm / "vol", writable=True) as v:
        stage(v, str(shm / "src"))
    with open_volume(shm / "vol") as v:
        export(v, str(shm / "out"))
    assert lm.tree_digest(shm / "out") == lm.tree_digest(shm / "src")


def test_restaging_another_revision_needs_replace(shm):
    lm.save_numpy_model(shm / "src", lm.numpy_tensors())
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v:
        stage(v, str(shm / "src"), name="m", revision="1")
        with pytest.raises(LayoutError, match="--replace"):
            stage(v, str(shm / "src"), name="m", revision="2")
        stage(v, str(shm / "src"), name="m", revision="2", replace=True)
        assert [m.revision for m in layout.read_index(v).models] == ["2"]


def test_bad_safetensors_sources_are_refused_before_staging(shm):
    src = shm / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v, pytest.raises(SafetensorsFormatError,
                                                            match="does not fit"):
        stage(v, str(src))
    (src / "model.safetensors").unlink()
    (src / "config.json").write_text("{}")
    with open_volume(vol, writable=True) as v, pytest.raises(LoaderError, match="no \\*"):
        stage(v, str(src))
    lm.sharded_model(shm / "sharded")
    (shm / "sharded" / "model-00002-of-00003.safetensors").unlink()
    with open_volume(vol, writable=True) as v, pytest.raises(LoaderError, match="missing"):
        stage(v, str(shm / "sharded"))
    with pytest.raises(NoModelError):
        load_numpy(str(vol))


@pytest.mark.parametrize("header, why", [
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', "needs 8 bytes"),
    (b'{"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 400]}}', "truncated"),
    (b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},'
     b' "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}', "overlap"),
    (b'{"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}', "shape"),
    (b'[1, 2]', "not a JSON object"),
    (b'{"a": ', "not JSON"),
])
def test_header_validation(header, why):
    blob = struct.pack("<Q", len(header)) + header + bytes(8)
    with pytest.raises(SafetensorsFormatError, match=why):
        parse_header(blob)


def test_a_small_page_file_keeps_an_fd_to_read_it_through(shm, monkeypatch):
    """The bounce loop reads 4 KiB-page files with pread() (no page faults on a fresh
    mapping); the fd is the volume's, closed with it. Large pages keep no such fd."""
    vol = lm.volume_file(shm / "vol", 4 * MiB)
    with open(vol, "r+b") as f:
        f.write(b"weights!")
    monkeypatch.setattr(volume_mod, "large_pages", lambda fd, path=None: False)
    v = open_volume(vol)
    fd = v.read_fd()
    assert fd is not None and os.pread(fd, 8, 0) == b"weights!"
    v.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert v.read_fd() is None
    monkeypatch.setattr(volume_mod, "large_pages", lambda fd, path=None: True)
    with open_volume(vol) as v:
        assert v.read_fd() is None
