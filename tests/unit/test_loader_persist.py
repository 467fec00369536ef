"""Durability of staged weights: the persist primitive per kind of mapping, and the
commit protocol's order under it.

Why on the host: the host kernel has no device-dax, so the VM tier proves the real
device; here a mapping whose msync fails with EINVAL, as a device-dax mapping's does,
shows that staging never depends on msync there and that libpmem is what persists,
and spies on the persist calls show that data is durable before the index says so.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from csi_pmem import failpoints
from csi_pmem.loader import staging
from csi_pmem.weights import layout, persist
from csi_pmem.weights.errors import VolumeError
from csi_pmem.weights.volume import Volume, _map, open_volume

import loader_models as lm

MiB = 1 << 20
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


class DevdaxLikeMapping(mmap.mmap):
    """An anonymous shared mapping whose msync fails as a device-dax mapping's does."""

    def flush(self, *args):
        raise OSError(errno.EINVAL, "Invalid argument")


def devdax_like_volume(size: int, persistence: persist.Persistence) -> Volume:
    mapping = DevdaxLikeMapping(-1, size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Volume(mapping, size=size, align=2 * MiB, numa_node=None, writable=True,
                  source="devdax-like", persistence=persistence)


@pytest.fixture
def model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    lm.sharded_model(src, shards=3)
    (src / "config.json").write_text(json.dumps({"model_type": "test"}))
    return src


def test_page_cache_files_use_msync_and_read_only_mappings_nothing(tmp_path):
    vol = lm.volume_file(tmp_path / "vol", 8 * MiB)
    with open_volume(vol, writable=True) as v:
        assert (v.persistence.kind, v.persistence.primitive) == ("page-cache", "msync")
        v.buffer[:4] = b"abcd"
        v.persist(0, 4)
    with open_volume(vol) as v:
        assert v.persistence is persist.NONE
        v.persist()  # a no-op, never an error


def test_devdax_kind_persists_with_libpmem_where_msync_fails(tmp_path, model):
    durable = persist.for_mapping(persist.KIND_DEVDAX, writable=True)
    assert durable.primitive == "pmem_persist"
    assert "libpmem pmem_persist" in durable.detail and "device-dax" in durable.detail
    vol = devdax_like_volume(64 * MiB, durable)
    result = staging.stage(vol, str(model), name="m")
    assert result.model.state == layout.COMMITTED
    assert staging.verify(vol) == {"m": []}
    index = layout.read_index(vol)
    assert index is not None and index.select("m").state == layout.COMMITTED


def test_msync_on_a_devdax_like_mapping_is_the_old_crash_as_a_clear_error(model):
    vol = devdax_like_volume(64 * MiB, persist.for_mapping(persist.KIND_PAGE_CACHE, True))
    with pytest.raises(VolumeError, match=r"msync of .* failed: .*Invalid argument"):
        staging.stage(vol, str(model), name="m")


def test_a_missing_libpmem_says_which_package_to_install(monkeypatch):
    monkeypatch.setattr(persist, "_LIB", None)
    monkeypatch.setattr(persist.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(persist, "LIBPMEM", "libpmem-not-here.so.1")
    with pytest.raises(VolumeError, match="apt-get install libpmem1"):
        persist.for_mapping(persist.KIND_DEVDAX, writable=True)
    # Reading needs no library at all.
    assert persist.for_mapping(persist.KIND_DEVDAX, writable=False) is persist.NONE


def test_index_body_is_durable_before_its_header_is_stored(tmp_path, model):
    vol = devdax_like_volume(64 * MiB, persist.for_mapping(persist.KIND_DEVDAX, True))
    calls = []
    real = vol.persist

    def spy(offset=0, length=None):
        slot = offset - offset % layout.SLOT_SIZE
        if offset < layout.INDEX_AREA:
            calls.append((offset, length, bytes(vol.buffer[slot:slot + layout.HEADER_SIZE])))
        real(offset, length)

    vol.persist = spy
    index = layout.Index(align=vol.align)
    for generation in range(1, 4):
        layout.write_index(vol, index)
        body, head = calls[-2], calls[-1]
        start = (generation % layout.SLOTS) * layout.SLOT_SIZE
        assert body[0] == start + layout.HEADER_SIZE and head[:2] == (start,
                                                                       layout.HEADER_SIZE)
        # When the body was persisted, the slot's header was still the old one.
        assert body[2] != head[2]
        assert layout.read_index(vol).generation == generation


def test_every_file_is_durable_before_the_index_says_so(monkeypatch, tmp_path, model):
    vol = lm.volume_file(tmp_path / "vol", 64 * MiB)
    v = open_volume(vol, writable=True)
    persisted: list[tuple[int, int]] = []
    real_persist = v.persist

    def spy(offset=0, length=None):
        real_persist(offset, length)
        persisted.append((offset, offset + (v.size - offset if length is None else length)))

    def covered(start: int, end: int) -> bool:
        at = start
        for a, b in sorted(persisted):
            if a <= at < b:
                at = b
        return at >= end

    real_write = staging.write_index
    seen = []

    def checked_write(volume, index, **kw):
        for m in index.models:
            for f in m.files:
                if f.done:
                    assert covered(f.offset, f.end), f"{f.name} marked done, not persisted"
            if m.state == layout.COMMITTED:
                assert all(f.done for f in m.files)
        seen.append(kw.get("commit", False))
        real_write(volume, index, **kw)

    v.persist = spy
    monkeypatch.setattr(staging, "write_index", checked_write)
    try:
        staging.stage(v, str(model), name="m")
    finally:
        v.close()
    assert seen[-1] is True and seen.count(True) == 1


def test_map_sync_refused_falls_back_to_a_plain_mapping(tmp_path):
    path = lm.volume_file(Path("/dev/shm") / f"persist-{os.getpid()}", 2 * MiB) \
        if os.access("/dev/shm", os.W_OK) else lm.volume_file(tmp_path / "v", 2 * MiB)
    fd = os.open(path, os.O_RDWR)
    try:
        mapping, _, synced = _map(fd, 2 * MiB, True, False, str(path), sync=True)
        mapping.close()
        assert synced is False  # tmpfs and ext4 without dax refuse MAP_SYNC
    finally:
        os.close(fd)
        os.unlink(path) if str(path).startswith("/dev/shm") else None


def test_a_dax_file_that_refuses_map_sync_is_persisted_with_msync(monkeypatch, tmp_path):
    from csi_pmem.weights import volume as volume_mod

    monkeypatch.setattr(volume_mod, "dax_file_reason", lambda fd, path=None, **kw: "DAX (test)")
    vol = lm.volume_file(tmp_path / "vol", 4 * MiB)
    with open_volume(vol, writable=True) as v:
        assert v.persistence.primitive == "msync"


def test_failpoint_actions_parse():
    assert failpoints._parse("a, b=stall,,c=kill") == {"a": "kill", "b": "stall", "c": "kill"}
    assert failpoints._parse("") == {}


def _stage_cli(vol: Path, src: Path, *extra: str, env: dict[str, str] | None = None,
               **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "csi_pmem.loader.cli", "stage", str(src), str(vol),
         "--name", "m", "-q", *extra], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


@pytest.mark.parametrize("point", failpoints.WEIGHTS)
def test_sigkill_at_each_step_of_a_stage_is_resumable_or_committed(tmp_path, model, point):
    vol = lm.volume_file(tmp_path / "vol", 64 * MiB)
    proc = _stage_cli(vol, model, env={"CSI_PMEM_FAILPOINTS": point})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    with open_volume(vol) as v:
        index = layout.read_index(v)
        state = index.find("m").state if index and index.find("m") else None
    committed = point == failpoints.WEIGHTS_AFTER_COMMIT
    assert state == (layout.COMMITTED if committed else layout.STAGING), (point, state)
    if not committed:
        verify = subprocess.run([sys.executable, "-m", "csi_pmem.loader.cli", "verify",
                                 str(vol), "-q"], cwd=REPO, capture_output=True, text=True,
                                timeout=60)
        assert verify.returncode != 0 and "not committed" in verify.stderr
        assert "Traceback" not in verify.stderr
    again = _stage_cli(vol, model)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    with open_volume(vol) as v:  # the CLI records the source's fingerprint as revision
        assert {m.name: bad for m, bad in staging.verify_models(v)} == {"m": []}
        got = {k: bytes(a.tobytes()) for k, a in _cpu_load(vol).items()}
    ref = {k: a.tobytes() for k, a in lm.reference(model).items()}
    assert got == ref


def _cpu_load(vol: Path):
    from csi_pmem.loader import load_numpy

    return load_numpy(str(vol))


def test_stall_failpoint_stops_the_stage_where_it_says(tmp_path, model):
    vol = lm.volume_file(tmp_path / "vol", 64 * MiB)
    proc = _stage_cli(vol, model, env={"CSI_PMEM_FAILPOINTS":
                                       f"{failpoints.WEIGHTS_AFTER_FILE}=stall"})
    try:
        line = proc.stderr.readline()
        assert line.strip() == f"failpoint {failpoints.WEIGHTS_AFTER_FILE} stalled"
        with open_volume(vol) as v:
            m = layout.read_index(v).find("m")
            assert m.state == layout.STAGING and 1 <= sum(f.done for f in m.files) \
                < len(m.files)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
