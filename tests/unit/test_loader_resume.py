"""Staging reports progress and records its work as chunks complete, and a stage stopped
at any point (an exception, Ctrl-C, SIGTERM, SIGKILL) is resumed by the next one, which
copies only the chunks not recorded yet.

Why counted, not timed: every stop here happens after a known number of chunks or files
(a wrapper around the chunk copy, a progress callback that raises, the ``@N`` fail
points), and each assertion is about chunk counts and bytes, so no test depends on how
fast this machine copies. The models are tiny, but staged in 4 KiB checksum chunks
(the smallest the index accepts) so that each file has several.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from csi_pmem import failpoints
from csi_pmem.loader import load_numpy, open_volume, staging
from csi_pmem.weights import layout
from csi_pmem.weights.errors import LayoutError

import loader_models as lm

MiB = lm.MiB
CHUNK = 4096
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
# csi-pmem-weights itself, its stages planned with CHUNK-byte checksum chunks.
CHILD = lm.small_chunk_cli(CHUNK)


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-resume") as d:
        yield d


@pytest.fixture
def small_chunks(monkeypatch):
    lm.plan_small_chunks(monkeypatch, CHUNK)


def make_model(d: Path) -> Path:
    lm.sharded_model(d, shards=3, per_shard=8)  # each shard ~37 KiB: 10 chunks
    return d


def n_chunks(length: int) -> int:
    return len(layout.chunk_ranges(length, CHUNK))


def recorded(vol: Path) -> tuple[layout.ModelEntry, int]:
    """The staged model as the volume holds it, and how many chunks it records."""
    with open_volume(vol) as v:
        (m,) = layout.read_index(v).models
    return m, sum(len(f.chunks) if f.done else len(f.partial) for f in m.files)


def counting_copies(monkeypatch, fail_after: int | None = None) -> list[str]:
    """Count chunk copies (thread-safe); with ``fail_after``, every copy after that
    many raises, as a source failing mid-stage would."""
    real = staging._copy_chunk
    calls: list[str] = []
    lock = threading.Lock()

    def copy(volume, reader, entry, off, length, algo):
        with lock:
            calls.append(f"{entry.name}:{off}")
            n = len(calls)
        if fail_after is not None and n > fail_after:
            raise OSError("simulated read error")
        return real(volume, reader, entry, off, length, algo)

    monkeypatch.setattr(staging, "_copy_chunk", copy)
    return calls


def lockstep(monkeypatch) -> None:
    """With one copy thread: chunk n is copied only once the stager recorded chunk n-1,
    so that each chunk is a batch of its own (without, tiny chunks complete faster than
    the main thread wakes, and one index write records several)."""
    real_copy, real_record = staging._copy_chunk, staging._Copier._record
    state = threading.Condition()
    copies, recorded = itertools.count(), [0]

    def copy(volume, reader, entry, off, length, algo):
        n = next(copies)
        with state:
            assert state.wait_for(lambda: recorded[0] >= n, timeout=60)
        return real_copy(volume, reader, entry, off, length, algo)

    def record(self, batch, **kw):
        try:
            real_record(self, batch, **kw)
        finally:
            with state:
                recorded[0] += len(batch)
                state.notify_all()

    monkeypatch.setattr(staging, "_copy_chunk", copy)
    monkeypatch.setattr(staging._Copier, "_record", record)


def assert_bit_exact(vol: Path, src: Path) -> None:
    with open_volume(vol) as v:
        assert {m.name: bad for m, bad in staging.verify_models(v)} == {"m": []}
    lm.assert_same(load_numpy(str(vol)), lm.reference(src))


# --- progress ------------------------------------------------------------------------

def test_progress_moves_with_each_chunk_and_says_what_is_durable(shm, small_chunks,
                                                                 monkeypatch):
    """Each progress report comes while chunks are still being copied, and what it
    reports is what the index on the volume already records as persisted: in lock step
    (:func:`lockstep`), one report per chunk, whatever the machine's speed."""
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    reports: list[tuple[int, int, int]] = []

    def progress(done: int, total: int, what: str) -> None:
        reports.append((done, total, layout.copied_bytes(layout.read_index(v).find("m"))))

    lockstep(monkeypatch)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m", threads=1, progress=progress)
    chunks = sum(n_chunks(f.length) for f in result.model.files)
    assert chunks > 20
    assert len(reports) == chunks + 1
    dones = [d for d, _, _ in reports]
    assert dones == sorted(dones) and dones[0] == 0 and dones[-1] == result.model.size
    assert all(t == result.model.size for _, t, _ in reports)
    # Bytes reported are bytes recorded on the volume, at every report.
    assert all(d == on_volume for d, _, on_volume in reports)
    assert_bit_exact(vol, src)


def test_files_are_committed_as_they_complete_not_at_the_end(shm, small_chunks,
                                                             monkeypatch):
    """At the report that completes a file, the index already has that file done."""
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    lockstep(monkeypatch)
    done_at_report: list[int] = []

    def progress(done: int, total: int, what: str) -> None:
        done_at_report.append(sum(f.done for f in layout.read_index(v).find("m").files))

    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m", threads=1, progress=progress)
    files = len(result.model.files)
    assert done_at_report[-1] == files
    # Some report came while some files were done and others not.
    assert any(0 < d < files for d in done_at_report)


# --- resume after an exception ---------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("good", [1, 8, 27])
def test_a_stage_failing_after_n_chunks_keeps_them_and_the_next_copies_only_the_rest(
        shm, small_chunks, monkeypatch, threads, good):
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    counting_copies(monkeypatch, fail_after=good)
    with open_volume(vol, writable=True) as v, pytest.raises(OSError, match="simulated"):
        staging.stage(v, str(src), name="m", threads=threads)
    model, kept = recorded(vol)
    assert model.state == layout.STAGING
    assert kept == good  # every chunk that was copied, none that was not
    total = sum(n_chunks(f.length) for f in model.files)
    before = layout.copied_bytes(model)

    monkeypatch.undo()
    calls = counting_copies(monkeypatch)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m", threads=threads)
    assert result.action == "resumed"
    assert len(calls) == total - good
    assert result.reused == before and result.copied == result.model.size - before
    assert_bit_exact(vol, src)


def test_ctrl_c_in_the_main_thread_records_every_chunk_copied_meanwhile(
        shm, small_chunks, monkeypatch):
    """Ctrl-C lands in the main thread (here: raised by its 2nd progress report, the
    first after a chunk); the chunks that completed since the last report are recorded
    before it goes on."""
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    seen: list[int] = []

    def progress(done: int, total: int, what: str) -> None:
        seen.append(done)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with open_volume(vol, writable=True) as v, pytest.raises(KeyboardInterrupt):
        staging.stage(v, str(src), name="m", threads=2, progress=progress)
    model, kept = recorded(vol)
    assert model.state == layout.STAGING and layout.copied_bytes(model) >= seen[-1] > 0
    calls = counting_copies(monkeypatch)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m")
    assert len(calls) == sum(n_chunks(f.length) for f in model.files) - kept
    assert result.reused == layout.copied_bytes(model)
    assert_bit_exact(vol, src)


def test_a_damaged_recorded_chunk_is_the_only_one_copied_again(shm, small_chunks,
                                                               monkeypatch):
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    counting_copies(monkeypatch, fail_after=15)
    with open_volume(vol, writable=True) as v, pytest.raises(OSError):
        staging.stage(v, str(src), name="m", threads=1)
    model, kept = recorded(vol)
    # Damage one chunk of a done file and one recorded chunk of an unfinished one.
    done = next(f for f in model.files if f.done and n_chunks(f.length) > 1)
    part = next(f for f in model.files if f.partial)
    for offset in (done.offset + CHUNK + 7, part.offset + max(part.partial) * CHUNK + 3):
        with open(vol, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.undo()
    calls = counting_copies(monkeypatch)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m", threads=1)
    total = sum(n_chunks(f.length) for f in model.files)
    assert len(calls) == total - kept + 2
    assert f"{done.name}:{CHUNK}" in calls
    assert result.reused == layout.copied_bytes(model) - 2 * CHUNK
    assert_bit_exact(vol, src)


def test_a_source_file_changed_since_its_chunks_were_copied_is_copied_whole(
        shm, small_chunks, monkeypatch):
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    counting_copies(monkeypatch, fail_after=14)
    with open_volume(vol, writable=True) as v, pytest.raises(OSError):
        staging.stage(v, str(src), name="m", threads=1)
    model, _ = recorded(vol)
    part = next(f for f in model.files if f.partial)
    path = src / part.name
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    monkeypatch.undo()
    calls = counting_copies(monkeypatch)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, str(src), name="m", threads=1)
    assert sum(c.startswith(part.name + ":") for c in calls) == n_chunks(part.length)
    assert result.reused == layout.copied_bytes(model) - len(part.partial) * CHUNK
    assert_bit_exact(vol, src)


def test_every_recorded_chunk_was_persisted_before_the_index_said_so(
        shm, small_chunks, monkeypatch):
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    v = open_volume(vol, writable=True)
    persisted: set[tuple[int, int]] = set()
    lock = threading.Lock()
    real_persist = v.persist

    def spy(offset=0, length=None):
        real_persist(offset, length)
        with lock:
            persisted.add((offset, length))

    real_write = staging.write_index
    writes = []

    def checked_write(volume, index, **kw):
        m = index.find("m")
        for f in m.files:
            got = range(n_chunks(f.length)) if f.done else f.partial
            for i in got:
                off, length = layout.chunk_ranges(f.length, CHUNK)[i]
                with lock:
                    assert (f.offset + off, length) in persisted, (f.name, i)
        writes.append(sum(len(f.partial) for f in m.files))
        real_write(volume, index, **kw)

    v.persist = spy
    monkeypatch.setattr(staging, "write_index", checked_write)
    lockstep(monkeypatch)
    try:
        staging.stage(v, str(src), name="m", threads=1)
    finally:
        v.close()
    assert max(writes) > 0  # chunks of unfinished files were recorded along the way


# --- the index -----------------------------------------------------------------------

def test_partial_chunks_round_trip_and_bad_ones_are_refused(shm):
    f = layout.FileEntry("a.safetensors", layout.INDEX_AREA, 3 * CHUNK, layout.KIND_AUX,
                         partial={0: "a" * 32, 2: "b" * 32})
    index = layout.Index(models=[layout.ModelEntry("m", "", layout.STAGING, [f],
                                                   chunk_size=CHUNK)])
    doc = json.loads(json.dumps(index.to_json()))
    assert doc["models"][0]["files"][0]["partial"] == {"0": "a" * 32, "2": "b" * 32}
    back = layout.index_from_json(doc, 1, 64 * MiB)
    assert back.models[0].files[0].partial == {0: "a" * 32, 2: "b" * 32}
    assert layout.copied_bytes(back.models[0]) == 2 * CHUNK
    # A file done, or never touched, writes no partial: indexes stay as before.
    f.done, f.chunks, f.partial = True, ["c" * 32] * 3, {}
    assert "partial" not in index.to_json()["models"][0]["files"][0]
    for bad in ({"x": "a" * 32}, {"0": "short"}, ["a" * 32], {"3": "a" * 32}, {"²": "a" * 32}):
        doc["models"][0]["files"][0]["partial"] = bad
        with pytest.raises(LayoutError, match=r"partial|past its"):
            layout.index_from_json(doc, 1, 64 * MiB)


# --- the command line, stopped by a signal ------------------------------------------------

def _child(vol: Path, src: Path, *extra: str, env: dict[str, str] | None = None
           ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "stage", str(src), str(vol), "--name", "m",
         "-o", "json", *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _restage(vol: Path, src: Path) -> dict:
    again = subprocess.run([sys.executable, "-m", "csi_pmem.loader.cli", "stage", str(src),
                            str(vol), "--name", "m", "-o", "json", "-q"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert again.returncode == 0, again.stderr
    return json.loads(again.stdout)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_signal_after_k_files_are_committed_keeps_them_for_the_next_stage(shm, sig):
    """The stage stops (stalls) right after its 2nd file is recorded done, with its
    progress bar drawn; then the signal. The next stage reuses at least those files,
    and exactly what the index recorded."""
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    point = f"{failpoints.WEIGHTS_AFTER_FILE}=stall@2"
    proc = _child(vol, src, "--progress", env={"CSI_PMEM_FAILPOINTS": point})
    try:
        err = ""
        while f"failpoint {failpoints.WEIGHTS_AFTER_FILE} stalled" not in err:
            line = proc.stderr.readline()
            assert line, f"the stage ended before its 2nd file: {err}"
            err += line
        assert "stage:" in err  # the bar was drawn before the stop
        model, _ = recorded(vol)
        done = [f for f in model.files if f.done]
        assert len(done) == 2 and model.state == layout.STAGING
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        assert rest.endswith("interrupted; run the same command again to resume\n")
    elif sig == signal.SIGTERM:  # unwinds like Ctrl-C: the chunks copied are recorded
        assert proc.returncode == 143
        assert rest.endswith("terminated; run the same command again to resume\n")
    else:
        assert proc.returncode == -sig
    after, _ = recorded(vol)
    assert after.state == layout.STAGING
    assert layout.copied_bytes(after) >= sum(f.length for f in done)
    doc = _restage(vol, src)
    assert doc["action"] == "resumed"
    assert doc["reused"] == layout.copied_bytes(after) >= sum(f.length for f in done) > 0
    assert doc["copied"] == doc["bytes"] - doc["reused"]
    assert_bit_exact(vol, src)


def test_sigkill_after_n_chunks_loses_none_of_them(shm):
    src, vol = make_model(shm / "src"), lm.volume_file(shm / "vol", 64 * MiB)
    proc = _child(vol, src, "-q",
                  env={"CSI_PMEM_FAILPOINTS": f"{failpoints.WEIGHTS_AFTER_CHUNK}=kill@7"})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    model, kept = recorded(vol)
    assert model.state == layout.STAGING and kept >= 7
    assert any(f.partial for f in model.files) or kept > 7  # chunk level, not only files
    doc = _restage(vol, src)
    assert doc["action"] == "resumed" and doc["reused"] == layout.copied_bytes(model)
    assert doc["copied"] == doc["bytes"] - doc["reused"]
    assert_bit_exact(vol, src)


def test_failpoint_at_the_nth_hit(monkeypatch):
    monkeypatch.setattr(failpoints, "_ACTIVE", {"p": "errno:EIO@3"})
    monkeypatch.setattr(failpoints, "_HITS", {})
    failpoints.hit("p")
    failpoints.hit("p")
    with pytest.raises(OSError):
        failpoints.hit("p")
    failpoints.hit("p")  # only the 3rd
