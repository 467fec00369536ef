#!/usr/bin/env python3
"""Fresh-process GPU loading benchmark: our loader beside the pinned-copy ceiling and the
peer loaders, every measurement in a new Python process, rounds interleaved.

Why fresh processes: a restarted inference pod meets the weights with nothing warm in
it (no loader, no pinned buffers, no registered mapping, no allocator cache), only a
CUDA context it creates before loading. bench_loader.py measures warm and cold paths
inside one process; this measures what a restart pays. Why interleaved rounds: host to
device bandwidth drifts (clocks, NUMA placement, other tenants), so round r runs every
method once before round r+1 starts, and the order rotates by one method per round so
that no method always runs right after the same neighbour. Ratios are taken within one
run only.

Each worker (this script with --worker) imports torch, creates the CUDA context
(torch.cuda.init, a 1-element tensor, synchronize) and imports the method's library;
then the clock runs from the load call until torch.cuda.synchronize() after it. GB/s is
loaded bytes / 1e9 / seconds. After the clock the worker fingerprints every tensor on
the GPU and compares with reference fingerprints that one subprocess computed before
the rounds from safetensors.torch.load_file(device="cpu"): bit-exact or the first
tensor that differs. Methods (METHODS; add a variant of ours with one line):
  pinned-ceiling   cudaMemcpyAsync of the model's byte count, 1 GiB at a time, from a
                   1 GiB pinned buffer into a device buffer; both allocated before the
                   clock (no check: it copies no tensors)
  safetensors, instanttensor, fastsafetensors, runai
                   the peers (benchmarks/peers.py) reading the model files (tmpfs)
  ours, ours-noverify
                   csi_pmem.loader.load_safetensors(VOLUME, device=...) with default
                   verification / verify=False, in-pod (no copy service); with several
                   --volume paths one method per volume, named ours@<basename>
  ours-map, ours-noverify-map
                   the same with CSI_PMEM_BOUNCE_SOURCE=map: the bounce loop copies
                   from the mapping also on 4 KiB-page files (by default it reads those
                   with pread); not in "all", name them in --methods
  ours-node, ours-node-noverify
                   the same from a published directory over the first volume whose
                   gpu.sock reaches the node's GPU copy service (its own process, as
                   deployed: csi_pmem.driver.standalone), registered before the rounds
A method whose library is not installed shows as "not installed" and is not retried;
a nonzero exit status (a signal shows as -N), a timeout or an inexact result shows in
the table. Each worker's stdout and stderr are kept in WORK/logs/r<round>-<method>.*.
Exit status: 0 if every run that could run succeeded bit-exact, else 1.

Usage (peers from the wheels benchmarks/fetch_peer_wheels.sh downloads):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site benchmarks/bench_fresh.py --size-gb 14.7 --json fresh.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MiB, GiB = 1 << 20, 1 << 30
CEILING = "pinned-ceiling"
NOT_INSTALLED = 3  # worker exit status: the method's library cannot be imported
WORDS = 1 << 24  # int64 words per fingerprint slice (128 MiB): bounds the temporaries
REEXEC = "BENCH_FRESH_REEXEC"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- methods (run inside a worker) ----------------------------------------------------

@dataclass
class Ctx:
    """What a method gets: the model's files, our volume (for ours), the device, the
    model's byte count, a scratch directory, and room for state set up before the clock."""

    files: list[str]
    volume: str | None
    device: str
    nbytes: int
    scratch: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """``run`` is timed and returns ``{name: tensor}`` (or None: nothing to check).
    ``setup`` runs before the clock (imports, buffers); ModuleNotFoundError there means
    not installed. ``env`` may ask for environment variables, applied by re-executing
    the worker before torch is imported. ``volume``: loads from ``Ctx.volume``."""

    run: Callable[[Ctx], dict[str, Any] | None]
    setup: Callable[[Ctx], None] | None = None
    env: Callable[[Ctx], dict[str, str]] | None = None
    volume: bool = False
    check: bool = True
    # Loads from the volume published with the node's GPU copy service
    # (csi_pmem.driver.standalone: dax.sock + gpu.sock + the service process).
    node: bool = False


def _ceiling_setup(ctx: Ctx) -> None:
    import torch

    ctx.state["pinned"] = torch.empty(GiB, dtype=torch.uint8, pin_memory=True).fill_(7)
    ctx.state["target"] = torch.empty(ctx.nbytes, dtype=torch.uint8, device=ctx.device)
    torch.cuda.synchronize(ctx.device)


def _ceiling_run(ctx: Ctx) -> None:
    pinned, target = ctx.state["pinned"], ctx.state["target"]
    for off in range(0, ctx.nbytes, GiB):
        n = min(GiB, ctx.nbytes - off)
        target[off:off + n].copy_(pinned[:n], non_blocking=True)


def peer(name: str) -> Method:
    """A loader of benchmarks/peers.py, imported before the clock."""
    def setup(ctx: Ctx) -> None:
        import importlib

        import peers

        for module in peers.MODULES[name]:
            importlib.import_module(module)

    def run(ctx: Ctx) -> dict[str, Any]:
        import peers

        return peers.LOADERS[name](ctx.files, ctx.device)

    def env(ctx: Ctx) -> dict[str, str]:
        import peers

        return peers.cudart_env(os.path.join(ctx.scratch, "cudart-shim"))

    return Method(run, setup, env if name == "fastsafetensors" else None)


def ours(node: bool = False, settings: dict[str, str] | None = None, **kw: Any) -> Method:
    """csi_pmem.loader.load_safetensors(volume, device=..., **kw), as a pod calls it;
    ``node``: from a published directory whose gpu.sock reaches the copy service;
    ``settings``: the loader's environment variables for this variant."""
    def setup(ctx: Ctx) -> None:
        import csi_pmem.loader.gpu.loader  # noqa: F401  (as peers import theirs before the clock)

        if node:
            import cuda.bindings.driver  # noqa: F401  (what the node path calls)

    def run(ctx: Ctx) -> dict[str, Any]:
        from csi_pmem.loader import load_safetensors

        return load_safetensors(ctx.volume, device=ctx.device, **kw)

    def env(ctx: Ctx) -> dict[str, str]:
        # In-pod rows must not reach a service, node rows must (no silent fallback).
        return {"CSI_PMEM_GPU_COPY": "auto" if node else "off", **(settings or {})}

    return Method(run, setup, env, volume=True, node=node)


# Variants for A/Bs: only when --methods names them.
EXTRA = ("ours-map", "ours-noverify-map")
METHODS: dict[str, Method] = {
    CEILING: Method(_ceiling_run, _ceiling_setup, check=False),
    "safetensors": peer("safetensors"),
    "instanttensor": peer("instanttensor"),
    "fastsafetensors": peer("fastsafetensors"),
    "runai": peer("runai"),
    "ours": ours(),
    "ours-noverify": ours(verify=False),
    # The bounce loop copying from the mapping on 4 KiB-page files too (the default
    # reads those with pread); the same on 2 MiB pages.
    "ours-map": ours(settings={"CSI_PMEM_BOUNCE_SOURCE": "map"}),
    "ours-noverify-map": ours(verify=False, settings={"CSI_PMEM_BOUNCE_SOURCE": "map"}),
    "ours-node": ours(node=True),
    "ours-node-noverify": ours(node=True, verify=False),
}


# --- fingerprints (worker and reference) ----------------------------------------------

def fingerprint(t: Any, dev: Any) -> list[int]:
    """Two int64 sums (wrapping) over the tensor's bytes read as little-endian int64
    words (zero padded): the plain sum and the sum weighted by the word's 1-based index.
    A swapped, shifted or missing range changes the second. Computed on ``dev`` in
    slices of WORDS words; a CPU tensor (the reference) is moved there slice by slice."""
    import torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    weighted = torch.zeros((), dtype=torch.int64, device=dev)
    index = None
    step = WORDS * 8
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step].to(dev)
        if part.numel() % 8 or part.data_ptr() % 8:
            padded = torch.zeros(-(-part.numel() // 8) * 8, dtype=torch.uint8, device=dev)
            padded[:part.numel()] = part
            part = padded
        x = part.view(torch.int64)
        if index is None or index.numel() < x.numel():
            index = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=dev)
        s = x.sum()
        total += s
        # sum(x * (i + offset)) = sum(x * i) + offset * sum(x): one index tensor serves
        # every slice.
        weighted += (x * index[:x.numel()]).sum() + s * (start // 8)
    return [int(v) for v in torch.stack([total, weighted]).tolist()]


def describe(t: Any, dev: Any) -> dict[str, Any]:
    return {"dtype": str(t.dtype), "shape": list(t.shape), "bytes": t.nbytes,
            "fp": fingerprint(t, dev)}


def compare(got: dict[str, Any], ref: dict[str, dict[str, Any]], dev: Any) -> str | None:
    """None if ``got`` is ``ref`` bit for bit (and on ``dev``), else the first difference."""
    import torch

    missing = [n for n in ref if n not in got]
    if missing:
        return f"{missing[0]}: missing ({len(missing)} tensors missing)"
    extra = [n for n in got if n not in ref]
    if extra:
        return f"{extra[0]}: not in the model ({len(extra)} extra)"
    want = torch.device(dev)
    for name, expected in ref.items():
        t = got[name]
        if not isinstance(t, torch.Tensor):
            return f"{name}: a {type(t).__name__}, not a tensor"
        if t.device != want:
            return f"{name}: on {t.device}, not {want}"
        mine = describe(t, want)
        for key in ("dtype", "shape", "bytes"):
            if mine[key] != expected[key]:
                return f"{name}: {key} {mine[key]} != {expected[key]}"
        if mine["fp"] != expected["fp"]:
            how = "sum" if mine["fp"][0] != expected["fp"][0] else "order"
            return f"{name}: bytes differ ({how} of the int64 words)"
    return None


# --- the worker and the reference (each its own process) ------------------------------

def cuda_device(device: str) -> Any:
    """torch and the device, with the CUDA context created and idle."""
    import torch

    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, 0)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    torch.cuda.synchronize(dev)
    return torch, dev


def worker_main(name: str, spec: dict[str, Any]) -> int:
    """Run one method once; print one JSON line on stdout; exit with its status."""
    method = METHODS[spec["base"]]
    ctx = Ctx(spec["files"], spec.get("volume"), spec["device"], spec["nbytes"],
              spec["scratch"])
    result: dict[str, Any] = {"method": name}

    def emit(**kw: Any) -> None:
        print(json.dumps({**result, **kw}), flush=True)

    try:
        if method.env is not None and os.environ.get(REEXEC) != "1":
            extra = method.env(ctx)
            if extra:
                log(f"{name}: re-executing with {extra}")
                sys.stdout.flush()
                sys.stderr.flush()
                os.execve(sys.executable, [sys.executable, *sys.argv],
                          {**os.environ, **extra, REEXEC: "1"})
        torch, dev = cuda_device(ctx.device)
        ctx.device = str(dev)
        if method.setup is not None:
            method.setup(ctx)
    except ModuleNotFoundError as exc:  # a broken install (other ImportError) fails
        emit(status="not installed", error=str(exc))
        return NOT_INSTALLED
    started = time.perf_counter()
    out = method.run(ctx)
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - started
    nbytes = ctx.nbytes if out is None else sum(t.nbytes for t in out.values())
    result.update(status="ok", bytes=nbytes, seconds=seconds,
                  **{"GB/s": nbytes / 1e9 / seconds if seconds > 0 else 0.0},
                  tensors=None if out is None else len(out))
    if out is None or not method.check:
        emit(exact="n/a", mismatch=None)
        return 0
    with open(spec["reference"]) as f:
        ref = json.load(f)["tensors"]
    mismatch = compare(out, ref, dev)
    emit(exact=mismatch is None, mismatch=mismatch)
    return 0


def reference_main(spec: dict[str, Any], out_path: str) -> int:
    """Fingerprints of every tensor as safetensors reads it to the CPU, computed on the
    GPU with the workers' code; also the environment only torch can report."""
    torch, dev = cuda_device(spec["device"])
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in spec["files"]:
        for name, t in load_file(path, device="cpu").items():
            tensors[name] = describe(t, dev)
        log(f"reference: {os.path.basename(path)} done")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(dev)}
    with open(out_path, "w") as f:
        json.dump({"env": env, "tensors": tensors}, f)
    return 0


# --- orchestration --------------------------------------------------------------------

def parse_methods(text: str) -> list[str]:
    """``--methods`` as a list of METHODS keys, in the order given."""
    names = [n for n in METHODS if n not in EXTRA] if text in ("", "all") else [
        m.strip() for m in text.split(",") if m.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: "
                         f"{', '.join(METHODS)}")
    return list(dict.fromkeys(names))


def expand(names: list[str], volumes: list[str],
           node_dir: str | None = None) -> list[tuple[str, str, str | None]]:
    """(label, method, volume) per measured method: a volume method once per volume,
    labelled method@<basename> when there are several; node methods once, from the
    published directory ``node_dir``."""
    out: list[tuple[str, str, str | None]] = []
    for name in names:
        if METHODS[name].node:
            out.append((name, name, node_dir))
        elif not METHODS[name].volume:
            out.append((name, name, None))
        elif len(volumes) == 1:
            out.append((name, name, volumes[0]))
        else:
            seen: set[str] = set()
            for vol in volumes:
                label = base = f"{name}@{os.path.basename(os.path.normpath(vol))}"
                n = 1
                while label in seen:  # two volumes of one basename
                    n += 1
                    label = f"{base}-{n}"
                seen.add(label)
                out.append((label, name, vol))
    return out


def round_order(labels: list[str], r: int) -> list[str]:
    """Every label once; round r (0-based) starts r places further along."""
    k = r % len(labels) if labels else 0
    return labels[k:] + labels[:k]


def describe_rc(rc: int | None, status: str) -> str:
    """An exit status as the table shows it: -6 (SIGABRT) for a signal, 134 (SIGABRT?)
    for a shell's 128 + N."""
    if status == "timeout":
        return "timeout"
    if rc is None:
        return "?"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    try:
        name = signal.Signals(sig).name if sig else ""
    except ValueError:
        name = ""
    return f"{rc} ({name}{'?' if rc > 0 else ''})" if name else str(rc)


def run_worker(cmd: list[str], timeout: float, out_path: str, err_path: str,
               env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own session, stdout and stderr to files; returns (returncode,
    "timeout" or "", wall seconds). Whatever it left in its process group is killed."""
    started = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        status = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
            _kill_group(proc.pid)
            proc.wait()
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            _kill_group(proc.pid)
    return proc.returncode, status, time.monotonic() - started


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def last_json(path: str) -> dict[str, Any] | None:
    """The worker's result: the last stdout line that is a JSON object with "method"."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "method" in obj:
                return obj
    return None


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def measure(label: str, base: str, volume: str | None, rnd: int, common: dict[str, Any],
            args: argparse.Namespace, logs: str, script: str = __file__,
            keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """One fresh worker for one method; the record of that round. ``script`` runs the
    worker (bench_vllm.py reuses this harness); ``keys``: more result fields to keep."""
    spec = {**common, "base": base, "volume": volume}
    stem = os.path.join(logs, f"r{rnd}-{label.replace('/', '_')}")
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", label,
           "--spec", json.dumps(spec)]
    rc, status, wall = run_worker(cmd, args.timeout_s, stem + ".out", stem + ".err")
    got = last_json(stem + ".out") or {}
    rec: dict[str, Any] = {"round": rnd, "method": label, "returncode": rc,
                           "wall_s": round(wall, 3), "log": stem + ".err"}
    if status == "timeout":
        rec["status"] = "timeout"
    elif rc == NOT_INSTALLED and got.get("status") == "not installed":
        rec.update(status="not installed", error=got.get("error", ""))
    elif rc != 0:
        rec["status"] = "failed"
    elif got.get("status") != "ok":
        rec["status"] = "no result"
    else:
        rec.update({k: got[k] for k in ("bytes", "seconds", "GB/s", "exact", "mismatch",
                                        "tensors", *keys) if k in got}, status="ok")
        if rec.get("exact") is False:
            rec["status"] = "inexact"
    return rec


def summarize(labels: list[str], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: best and median GB/s over its successful rounds, best / best of the
    ceiling, every round's exit status, and the check's verdict."""
    rows = []
    for label in labels:
        recs = [r for r in records if r["method"] == label]
        timed = [r for r in recs if r["status"] in ("ok", "inexact")]
        gbps = [r["GB/s"] for r in timed]
        best = max(timed, key=lambda r: r["GB/s"]) if timed else None
        rows.append({
            "method": label,
            "best GB/s": max(gbps) if gbps else None,
            "median GB/s": statistics.median(gbps) if gbps else None,
            "best s": best["seconds"] if best else None,
            "bytes": best["bytes"] if best else None,
            "rounds": len(recs),
            "returncodes": [describe_rc(r["returncode"], r["status"]) for r in recs],
            "exact": _verdict(recs, timed),
            "note": _note(recs),
        })
    ceiling = next((r["best GB/s"] for r in rows if r["method"] == CEILING), None)
    for row in rows:
        row["x ceiling"] = (row["best GB/s"] / ceiling
                            if ceiling and row["best GB/s"] is not None else None)
    return rows


def _verdict(recs: list[dict[str, Any]], timed: list[dict[str, Any]]) -> str:
    if any(r["status"] == "not installed" for r in recs):
        return "-"
    if timed and all(r.get("exact") == "n/a" for r in timed):
        return "n/a"
    bad = [r for r in timed if r.get("exact") is False]
    if bad:
        return f"NO ({len(bad)}/{len(timed)}): {bad[0].get('mismatch')}"
    if not timed:
        return "-"
    return "yes" if all(r.get("exact") is True for r in timed) else "?"


def _note(recs: list[dict[str, Any]]) -> str:
    notes = []
    for r in recs:
        if r["status"] == "not installed":
            return f"not installed ({r.get('error', '')})"
        if r["status"] in ("failed", "timeout", "no result"):
            notes.append(f"round {r['round']}: {r['status']}")
    return "; ".join(notes)


def render_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| method | best GB/s | median GB/s | x ceiling | best s | exact | "
             "exit codes | note |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        exact = r["exact"].replace("|", "\\|")
        note = r["note"].replace("|", "\\|")
        lines.append(f"| {r['method']} | {num(r['best GB/s'], '.2f')} | "
                     f"{num(r['median GB/s'], '.2f')} | {num(r['x ceiling'], '.3f')} | "
                     f"{num(r['best s'], '.3f')} | {exact} | "
                     f"{','.join(r['returncodes'])} | {note} |")
    return "\n".join(lines)


def run_rounds(entries: list[tuple[str, str, str | None]], rounds: int,
               measure_one: Callable[[str, str, str | None, int], dict[str, Any]],
               on_round: Callable[[list[dict[str, Any]], int], None] | None = None,
               budget_s: float | None = None) -> list[dict[str, Any]]:
    """Interleaved rounds; a method found not installed is not run again.

    ``on_round(records, done)`` runs after each whole round (the caller saves what it
    has, so a run cut short by its host keeps its complete rounds). With ``budget_s``,
    a round is not started when the seconds spent so far plus the longest round so far
    would pass it: the run ends with whole rounds instead of being killed in one."""
    by_label = {e[0]: e for e in entries}
    skip: set[str] = set()
    records: list[dict[str, Any]] = []
    start, longest = time.monotonic(), 0.0
    for rnd in range(1, rounds + 1):
        spent = time.monotonic() - start
        if budget_s is not None and rnd > 1 and spent + longest > budget_s:
            log(f"stopping after round {rnd - 1} of {rounds}: {spent:.0f} s spent, a round "
                f"takes up to {longest:.0f} s, the budget is {budget_s:.0f} s")
            break
        t = time.monotonic()
        for label in round_order(list(by_label), rnd - 1):
            if label in skip:
                continue
            _, base, volume = by_label[label]
            rec = measure_one(label, base, volume, rnd)
            records.append(rec)
            _progress(rec, rounds)
            if rec["status"] == "not installed":
                skip.add(label)
        longest = max(longest, time.monotonic() - t)
        if on_round is not None:
            on_round(records, rnd)
    return records


def _progress(rec: dict[str, Any], rounds: int) -> None:
    head = f"round {rec['round']}/{rounds} {rec['method']}:"
    if rec["status"] in ("ok", "inexact"):
        exact = {True: "bit-exact", False: f"NOT EXACT: {rec.get('mismatch')}",
                 "n/a": "no check"}.get(rec.get("exact"), "?")
        log(f"{head} {rec['GB/s']:.2f} GB/s, {rec['seconds']:.3f} s, {exact} "
            f"(wall {rec['wall_s']:.1f} s)")
    elif rec["status"] == "not installed":
        log(f"{head} not installed ({rec.get('error', '')})")
    else:
        log(f"{head} {rec['status']}, exit {describe_rc(rec['returncode'], rec['status'])}"
            f" (wall {rec['wall_s']:.1f} s); log {rec['log']}:\n{tail(rec['log'])}")


def tensor_bytes(files: Iterable[str]) -> tuple[int, int]:
    """(data bytes, tensors) from the safetensors headers, without torch."""
    total = count = 0
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                total += end - start
                count += 1
    return total, count


def model_dir(args: argparse.Namespace) -> str:
    """--model, or a synthetic model in WORK/model, regenerated when --size-gb changed."""
    if args.model:
        return args.model
    import make_model

    src = os.path.join(args.work, "model")
    stamp = os.path.join(args.work, "model.size")  # written before make: the dir is ours
    size = int(args.size_gb * 1e9)
    try:
        with open(stamp) as f:
            current: str | None = f.read().strip()
    except OSError:
        current = None
    config = os.path.join(src, "config.json")
    if current != str(size) or not os.path.exists(config):
        if os.path.exists(src):
            if current is None and not _synthetic(config):
                raise SystemExit(f"{src} exists and is not a model make_model.py wrote; "
                                 "pass it as --model or pick another --work")
            shutil.rmtree(src)
        with open(stamp, "w") as f:
            f.write("generating")
        t = time.perf_counter()
        info = make_model.make(size, src)
        with open(stamp, "w") as f:
            f.write(str(size))
        log(f"generated {info} in {time.perf_counter() - t:.1f} s")
    return src


def _synthetic(config: str) -> bool:
    try:
        with open(config) as f:
            return json.load(f).get("model_type") == "synthetic"
    except (OSError, ValueError, AttributeError):
        return False


def stage_volumes(args: argparse.Namespace, src: str) -> list[str]:
    """--volume paths (or WORK/volume.img) holding the model, staged where needed."""
    from csi_pmem.loader import open_model
    from csi_pmem.loader.staging import open_for_staging, stage
    from csi_pmem.weights.errors import LayoutError, ReadOnlyVolumeError

    default = os.path.join(args.work, "volume.img")
    volumes = args.volume or [default]
    for path in volumes:
        t = time.perf_counter()
        try:
            if os.path.isdir(path):
                with open_for_staging(path) as vol:
                    result = stage(vol, src, name="bench")
            else:
                result = _stage_file(path, src)
        except ReadOnlyVolumeError:
            open_model(path).volume.close()  # raises NoModelError if nothing is staged
            log(f"{path} is read-only; loading the model it holds")
            continue
        except LayoutError:
            if path != default:
                raise
            log(f"{path} holds another model; recreating it")
            os.unlink(path)
            result = _stage_file(path, src)
        if not result.already:
            log(f"staged into {path} in {time.perf_counter() - t:.1f} s")
    return volumes


def _stage_file(path: str, src: str) -> Any:
    """A volume file sized for the model (as bench_loader.prepare does), then staged."""
    from csi_pmem.loader import open_volume, stage
    from csi_pmem.loader.staging import scan_source
    from csi_pmem.sizes import round_up
    from csi_pmem.weights.layout import INDEX_AREA, plan_files

    need = round_up(max(f.end for f in plan_files(scan_source(src), INDEX_AREA, 2 * MiB)),
                    2 * MiB)
    with open(path, "ab") as f:
        if os.fstat(f.fileno()).st_size < need:
            f.truncate(need)
    with open_volume(path, writable=True) as vol:
        return stage(vol, src, name="bench")


def source_commit() -> str | None:
    """The commit that ran: CSI_PMEM_COMMIT (a copied tree has no .git), else git's."""
    if os.environ.get("CSI_PMEM_COMMIT"):
        return os.environ["CSI_PMEM_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def gpu_driver_version() -> str | None:
    """The NVIDIA driver's version, which torch does not report."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def host_copy_gbps(nbytes: int = 2 * GiB, repeat: int = 5) -> dict[str, float]:
    """Host memory bandwidth, best of `repeat` copies of 2 GiB: one thread (numpy) and
    all threads (torch's parallel copy). GB/s counts the bytes copied, not read plus
    written. Why here: hosts of one kind differed by up to 2x for every loader that
    copies through host memory, so a run records its host's figure beside its table."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out = {}
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    out["one_thread"] = round(nbytes / 1e9 / best, 2)
    try:
        import torch
    except ImportError:
        return out
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    best = min(_timed(lambda: td.copy_(ts)) for _ in range(repeat))
    out[f"torch_{torch.get_num_threads()}_threads"] = round(nbytes / 1e9 / best, 2)
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def environment(args: argparse.Namespace, src: str, volumes: list[str],
                ref_env: dict[str, Any]) -> dict[str, Any]:
    from importlib import metadata

    import peers
    from bench_loader import fs_type

    versions = {}
    for name, dist in peers.DISTRIBUTIONS.items():
        try:
            versions[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"commit": source_commit(), "gpu_driver": gpu_driver_version(),
            "host_copy_gbps": host_copy_gbps(),
            "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
            "kernel": platform.release(), "model_fs": fs_type(os.path.abspath(src)),
            "volumes": {v: fs_type(os.path.abspath(v)) for v in volumes},
            "peers": versions, **ref_env}


def make_reference(common: dict[str, Any], args: argparse.Namespace, logs: str,
                   script: str = __file__) -> dict:
    path = common["reference"]
    cmd = [sys.executable, str(Path(script).resolve()), "--make-reference", path,
           "--spec", json.dumps(common)]
    t = time.perf_counter()
    rc, status, _ = run_worker(cmd, args.timeout_s, os.path.join(logs, "reference.out"),
                               os.path.join(logs, "reference.err"))
    if rc != 0 or status:
        raise RuntimeError(f"the reference fingerprints failed ({status or describe_rc(rc, '')}"
                           f"):\n{tail(os.path.join(logs, 'reference.err'))}")
    with open(path) as f:
        ref = json.load(f)
    log(f"reference fingerprints of {len(ref['tensors'])} tensors in "
        f"{time.perf_counter() - t:.1f} s")
    return ref["env"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="methods: " + ", ".join(METHODS))
    p.add_argument("--size-gb", type=float, default=14.7,
                   help="synthetic model size (benchmarks/make_model.py), GB")
    p.add_argument("--work", default="/dev/shm/csi-pmem-fresh",
                   help="tmpfs directory for the model, volume, reference and logs")
    p.add_argument("--model", help="use this safetensors directory instead of generating")
    p.add_argument("--volume", action="append",
                   help="a volume file or published volume directory for our loader "
                        "(repeatable; default WORK/volume.img, staged here)")
    p.add_argument("--methods", default="all", help="comma-separated, default all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600, help="per worker")
    p.add_argument("--budget-s", type=float,
                   help="start no round that would end past this many seconds of rounds "
                        "(the longest round so far is the estimate); whole rounds only")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--make-reference", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, json.loads(args.spec))
    if args.make_reference:
        return reference_main(json.loads(args.spec), args.make_reference)
    try:
        names = parse_methods(args.methods)
    except ValueError as exc:
        p.error(str(exc))
    os.makedirs(args.work, exist_ok=True)
    logs = os.path.join(args.work, "logs")
    os.makedirs(logs, exist_ok=True)
    src = model_dir(args)
    files = sorted(str(f) for f in Path(src).glob("*.safetensors"))
    if not files:
        p.error(f"no *.safetensors in {src}")
    nbytes, ntensors = tensor_bytes(files)
    volumes = stage_volumes(args, src) if any(METHODS[n].volume for n in names) else []
    common = {"files": files, "device": args.device, "nbytes": nbytes, "scratch": args.work,
              "reference": os.path.join(args.work, "reference.json")}
    ref_env = make_reference(common, args, logs)
    env = environment(args, src, volumes, ref_env)
    log(f"model {nbytes / 1e9:.2f} GB, {ntensors} tensors in {len(files)} files; {env}")
    with contextlib.ExitStack() as stack:
        node_dir = None
        if any(METHODS[n].node for n in names):
            from csi_pmem.driver.standalone import published

            node_dir = stack.enter_context(published(volumes[0],
                                                     os.path.join(args.work, "published")))
        entries = expand(names, volumes, node_dir)
        labels = [e[0] for e in entries]

        def save(records: list[dict[str, Any]], done: int) -> None:
            if not args.json:
                return
            rows = summarize(labels, records)
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"environment": env,
                           "model": {"dir": src, "files": files, "bytes": nbytes,
                                     "tensors": ntensors},
                           "volumes": volumes, "methods": labels,
                           "rounds_asked": args.rounds, "rounds_done": done,
                           "rounds": records, "summary": rows,
                           "table": render_table(rows)}, f, indent=1)
            os.replace(tmp, args.json)

        records = run_rounds(entries, args.rounds, lambda label, base, vol, rnd: measure(
            label, base, vol, rnd, common, args, logs), on_round=save,
            budget_s=args.budget_s)
    done = max((r["round"] for r in records), default=0)
    rows = summarize(labels, records)
    print(f"\n{env.get('gpu', '?')}, torch {env.get('torch', '?')}: model "
          f"{nbytes / 1e9:.2f} GB, {done} of {args.rounds} rounds, a fresh process each\n")
    print(render_table(rows))
    if args.json:
        print(f"\nJSON: {os.path.abspath(args.json)}")
    bad = [r for r in records if r["status"] not in ("ok", "not installed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
