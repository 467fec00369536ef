#!/usr/bin/env python3
"""Measure how fast the driver erases a volume, and whether its threads really help.

Why: DeleteVolume zeroes the whole namespace before the space can be reused
(docs/design.md §4), so erase throughput bounds how quickly capacity comes back. The
multi-threaded path only pays off if ``ctypes.memset`` and ``memcmp`` release the GIL;
this benchmark checks that claim in one run, on one file, with the modes alternating
so that drift (other load, frequency changes) hits all of them alike.

Modes (all on the same tmpfs-backed file, which maps like a devdax device):
  pwrite      naive baseline: os.pwrite of a zero buffer in 64 MiB blocks, 1 thread
  zero/1      zero_fd(threads=1, verify=False)
  zero/N      zero_fd(threads=N, verify=False)
  erase/1     zero_fd(threads=1, verify=True)   (what DeleteVolume does)
  erase/N     zero_fd(threads=N, verify=True)

Usage: benchmarks/bench_erase.py [--size 1Gi] [--threads N] [--reps 5] [--dir /dev/shm]
                                 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from csi_pmem.driver.erasing.erase import DEFAULT_CHUNK, default_threads, zero_fd
from csi_pmem.sizes import format_bytes, parse_quantity

PWRITE_BLOCK = 64 << 20


def fill(fd: int, size: int) -> None:
    """Allocate every page with non-zero data, as a used volume would have."""
    block = (bytes(range(1, 256)) * (PWRITE_BLOCK // 255 + 1))[:PWRITE_BLOCK]
    for off in range(0, size, PWRITE_BLOCK):
        os.pwrite(fd, block[: min(PWRITE_BLOCK, size - off)], off)


def fs_type(path: str) -> str:
    """File-system type of ``path`` from /proc/mounts (longest mount-point prefix)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as m:
            for line in m:
                fields = line.split()
                mnt = fields[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def naive_pwrite(fd: int, size: int) -> None:
    zeros = bytes(PWRITE_BLOCK)
    for off in range(0, size, PWRITE_BLOCK):
        n = min(PWRITE_BLOCK, size - off)
        os.pwrite(fd, zeros if n == PWRITE_BLOCK else zeros[:n], off)


def run(size: int, threads: int, reps: int, directory: str | None,
        chunk: int) -> dict[str, object]:
    modes: dict[str, Callable[[int], object]] = {
        "pwrite": lambda fd: naive_pwrite(fd, size),
        "zero/1": lambda fd: zero_fd(fd, size, threads=1, verify=False, chunk=chunk),
        f"zero/{threads}": lambda fd: zero_fd(fd, size, threads=threads, verify=False,
                                              chunk=chunk),
        "erase/1": lambda fd: zero_fd(fd, size, threads=1, verify=True, chunk=chunk),
        f"erase/{threads}": lambda fd: zero_fd(fd, size, threads=threads, verify=True,
                                               chunk=chunk),
    }
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.NamedTemporaryFile(prefix="bench-erase-", dir=directory) as f:
        fd = f.fileno()
        os.ftruncate(fd, size)
        fill(fd, size)
        # One untimed pass of each mode warms code paths and the thread machinery.
        for fn in modes.values():
            fn(fd)
        for rep in range(reps):
            # Rotate the starting mode each repetition so no mode always runs first.
            order = list(modes)[rep % len(modes):] + list(modes)[:rep % len(modes)]
            for m in order:
                t0 = time.perf_counter()
                modes[m](fd)
                seconds[m].append(time.perf_counter() - t0)
        backing = f"{os.path.dirname(f.name)} ({fs_type(f.name)})"
    results = {}
    for m, ts in seconds.items():
        med = statistics.median(ts)
        results[m] = {
            "median_s": med,
            "median_gb_s": size / med / 1e9,
            "min_s": min(ts),
            "max_s": max(ts),
            "runs": len(ts),
        }
    base1 = results["zero/1"]["median_s"]
    baseN = results[f"zero/{threads}"]["median_s"]
    return {
        "size_bytes": size,
        "threads": threads,
        "reps": reps,
        "chunk_bytes": chunk,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "backing": backing,
        "results": results,
        "speedup_zero_N_over_1": base1 / baseN,
        "speedup_erase_N_over_1": results["erase/1"]["median_s"]
        / results[f"erase/{threads}"]["median_s"],
        "speedup_zero_1_over_pwrite": results["pwrite"]["median_s"] / base1,
    }


def print_table(r: dict[str, object]) -> None:
    size = int(r["size_bytes"])  # type: ignore[arg-type]
    print(f"erase benchmark: {format_bytes(size)} file in {r['backing']}, "
          f"{r['reps']} reps, chunk {format_bytes(int(r['chunk_bytes']))}, "  # type: ignore[arg-type]
          f"{r['cpus']} CPUs, Python {r['python']}")
    print(f"{'mode':<10} {'median GB/s':>12} {'median s':>10} {'min s':>8} {'max s':>8}")
    for m, v in r["results"].items():  # type: ignore[union-attr]
        print(f"{m:<10} {v['median_gb_s']:>12.2f} {v['median_s']:>10.4f} "
              f"{v['min_s']:>8.4f} {v['max_s']:>8.4f}")
    n = r["threads"]
    print(f"speed-up zero/{n} over zero/1:   {r['speedup_zero_N_over_1']:.2f}x")
    print(f"speed-up erase/{n} over erase/1: {r['speedup_erase_N_over_1']:.2f}x")
    print(f"speed-up zero/1 over pwrite:  {r['speedup_zero_1_over_pwrite']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1Gi", help="file size (Kubernetes quantity), default 1Gi")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="N for the multi-threaded modes (default: usable CPUs, capped)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per mode")
    p.add_argument("--chunk", default=format_bytes(DEFAULT_CHUNK), help="chunk per task")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="directory for the file; tmpfs stands in for devdax (default /dev/shm)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args(argv)
    r = run(parse_quantity(a.size), a.threads, a.reps, a.dir, parse_quantity(a.chunk))
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print_table(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
