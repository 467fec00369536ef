#!/usr/bin/env python3
"""GPU weight-loading benchmark: our loader against the pinned-copy ceiling, safetensors
and torch, in one process and one run (issue 5 item 6).

Why one run: host-to-device bandwidth drifts with clocks, other tenants and NUMA
placement; ratios are only meaningful between numbers taken together.

Methods (GB/s = weight bytes / wall time until the data is usable on the device):
  (a) pinned H2D ceiling: cudaMemcpyAsync from a 1 GiB pinned buffer, one stream
  (b) safetensors.torch.load_file(device="cuda") over every shard
  (c) torch.load(mmap=True) of the same weights saved as .pt, then .to("cuda")
  (d) csi_pmem.loader from a volume file on tmpfs/hugetlbfs standing in for devdax:
      bounce path cold (fresh mapping) and warm (same mapping, warm loader), with
      verification, and the registered-mapping path
  (e) our CPU path (views, read-through, bounce fill, sha256) plus a numpy memcpy
Every GPU result is compared bit for bit with (b); the table ends with those results.
With --cpu-only (CI, no torch) only (e) runs.

Usage:
  benchmarks/bench_loader.py --size-gb 16 --work /mnt/bench [--volume PATH ...]
  benchmarks/bench_loader.py --cpu-only --size-gb 0.05 --work /tmp/x
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_model

from csi_pmem.loader import bench, open_model, open_volume, stage, start_load
from csi_pmem.loader.staging import scan_source
from csi_pmem.sizes import round_up
from csi_pmem.weights.layout import INDEX_AREA, plan_files

MiB, GiB = 1 << 20, 1 << 30


def fs_type(path: str) -> str:
    """File system of ``path``; tmpfs with transparent huge pages shows as tmpfs+thp."""
    best, kind = "", "?"
    with open("/proc/mounts") as m:
        for line in m:
            mnt, typ, opts = line.split()[1:4]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                huge = typ == "tmpfs" and any(o in opts for o in ("huge=always",
                                                                  "huge=within_size"))
                best, kind = mnt, typ + ("+thp" if huge else "")
    return kind


def prepare(args: argparse.Namespace) -> tuple[str, list[str]]:
    src = args.model or os.path.join(args.work, "model")
    if not args.model and not os.path.exists(os.path.join(src, "config.json")):
        t = time.perf_counter()
        info = make_model.make(int(args.size_gb * 1e9), src)
        log(f"generated {info} in {time.perf_counter() - t:.1f} s")
    sources = scan_source(src)
    need = round_up(max(f.end for f in plan_files(sources, INDEX_AREA, 2 * MiB)), 2 * MiB)
    volumes = args.volume or [os.path.join(args.work, "volume.img")]
    for path in volumes:
        with open(path, "ab") as f:
            if os.fstat(f.fileno()).st_size < need:
                f.truncate(need)
        t = time.perf_counter()
        with open_volume(path, writable=True) as vol:
            result = stage(vol, src, name="bench")
        if not result.already:
            log(f"staged into {path} ({fs_type(path)}) in {time.perf_counter() - t:.1f} s")
    return src, volumes


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def row(name: str, nbytes: int, seconds: float, check: str = "", **extra: object) -> dict:
    return {"method": name, "bytes": nbytes, "seconds": seconds,
            "GB/s": nbytes / seconds / 1e9 if seconds else 0.0, "check": check, **extra}


def cpu_rows(volume: str, args: argparse.Namespace) -> list[dict]:
    with open_volume(volume) as vol:
        results = bench.run_cpu(open_model(vol), threads=args.threads, buffers=args.buffers,
                                buffer_size=args.buffer_mib * MiB, repeat=args.repeat)
    return [row(f"(e) {r.name}", r.nbytes, r.seconds, note=r.note) for r in results]


# --- GPU ------------------------------------------------------------------------------

def gpu_rows(src: str, volumes: list[str], args: argparse.Namespace) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    shards = sorted(str(p) for p in Path(src).glob("*.safetensors"))
    total = sum(t.nbytes for ts in open_model(volumes[0]).select().values() for t in ts)
    rows: list[dict] = []

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t

    def free() -> None:
        gc.collect()
        torch.cuda.empty_cache()

    # (a) the ceiling: the same bytes from one pinned buffer, one stream, into a
    # preallocated target. (a') adds the target's cudaMalloc, which every loader pays.
    pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True).fill_(7)

    def ceiling(target=None) -> None:
        target = torch.empty(total, dtype=torch.uint8, device=dev) if target is None \
            else target
        for off in range(0, total, GiB):
            n = min(GiB, total - off)
            target[off:off + n].copy_(pinned[:n], non_blocking=True)

    target = torch.empty(total, dtype=torch.uint8, device=dev)
    timed(partial(ceiling, target))
    best = min(timed(partial(ceiling, target))[1] for _ in range(args.repeat))
    rows.append(row("(a) pinned H2D ceiling (cudaMemcpyAsync)", total, best))
    del target
    free()
    times = []
    for _ in range(args.repeat):
        times.append(timed(ceiling)[1])
        free()
    rows.append(row("(a') pinned H2D incl. cudaMalloc of the target", total, min(times)))
    pinned = None  # the closure above holds the name; drop the buffer itself
    free()

    # (b) safetensors, also the reference for every check below.
    def st_load() -> dict:
        out = {}
        for f in shards:
            out.update(load_file(f, device=str(dev)))
        return out

    ref, secs = timed(st_load)
    rows.append(row("(b) safetensors.torch.load_file(cuda)", total, secs))

    def same(got: dict) -> str:
        if got.keys() != ref.keys():
            return f"FAIL: {len(got)} tensors, expected {len(ref)}"
        bad = [k for k, v in ref.items()
               if v.shape != got[k].shape or v.dtype != got[k].dtype
               or not torch.equal(v.view(-1).view(torch.uint8),
                                  got[k].contiguous().view(-1).view(torch.uint8))]
        return "bit-exact" if not bad else f"FAIL: {len(bad)} differ, e.g. {bad[0]}"

    def measure(fn, check: bool = True) -> tuple[float, str]:
        """Seconds and check result of one load; its tensors are freed before return
        (each load allocates afresh, as a new server process would)."""
        out, secs = timed(fn)
        result = same(out) if check else ""
        del out
        free()
        return secs, result

    # (c) torch.load(mmap=True) + .to(cuda)
    if not args.skip_torch_load:
        pt = os.path.join(args.work, "model.pt")
        if not os.path.exists(pt):
            cpu = {}
            for f in shards:
                cpu.update(load_file(f))
            torch.save(cpu, pt)
            del cpu

        def tl() -> dict:
            sd = torch.load(pt, mmap=True, weights_only=True)
            return {k: v.to(dev) for k, v in sd.items()}

        secs, check = measure(tl)
        rows.append(row("(c) torch.load(mmap=True) + .to(cuda)", total, secs, check))

    # (d) ours
    configs = [tuple(int(x) for x in c.replace(":", "x").split("x"))
               for c in args.configs.split(",")]
    for vpath in volumes:
        rows += ours(vpath, configs, dev, total, measure, args)
    ref.clear()
    free()
    ceiling_gbps = rows[0]["GB/s"]
    for r in rows:
        r["ratio_to_a"] = r["GB/s"] / ceiling_gbps
    return rows


def load(view, device: str, loader, verify: bool) -> dict:
    return start_load(view, device, loader=loader, verify=verify).result()


def ours(vpath: str, configs: list, dev, total: int, measure,
         args: argparse.Namespace) -> list[dict]:
    """(d) for one volume file: bounce configs, verification, registered, default."""
    from csi_pmem.loader.gpu import GpuLoader

    fs = fs_type(vpath)
    rows = []

    def once(view, loader, verify: bool = False, check: bool = True) -> tuple[float, str]:
        return measure(partial(load, view, str(dev), loader, verify), check)

    def repeat(view, loader, label: str) -> None:
        times = [once(view, loader, check=False)[0] for _ in range(args.repeat)]
        rows.append(row(f"(d) ours, {loader.last_path}, warm [{fs}{label}]", total,
                        min(times), "", runs=[round(t, 4) for t in times]))

    for n, (nbuf, mib, threads) in enumerate(configs):
        label = f" {nbuf}x{mib}MiB/{threads}thr"
        loader = GpuLoader(dev, buffers=nbuf, buffer_size=mib * MiB, threads=threads,
                           mode="bounce")
        loader.prepare()
        with open_volume(vpath) as vol:  # a fresh mapping: the first load pays faults
            view = open_model(vol)
            secs, check = once(view, loader)
            rows.append(row(f"(d) ours, bounce, cold mapping [{fs}{label}]", total, secs,
                            check))
            repeat(view, loader, label)
            if n == 0:
                secs, check = once(view, loader, verify=True)
                rows.append(row(f"(d) ours, bounce + sha256 verify [{fs}{label}]", total,
                                secs, check))
        loader.close()
    if not args.skip_registered:
        with GpuLoader(dev, mode="registered") as loader, open_volume(vpath) as vol:
            view = open_model(vol)
            secs, check = once(view, loader)
            reg = next(iter(loader._registrations.values()), None)
            note = f" (registration {reg.seconds:.3f} s)" if reg else ""
            rows.append(row(f"(d) ours, {loader.last_path}, first load incl. registration "
                            f"[{fs}]", total, secs, check, note=note))
            repeat(view, loader, "")
            # Like (a): the target's device memory exists before the clock starts
            # (GpuLoader.reserve, what a server does during its own start-up).
            times, checks = [], []
            for i in range(args.repeat):
                loader.reserve(view)
                secs, check = once(view, loader, check=i == 0)
                times.append(secs)
                checks.append(check)
            rows.append(row(f"(d) ours, {loader.last_path}, device memory reserved ahead "
                            f"[{fs}]", total, min(times), checks[0],
                            runs=[round(t, 4) for t in times]))
            secs, check = once(view, loader, verify=True)
            rows.append(row(f"(d) ours, {loader.last_path} + sha256 verify [{fs}]", total,
                            secs, check))
    # What a caller gets with no tuning: the default loader, one open volume, 3 loads.
    with GpuLoader(dev) as loader, open_volume(vpath) as vol:
        view = open_model(vol)
        for i in range(3):
            secs, check = once(view, loader, check=i == 0)
            rows.append(row(f"(d) ours, default GpuLoader, load {i + 1} "
                            f"({loader.last_path}) [{fs}]", total, secs, check))
    return rows


def environment(args: argparse.Namespace) -> dict:
    env = {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
           "kernel": platform.release(), "work_fs": fs_type(args.work)}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            env["shmem_thp"] = f.read().strip()
    except OSError:
        pass
    env["numa_nodes"] = sorted(p for p in os.listdir("/sys/devices/system/node")
                               if p.startswith("node")) if os.path.isdir(
        "/sys/devices/system/node") else []
    if not args.cpu_only:
        import torch

        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name(args.device)
    return env


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed; no plot")
        return
    # Zero-copy views have no meaningful bandwidth; they would flatten every other bar.
    rows = [r for r in rows if "views" not in r["method"]]
    names = [r["method"] for r in rows]
    values = [r["GB/s"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.5))
    bars = ax.barh(range(len(rows)), values, color=[
        "#777" if n.startswith("(a") else "#2a7" if n.startswith("(d)") else
        "#59c" if n.startswith("(e)") else "#c84" for n in names])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.22)
    ax.set_xlabel("GB/s (weight bytes / wall time until usable on the device)")
    ax.set_title(title, fontsize=9)
    for bar, r in zip(bars, rows, strict=True):
        ratio = f"  {r['ratio_to_a']:.0%} of (a)" if "ratio_to_a" in r else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {r['GB/s']:.1f}{ratio}", va="center", fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot saved to {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=16.0)
    p.add_argument("--work", default="/dev/shm/csi-pmem-bench",
                   help="tmpfs directory for the model, volume and .pt file")
    p.add_argument("--model", help="use this safetensors directory instead of generating")
    p.add_argument("--volume", action="append",
                   help="volume file(s) to stage into and load from (tmpfs, hugetlbfs)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cpu-only", action="store_true", help="only (e); no torch needed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--buffers", type=int, default=24)
    p.add_argument("--buffer-mib", type=int, default=16)
    p.add_argument("--configs", default="24x16:12",
                   help="bounce configs BUFFERSxMIB:THREADS, comma separated")
    p.add_argument("--skip-torch-load", action="store_true")
    p.add_argument("--skip-registered", action="store_true")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "results"
                                         / "loader-bench.png"))
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    src, volumes = prepare(args)
    env = environment(args)
    rows = [] if args.cpu_only else gpu_rows(src, volumes, args)
    rows += cpu_rows(volumes[0], args)
    size = rows[0]["bytes"] / 1e9
    print(f"\nmodel {size:.2f} GB, {env}")
    print(f"{'method':<66} {'GB/s':>8} {'x (a)':>6} {'s':>8}  check")
    for r in rows:
        ratio = f"{r['ratio_to_a']:.2f}" if "ratio_to_a" in r else "-"
        print(f"{r['method']:<66} {r['GB/s']:8.2f} {ratio:>6} {r['seconds']:8.4f}  "
              f"{r['check']}{r.get('note', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    if not args.cpu_only and args.plot:
        plot(rows, args.plot, f"{env.get('gpu', '')}: {size:.1f} GB model, "
                              f"{env.get('torch', '')}")
    failed = [r for r in rows if str(r["check"]).startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
