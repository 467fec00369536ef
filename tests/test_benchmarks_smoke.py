"""Smoke test of benchmarks/bench_driver.py: it runs, reports every metric, cleans up.

Why: a benchmark nobody runs rots silently (an RPC signature changes, a flag is renamed)
and is found broken the day someone needs the numbers. This runs it with --quick and
checks the shape of the JSON only; timings are never asserted (a CI host is too noisy
for that, and a slow number is information, not a failure).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from csi_pmem.sizes import MiB

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_driver.py"

# Listed here on purpose rather than imported: dropping a metric must fail this test.
METRICS = {
    "create_erase_off": ("p50", "p90", "p99"),
    "delete_erase_off": ("p50", "p90", "p99"),
    "create_delete_erase_off": ("p50", "p90", "p99"),
    "create_erase_on": ("p50", "p90", "p99"),
    "delete_erase_on": ("p50", "p90", "p99"),
    "create_delete_erase_on": ("p50", "p90", "p99"),
    "node_publish": ("p50", "p90", "p99"),
    "node_unpublish": ("p50", "p90", "p99"),
    "dax_open_volume": ("p50", "p90", "p99"),
    "get_capacity": ("p50", "p90", "p99"),
    "get_capacity_loaded": ("p50", "p90", "p99"),
    "startup_empty": ("median", "min", "max"),
    "startup_published": ("median", "min", "max"),
    "rss_idle": ("value",),
    "rss_loaded": ("value",),
    "rss_restarted_loaded": ("value",),
}


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for tmpfs mounts")
def test_bench_driver_quick_json(tmp_path):
    pools = Path(tempfile.mkdtemp(prefix="bench-smoke-",
                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    work = tmp_path / "work"
    work.mkdir()
    try:
        proc = subprocess.run(
            [sys.executable, str(BENCH), "--quick", "--json", "--pool-dir", str(pools),
             "--work-dir", str(work)],
            capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        report = json.loads(proc.stdout)

        assert report["machine"]["cpus"] > 0 and report["machine"]["kernel"]
        assert report["date"]
        assert report["config"]["quick"] is True
        metrics = report["metrics"]
        assert sorted(metrics) == sorted(METRICS)
        for name, stats in METRICS.items():
            m = metrics[name]
            assert m["unit"] and m["n"] >= 1, name
            for stat in stats:
                value = m[stat]
                assert isinstance(value, (int, float)) and value > 0, (name, stat, value)

        # Cleanup: no temp dir, pool file, mount or driver process left behind.
        assert list(work.iterdir()) == [], list(work.iterdir())
        assert list(pools.iterdir()) == [], list(pools.iterdir())
        with open("/proc/self/mountinfo") as f:
            leftovers = [line for line in f if str(work) in line or str(pools) in line]
        assert leftovers == []
        assert [pid for pid in _pids() if str(work) in _cmdline(pid)] == []
    finally:
        shutil.rmtree(pools, ignore_errors=True)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdecimal()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


PROVISION = ROOT / "benchmarks" / "bench_provision.py"
MEMORY = ROOT / "benchmarks" / "bench_memory_pools.py"
S3_STAGE = ROOT / "benchmarks" / "bench_s3_stage.py"


def test_bench_s3_stage_reports_both_methods_and_cleans_up(tmp_path):
    """bench_s3_stage.py on a tiny model against the tests' S3 server: both methods
    every round, their bytes equal, a ratio, progress counted, nothing left behind."""
    import s3server

    binary = s3server.server_binary()  # skips (or, in CI, fails) without the server
    out = tmp_path / "s3.json"
    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith("csi-pmem-bench-s3-")}

    before = ours()
    proc = subprocess.run([sys.executable, str(S3_STAGE), "--size", "8Mi", "--shard",
                           "4Mi", "--rounds", "2", "--sidecar", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "S3_SERVER_BIN": binary})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    assert len(doc["rows"]["stage"]) == len(doc["rows"]["download"]) == 2
    assert {r["bytes"] for r in doc["rows"]["stage"]} == \
        {r["bytes"] for r in doc["rows"]["download"]} == {doc["bytes"]}
    assert doc["ratio_best"] > 0 and doc["progress_events_min"] >= 2
    assert "stage / download:" in proc.stdout
    side = doc["sidecar"]
    assert side["action"] == "staged" and side["bytes_copied"] == doc["bytes"]
    assert ours() - before == set()


def memory_pool_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if "csi-pmem-bench-mem-" in line]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for the pools' tmpfs mounts")
def test_bench_memory_pools_reports_create_and_memset_and_cleans_up(tmp_path):
    """bench_memory_pools.py on a small tmpfs pool: both figures for every size and
    round, and no pool mount or directory left behind."""
    out = tmp_path / "mem.json"
    proc = subprocess.run([sys.executable, str(MEMORY), "--sizes", "16Mi,64Mi",
                           "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads(out.read_text())
    assert [r["size"] for r in doc["table"]] == ["16Mi", "64Mi"]
    for r in doc["table"]:
        assert len(r["rounds"]["create"]) == len(r["rounds"]["memset"]) == 2
        assert all(v > 0 for v in r["rounds"]["create"] + r["rounds"]["memset"])
        # A mapping of the volume: every page resident, all on node 0 (the pool's).
        m = r["mapping"]
        assert m["Rss kB"] * 1024 == m["bytes"] >= r["bytes"], m
        assert sum(m["numa_maps MiB"].values()) * MiB == m["bytes"], m
        assert m["numa_maps MiB"].get("N0", 0) * MiB == m["bytes"], m
    assert "| 64Mi |" in proc.stdout and "a 64Mi volume mapped: KernelPageSize" in proc.stdout
    assert memory_pool_mounts() == [], "the benchmark left a pool mounted"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for tmpfs mounts")
def test_bench_provision_quick_json():
    """bench_provision.py --quick: every phase, size and erase mode is reported."""
    pool_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def ours() -> set[str]:  # /dev/shm is shared with other tests and users
        return {n for n in os.listdir(pool_dir) if n.startswith("bench-provision-")}

    before = ours()
    proc = subprocess.run([sys.executable, str(PROVISION), "--quick", "--json",
                           "--pool-dir", pool_dir],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert sorted(report["phases"]) == ["clean", "clean/wait0", "dirty"]
    for rows in report["phases"].values():
        assert sorted(rows) == ["16Mi", "64Mi"]
        for v in rows.values():
            assert v["n"] == 2 and all(v[k] > 0 for k in
                                       ("create_p50_ms", "delete_p50_ms", "space_back_p50_ms"))
    modes = report["erase"]["modes"]
    assert len(modes) == 6 and all(m["gb_s"] > 0 for m in modes.values())
    for op in ("CreateVolume", "DeleteVolume"):
        share = report["share"][op]
        assert share["total_ms"] >= share["backend_ms"] > 0
    assert ours() <= before, "the benchmark left files behind"


LOAD = ROOT / "benchmarks" / "bench_load.py"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for mounts and loop devices")
def test_bench_load_tiny_run(tmp_path):
    """bench_load.py, 2 clients for a few seconds with one SIGKILL: every figure is
    reported, every byte written was read back, and nothing is left behind (driver
    processes, mounts, loop devices, pool files, directories)."""
    pools = Path(tempfile.mkdtemp(prefix="bench-load-smoke-",
                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    try:
        proc = subprocess.run(
            [sys.executable, str(LOAD), "--seconds", "4", "--clients", "2", "--kills", "1",
             "--pool-dir", str(pools), "--work-dir", str(work), "--results-dir", str(results),
             "--settle", "0.2", "--json"],
            capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        report = json.loads(proc.stdout)
        (saved,) = results.iterdir()
        assert saved.name.startswith("bench_load-") and saved.suffix == ".json"
        assert json.loads(saved.read_text()) == report
        assert len(report["commit"]) == 40 and report["host"] and report["date"]
        (side,) = report["sides"]
        assert side["ok"] is True, side
        assert len(side["kills"]) == 1 and len(side["pids"]) == 2
        for key in ("rss_fresh_mib", "rss_peak_mib", "rss_after_mib"):
            assert side[key] > 0, key
        assert side["rss_peak_mib"] >= side["rss_fresh_mib"]
        assert side["fds_fresh"] > 0 and side["fds_after"] > 0
        for key in ("create_ms", "publish_ms"):
            assert side[key]["n"] >= 1 and 0 < side[key]["p50"] <= side[key]["p99"], key
        assert min(side["cycles"].values()) >= 1, side["cycles"]
        assert side["bytes_written"] == side["bytes_verified"] > 0
        assert sorted(report["goals"]["driver-src"]) == [
            "no_fd_growth", "rss_after_within_1.5x_fresh", "rss_peak_under_150MiB"]

        assert list(work.iterdir()) == [], list(work.iterdir())
        assert list(pools.iterdir()) == [], list(pools.iterdir())
        with open("/proc/self/mountinfo") as f:
            assert [line for line in f if str(work) in line or str(pools) in line] == []
        loops = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
                               capture_output=True, text=True, check=True).stdout
        assert str(pools) not in loops
        assert [pid for pid in _pids() if str(work) in _cmdline(pid)] == []
    finally:
        shutil.rmtree(pools, ignore_errors=True)
