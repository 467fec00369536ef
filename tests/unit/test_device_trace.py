"""benchmarks/device_trace.py: a load's copy-engine gaps and kernels, from a Chrome trace
(the torch profiler's, on a GPU host; here a hand-made one with known answers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_trace  # noqa: E402


def ev(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


TRACE = {"traceEvents": [
    ev("user_annotation", "load", 1000, 5000),
    ev("cuda_runtime", "cudaMemcpyAsync", 1100, 5),  # host side: not device time
    ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2000, 1000),
    ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2500, 1000),  # overlaps: one span
    ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4000, 500),  # 500 us gap before
    ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4700, 300),  # 200 us gap before
    ev("kernel", "reduce_kernel", 3400, 300),  # 100 us in the copies, 200 in the gap
    ev("kernel", "reduce_kernel", 5100, 400),  # after the last copy
    ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 5600, 10),
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3000},  # not a span
]}


def test_gaps_kernels_and_tail_are_measured_from_the_load_start():
    got = device_trace.summarize(TRACE)
    assert got["window_ms"] == 5.0
    h2d = got["h2d"]
    assert h2d == {"copies": 4, "first_ms": 1.0, "last_end_ms": 4.0, "busy_ms": 2.3,
                   "gaps_ms": 0.7, "gaps_with_kernels_ms": 0.2,
                   "largest_gaps": [{"at_ms": 2.5, "ms": 0.5}, {"at_ms": 3.5, "ms": 0.2}]}
    assert got["kernels"] == {"busy_ms": 0.7, "after_last_h2d_ms": 0.5,
                              "while_copying_ms": 0.1}
    assert got["d2h"] == {"busy_ms": 0.01, "after_last_h2d_ms": 0.61}


def test_without_copies_or_annotation_it_still_answers():
    got = device_trace.summarize({"traceEvents": [ev("kernel", "k", 10, 5)]})
    assert got["window_ms"] == 0.005
    assert got["h2d"]["first_ms"] is None and got["kernels"]["after_last_h2d_ms"] is None


def test_the_command_prints_json_and_refuses_bad_usage(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    script = str(ROOT / "benchmarks" / "device_trace.py")
    r = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and json.loads(r.stdout)["h2d"]["copies"] == 4
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "Usage" in r.stderr
