"""What the GPU did during one load, from a torch profiler (Kineto) Chrome trace.

Why: the loader's own timers say when the host queued work; they cannot say whether the
copy engine sat idle, or whether the check's kernels ran while it did. The profiler's
CUDA activity (CUPTI) sees every copy and kernel of the process, also those queued
through the driver API by the native bounce loop. ``profile_load.py --trace PATH``
records one; :func:`summarize` reduces it to the numbers that decide where a load loses
time: how long host-to-device copies ran, the gaps between them, and how much of those
gaps had a kernel running (the device busy with the check) or nothing at all (the host
late with the next copy).

Usage: python3 benchmarks/device_trace.py TRACE.json   (prints the summary as JSON)
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]  # (start, end), microseconds


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(xs: list[Interval], ys: list[Interval]) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(trace: dict[str, Any], annotation: str = "load", top: int = 5) -> dict[str, Any]:
    """Milliseconds, relative to the start of the ``annotation`` range (the load)."""
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and isinstance(e.get("ts"), int | float)]
    marks = [e for e in events if e.get("cat") == "user_annotation"
             and e.get("name") == annotation]
    if marks:
        t0, t1 = float(marks[0]["ts"]), float(marks[0]["ts"]) + float(marks[0].get("dur", 0))
    else:
        t0 = min((float(e["ts"]) for e in events), default=0.0)
        t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in events), default=0.0)

    def spans(cat: str, word: str = "") -> list[Interval]:
        return merge((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                     for e in events if e.get("cat") == cat and word in str(e.get("name")))

    h2d, d2h, kernels = spans("gpu_memcpy", "HtoD"), spans("gpu_memcpy", "DtoH"), \
        spans("kernel")
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(h2d)]
    ms = 1e-3

    def length(xs: list[Interval]) -> float:
        return sum(b - a for a, b in xs)

    out: dict[str, Any] = {
        "window_ms": round((t1 - t0) * ms, 3),
        "h2d": {"copies": sum(1 for e in events if e.get("cat") == "gpu_memcpy"
                              and "HtoD" in str(e.get("name"))),
                "first_ms": round((h2d[0][0] - t0) * ms, 3) if h2d else None,
                "last_end_ms": round((h2d[-1][1] - t0) * ms, 3) if h2d else None,
                "busy_ms": round(length(h2d) * ms, 3),
                "gaps_ms": round(length(gaps) * ms, 3),
                "gaps_with_kernels_ms": round(overlap(gaps, kernels) * ms, 3),
                "largest_gaps": [{"at_ms": round((a - t0) * ms, 3),
                                  "ms": round((b - a) * ms, 3)}
                                 for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]]},
        "kernels": {"busy_ms": round(length(kernels) * ms, 3),
                    "after_last_h2d_ms": round(max(0.0, (kernels[-1][1] - h2d[-1][1]) * ms), 3)
                    if kernels and h2d else None,
                    "while_copying_ms": round(overlap(kernels, h2d) * ms, 3)},
        "d2h": {"busy_ms": round(length(d2h) * ms, 3),
                "after_last_h2d_ms": round(max(0.0, (d2h[-1][1] - h2d[-1][1]) * ms), 3)
                if d2h and h2d else None},
    }
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(json.dumps(summarize(json.load(f)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
