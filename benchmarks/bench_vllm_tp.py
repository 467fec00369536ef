#!/usr/bin/env python3
"""Tensor-parallel ranks on one GPU, vLLM-shaped: TP ranks as separate processes, each
filling its own shard-shaped parameters the way vLLM's Llama weight loaders cut each
checkpoint tensor, from the same volume at once.

Why: with tensor parallelism a rank must read only its own bytes, or 8 ranks read the
model 8 times over the host's memory. vLLM's CUDA build cannot run on the GPU host (its
wheels pin a newer torch, and the host has no network), so its weight loaders' cuts are
reproduced, for rank r of TP:

- column-parallel (``embed_tokens``, ``lm_head``, fused ``qkv_proj`` and
  ``gate_up_proj`` members, q/k/v biases): ``loaded.narrow(0, r * rows, rows)``, into
  ``param.narrow(0, offset, rows)`` for a fused member;
- row-parallel (``o_proj``, ``down_proj``): ``loaded.narrow(1, r * cols, cols)``: a
  stretch of every row;
- everything else (the norms) whole, on every rank;

each ending in ``param_slice.copy_(loaded_slice)``, as in vLLM.

Methods, each in fresh processes (TP of them at once, on one GPU), rounds interleaved:
  rank-slices   csi-pmem's format for a rank of several: VolumeTensor views whose copy_
                goes through pinned buffers (csi_pmem.loader.gpu.slices)
  rank-node     the same views, their copy_ through the node's GPU copy service (the
                volume published with gpu.sock): each slice one plain or 2D copy into a
                ring of slots, then a device copy (csi_pmem.loader.gpu.rankslots)
  cpu-views     plain views of the mapping, copy_ from pageable memory (what the format
                did before)

The ranks start their loads together, as an engine's workers do once their devices and
process group are up: each rank allocates its parameters, says it is ready and waits
for the word, which the parent gives once every rank is ready. Each rank reports its
seconds (start_load to torch.cuda.synchronize()) and the wall-clock times of both ends,
the bytes the copier moved (its slices), the bytes torch copied from the views itself,
and whether every parameter equals the checkpoint's slice read by safetensors (bit for
bit). The row's GB/s is the model's bytes over the span from the first rank's start to
the last rank's end: what the engine waits for. The slowest rank's own seconds are
given beside it; a rank's share is its bytes read over 1/TP of the model.

Usage (on the GPU host, after ``source benchmarks/gpu_host.sh``):
  python3 benchmarks/bench_vllm_tp.py --work /mnt/h/vllm --tp 2,4 --json tp.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_fresh as bf  # noqa: E402
import bench_vllm as bv  # noqa: E402

ROW_PARALLEL = (".o_proj.", ".down_proj.")
METHODS = ("rank-slices", "rank-node", "cpu-views")


def cut(name: str, shape: list[int], rank: int, tp: int) -> tuple[int, int, int] | None:
    """(dim, start, length) of rank's cut of checkpoint tensor ``name``, or None: whole."""
    if any(p in name for p in ROW_PARALLEL) and len(shape) == 2:
        n = shape[1] // tp
        return 1, rank * n, n
    if "norm" in name:
        return None
    n = shape[0] // tp
    return 0, rank * n, n


def slices_threads() -> int:
    from csi_pmem.loader.gpu.slices import THREADS

    return THREADS


def worker(spec: dict[str, Any]) -> int:
    import torch

    from csi_pmem.loader import open_model, start_load
    from csi_pmem.loader.gpu import rankslots, slices

    rank, tp, method = spec["rank"], spec["tp"], spec["method"]
    dev = torch.device(spec["device"])
    torch.cuda.init()
    with open(spec["reference"]) as f:
        ref = json.load(f)["tensors"]
    shapes, slots = bv.layout(ref)
    dtypes = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32,
              "torch.float16": torch.float16}
    params = {}
    for pname, (shape, dt) in shapes.items():
        member = next(n for n, s in slots.items() if s.param == pname)
        c = cut(member, shape, rank, tp)
        if c is not None:
            shape = list(shape)
            shape[c[0]] = shape[c[0]] // tp
        params[pname] = torch.empty(shape, dtype=dtypes[dt], device=dev)
    torch.cuda.synchronize(dev)
    print("READY", flush=True)
    sys.stdin.readline()
    start = time.time()
    t0 = time.perf_counter()
    node = method == "rank-node"
    # Open here, as vLLM's format does: the copier finds a slice's volume offset in the
    # mapping, which a load that opened the volume itself closes once its views exist.
    model = open_model(spec["node_dir"] if node else spec["volume"])
    handle = start_load(model, "cpu", verify=False, writes="readonly")
    copier: Any = None
    if method == "rank-slices":
        copier = slices.RankCopier(dev, rank, tp, threads=spec["threads"])
    elif node:
        copier = rankslots.rank_copier(model.volume, dev, rank, tp, "readonly",
                                       spec["budget"])
    ctx = slices.active(copier) if copier else None
    if ctx:
        ctx.__enter__()
    try:
        for fut in handle.files.values():
            for name, view in fut.result().items():
                t = slices.wrap(view) if copier else view
                slot = slots[name]
                c = cut(name, list(view.shape), rank, tp)
                if c is not None:
                    t = t.narrow(*c)
                dst = params[slot.param]
                if slot.fused:
                    dst = dst.narrow(0, slot.offset // tp, slot.rows // tp)
                dst.copy_(t)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
        if copier:
            copier.finish()
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    end = time.time()
    exact = check(params, slots, ref, spec["files"], rank, tp)
    print("RESULT " + json.dumps({
        "seconds": seconds, "start": start, "end": end, "exact": exact,
        "copied": copier.copied if copier else None,
        "node_copied": getattr(copier, "node_copied", None),
        "path": copier.path if copier else None,
        "refused": getattr(copier, "refused", None),
        "elsewhere": copier.elsewhere if copier else None}), flush=True)
    return 0


def check(params: dict[str, Any], slots: dict[str, bv.Slot], ref: dict[str, Any],
          files: list[str], rank: int, tp: int) -> bool:
    """Every parameter slice against the checkpoint's cut, read by safetensors."""
    import torch
    from safetensors import safe_open

    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                want = f.get_tensor(name)
                c = cut(name, list(want.shape), rank, tp)
                if c is not None:
                    want = want.narrow(*c)
                slot = slots[name]
                got = params[slot.param]
                if slot.fused:
                    got = got.narrow(0, slot.offset // tp, slot.rows // tp)
                # Bytes, not values: a random checkpoint holds NaN patterns.
                a = got.cpu().contiguous().view(-1).view(torch.uint8)
                if not torch.equal(a, want.contiguous().view(-1).view(torch.uint8)):
                    return False
    return True


def run_ranks(spec: dict[str, Any], tp: int, method: str, timeout: float,
              logs: str) -> dict[str, Any]:
    """Start TP workers, wait until each is ready, then start them all at once."""
    procs, errs = [], []
    for rank in range(tp):
        s = dict(spec, rank=rank, tp=tp, method=method)
        err = open(os.path.join(logs, f"tp{tp}-{method}-rank{rank}.err"), "w+")
        errs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True))
    ranks: list[dict[str, Any]] = []
    try:
        for p in procs:
            # A worker that dies before it is ready ends its stdout: readline returns "".
            line = "-"
            while line and line.strip() != "READY":
                line = p.stdout.readline()  # type: ignore[union-attr]
        for p in procs:
            with contextlib.suppress(BrokenPipeError):
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        for p, err in zip(procs, errs, strict=True):
            out, _ = p.communicate(timeout=timeout)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                err.seek(0)
                ranks.append({"error": err.read()[-2000:], "rc": p.returncode})
            else:
                ranks.append(json.loads(line[7:]))
    finally:
        for p, err in zip(procs, errs, strict=True):
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    return {"tp": tp, "method": method, "ranks": ranks}


def span(rec: dict[str, Any]) -> float | None:
    """Seconds from the first rank's start to the last rank's end; None if one failed."""
    ok = [x for x in rec["ranks"] if "seconds" in x]
    if not ok or len(ok) != len(rec["ranks"]):
        return None
    return max(x["end"] for x in ok) - min(x["start"] for x in ok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/dev/shm/csi-pmem-vllm")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--size-gb", type=float, default=14.7)
    p.add_argument("--model")
    p.add_argument("--volume")
    p.add_argument("--tp", default="2,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=slices_threads(),
                   help="packing threads per rank for rank-slices (default: the loader's)")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--budget", type=int, default=1 << 30,
                   help="rank-node: the device memory its slots may hold (bytes)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)
    src = bv.model_dir(args)
    files = sorted(str(f) for f in Path(src).glob("*.safetensors"))
    nbytes, ntensors = bf.tensor_bytes(files)
    args.volume = [args.volume] if args.volume else None
    volume = bf.stage_volumes(args, src)[0]
    reference = os.path.join(args.work, f"reference-{args.shape}.json")
    if not os.path.exists(reference):
        common = {"files": files, "device": args.device, "nbytes": nbytes,
                  "scratch": args.work, "reference": reference}
        bf.make_reference(common, args, os.path.join(args.work, "logs"),
                          script=str(HERE / "bench_vllm.py"))
    spec = {"volume": volume, "files": files, "reference": reference,
            "device": args.device, "threads": args.threads, "budget": args.budget}
    methods = [m for m in args.methods.split(",") if m]
    with contextlib.ExitStack() as stack:
        if "rank-node" in methods:
            from csi_pmem.driver.standalone import published

            spec["node_dir"] = stack.enter_context(
                published(volume, os.path.join(args.work, "published-tp")))
        return measure(args, spec, methods, nbytes, ntensors)


def measure(args: argparse.Namespace, spec: dict[str, Any], methods: list[str],
            nbytes: int, ntensors: int) -> int:
    sizes = [int(x) for x in args.tp.split(",")]
    bf.log(f"model {nbytes / 1e9:.2f} GB, {ntensors} tensors; TP {sizes}; {methods}; "
           f"{args.threads} packing threads per rank")
    records = []
    for r in range(args.rounds):
        for tp in sizes:
            for m in methods:
                rec = run_ranks(spec, tp, m, args.timeout_s,
                                os.path.join(args.work, "logs"))
                rec["round"] = r
                rec["span"] = span(rec)
                records.append(rec)
                ok = [x for x in rec["ranks"] if "seconds" in x]
                slow = max((x["seconds"] for x in ok), default=float("nan"))
                whole = rec["span"] or float("nan")
                bf.log(f"round {r} TP={tp} {m}: first start to last end {whole:.3f} s "
                       f"({nbytes / 1e9 / whole:.2f} GB/s), slowest rank {slow:.3f} s, "
                       f"exact "
                       f"{[x.get('exact') for x in rec['ranks']]}, read "
                       f"{[x.get('copied') for x in rec['ranks']]}, by the service "
                       f"{[x.get('node_copied') for x in rec['ranks']]}, refused "
                       f"{[x.get('refused') or x.get('error') for x in rec['ranks']]}")
    rows = []
    print("| TP | method | best GB/s | median GB/s | median, slowest rank's own |"
          " each rank's read, of 1/TP | copied by torch | exact |")
    print("|---:|---|---:|---:|---:|---|---:|---|")
    for tp in sizes:
        for m in methods:
            recs = [x for x in records if x["tp"] == tp and x["method"] == m]
            speeds, own, shares, exact, elsewhere = [], [], [], True, 0
            for rec in recs:
                ok = [x for x in rec["ranks"] if "seconds" in x]
                exact = exact and len(ok) == tp and all(x["exact"] for x in ok)
                if len(ok) == tp and rec["span"]:
                    speeds.append(nbytes / 1e9 / rec["span"])
                    own.append(nbytes / 1e9 / max(x["seconds"] for x in ok))
                shares += [x["copied"] / (nbytes / tp) for x in ok
                           if x.get("copied") is not None]
                elsewhere += sum(x.get("elsewhere") or 0 for x in ok)
            row = {"tp": tp, "method": m, "best GB/s": max(speeds, default=None),
                   "median GB/s": statistics.median(speeds) if speeds else None,
                   "median GB/s, slowest rank": statistics.median(own) if own else None,
                   "share max": max(shares, default=None),
                   "share min": min(shares, default=None),
                   "copied by torch": elsewhere, "exact": exact}
            rows.append(row)
            share = (f"{row['share min']:.3f}-{row['share max']:.3f}"
                     if shares else "n/a (not counted)")
            best = f"{row['best GB/s']:.2f}" if speeds else "failed"
            med = f"{row['median GB/s']:.2f}" if speeds else "-"
            slowest = f"{row['median GB/s, slowest rank']:.2f}" if own else "-"
            print(f"| {tp} | {m} | {best} | {med} | {slowest} | {share} | {elsewhere} | "
                  f"{'yes' if exact else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model bytes": nbytes, "tensors": ntensors, "rows": rows,
                       "threads": args.threads,
                       "records": records, "commit": os.environ.get("CSI_PMEM_COMMIT")},
                      f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
