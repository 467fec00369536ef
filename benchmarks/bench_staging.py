#!/usr/bin/env python3
"""Stage and verify throughput of ``csi-pmem-weights`` into one volume, in fresh processes.

Why: the VM tier runs this on a real device-dax namespace in the QEMU guest and
e2e/vm/run.sh runs it on the host against a file on tmpfs (what the emulated back end's
volumes are), so the two numbers come from the same code and the same model. TCG slows
the guest's userspace many times over: compare the ratio, not the absolute numbers.

Each step runs twice: as its own ``csi-pmem-weights`` process, as a user runs it (the
wall time includes the interpreter start, which TCG makes seconds long), and inside
this process (``staging.stage(replace=True)`` / ``staging.verify``: the copy, hash and
persist work alone, the numbers to compare across machines). A stage copies and hashes
every byte and persists it; ``verify`` re-hashes every byte.

Usage: benchmarks/bench_staging.py VOLUME [--size-mib 64] [--work DIR] [--json FILE]
VOLUME is a published volume directory, a devdax device, a directory volume or a
plain file (created with --volume-mib when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> tuple[float, str]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "csi_pmem.loader.cli", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=1800)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        sys.exit(f"bench_staging: csi-pmem-weights {' '.join(args)} exited "
                 f"{proc.returncode}:\n{proc.stderr}")
    return wall, proc.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("volume")
    p.add_argument("--size-mib", type=int, default=64, help="model size (default 64)")
    p.add_argument("--volume-mib", type=int, default=0,
                   help="create VOLUME as a plain file of this size when it is missing")
    p.add_argument("--work", help="scratch directory for the model (default: a tmpdir)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    if args.volume_mib and not os.path.exists(args.volume):
        with open(args.volume, "wb") as f:
            f.truncate(args.volume_mib << 20)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-staging-"))
    model = work / "model"
    try:
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_model.py"),
                        "--size-gb", f"{args.size_mib * (1 << 20) / 1e9:.6f}",
                        "--shard-gb", f"{args.size_mib * (1 << 20) / 2e9:.6f}",
                        "--out", str(model)], check=True, capture_output=True, timeout=600)
        nbytes = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
        stage_s, out = run("stage", str(model), args.volume, "--name", "bench", "--replace",
                           "-q", "-o", "table")
        verify_s, _ = run("verify", args.volume, "-q")
        persisted = re.search(r"^persisted with (.*)$", out, re.M)
        sys.path.insert(0, str(REPO))
        from csi_pmem.loader import staging

        with staging.open_for_staging(args.volume) as vol:
            t = time.monotonic()
            staging.stage(vol, str(model), name="bench", replace=True)
            stage_in = time.monotonic() - t
            t = time.monotonic()
            problems = staging.verify(vol)
            verify_in = time.monotonic() - t
        if any(problems.values()):
            sys.exit(f"bench_staging: verify found damage: {problems}")
        result = {"volume": args.volume, "bytes": nbytes,
                  "process_stage_seconds": round(stage_s, 3),
                  "process_verify_seconds": round(verify_s, 3),
                  "stage_seconds": round(stage_in, 4), "verify_seconds": round(verify_in, 4),
                  "stage_GBps": round(nbytes / stage_in / 1e9, 4),
                  "verify_GBps": round(nbytes / verify_in / 1e9, 4),
                  "persist": persisted.group(1) if persisted else "?"}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(model, ignore_errors=True)
    print(f"stage  {result['stage_GBps']:.3f} GB/s in-process ({nbytes >> 20} MiB; a fresh "
          f"csi-pmem-weights stage took {stage_s:.2f} s)\n"
          f"verify {result['verify_GBps']:.3f} GB/s in-process (fresh process "
          f"{verify_s:.2f} s)\npersist: {result['persist']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
