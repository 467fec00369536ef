#!/usr/bin/env python3
"""A/B of loader settings: profile_load.py configurations in fresh processes, interleaved.

Why: the GPU hosts this project is measured on are shared, and their host memory
bandwidth changes between runs (InstantTensor measured 44.6, 26.1 and 39.3 GB/s on
three hosts lent the same week). A setting is only judged against another one in the
same run, each load in its own fresh process, the configurations taking turns so that
drift hits all of them alike. Prints one line per load and a best/median summary.

Each ``--config`` is ``LABEL|ENV|ARGS``: ``ENV`` is space-separated ``NAME=VALUE``
pairs for the process (``CSI_PMEM_BOUNCE_COPY=torch``, ``GLIBC_TUNABLES=...``), ``ARGS``
the extra arguments of profile_load.py (``--no-verify --buffers 16``). Every load is
in-pod: the node copy service is off (``--no-node``, ``CSI_PMEM_GPU_COPY=off``), unless
``--node`` serves the volume as a published directory with the copy service in its own
process (:mod:`csi_pmem.driver.standalone`, as ``bench_fresh.py``'s node rows do) and
every load goes through it.

Usage: benchmarks/profile_ab.py VOLUME --config 'drv||--no-verify'
         --config 'torch|CSI_PMEM_BOUNCE_COPY=torch|--no-verify' [--reps 3] [--json F]
         [--trace-dir DIR] [--log-dir DIR] [--node DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

PROFILE = Path(__file__).resolve().parent / "profile_load.py"


def parse_config(text: str) -> tuple[str, dict[str, str], list[str]]:
    parts = text.split("|")
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError(
            f"--config {text!r}: want LABEL|ENV|ARGS, for example 'torch|"
            "CSI_PMEM_BOUNCE_COPY=torch|--no-verify'")
    env = {}
    for pair in shlex.split(parts[1]):
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"--config {text!r}: {pair!r} is not NAME=VALUE")
        env[name] = value
    return parts[0], env, shlex.split(parts[2])


def one(volume: str, env: dict[str, str], args: list[str], timeout: float,
        trace: str | None = None, node: bool = False, log: str | None = None) -> dict:
    e = dict(os.environ, **({} if node else {"CSI_PMEM_GPU_COPY": "off"}), **env)
    cmd = [sys.executable, str(PROFILE), volume, *([] if node else ["--no-node"]), *args,
           *(["--trace", trace] if trace else []), *(["--log"] if log else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if log:
        Path(log).write_text(r.stderr)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"returncode": r.returncode, "error": r.stderr.strip()[-800:]}
    doc = json.loads(lines[-1])
    # profile_load.py's own total: opening the volume and the model, the loader, the
    # load until verified.
    return {"returncode": r.returncode, "path": doc["path"], "gb_s": doc["gbps_total"],
            "total_ms": doc["bytes"] / 1e6 / doc["gbps_total"], "phases_ms": doc["phases_ms"],
            **({"device": doc["device"]} if "device" in doc else {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("volume")
    p.add_argument("--config", type=parse_config, action="append", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60)
    p.add_argument("--json", help="write every load and the summary here")
    p.add_argument("--trace-dir", help="trace every load (profile_load.py --trace) into "
                   "LABEL-REP.json here; the summaries add the device's numbers")
    p.add_argument("--log-dir", help="run every load with profile_load.py --log and keep "
                   "its debug lines (what each step before the first copy cost) in "
                   "LABEL-REP.log here")
    p.add_argument("--node", metavar="DIR", help="publish VOLUME at DIR with the node's copy "
                   "service and load through it")
    a = p.parse_args()
    with contextlib.ExitStack() as stack:
        if a.node:
            sys.path.insert(0, str(PROFILE.parent.parent))
            from csi_pmem.driver.standalone import published

            a.volume = stack.enter_context(published(a.volume, a.node))
        return run(a)


def run(a: argparse.Namespace) -> int:
    for d in (a.trace_dir, a.log_dir):
        if d:
            os.makedirs(d, exist_ok=True)
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in a.config}
    for rep in range(a.reps):
        for label, env, args in a.config:
            try:
                trace = (os.path.join(a.trace_dir, f"{label}-{rep + 1}.json")
                         if a.trace_dir else None)
                log = (os.path.join(a.log_dir, f"{label}-{rep + 1}.log")
                       if a.log_dir else None)
                r = one(a.volume, env, args, a.timeout_s, trace, node=bool(a.node), log=log)
            except subprocess.TimeoutExpired:
                r = {"returncode": None, "error": f"no result in {a.timeout_s} s"}
            runs[label].append(r)
            if "gb_s" in r:
                print(f"{rep + 1} {label:24s} rc={r['returncode']} path={r['path']:7s} "
                      f"{r['total_ms']:7.1f} ms {r['gb_s']:6.2f} GB/s"
                      + (f" device {json.dumps(r['device'])}" if "device" in r else ""),
                      flush=True)
            else:
                print(f"{rep + 1} {label:24s} FAILED rc={r['returncode']}: {r['error']}",
                      flush=True)
    summary = {}
    print(f"\n{'config':24s} {'best GB/s':>10s} {'median':>8s}  exit codes")
    for label, rs in runs.items():
        gbs = [r["gb_s"] for r in rs if "gb_s" in r]
        codes = ",".join(str(r["returncode"]) for r in rs)
        summary[label] = {"best": max(gbs, default=None),
                          "median": statistics.median(gbs) if gbs else None,
                          "exit_codes": [r["returncode"] for r in rs]}
        best = f"{max(gbs):10.2f} {statistics.median(gbs):8.2f}" if gbs else f"{'-':>10s} {'-':>8s}"
        print(f"{label:24s} {best}  {codes}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    failed = any(r["returncode"] != 0 for rs in runs.values() for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
