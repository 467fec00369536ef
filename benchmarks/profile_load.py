#!/usr/bin/env python3
"""Where a fresh process spends one GPU load: phase times and the loader's debug log.

Why: bench_fresh.py says how fast each path is; this says why, for one path and one
configuration per run (run it in a loop of fresh processes to compare settings). It
prints one JSON line: seconds per phase (opening the volume, reading the model, making
the loader, the load, verification) and the path taken; ``--log`` adds the loader's
DEBUG lines (pinned buffer allocation, how many pieces the hybrid load registered,
the node copy service's timings) on stderr. ``--trace PATH`` records the load's CUDA
activity with the torch profiler (a Chrome trace at PATH) and adds what the device did
(:mod:`device_trace`: copy-engine gaps, kernels during them, the check after the last
copy); tracing slows the load, so compare traced loads with traced loads only.

Usage: benchmarks/profile_load.py VOLUME [--mode auto|bounce|registered|hybrid]
         [--buffers N --buffer-mib M --threads T --register-mib R] [--no-verify] [--log]
         [--trace PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("volume")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--mode", default="auto")
    p.add_argument("--buffers", type=int, default=32)
    p.add_argument("--buffer-mib", type=int, default=4)
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--register-mib", type=int, default=256)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-node", action="store_true", help="do not use a gpu.sock")
    p.add_argument("--no-hybrid-bounce", action="store_true",
                   help="hybrid loads: registration only, no bounce buffers from the back")
    p.add_argument("--log", action="store_true")
    p.add_argument("--trace", help="write the load's CUDA activity here (Chrome trace)")
    args = p.parse_args()
    if args.log:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                            format="%(relativeCreated)8.1f ms %(name)s: %(message)s")
    import torch

    torch.cuda.init()
    torch.empty(1, device=args.device)
    torch.cuda.synchronize()
    with contextlib.suppress(ImportError):
        import cuda.bindings.driver  # noqa: F401  (what the node path imports)
    from csi_pmem.loader import open_model, open_volume, start_load
    from csi_pmem.loader.gpu import GpuLoader

    MiB = 1 << 20
    phases: dict[str, float] = {}
    t = time.perf_counter()
    volume = open_volume(args.volume)
    phases["open_volume"] = time.perf_counter() - t
    t = time.perf_counter()
    view = open_model(volume)
    phases["open_model"] = time.perf_counter() - t
    t = time.perf_counter()
    loader = GpuLoader(args.device, buffers=args.buffers, buffer_size=args.buffer_mib * MiB,
                       threads=args.threads, mode=args.mode, node_copy=not args.no_node,
                       register_step=args.register_mib * MiB,
                       hybrid_bounce=not args.no_hybrid_bounce)
    phases["loader"] = time.perf_counter() - t
    tracing: Any = contextlib.nullcontext()
    mark: Any = contextlib.nullcontext()
    if args.trace:
        from torch.profiler import ProfilerActivity, profile, record_function

        tracing = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        mark = record_function("load")
    with tracing:
        with mark:
            t = time.perf_counter()
            handle = start_load(view, args.device, loader=loader, verify=not args.no_verify)
            handle.done.result()
            torch.cuda.synchronize()
            phases["load"] = time.perf_counter() - t
            handle.verified.result()
            phases["verified"] = time.perf_counter() - t
    device = None
    if args.trace:
        import device_trace

        tracing.export_chrome_trace(args.trace)
        with open(args.trace) as f:
            device = device_trace.summarize(json.load(f))
    total = sum(phases[k] for k in ("open_volume", "open_model", "loader")) + phases["verified"]
    print(json.dumps({"path": handle.path, "bytes": handle.nbytes,
                      "gbps_load": handle.nbytes / 1e9 / phases["load"],
                      "gbps_total": handle.nbytes / 1e9 / total,
                      "phases_ms": {k: round(v * 1e3, 1) for k, v in phases.items()},
                      **({"device": device} if device is not None else {}),
                      "config": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
