"""The staging sidecar (``csi-pmem-weights sidecar``) as kubelet would run it: a real
process, probed over HTTP, signalled, SIGKILLed mid-copy and restarted; on plain-file
volumes (no root) and on volumes published by a real driver (root). No torch, no GPU.

What matters most is the warm restart: a pod restarted on the same node must find its
model staged and become ready without writing a byte to the volume.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from csi_pmem.driver import params
from csi_pmem.loader import VolumeTooSmallError, export, load_numpy, open_volume, sidecar, stage
from csi_pmem.loader import cli as weights_cli
from csi_pmem.loader.staging import scan_source
from csi_pmem.weights import layout
from csi_pmem.weights.image import IMAGE_NAME
from csi_pmem.weights.stformat import read_header_file

import loader_models as lm
from conftest import mount_cap, needs_root

MiB = lm.MiB
ROOT = Path(__file__).resolve().parent.parent
LOG_KEYS = {"ts", "level", "logger", "msg"}
EXAMPLES = ROOT / "deploy" / "examples"


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-sidecar") as d:
        yield d



# --- models and volumes -----------------------------------------------------------------

def make_model(directory: Path, shards: int = 4, shard_bytes: int = 2 * MiB,
               seed: int = 0) -> Path:
    """A sharded model of random U8 tensors (4 per shard) plus a config file."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    per = shard_bytes // 4
    for s in range(shards):
        tensors = {f"layers.{s}.{j}.weight": ("U8", (per,), rng.bytes(per)) for j in range(4)}
        lm.write_raw(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": shards}))
    return directory


def poke_tensor(path: Path, tensor: str | None = None, at: int = 0) -> None:
    """Change bytes of one tensor in place (same size, same header: a new fine-tune)."""
    header = read_header_file(str(path))
    info = header.tensors[tensor] if tensor else next(iter(header.tensors.values()))
    with open(path, "r+b") as f:
        f.seek(info.offset + at)
        old = f.read(16)
        f.seek(info.offset + at)
        f.write(bytes(b ^ 0xFF for b in old))


def index_of(volume: Path | str) -> layout.Index | None:
    with open_volume(str(volume)) as v:
        return layout.read_index(v)


def volume_digest(volume: Path | str) -> str:
    with open_volume(str(volume)) as v:
        return hashlib.sha256(v.buffer).hexdigest()


def exported(volume: Path | str, dest: Path, name: str = "m") -> dict[str, bytes]:
    with open_volume(str(volume)) as v:
        export(v, str(dest), name)
    return lm.tree_digest(dest)




# --- a sidecar process ------------------------------------------------------------------

class SidecarProc:
    """``csi-pmem-weights sidecar`` in a child process; its JSON log lines are collected."""

    def __init__(self, volume: Path | str, source: Path | str, *extra: str, name: str = "m",
                 failpoints: str = ""):
        argv = [sys.executable, "-m", "csi_pmem.loader.cli", "sidecar", "--volume",
                str(volume), "--source", str(source), "--name", name,
                "--listen", "127.0.0.1:0", *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT), CSI_PMEM_FAILPOINTS=failpoints)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.events: list[dict] = []
        self.raw: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self.wait_event("listening")["port"]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.raw.append(line)
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, msg: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if e.get("msg") == msg:
                        return e
                if self.proc.poll() is not None and not self._pending():
                    raise AssertionError(f"sidecar exited ({self.proc.returncode}) before "
                                         f"{msg!r}:\n{''.join(self.raw)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {msg!r} event in {timeout} s:\n"
                                         + "".join(self.raw))
                self._cond.wait(min(left, 0.2))

    def _pending(self) -> bool:
        return self.proc.stderr is not None and not self.proc.stderr.closed

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """/metrics as Prometheus parses it: {(sample name, labels): value}."""
        code, body = self.get("/metrics")
        assert code == 200, body
        return {(smp.name, frozenset(smp.labels.items())): smp.value
                for fam in text_string_to_metric_families(body) for smp in fam.samples}

    def status(self) -> dict:
        code, body = self.get("/status")
        assert code == 200
        return json.loads(body)

    def wait_ready(self, timeout: float = 60) -> float:
        """Seconds from spawning the process to the first /readyz 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/readyz")[0] == 200:
                return time.monotonic() - self.started
            assert self.proc.poll() is None, "".join(self.raw)
            time.sleep(0.01)
        raise AssertionError(f"not ready after {timeout} s: {self.status()}")

    def wait_state(self, *states: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st["state"] in states:
                return st
            time.sleep(0.02)
        raise AssertionError(f"state never in {states}: {self.status()}")

    def terminate(self, timeout: float = 10) -> tuple[int, float]:
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, time.monotonic() - t

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def sidecars():
    made: list[SidecarProc] = []

    def start(*args, **kw) -> SidecarProc:
        s = SidecarProc(*args, **kw)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


def run_once(volume: Path | str, source: Path | str, *extra: str, name: str = "m",
             failpoints: str = "") -> tuple[int, dict | None, str]:
    argv = [sys.executable, "-m", "csi_pmem.loader.cli", "sidecar", "--volume", str(volume),
            "--source", str(source), "--name", name, "--once", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CSI_PMEM_FAILPOINTS=failpoints)
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = None
    return p.returncode, doc, p.stderr


# --- the fingerprint ----------------------------------------------------------------------

def test_fingerprint_ignores_mtimes_and_location_and_sees_new_weights(shm, monkeypatch):
    a = make_model(shm / "a")
    fp = sidecar.fingerprint(scan_source(str(a)))
    assert fp.startswith("fp-")
    b = shm / "b"
    shutil.copytree(a, b)
    for p in b.iterdir():
        os.utime(p, ns=(1, 1))
    assert sidecar.fingerprint(scan_source(str(b))) == fp

    # A new fine-tune: same names, sizes and headers, new values.
    poke_tensor(b / "model-00003-of-00004.safetensors", "layers.2.3.weight")
    assert sidecar.fingerprint(scan_source(str(b))) != fp
    (b / "model-00003-of-00004.safetensors").unlink()
    shutil.copy(a / "model-00003-of-00004.safetensors", b)
    assert sidecar.fingerprint(scan_source(str(b))) == fp
    (b / "config.json").write_text(json.dumps({"num_hidden_layers": 5}))
    assert sidecar.fingerprint(scan_source(str(b))) != fp

    # It reads a few KiB per tensor, not the model: count what pread returns.
    big = shm / "big"
    lm.large_model(big, 32 * MiB)
    read = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: read.append(n) or real(fd, n, off))
    sampled = sidecar.fingerprint(scan_source(str(big)))
    assert sum(read) < 256 * 1024
    monkeypatch.undo()
    full = sidecar.fingerprint(scan_source(str(big)), "full")
    assert full.startswith("sha-")
    # What sampling cannot see (bytes in the middle of one big tensor, away from every
    # sample) is what --fingerprint full and --revision are for.
    poke_tensor(big / "model.safetensors", "big", at=16 * MiB + 12345)
    assert sidecar.fingerprint(scan_source(str(big))) == sampled
    assert sidecar.fingerprint(scan_source(str(big)), "full") != full


# --- revisions and space (in process) ----------------------------------------------------

def ensure(volume: Path, src: Path, name: str = "m", revision: str | None = None,
           **kw) -> sidecar.Outcome:
    sources = scan_source(str(src))
    rev = revision or sidecar.fingerprint(sources, kw.get("fingerprint_mode") or "sample")
    with open_volume(volume, writable=True) as v:
        return sidecar.ensure_model(v, str(src), sources, name, rev, **kw)


def committed(volume: Path) -> list[str]:
    index = index_of(volume)
    return [m.label() for m in index.models if m.state == layout.COMMITTED] if index else []


def test_new_revision_beside_the_old_one_when_there_is_room(shm):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    first = ensure(vol, src, revision="r1")
    assert (first.action, first.copied) == ("staged", first.model.size)
    poke_tensor(src / "model-00001-of-00004.safetensors")
    second = ensure(vol, src, revision="r2")
    assert second.action == "staged" and "fits beside m@r1" in second.space
    assert second.released == ["m@r1"]
    assert committed(vol) == ["m@r2"]
    assert exported(vol, shm / "out") == lm.tree_digest(src)
    # The new copy went after the old one: the old bytes stayed valid while it was staged.
    assert min(f.offset for f in second.model.files) >= first.model.end


# Shards a little under 6 MiB fill three 2 MiB-aligned extents each: one copy of the
# model spans [8, 22) MiB of a volume (the index takes the first 8 MiB).
SHARD = 6 * MiB - 8192


def test_no_room_releases_older_revisions_of_the_same_model(shm):
    src = make_model(shm / "src", shards=2, shard_bytes=SHARD)
    vol = lm.volume_file(shm / "vol", 32 * MiB)
    ensure(vol, src, revision="r1")
    poke_tensor(src / "model-00002-of-00002.safetensors")
    out = ensure(vol, src, revision="r2")
    assert out.action == "staged" and out.released == ["m@r1"]
    assert "no room for m@r2 beside m@r1" in out.space
    assert committed(vol) == ["m@r2"]
    assert exported(vol, shm / "out") == lm.tree_digest(src)


def test_another_model_is_never_removed(shm):
    src = make_model(shm / "src", shards=2, shard_bytes=SHARD)
    other = make_model(shm / "other", shards=1, shard_bytes=2 * MiB - 8192, seed=7)
    vol = lm.volume_file(shm / "vol", 28 * MiB)
    ensure(vol, src, revision="r1")
    ensure(vol, other, name="other", revision="o1")  # placed after m@r1
    generation = index_of(vol).generation
    poke_tensor(src / "model-00001-of-00002.safetensors")
    with pytest.raises(VolumeTooSmallError) as err:
        ensure(vol, src, revision="r2")
    msg = str(err.value)
    assert "never removes another model" in msg and "other@o1" in msg
    assert "would not help" in msg and err.value.needed > err.value.available
    assert index_of(vol).generation == generation  # refused before writing anything
    assert committed(vol) == ["m@r1", "other@o1"]


def test_model_larger_than_the_volume(shm):
    src = make_model(shm / "src", shards=2, shard_bytes=8 * MiB)
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with pytest.raises(VolumeTooSmallError, match="larger than the volume") as err:
        ensure(vol, src)
    assert err.value.needed > err.value.available
    assert index_of(vol) is None


def test_damaged_copy_is_repaired_chunk_by_chunk(shm, monkeypatch):
    src = make_model(shm / "src")
    big = lm.large_model(src / "big", 66 * MiB)  # two checksum chunks: 64 MiB and the rest
    assert big
    vol = lm.volume_file(shm / "vol", 128 * MiB)
    first = ensure(vol, src)
    victim = first.model.file("model-00002-of-00004.safetensors")
    large = first.model.file("big/model.safetensors")
    with open(vol, "r+b") as f:
        f.seek(victim.offset + 100)
        f.write(b"bit rot")
        f.seek(large.offset + large.length - 10)  # in its second chunk
        f.write(b"rot")
    read = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(
        sum(len(b) for b in bufs)) or real(fd, bufs, off))
    # The start-up sample sees the first chunks; the damage found, every chunk is
    # checked, and only the two damaged chunks are copied again.
    out = ensure(vol, src)
    second_chunk = large.length - layout.CHUNK_SIZE
    assert out.action == "repaired"
    assert out.copied == sum(read) == victim.length + second_chunk
    assert out.reused == out.model.size - out.copied
    assert committed(vol) == [first.model.label()]
    assert exported(vol, shm / "out") == lm.tree_digest(src)


# --- stage and the sidecar agree on revisions ---------------------------------------------

def test_stage_then_sidecar_copies_nothing(shm):
    """``csi-pmem-weights stage`` records the fingerprint the sidecar computes."""
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    assert weights_cli.main(["stage", str(src), str(vol), "--name", "m", "-q"]) == 0
    (staged,) = index_of(vol).models
    assert staged.revision == sidecar.fingerprint(scan_source(str(src)))
    before = volume_digest(vol)
    rc, doc, err = run_once(vol, src)
    assert rc == 0, err
    assert (doc["action"], doc["bytes_copied"], doc["revision"]) == (
        "already-staged", 0, staged.revision)
    assert volume_digest(vol) == before  # not a byte written


def test_sidecar_then_stage_copies_nothing(shm, capsys):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    rc, doc, err = run_once(vol, src)
    assert rc == 0 and doc["action"] == "staged", err
    before = volume_digest(vol)
    assert weights_cli.main(["stage", str(src), str(vol), "--name", "m", "-q",
                             "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["action"], out["copied"], out["revision"]) == (
        "already-staged", 0, doc["revision"])
    assert out["checked"] == out["bytes"] > 0  # it checked what it skipped
    assert volume_digest(vol) == before
    # --fingerprint full on both sides agrees too; sample and full name different things.
    rc, full, err = run_once(vol, src, "--fingerprint", "full")
    assert rc == 0 and full["action"] == "staged" and full["revision"].startswith("sha-")
    before = volume_digest(vol)
    assert weights_cli.main(["stage", str(src), str(vol), "--name", "m", "-q",
                             "--fingerprint", "full", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "already-staged"
    assert volume_digest(vol) == before


def test_a_model_staged_without_a_revision_is_adopted_not_copied(shm, capsys):
    """What earlier versions of stage wrote (revision ""): both stagers recognise the
    source's content on the volume by its fingerprint and record it, copying nothing;
    other content under that name is not adopted."""
    src = make_model(shm / "src")
    for who in ("sidecar", "stage"):
        vol = lm.volume_file(shm / f"vol-{who}", 64 * MiB)
        with open_volume(vol, writable=True) as v:
            stage(v, str(src), name="m")
        assert index_of(vol).models[0].revision == ""
        if who == "sidecar":
            out = ensure(vol, src, fingerprint_mode="sample")
            assert (out.action, out.copied) == ("already-staged", 0)
        else:
            assert weights_cli.main(["stage", str(src), str(vol), "--name", "m", "-q",
                                     "-o", "json"]) == 0
            doc = json.loads(capsys.readouterr().out)
            assert (doc["action"], doc["adopted"], doc["copied"]) == (
                "already-staged", True, 0)
        assert index_of(vol).models[0].revision == sidecar.fingerprint(
            scan_source(str(src)))

    other = shm / "other"
    shutil.copytree(src, other)
    poke_tensor(other / "model-00001-of-00004.safetensors")
    vol = lm.volume_file(shm / "vol-other", 64 * MiB)
    with open_volume(vol, writable=True) as v:
        stage(v, str(src), name="m")
    assert weights_cli.main(["stage", str(other), str(vol), "--name", "m", "-q"]) == 1
    assert "needs --replace" in capsys.readouterr().err
    assert index_of(vol).models[0].revision == ""


def test_rollback_to_a_revision_still_on_the_volume_copies_nothing(shm):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    ensure(vol, src, revision="r1")
    # The state a crash leaves between committing r2 and releasing r1.
    with open_volume(vol, writable=True) as v:
        index = layout.read_index(v)
        index.models[0].name = sidecar.retired_name("m")
        layout.write_index(v, index)
        shutil.copytree(src, shm / "src2")
        poke_tensor(shm / "src2" / "model-00004-of-00004.safetensors")
        stage(v, str(shm / "src2"), name="m", revision="r2")
    out = ensure(vol, src, revision="r1")
    assert (out.action, out.copied, out.released) == ("restored", 0, ["m@r2"])
    assert committed(vol) == ["m@r1"]
    assert exported(vol, shm / "out") == lm.tree_digest(src)


# --- the process: first start, warm restart, new revision, crash, signals -----------------

def test_first_start_stages_and_a_restart_is_ready_without_writing(shm, sidecars):
    src = make_model(shm / "src", shards=6, shard_bytes=16 * MiB)
    vol = lm.volume_file(shm / "vol", 128 * MiB)
    ready_file = shm / "ready.json"

    first = sidecars(vol, src, "--ready-file", str(ready_file))
    seen = []
    while True:  # /readyz says 200 only once the model is committed
        code, body = first.get("/readyz")
        if code == 200:
            index = index_of(vol)
            assert [m.state for m in index.models] == [layout.COMMITTED]
            break
        seen.append(body)
        assert first.proc.poll() is None
    assert seen and seen[0].startswith("not ready")
    st = first.status()
    assert st["action"] == "staged" and st["bytes_copied"] == st["bytes"] > 90 * MiB
    assert st["revision"].startswith("fp-") and st["verify_mode"] == "full"
    assert first.get("/healthz")[0] == 200
    assert json.loads(ready_file.read_text())["revision"] == st["revision"]
    m, model = first.metrics(), frozenset({("model", "m")})
    assert m[("csi_pmem_weights_ready", model)] == 1
    assert m[("csi_pmem_weights_copied_bytes_total", model)] == st["bytes_copied"]
    assert m[("csi_pmem_weights_model_bytes", model)] == st["bytes"]
    assert m[("csi_pmem_weights_phase_seconds", model | {("phase", "total")})] > 0
    full_ok = model | {("mode", "full"), ("result", "ok")}
    assert m[("csi_pmem_weights_verifications_total", full_ok)] == 1
    assert m[("csi_pmem_weights_state", model | {("state", "ready")})] == 1
    rc, secs = first.terminate()
    assert rc == 0 and secs < 5
    assert not ready_file.exists()
    # The project's one JSON log schema (csi_pmem.logs), as the driver writes it.
    listening = first.wait_event("listening")
    assert LOG_KEYS <= listening.keys() and listening["logger"] == "csi_pmem.loader.sidecar"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", listening["ts"])
    assert all(LOG_KEYS <= e.keys() for e in first.events), first.events
    assert not [e for e in first.events if {"time", "exception"} & e.keys()]

    generation, digest = index_of(vol).generation, volume_digest(vol)
    mtime = os.stat(vol).st_mtime_ns
    warm = sidecars(vol, src)
    warm_wall = warm.wait_ready()
    wst = warm.status()
    assert wst["action"] == "already-staged" and wst["bytes_copied"] == 0
    assert "stage" not in wst["phases"] and wst["verify_mode"] == "sample"
    assert wst["revision"] == st["revision"]
    assert warm.terminate()[0] == 0
    # Not a byte written: same index generation, same content, same mtime.
    assert index_of(vol).generation == generation
    assert volume_digest(vol) == digest and os.stat(vol).st_mtime_ns == mtime
    print(f"\nfirst start: ready {st['startup_seconds']} s after exec "
          f"({st['bytes'] / MiB:.0f} MiB staged, phases {st['phases']}); warm restart: "
          f"{wst['startup_seconds']} s after exec, {warm_wall:.3f} s to /readyz 200 "
          f"(phases {wst['phases']})")


def test_a_changed_source_is_restaged_and_the_old_revision_released(shm, sidecars):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    rc, before, _ = run_once(vol, src)
    assert rc == 0 and before["action"] == "staged"
    poke_tensor(src / "model-00004-of-00004.safetensors", "layers.3.2.weight")

    s = sidecars(vol, src)
    s.wait_ready()
    st = s.status()
    assert st["action"] == "staged" and st["revision"] != before["revision"]
    assert st["released"] == [f"m@{before['revision']}"]
    assert committed(vol) == [f"m@{st['revision']}"]
    assert exported(vol, shm / "out") == lm.tree_digest(src)


def test_sigkill_mid_copy_then_restart_resumes_byte_exact(shm, sidecars):
    src = make_model(shm / "src", shards=6, shard_bytes=4 * MiB)
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    rc, _, err = run_once(vol, src, "--threads", "1", failpoints=sidecar.FP_STAGE_HALF)
    assert rc == -signal.SIGKILL, err
    index = index_of(vol)
    (entry,) = index.models
    done = [f for f in entry.files if f.done]
    assert entry.state == layout.STAGING and 0 < len(done) < len(entry.files)
    with pytest.raises(Exception, match="interrupted"):
        load_numpy(str(vol))

    s = sidecars(vol, src)
    s.wait_ready()
    st = s.status()
    assert st["action"] == "resumed"
    assert st["bytes_reused"] >= sum(f.length for f in done) > 0
    assert st["bytes_copied"] == st["bytes"] - st["bytes_reused"]
    assert exported(vol, shm / "out") == lm.tree_digest(src)


def test_sigterm_during_staging_exits_zero_and_the_next_start_resumes(shm, sidecars):
    src = make_model(shm / "src", shards=8, shard_bytes=16 * MiB)
    vol = lm.volume_file(shm / "vol", 192 * MiB)
    s = sidecars(vol, src, "--threads", "1")
    s.wait_state("staging")
    rc, secs = s.terminate()
    assert rc == 0 and secs < 3
    assert s.wait_event("stopping")["state"] == "staging"
    # Almost always mid-copy; the copy may also have committed just before the signal.
    left = index_of(vol).models[0].state
    again = sidecars(vol, src)
    again.wait_ready()
    expect = "resumed" if left == layout.STAGING else "already-staged"
    assert again.status()["action"] == expect
    assert exported(vol, shm / "out") == lm.tree_digest(src)


def test_missing_source_is_reported_then_picked_up(shm, sidecars):
    make_model(shm / "later")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    s = sidecars(vol, shm / "src")
    st = s.wait_state("error")
    assert st["error_kind"] == "source" and "does not exist" in st["last_error"]
    code, body = s.get("/readyz")
    assert code == 503 and "mount the model files there" in body
    assert s.get("/healthz")[0] == 200  # alive: kubelet must not restart it for this
    (shm / "later").rename(shm / "src")
    s.wait_ready(timeout=30)
    assert s.status()["attempts"] >= 2
    rc, secs = s.terminate()
    assert rc == 0 and secs < 5


def test_a_model_larger_than_the_volume_says_by_how_much(shm, sidecars):
    src = make_model(shm / "src", shards=2, shard_bytes=8 * MiB)
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    s = sidecars(vol, src)
    st = s.wait_state("error")
    assert st["error_kind"] == "too-small" and st["needed"] > st["available"] > 0
    assert "larger than the volume" in st["last_error"]
    assert s.get("/readyz")[0] == 503
    m, model = s.metrics(), frozenset({("model", "m")})
    assert m[("csi_pmem_weights_ready", model)] == 0
    assert m[("csi_pmem_weights_error", model | {("kind", "too-small")})] == 1
    assert s.terminate()[0] == 0


def test_a_dead_dax_socket_is_a_clear_error(tmp_path):
    volume_dir = tmp_path / "vol"
    volume_dir.mkdir()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(volume_dir / "dax.sock"))
    dead.close()  # the file stays, nobody listens: ECONNREFUSED
    rc, st, _ = run_once(volume_dir, make_model(tmp_path / "src"))
    assert rc == 1 and st["error_kind"] == "dax-socket"
    assert "nothing is listening" in st["last_error"] and not st["ready"]


def test_a_second_stager_waits_for_the_lock_and_sigterm_stays_prompt(shm, sidecars):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    holder = os.open(vol, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        waiting = sidecars(vol, src)
        waiting.wait_event("another process is staging into this volume; waiting for it")
        assert waiting.get("/readyz")[0] == 503
        rc, secs = waiting.terminate()  # its worker is blocked in flock()
        assert rc == 0 and secs < 3

        s = sidecars(vol, src)
        s.wait_event("another process is staging into this volume; waiting for it")
        fcntl.flock(holder, fcntl.LOCK_UN)
        s.wait_ready()
        assert s.status()["phases"]["lock"] > 0
    finally:
        os.close(holder)


def test_periodic_verify_notices_damage_and_repairs_it(shm, sidecars):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    s = sidecars(vol, src, "--verify-interval", "0.3")
    s.wait_ready()
    s.wait_event("re-verified")
    victim = index_of(vol).models[0].file("model-00003-of-00004.safetensors")
    with open(vol, "r+b") as f:  # the middle of a file: only a full verify sees it
        f.seek(victim.offset + victim.length // 2)
        f.write(b"\xde\xad")
    s.wait_event("the staged copy is damaged; copying the damaged chunks again")
    s.wait_ready()
    assert s.status()["action"] == "repaired"
    m, model = s.metrics(), frozenset({("model", "m")})
    assert m[("csi_pmem_weights_verifications_total",
              model | {("mode", "full"), ("result", "damaged")})] >= 1
    assert m[("csi_pmem_weights_verifications_total",
              model | {("mode", "full"), ("result", "ok")})] >= 2  # first stage, re-verify
    assert exported(vol, shm / "out") == lm.tree_digest(src)


# --- a directory volume: an fsdax file system's mount, no dax.sock --------------------------

def alone(src: Path) -> int:
    """The image size the planner gives ``src`` on its own."""
    return layout.required_size(layout.Index(), scan_source(str(src)))


def test_a_directory_volume_gets_an_image_and_a_warm_restart_writes_nothing(shm, sidecars):
    src = make_model(shm / "src")
    models = shm / "models"
    models.mkdir()
    image = models / IMAGE_NAME
    first = sidecars(models, src)
    first.wait_ready()
    st = first.status()
    assert st["action"] == "staged" and st["bytes_copied"] == st["bytes"]
    assert first.terminate()[0] == 0
    assert os.listdir(models) == [IMAGE_NAME] and image.stat().st_size == alone(src)
    before = (index_of(models).generation, volume_digest(models), image.stat().st_mtime_ns,
              image.stat().st_size)

    warm = sidecars(models, src)
    warm.wait_ready()
    wst = warm.status()
    assert wst["action"] == "already-staged" and wst["bytes_copied"] == 0
    assert warm.terminate()[0] == 0
    assert (index_of(models).generation, volume_digest(models), image.stat().st_mtime_ns,
            image.stat().st_size) == before

    # A larger new revision: the image grows to what it needs alone, and the older
    # revision is released rather than kept beside it (which would grow the image at
    # every revision).
    src2 = make_model(shm / "src2", shards=5, seed=1)
    rc, st2, err = run_once(models, src2)
    assert rc == 0, err
    assert st2["action"] == "staged" and st2["released"] == [f"m@{st['revision']}"]
    assert "no room for" in st2["space"]
    assert image.stat().st_size == alone(src2) > before[3]
    assert image.stat().st_blocks * 512 >= alone(src2)
    assert exported(models, shm / "out") == lm.tree_digest(src2)
    # Back to the smaller one: it fits in the image as it is; nothing shrinks.
    rc, st3, _ = run_once(models, src)
    assert rc == 0 and st3["action"] == "staged"
    assert image.stat().st_size == alone(src2)
    assert exported(models, shm / "out1") == lm.tree_digest(src)


def test_a_directory_volume_is_locked_through_its_image(shm, sidecars):
    src = make_model(shm / "src")
    models = shm / "models"
    models.mkdir()
    assert run_once(models, src)[0] == 0
    holder = os.open(models / IMAGE_NAME, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        s = sidecars(models, src)
        s.wait_event("another process is staging into this volume; waiting for it")
        assert s.get("/readyz")[0] == 503
        fcntl.flock(holder, fcntl.LOCK_UN)
        s.wait_ready()
        assert s.status()["action"] == "already-staged"
    finally:
        os.close(holder)


@needs_root()
def test_a_full_directory_volume_says_how_much_is_needed_and_free(shm, sidecars):
    src = make_model(shm / "src", shards=3, shard_bytes=8 * MiB)
    with lm.tmpfs(shm / "fs", 24 * MiB) as fs:
        s = sidecars(fs, src)
        st = s.wait_state("error")
        assert st["error_kind"] == "too-small" and st["needed"] > st["available"] > 0
        assert st["last_error"].startswith(f"no space for {fs / IMAGE_NAME}")
        assert s.get("/readyz")[0] == 503
        assert s.terminate()[0] == 0
        assert (fs / IMAGE_NAME).stat().st_size == layout.INDEX_AREA


@needs_root()
def test_a_read_only_directory_volume_without_an_image_says_what_to_change(shm):
    src = make_model(shm / "src")
    models = shm / "models"
    models.mkdir()
    with lm.read_only_bind(models, shm / "ro") as ro:
        rc, st, _ = run_once(ro, src)
        assert rc == 1 and st["error_kind"] == "read-only"
        assert "needs a writable mount" in st["last_error"]
        assert run_once(models, src)[0] == 0
        rc, st, _ = run_once(ro, src)  # staged already: ready on a read-only mount
        assert rc == 0 and st["action"] == "already-staged"


# --- through a published volume (the driver, root) -----------------------------------------

@needs_root()
def test_published_volume_first_stage_warm_restart_and_load(driver, shm, sidecars):
    src = make_model(shm / "src", shards=4, shard_bytes=8 * MiB)
    vol = driver.create("weights", size=96 * MiB, params={"numaNode": "1"}).volume
    rw = driver.target("pod-a")
    driver.publish(vol.volume_id, rw)
    try:
        first = sidecars(rw, src, "--name", "llm")
        first.wait_ready()
        st = first.status()
        assert st["action"] == "staged" and st["bytes_copied"] == st["bytes"]
        assert first.terminate()[0] == 0
        generation, digest = index_of(rw).generation, volume_digest(rw)

        warm = sidecars(rw, src, "--name", "llm")
        warm_wall = warm.wait_ready()
        wst = warm.status()
        assert wst["action"] == "already-staged" and wst["bytes_copied"] == 0
        assert warm.terminate()[0] == 0
        assert index_of(rw).generation == generation and volume_digest(rw) == digest
        print(f"\npublished volume: first start {st['startup_seconds']} s "
              f"({st['bytes'] / MiB:.0f} MiB, phases {st['phases']}); warm restart "
              f"{wst['startup_seconds']} s after exec, {warm_wall:.3f} s to /readyz 200 "
              f"(phases {wst['phases']})")
    finally:
        driver.unpublish(vol.volume_id, rw)

    ro = driver.target("pod-b")
    driver.publish(vol.volume_id, ro, readonly=True)
    try:
        got = load_numpy(ro, model="llm")  # what the serving container does
        for shard in sorted(src.glob("*.safetensors")):
            for name, info in read_header_file(str(shard)).tensors.items():
                with open(shard, "rb") as f:
                    f.seek(info.offset)
                    assert got[name].tobytes() == f.read(info.nbytes)
        # A read-only publish that already holds the revision needs no write: ready.
        rc, st, _ = run_once(ro, src, "--name", "llm")
        assert rc == 0 and st["action"] == "already-staged"
    finally:
        driver.unpublish(vol.volume_id, ro)
    driver.delete(vol.volume_id)


@needs_root()
def test_read_only_publish_that_must_stage_says_what_to_change(driver, shm, sidecars):
    src = make_model(shm / "src")
    vol = driver.create("ro", size=64 * MiB).volume
    ro = driver.target("pod-ro")
    driver.publish(vol.volume_id, ro, readonly=True)
    try:
        s = sidecars(ro, src)
        st = s.wait_state("error")
        assert st["error_kind"] == "read-only"
        assert "published read-only" in st["last_error"]
        assert "persistentVolumeClaim.readOnly" in st["last_error"]
        assert "serving container's volumeMount" in st["last_error"]
        code, body = s.get("/readyz")
        assert code == 503 and "read-only" in body
        assert s.terminate()[0] == 0
    finally:
        driver.unpublish(vol.volume_id, ro)
    driver.delete(vol.volume_id)


@needs_root()
def test_fsdax_filesystem_volume_stage_warm_restart_and_read_only_publish(driver, shm):
    src = make_model(shm / "src")
    cap = mount_cap()
    cap.mount.fs_type = "ext4"
    vid = driver.create("fs", size=64 * MiB, params={"deviceMode": "fsdax"},
                        caps=[cap]).volume.volume_id
    globalmount = driver.staging("fs")
    driver.stage(vid, globalmount, cap=cap)
    rw, ro = driver.target("pod-rw"), driver.target("pod-ro")
    driver.publish(vid, rw, cap=cap, staging=globalmount)
    driver.publish(vid, ro, readonly=True, cap=cap, staging=globalmount)
    try:
        rc, st, err = run_once(rw, src, "--name", "llm")
        assert rc == 0 and st["action"] == "staged", err
        assert os.path.getsize(os.path.join(rw, IMAGE_NAME)) == alone(src)
        rc, st, _ = run_once(rw, src, "--name", "llm")
        assert rc == 0 and st["action"] == "already-staged" and st["bytes_copied"] == 0
        rc, st, _ = run_once(ro, src, "--name", "llm")
        assert rc == 0 and st["action"] == "already-staged"
        assert exported(ro, shm / "out", "llm") == lm.tree_digest(src)
    finally:
        for target in (rw, ro):
            driver.unpublish(vid, target)
        driver.unstage(vid, globalmount)
    driver.delete(vid)


# --- the deploy examples -------------------------------------------------------------------

def example_docs() -> list[dict]:
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for d in docs:
        if d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["spec"]))
        elif d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
    return out


def test_examples_parse_and_pass_pod_security_restricted():
    docs = example_docs()
    kinds = {d["kind"] for d in docs}
    assert {"StorageClass", "PersistentVolumeClaim", "Deployment", "Kustomization"} <= kinds
    (sc,) = [d for d in docs if d["kind"] == "StorageClass"]
    assert sc["provisioner"] == "csi-pmem.io"
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert {"numaNode", "align"} <= set(sc["parameters"])
    params.parse(sc["parameters"])  # the driver accepts them
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert any(c["spec"].get("storageClassName") == sc["metadata"]["name"]
               for c in claims.values())

    specs = pod_specs(docs)
    assert len(specs) >= 2
    for name, spec in specs:
        check_restricted(name, spec)
        check_sidecar_wiring(name, spec, claims)


# The volume types Pod Security "restricted" admits (k8s.io/pod-security-admission
# v0.36.3, policy/check_restrictedVolumes.go: image volumes included).
RESTRICTED_VOLUMES = {"persistentVolumeClaim", "configMap", "emptyDir", "csi", "projected",
                      "secret", "downwardAPI", "ephemeral", "image"}


def check_restricted(name: str, spec: dict) -> None:
    """What Pod Security "restricted" requires of a pod spec."""
    pod_sc = spec.get("securityContext", {})
    assert not spec.get("hostNetwork") and not spec.get("hostPID"), name
    for v in spec.get("volumes", []):
        assert set(v) - {"name"} <= RESTRICTED_VOLUMES, (name, v)
    for c in spec.get("initContainers", []) + spec["containers"]:
        csc = c.get("securityContext", {})
        where = f"{name}/{c['name']}"
        assert csc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
        assert csc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, where
        assert csc.get("allowPrivilegeEscalation") is False, where
        assert "ALL" in csc.get("capabilities", {}).get("drop", []), where
        assert not csc.get("capabilities", {}).get("add"), where
        assert not csc.get("privileged"), where
        seccomp = csc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", where


def check_sidecar_wiring(name: str, spec: dict, claims: dict) -> None:
    (side,) = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    argv = side.get("command", [])[1:] + side.get("args", [])
    assert side["command"][0] == "csi-pmem-weights", name
    args = weights_cli.build_parser().parse_args(argv)  # the flags exist
    assert args.command == "sidecar"
    port = args.listen[1]
    for probe in ("startupProbe", "readinessProbe"):
        got = side[probe]["httpGet"]
        assert (got["path"], got["port"]) == ("/readyz", port), (name, probe)
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"

    volumes = {v["name"]: v for v in spec["volumes"]}
    pmem = [m for m in side["volumeMounts"] if m["mountPath"] == args.volume]
    assert len(pmem) == 1 and not pmem[0].get("readOnly"), name
    pvc = volumes[pmem[0]["name"]]["persistentVolumeClaim"]
    assert not pvc.get("readOnly"), "the publish itself must be writable for the sidecar"
    assert claims[pvc["claimName"]]["spec"]["storageClassName"]
    main = spec["containers"][0]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts[pmem[0]["name"]].get("readOnly") is True, name
    assert str(main["resources"]["limits"]["nvidia.com/gpu"]) == "1", name
    if args.source.startswith("s3://"):  # read over the network: no source volume
        return
    source = [m for m in side["volumeMounts"] if args.source.startswith(m["mountPath"])]
    assert source and source[0].get("readOnly") is True, name


def test_source_examples_are_the_sidecars_source():
    """deploy/examples/sources/: a pod spec per kind of source (an image volume, S3),
    each on the StorageClass of deploy/examples, restricted, wired as the sidecar
    example is, with the source volume the sidecar reads; none of them in the
    kustomization (their image references are placeholders)."""
    (sc,) = [d for d in example_docs() if d["kind"] == "StorageClass"]
    files = sorted((EXAMPLES / "sources").glob("*.yaml"))
    assert [f.name for f in files] == ["image-volume.yaml", "s3.yaml"]
    (k,) = [d for d in example_docs() if d["kind"] == "Kustomization"]
    assert not [f for f in k["resources"] if f.startswith("sources/")]
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        claims = {d["metadata"]["name"]: d for d in docs
                  if d["kind"] == "PersistentVolumeClaim"}
        assert claims and all(c["spec"]["storageClassName"] == sc["metadata"]["name"]
                              for c in claims.values()), path.name
        specs = pod_specs(docs)
        assert specs, path.name
        for name, spec in specs:
            check_restricted(name, spec)
            check_sidecar_wiring(name, spec, claims)
            (side,) = [c for c in spec["initContainers"] if c.get("restartPolicy") == "Always"]
            args = weights_cli.build_parser().parse_args(side["command"][1:] + side["args"])
            if path.name == "s3.yaml":
                # Credentials from a Secret, as the standard variables; none inline.
                assert args.source.startswith("s3://"), args.source
                assert [e["secretRef"]["name"] for e in side["envFrom"]] == ["model-store"]
                inline = {e["name"] for e in side.get("env", [])}
                assert not inline & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
                assert "AWS_ENDPOINT_URL_S3" in inline
                continue
            (mount,) = [m for m in side["volumeMounts"]
                        if args.source.startswith(m["mountPath"].rstrip("/") + "/")]
            source = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
            if path.name == "image-volume.yaml":
                # The image volume API (core/v1 ImageVolumeSource): a reference and a
                # pull policy, nothing else; the model below /models (ModelCar).
                assert set(source["image"]) == {"reference", "pullPolicy"}, source
                assert source["image"]["pullPolicy"] in ("Always", "Never", "IfNotPresent")
                assert args.source == mount["mountPath"] + "/models", args.source
                # Only the sidecar reads the image.
                assert not [m for c in spec["containers"] for m in c["volumeMounts"]
                            if m["name"] == mount["name"]], name


def test_kustomization_lists_existing_files():
    (k,) = [d for d in example_docs() if d["kind"] == "Kustomization"]
    for f in k["resources"]:
        assert (EXAMPLES / f).is_file(), f
    for gen in k.get("configMapGenerator", []):
        for f in gen["files"]:
            assert (EXAMPLES / f.split("=")[-1]).is_file(), f


def test_serve_example_loads_through_the_library(shm):
    src = make_model(shm / "src")
    vol = lm.volume_file(shm / "vol", 64 * MiB)
    assert run_once(vol, src, "--name", "llm")[0] == 0
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / "serve_example.py"), "--volume", str(vol),
         "--model", "llm", "--device", "cpu", "--framework", "numpy", "--exit"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["tensors"] == 16 and summary["bytes"] == 4 * 2 * MiB
    assert summary["config"] == {"num_hidden_layers": 4}
    assert summary["path"] == "cpu-view"

