"""Staging from an S3-compatible object store, against a real S3 server on loopback.

Why a real server (versitygw, tests/s3server.py): listing pages, ranged GETs with
If-Match, ETags and the error answers are the server's behaviour, not ours. What each
test shows: a stage from ``s3://`` is bit-exact and a second one copies nothing (the
revision is the objects' ETags); the sidecar finds what ``stage`` staged; a stage
stopped half way (SIGINT, SIGTERM, SIGKILL) keeps its chunks and the next reuses
exactly them; each failure (no bucket, no model under the prefix, bad or missing
credentials, no server, an object replaced mid-stage) exits with its code and a
message naming what to fix, and leaves nothing loadable; no credential reaches a log.
Stops are counted in chunks (fail points), never timed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import s3server

from csi_pmem import failpoints
from csi_pmem.loader import load_numpy, open_volume, staging
from csi_pmem.loader.sources import SourceChangedError
from csi_pmem.loader.sources import s3 as s3source
from csi_pmem.weights import layout
from csi_pmem.weights.errors import NoModelError

import loader_models as lm

pytest.importorskip("boto3", reason="pip install -e '.[test]'")

MiB = lm.MiB
ROOT = Path(__file__).resolve().parent.parent
CHUNK = 4096
# csi-pmem-weights, its stages planned in CHUNK-byte checksum chunks (several per file).
CHILD = lm.small_chunk_cli(CHUNK)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("s3")
    with s3server.running(d / "root", d / "server.log") as srv:
        yield srv


@pytest.fixture
def shm(tmp_path):
    with lm.shm_scratch(tmp_path, "csi-pmem-s3") as d:
        yield d


@pytest.fixture
def model(server, shm, request):
    """A sharded model (3 shards, an index, a config, a tokenizer file) uploaded under
    a prefix of its own; (its s3:// URL, the local copy)."""
    src = shm / "src"
    lm.sharded_model(src, shards=3, per_shard=8)
    prefix = f"org/{request.node.name[:40]}"
    server.upload(src, "models", prefix)
    return f"s3://models/{prefix}/", src


def clean_env(server: s3server.S3Server, **extra: str) -> dict[str, str]:
    """This process's environment without AWS settings, plus the server's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               PYTHONPATH=str(ROOT))
    env.update(server.env(**extra))
    return env


@pytest.fixture
def in_process(server, monkeypatch):
    """The server's environment in this process, and a fresh client."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in clean_env(server).items():
        monkeypatch.setenv(k, v)
    s3source._clients.clear()
    yield
    s3source._clients.clear()


def weights(*args: str, env: dict[str, str], child: bool = False,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", CHILD] if child else \
        [sys.executable, "-m", "csi_pmem.loader.cli"]
    return subprocess.run([*argv, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def stage_json(url: str, vol: Path, env: dict[str, str], *extra: str) -> dict:
    p = weights("stage", url, str(vol), "-o", "json", "-q", *extra, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_bit_exact(vol: Path, src: Path) -> None:
    lm.assert_same(load_numpy(str(vol)), lm.reference(src))


def nothing_committed(vol: Path) -> None:
    with pytest.raises(NoModelError):
        load_numpy(str(vol))
    if vol.stat().st_size:
        with open_volume(vol) as v:
            index = layout.read_index(v)
        assert index is None or not index.committed()


def test_stage_from_s3_is_bit_exact_and_the_second_stage_copies_nothing(server, model, shm):
    url, src = model
    vol = shm / "vol"
    env = clean_env(server)
    doc = stage_json(url, vol, env, "--size", "16Mi")
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert (doc["action"], doc["copied"], doc["reused"]) == ("staged", size, 0)
    assert doc["model"] == src.parent.name or doc["model"] == url.rstrip("/").split("/")[-1]
    assert doc["revision"].startswith("etag-")
    assert_bit_exact(vol, src)
    with open_volume(vol) as v:
        (m,) = layout.read_index(v).committed()
    assert sorted(f.name for f in m.files) == sorted(
        p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    again = stage_json(url, vol, env)
    assert (again["action"], again["copied"], again["revision"]) == \
        ("already-staged", 0, doc["revision"])


def test_the_sidecar_finds_what_stage_staged_from_s3(server, model, shm):
    url, _ = model
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    env = clean_env(server)
    name = url.rstrip("/").split("/")[-1]
    staged = stage_json(url, vol, env, "--name", name)
    p = weights("sidecar", "--volume", str(vol), "--source", url, "--name", name,
                "--once", "--log-format", "text", env=env)
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)
    assert (status["ready"], status["action"], status["revision"]) == \
        (True, "already-staged", staged["revision"])
    assert status["bytes_copied"] == 0


def test_the_sidecar_stages_from_s3_with_progress(server, model, shm):
    url, src = model
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    p = weights("sidecar", "--volume", str(vol), "--source", url, "--name", "m",
                "--once", env=clean_env(server))
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)
    assert status["ready"] and status["action"] == "staged"
    assert status["revision"].startswith("etag-")
    assert_bit_exact(vol, src)


def recorded(vol: Path) -> layout.ModelEntry:
    with open_volume(vol) as v:
        (m,) = layout.read_index(v).models
    return m


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_a_stage_from_s3_stopped_half_way_keeps_its_chunks(server, model, shm, sig):
    """One copy thread, held inside its 15th chunk (of about 30) while the signal comes:
    the next stage reuses exactly the bytes the index recorded, and copies only the
    rest. (The hold is a pause of 8 s, which the signal comes inside of: SIGINT's
    stop waits for the running chunk, the other two kill.)"""
    url, src = model
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    env = clean_env(server,
                    CSI_PMEM_FAILPOINTS=f"{failpoints.WEIGHTS_BEFORE_CHUNK}=sleep:8@15")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "stage", url, str(vol), "--name",
                             "m", "-o", "json", "--progress", "--threads", "1"], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    try:
        err = ""
        while f"failpoint {failpoints.WEIGHTS_BEFORE_CHUNK} sleeping" not in err:
            line = proc.stderr.readline()
            assert line, f"the stage ended before its 15th chunk: {err}"
            err += line
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}.get(sig, -sig), rest
    if sig != signal.SIGKILL:  # both unwind: the running chunk is recorded too
        assert rest.endswith("; run the same command again to resume\n"), rest
    model_entry = recorded(vol)
    kept = layout.copied_bytes(model_entry)
    assert model_entry.state == layout.STAGING and 0 < kept <= 15 * CHUNK
    nothing_committed(vol)
    p = weights("stage", url, str(vol), "--name", "m", "-o", "json", "-q", child=True,
                env=clean_env(server))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["action"] == "resumed" and doc["reused"] == kept
    assert doc["copied"] == doc["bytes"] - kept
    assert_bit_exact(vol, src)


def failing(url: str, vol: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    p = weights("stage", url, str(vol), "--size", "16Mi", "-q", env=env)
    assert "Traceback" not in p.stderr
    return p


def test_no_such_bucket(server, shm):
    p = failing("s3://no-such-bucket/m/", shm / "vol", clean_env(server))
    assert p.returncode == 1
    assert "s3://no-such-bucket/m/: no such bucket at http://127.0.0.1:" in p.stderr
    nothing_committed(shm / "vol")


def test_no_model_under_the_prefix(server, model, shm):
    url, _ = model
    p = failing(url.replace("/org/", "/nothing-here/"), shm / "vol", clean_env(server))
    assert p.returncode == 1
    assert "holds no *.safetensors file; nothing to stage" in p.stderr
    nothing_committed(shm / "vol")


def test_wrong_credentials_are_access_denied_and_never_logged(server, model, shm):
    url, _ = model
    env = clean_env(server, AWS_SECRET_ACCESS_KEY="not-the-secret")
    p = weights("--log-level", "debug", "stage", url, str(shm / "vol"), "--size", "16Mi",
                "-q", env=env)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "access denied by http://127.0.0.1:" in p.stderr
    assert "check the credentials" in p.stderr
    assert "not-the-secret" not in p.stderr + p.stdout
    nothing_committed(shm / "vol")


def test_a_debug_log_of_a_good_stage_holds_no_credential(server, model, shm):
    url, src = model
    p = weights("--log-level", "debug", "stage", url, str(shm / "vol"), "--size", "16Mi",
                "-q", "-o", "json", env=clean_env(server))
    assert p.returncode == 0, p.stderr
    assert server.secret_key not in p.stderr + p.stdout
    assert server.access_key not in p.stderr + p.stdout
    assert_bit_exact(shm / "vol", src)


def test_no_credentials_at_all(server, model, shm):
    url, _ = model
    env = clean_env(server)
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    p = failing(url, shm / "vol", env)
    assert p.returncode == 1
    assert "no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" \
        in p.stderr
    nothing_committed(shm / "vol")


def test_an_unreachable_server_is_worth_a_retry(server, model, shm):
    url, _ = model
    closed = s3server._free_port()  # nothing listens there
    env = clean_env(server, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{closed}",
                    AWS_MAX_ATTEMPTS="2")
    p = failing(url, shm / "vol", env)
    assert p.returncode == 5, p.stderr
    assert f"cannot reach http://127.0.0.1:{closed} after 2 attempts" in p.stderr
    nothing_committed(shm / "vol")


def test_an_object_replaced_mid_stage_fails_the_stage_and_commits_nothing(
        server, model, shm, in_process, monkeypatch):
    url, src = model
    shard = sorted(src.glob("*.safetensors"))[1]
    real = s3source.ObjectReader.readinto
    replaced = []

    def readinto(self, view, offset):
        if self.src.name == shard.name and len(view) > 4096 and not replaced:  # its data
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF  # same size, other bytes: a new upload of the shard
            server.client().put_object(Bucket="models", Key=self.key, Body=bytes(data))
            replaced.append(self.key)
        return real(self, view, offset)

    monkeypatch.setattr(s3source.ObjectReader, "readinto", readinto)
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v, \
            pytest.raises(SourceChangedError, match="changed while it was being staged"):
        staging.stage(v, url, name="m", revision=None)
    assert replaced
    nothing_committed(vol)
    assert recorded(vol).state == layout.STAGING
    # Once the upload is complete, the next stage takes the new content.
    monkeypatch.setattr(s3source.ObjectReader, "readinto", real)
    shard.write_bytes(bytes(bytearray(shard.read_bytes())[:-1]) +
                      bytes([shard.read_bytes()[-1] ^ 0xFF]))
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, url, name="m", revision=None)
    assert result.action == "staged"
    with open_volume(vol) as v:
        (m,) = layout.read_index(v).committed()
        entry = m.file(shard.name)
        assert bytes(v.view(entry.offset, entry.length)) == shard.read_bytes()


def test_progress_moves_with_the_chunks_of_an_s3_stage(server, model, shm, in_process,
                                                       monkeypatch):
    url, src = model
    lm.plan_small_chunks(monkeypatch, CHUNK)
    seen: list[int] = []
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    with open_volume(vol, writable=True) as v:
        result = staging.stage(v, url, name="m", threads=1,
                               progress=lambda done, total, what: seen.append(done))
    chunks = sum(len(layout.chunk_ranges(f.length, CHUNK)) for f in result.model.files)
    assert seen[0] == 0 and seen[-1] == result.model.size
    assert len(set(seen)) >= chunks // 2 >= 10  # the bar moves as chunks complete
    assert seen == sorted(seen)
    assert_bit_exact(vol, src)


@pytest.mark.parametrize("url", ["s3:///prefix/", "s3:/bucket/x", "s3://bucket/x?versionId=1"])
def test_a_malformed_s3_url_is_a_usage_error(url, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in (["stage", url, str(tmp_path / "vol"), "--size", "16Mi"],
                 ["sidecar", "--volume", str(tmp_path / "vol"), "--source", url,
                  "--name", "m", "--once"]):
        p = weights(*argv, env=env)
        assert p.returncode == 2, p.stderr
        assert "is not an S3 location; write s3://BUCKET/PREFIX/" in p.stderr
    assert not (tmp_path / "vol").exists()


def test_the_sidecar_lists_the_prefix_once_per_pass(server, model, shm, in_process,
                                                    monkeypatch):
    """The sidecar scans the source to plan, and staging reuses that scan: one listing
    (and one read of each safetensors header) per pass, not two."""
    from csi_pmem.loader.sidecar.process import Config, Sidecar

    url, src = model
    calls: list[str] = []
    real = s3source.scan
    monkeypatch.setattr(s3source, "scan", lambda u: calls.append(u) or real(u))
    vol = lm.volume_file(shm / "vol", 16 * MiB)
    outcome = Sidecar(Config(volume=str(vol), source=url, name="m", listen=None,
                             once=True)).reconcile()
    assert outcome.action == "staged" and calls == [url]
    assert_bit_exact(vol, src)
