#!/usr/bin/env python3
"""Staging from an S3-compatible store, against the client library's own download.

Why: ``--source s3://`` reads each 64 MiB chunk with a ranged GET straight into the
volume's mapping, checksums it and records it as it lands. The yardstick is what a
user would otherwise run to get the same objects onto the node: boto3's own parallel
download (s3transfer's ``download_file``: ranged GETs on a thread pool into a file),
into tmpfs, against the same server, in the same run. A stage that keeps up with it
costs the user nothing for its checksums, resume and commit, and saves the second copy
from the download directory into the volume.

What runs: a versitygw S3 server on loopback (scripts/install-s3-server.sh) over a
directory on this machine's disk (page cache warm after the upload), a generated model
of ``--size`` in shards of ``--shard``; then ``--rounds`` interleaved rounds, each a
fresh process for each method:
- ``stage``: csi-pmem's staging into a fresh plain-file volume on /dev/shm, with its
  default threads (16 GETs in flight), counting progress reports;
- ``download``: boto3 ``download_file`` of every object into /dev/shm, one object
  after another, ``max_concurrency`` 16 and 64 MiB parts (the same requests in flight).
Prints the best and median GB/s of each, and the ratio of the bests and of the medians;
``--json`` writes them. With ``--sidecar``, one more stage by the staging sidecar
(``csi-pmem-weights sidecar``, serving ``/status``) into a fresh volume, its ``/status``
polled every 50 ms: how often its ``bytes_done`` moved, and its progress log events.
Everything it creates is removed at the end.

Usage: benchmarks/bench_s3_stage.py [--size 2Gi] [--shard 512Mi] [--rounds 3]
                                    [--sidecar] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

STAGE = r"""
import json, sys, time
from csi_pmem.loader import open_volume, staging
events = []
with open(sys.argv[2], "wb") as f:
    f.truncate(int(sys.argv[3]))  # a plain-file volume, as stage --size makes
t = time.monotonic()
with open_volume(sys.argv[2], writable=True) as vol:
    r = staging.stage(vol, sys.argv[1], name="m", revision="bench",
                      progress=lambda done, total, what: events.append(done))
print(json.dumps({"seconds": time.monotonic() - t, "bytes": r.copied,
                  "progress_events": len(events), "distinct": len(set(events))}))
"""

DOWNLOAD = r"""
import json, os, sys, time
import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
bucket, prefix, dest = sys.argv[1], sys.argv[2], sys.argv[3]
s3 = boto3.session.Session().client("s3", config=Config(
    max_pool_connections=16, s3={"addressing_style": "path"}))
cfg = TransferConfig(max_concurrency=16, multipart_chunksize=64 << 20,
                     multipart_threshold=64 << 20)
t = time.monotonic()
total = 0
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
    for obj in page.get("Contents", []):
        target = os.path.join(dest, obj["Key"][len(prefix):])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        s3.download_file(bucket, obj["Key"], target, Config=cfg)
        total += obj["Size"]
print(json.dumps({"seconds": time.monotonic() - t, "bytes": total}))
"""


def size(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[:-2]) * mult)
    return int(text)


def make_model(directory: Path, total: int, shard: int) -> int:
    """Shards of random bf16-sized tensors (numpy u2), a config: what staging sees."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    rng = np.random.default_rng(7)
    n = max(1, total // shard)
    for i in range(n):
        per = shard // 4
        tensors = {f"layers.{i}.{j}.weight": rng.integers(
            0, 2**16, per // 2, dtype=np.uint16) for j in range(4)}
        save_file(tensors, str(directory / f"model-{i + 1:05d}-of-{n:05d}.safetensors"))
    (directory / "config.json").write_text(json.dumps({"shards": n}))
    return sum(p.stat().st_size for p in directory.iterdir())


def child(code: str, *args: str, env: dict[str, str]) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1800)
    if p.returncode:
        raise SystemExit(f"child failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def sidecar_run(url: str, vol: Path, size: int, env: dict[str, str]) -> dict:
    """The sidecar stages ``url`` into a fresh ``vol``; /status polled until ready."""
    import s3server

    with open(vol, "wb") as f:
        f.truncate(size)
    port = s3server._free_port()
    proc = subprocess.Popen([sys.executable, "-m", "csi_pmem.loader.cli", "sidecar",
                             "--volume", str(vol), "--source", url, "--name", "m",
                             "--listen", f"127.0.0.1:{port}"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: list[int] = []
    status: dict = {}
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 1800 and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status",
                                            timeout=2) as r:
                    status = json.loads(r.read())
                seen.append(int(status.get("bytes_done") or 0))
                if status.get("ready"):
                    break
            except OSError:
                pass
            time.sleep(0.05)
        seconds = time.monotonic() - t0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    if not status.get("ready"):
        raise SystemExit(f"the sidecar did not get ready: {status} {err[-2000:]}")
    return {"seconds_to_ready": round(seconds, 2), "status_polls": len(seen),
            "bytes_done_moves": len({v for v in seen if v}),
            "progress_log_events": sum(1 for e in events if "progress" in
                                       (e.get("msg"), e.get("message"))),
            "action": status.get("action"), "bytes_copied": status.get("bytes_copied")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size, default=2 << 30)
    ap.add_argument("--shard", type=size, default=512 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sidecar", action="store_true",
                    help="also stage once with the sidecar, counting its /status moves")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import s3server

    work = Path(tempfile.mkdtemp(prefix="csi-pmem-bench-s3-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="csi-pmem-bench-s3-", dir="/dev/shm"))
    try:
        nbytes = make_model(work / "model", args.size, args.shard)
        with s3server.running(work / "root", work / "server.log") as srv:
            t = time.monotonic()
            srv.upload(work / "model", "models", "bench/m")
            upload = time.monotonic() - t
            shutil.rmtree(work / "model")
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(srv.env(), PYTHONPATH=str(ROOT), AWS_CONFIG_FILE="/nonexistent",
                       AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
            rows: dict[str, list[dict]] = {"stage": [], "download": []}
            for r in range(args.rounds):
                vol, dest = shm / "vol", shm / "dl"
                rows["stage"].append(child(STAGE, "s3://models/bench/m/", str(vol),
                                           str((nbytes >> 21) + 64 << 21), env=env))
                vol.unlink()
                dest.mkdir()
                rows["download"].append(child(DOWNLOAD, "models", "bench/m/", str(dest),
                                              env=env))
                shutil.rmtree(dest)
                print(f"round {r + 1}: stage {rows['stage'][-1]['seconds']:.2f} s, "
                      f"download {rows['download'][-1]['seconds']:.2f} s", flush=True)
            side = None
            if args.sidecar:
                side = sidecar_run("s3://models/bench/m/", shm / "vol-sidecar",
                                   (nbytes >> 21) + 64 << 21, env)
                (shm / "vol-sidecar").unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    def rates(name: str) -> list[float]:
        return [row["bytes"] / row["seconds"] / 1e9 for row in rows[name]]

    out = {"bytes": nbytes, "shard": args.shard, "rounds": args.rounds,
           "upload_seconds": round(upload, 2), "cpus": os.cpu_count(),
           "server": "versitygw posix, loopback", "rows": rows}
    print(f"\nmodel {nbytes / 1e9:.2f} GB in {nbytes // args.shard or 1} shards; "
          f"{args.rounds} interleaved rounds, fresh processes; {os.cpu_count()} CPUs")
    print(f"{'method':<48} {'best GB/s':>10} {'median':>8}")
    for name, label in (("stage", "csi-pmem stage s3:// (checked, resumable)"),
                        ("download", "boto3 download_file into tmpfs")):
        rs = rates(name)
        out[f"{name}_best_gbps"], out[f"{name}_median_gbps"] = max(rs), statistics.median(rs)
        print(f"{label:<48} {max(rs):>10.2f} {statistics.median(rs):>8.2f}")
    out["ratio_best"] = out["stage_best_gbps"] / out["download_best_gbps"]
    out["ratio_median"] = out["stage_median_gbps"] / out["download_median_gbps"]
    if side is not None:
        out["sidecar"] = side
        print(f"sidecar: ready in {side['seconds_to_ready']:.2f} s ({side['action']}); "
              f"/status bytes_done moved {side['bytes_done_moves']} times in "
              f"{side['status_polls']} polls; {side['progress_log_events']} progress "
              "log events")
    events = [row["distinct"] for row in rows["stage"]]
    out["progress_events_min"] = min(events)
    print(f"stage / download: {out['ratio_best']:.2f} (bests), "
          f"{out['ratio_median']:.2f} (medians); the stage's progress moved "
          f"{min(events)}-{max(events)} times")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
