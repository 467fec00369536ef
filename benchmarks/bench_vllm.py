#!/usr/bin/env python3
"""vLLM-shaped fresh-process benchmark: each method feeds a model's checkpoint tensors
into parameters allocated on the GPU before the clock, the way vLLM's
``model.load_weights`` does, in a new Python process per load, rounds interleaved.

Why a second harness beside bench_fresh.py: a server like vLLM owns its parameters
before it reads a byte, and fuses some checkpoint tensors into one parameter (Llama's
q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). What a user meets is then the
rate at which a loader's ``(name, tensor)`` stream fills those parameters, and the
device memory the stream takes beyond them. bench_fresh.py measures whole-model loads
into the loader's own buffers; this measures the server's path. vLLM's CUDA build
cannot run on the GPU host (its wheels pin a newer torch, and the host has no network),
so its loading logic is reproduced here: for each checkpoint tensor the parameter is
looked up through Llama's ``stacked_params_mapping``; a fused shard is
``param.narrow(0, offset, rows)`` and the loaded tensor ``narrow(0, rank * rows, rows)``
(tensor-parallel rank 0 of 1, as ``QKVParallelLinear.weight_loader`` and
``MergedColumnParallelLinear.weight_loader`` do), other parameters are copied whole
(``default_weight_loader``); each ends in ``param_slice.copy_(loaded)``.

Methods (each one the iterator vLLM's load format uses, vLLM 0.32):
  pinned-ceiling     the model's bytes from a 1 GiB pinned buffer straight into the
                     parameters, 1 GiB at a time: the host link's ceiling (no check)
  ours-node, ours-node-noverify
                     csi-pmem's format: csi_pmem.loader.batches.BatchedLoad through the
                     node's GPU copy service (the volume published with gpu.sock),
                     checked against the staged checksums / not
  ours-node-ahead1, ours-node-ahead3
                     the node path with one or three batches loading ahead (default 2)
  ours-node-drain    a diagnostic, never exact: the node path's batches drained
                     unverified without the copies into the parameters
  ours, ours-noverify
                     the same in-pod (CSI_PMEM_GPU_COPY=off: pinned bounce buffers)
  ours-cpu-views     the format before batches: CPU views of the mapping, each copied
                     into its parameter from pageable memory
  instanttensor      vLLM's instanttensor_weights_iterator: safe_open(files,
                     device=index, copy=True), f.tensors()
  fastsafetensors    vLLM's fastsafetensors_weights_iterator: ParallelLoader(None,
                     files, queue_size=0, nogds=True).iterate_weights() (vLLM falls
                     back to nogds where GDS cannot serve the files, as on tmpfs)
  runai              vLLM's runai_safetensors_weights_iterator on one GPU: host
                     tensors (cloned), copied into the parameters
  safetensors        vLLM's default (safetensors_weights_iterator): safe_open per file,
                     get_tensor on the CPU

Each worker reports GB/s (checkpoint bytes / seconds, the clock from the iterator's
creation to torch.cuda.synchronize() after the last copy and the method's own end,
for ours the verification), bit-exactness (every parameter slice against the
checkpoint tensor's fingerprint, computed before the rounds from safetensors on the
CPU), and peaks beyond the parameters: ``peak torch`` (torch's
max_memory_allocated minus what was allocated at the clock's start; ``peak reserved``,
the same for what its caching allocator holds, freed blocks included) and ``peak device``
(the device's used memory, sampled every 5 ms with cudaMemGetInfo, as nvidia-smi's
memory.used reads it, minus its value at the start; it sees the copy service's process
and allocations outside torch's allocator too). For ours on the node path also ``peak
exported``: the most bytes of the pod's exportable allocations alive at once (the
batches themselves, counted as they are made and freed), which tells the batches' own
memory from what the driver and the service hold beside them.

Usage (on the GPU host, after ``source benchmarks/gpu_host.sh``):
  python3 benchmarks/bench_vllm.py --shape llama3-8b --rounds 3 --json vllm.json
``--trace`` adds the loader's debug lines (each batch's start, its wait, the node
path's allocation, export and copies, in ms) to each worker's WORK/logs/*.err.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_fresh as bf  # noqa: E402  (the harness: workers, rounds, fingerprints)

GiB = 1 << 30
CEILING = bf.CEILING
# Llama's stacked_params_mapping (vllm/model_executor/models/llama.py): the fused
# parameter, the checkpoint shard's name, the shard's place in the fused parameter.
STACKED = ((".qkv_proj", ".q_proj", 0), (".qkv_proj", ".k_proj", 1),
           (".qkv_proj", ".v_proj", 2), (".gate_up_proj", ".gate_proj", 0),
           (".gate_up_proj", ".up_proj", 1))
EXTRA_KEYS = ("peak torch", "peak reserved", "peak device", "peak exported", "path",
              "budget", "slots")
PEAKS = ("peak torch", "peak reserved", "peak device", "peak exported")


# --- the server's parameters and its weight loaders -----------------------------------

@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands: the parameter and its row range."""

    param: str
    offset: int
    rows: int
    fused: bool


def layout(ref: dict[str, dict[str, Any]]) -> tuple[dict[str, tuple[list[int], str]],
                                                     dict[str, Slot]]:
    """(parameter -> (shape, dtype), checkpoint name -> Slot), as vLLM builds Llama."""
    shards: dict[str, list[tuple[int, str]]] = {}
    params: dict[str, tuple[list[int], str]] = {}
    for name, t in ref.items():
        for fused, part, index in STACKED:
            if part in name:
                shards.setdefault(name.replace(part, fused), []).append((index, name))
                break
        else:
            params[name] = (list(t["shape"]), t["dtype"])
    slots: dict[str, Slot] = {n: Slot(n, 0, params[n][0][0] if params[n][0] else 1, False)
                              for n in params}
    for pname, members in shards.items():
        offset = 0
        first = ref[members[0][1]]
        for _, name in sorted(members):
            rows = ref[name]["shape"][0]
            slots[name] = Slot(pname, offset, rows, True)
            offset += rows
        params[pname] = ([offset, *first["shape"][1:]], first["dtype"])
    return params, slots


class Server:
    """The parameters, allocated before the clock, and vLLM's weight loading."""

    def __init__(self, torch: Any, ref: dict[str, dict[str, Any]], device: Any):
        self.torch = torch
        shapes, self.slots = layout(ref)
        dtypes = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32,
                  "torch.float16": torch.float16, "torch.uint8": torch.uint8}
        self.params = {n: torch.empty(shape, dtype=dtypes[dt], device=device)
                       for n, (shape, dt) in shapes.items()}
        self.loaded: set[str] = set()

    def load(self, name: str, loaded: Any) -> None:
        """One (name, tensor) of the stream, as vLLM's weight loaders consume it."""
        slot = self.slots[name]
        param = self.params[slot.param]
        if slot.fused:
            # QKVParallelLinear / MergedColumnParallelLinear.weight_loader, TP rank 0 of 1
            dst = param.data.narrow(0, slot.offset, slot.rows)
            loaded = loaded.narrow(0, 0, slot.rows)
        else:
            dst = param.data  # default_weight_loader
        if dst.shape != loaded.shape:
            raise ValueError(f"{name}: shape {tuple(loaded.shape)} into {tuple(dst.shape)}")
        dst.copy_(loaded)
        self.loaded.add(name)

    def views(self) -> dict[str, Any]:
        """Each checkpoint tensor's slice of its parameter, for the fingerprint check."""
        out = {}
        for name, slot in self.slots.items():
            p = self.params[slot.param]
            out[name] = p.narrow(0, slot.offset, slot.rows) if slot.fused else p
        return out

    def fill_from(self, pinned: Any) -> int:
        """The ceiling: every parameter's bytes from ``pinned``, 1 GiB at a time."""
        moved = 0
        size = pinned.numel()
        for p in self.params.values():
            flat = p.view(-1).view(self.torch.uint8)
            for off in range(0, flat.numel(), size):
                n = min(size, flat.numel() - off)
                flat[off:off + n].copy_(pinned[:n], non_blocking=True)
                moved += n
        return moved


# --- the methods: each a (name, tensor) stream, as vLLM's format builds it ------------

@dataclass(frozen=True)
class Method:
    """``stream(ctx)`` gives the iterator and a callable run after the last tensor
    (inside the clock); ``setup`` imports before it; ``env`` as in bench_fresh."""

    stream: Callable[[bf.Ctx], tuple[Iterator[tuple[str, Any]], Callable[[], str]]] | None
    setup: Callable[[bf.Ctx], None] | None = None
    env: Callable[[bf.Ctx], dict[str, str]] | None = None
    volume: bool = False
    node: bool = False


def _nothing() -> str:
    return ""


def count_exported() -> dict[str, int]:
    """Live and peak bytes of the pod's exportable allocations (the node path's batches),
    counted as each is made and freed."""
    from csi_pmem.loader.gpu import nodecopy

    counts = {"live": 0, "peak": 0}
    real = nodecopy.ExportableAllocation

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, ordinal: int, nbytes: int, head: int | None = None):
            super().__init__(ordinal, nbytes, head)
            self._counted = self.size
            counts["live"] += self._counted
            counts["peak"] = max(counts["peak"], counts["live"])

        def free(self) -> None:
            counts["live"] -= getattr(self, "_counted", 0)
            self._counted = 0
            super().free()

    nodecopy.ExportableAllocation = Counted  # type: ignore[misc]
    return counts


def ours(node: bool = False, verify: bool = True, ahead: int | None = None,
         consume: bool = True) -> Method:
    """``consume=False``: a diagnostic, not a load: the batches are drained without the
    copies into the parameters (so the row is never exact), to tell the link's rate
    for batches from what the server's copies beside them cost."""
    def setup(ctx: bf.Ctx) -> None:
        import csi_pmem.loader.batches
        import csi_pmem.loader.gpu.loader  # noqa: F401

        if node:
            import cuda.bindings.driver  # noqa: F401

            ctx.state["exported"] = count_exported()

    def stream(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
        from csi_pmem.loader import open_model
        from csi_pmem.loader.batches import BatchedLoad

        load = BatchedLoad(open_model(ctx.volume), ctx.device, verify=verify,
                           budget=int(ctx.state["budget"]), ahead=ahead)

        def end() -> str:
            load.verified()
            from csi_pmem.loader.api import default_loader

            pool = getattr(default_loader(ctx.device), "last_pool", None)
            if node and pool is not None:  # the node path's allocations, reused or not
                ctx.state["slots"] = {"made": pool.made, "reused": pool.reused,
                                      "let go": pool.let_go}
            return load.path

        def drained() -> Iterator[tuple[str, Any]]:
            for _ in load:
                pass
            yield from ()

        return (iter(load) if consume else drained()), end

    def env(ctx: bf.Ctx) -> dict[str, str]:
        return {"CSI_PMEM_GPU_COPY": "auto" if node else "off"}

    return Method(stream, setup, env, volume=True, node=node)


def ours_cpu_views() -> Method:
    def stream(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
        from csi_pmem.loader import start_load

        handle = start_load(ctx.volume, "cpu", verify=True)

        def pairs() -> Iterator[tuple[str, Any]]:
            for fut in handle.files.values():
                yield from fut.result().items()

        def end() -> str:
            handle.verified.result()
            return "cpu-view"

        return pairs(), end

    return Method(stream, env=lambda ctx: {"CSI_PMEM_GPU_COPY": "off"}, volume=True)


def _peer_setup(name: str) -> Callable[[bf.Ctx], None]:
    def setup(ctx: bf.Ctx) -> None:
        import importlib

        import peers

        for module in peers.MODULES[name]:
            importlib.import_module(module)
    return setup


def _instanttensor(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
    import instanttensor
    import torch

    def pairs() -> Iterator[tuple[str, Any]]:
        with instanttensor.safe_open(list(ctx.files), framework="pt",
                                     device=torch.device(ctx.device).index,
                                     process_group=None, copy=True) as f:
            yield from f.tensors()

    return pairs(), _nothing


def _fastsafetensors(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
    from fastsafetensors.parallel_loader import ParallelLoader

    def pairs() -> Iterator[tuple[str, Any]]:
        pl = ParallelLoader(pg=None, hf_weights_files=sorted(ctx.files), queue_size=0,
                            use_tqdm_on_load=False, device=ctx.device, nogds=True)
        try:
            yield from pl.iterate_weights()
        finally:
            pl.close()

    return pairs(), _nothing


def _runai(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
    from runai_model_streamer import SafetensorsStreamer

    def pairs() -> Iterator[tuple[str, Any]]:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(list(ctx.files), device="cpu", is_distributed=False)
            for name, tensor in streamer.get_tensors():
                yield name, tensor.clone()

    return pairs(), _nothing


def _safetensors(ctx: bf.Ctx) -> tuple[Iterator[tuple[str, Any]], Callable[[], str]]:
    from safetensors import safe_open

    def pairs() -> Iterator[tuple[str, Any]]:
        for path in ctx.files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return pairs(), _nothing


def _fastsafetensors_env(ctx: bf.Ctx) -> dict[str, str]:
    import peers

    return peers.cudart_env(os.path.join(ctx.scratch, "cudart-shim"))


METHODS: dict[str, Method] = {
    CEILING: Method(None),
    "ours-node": ours(node=True),
    "ours-node-ahead1": ours(node=True, ahead=1),  # one batch ahead: the earlier default
    "ours-node-ahead3": ours(node=True, ahead=3),  # three ahead, a quarter of the budget
    "ours-node-noverify": ours(node=True, verify=False),
    "ours-node-drain": ours(node=True, verify=False, consume=False),  # diagnostic
    "ours": ours(),
    "ours-noverify": ours(verify=False),
    "ours-cpu-views": ours_cpu_views(),
    "instanttensor": Method(_instanttensor, _peer_setup("instanttensor")),
    "fastsafetensors": Method(_fastsafetensors, _peer_setup("fastsafetensors"),
                              _fastsafetensors_env),
    "runai": Method(_runai, _peer_setup("runai")),
    "safetensors": Method(_safetensors, _peer_setup("safetensors")),
}


# --- the worker ------------------------------------------------------------------------

class PeakSampler:
    """The device's used memory (cudaMemGetInfo, what nvidia-smi reports), every 5 ms."""

    def __init__(self, torch: Any, device: Any):
        self.torch, self.device = torch, device
        self.base = self._used()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._used())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())


def worker_main(name: str, spec: dict[str, Any]) -> int:
    method = METHODS[spec["base"]]
    ctx = bf.Ctx(spec["files"], spec.get("volume"), spec["device"], spec["nbytes"],
                 spec["scratch"], {"budget": spec["budget"]})
    result: dict[str, Any] = {"method": name}

    def emit(**kw: Any) -> None:
        print(json.dumps({**result, **kw}), flush=True)

    try:
        if method.env is not None and os.environ.get(bf.REEXEC) != "1":
            extra = method.env(ctx)
            if extra:
                sys.stdout.flush()
                os.execve(sys.executable, [sys.executable, *sys.argv],
                          {**os.environ, **extra, bf.REEXEC: "1"})
        if spec.get("trace"):
            import logging

            logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                                format="%(relativeCreated).1f ms %(name)s %(message)s")
        torch, dev = bf.cuda_device(ctx.device)
        ctx.device = str(dev)
        if method.setup is not None:
            method.setup(ctx)
    except ModuleNotFoundError as exc:
        emit(status="not installed", error=str(exc))
        return bf.NOT_INSTALLED
    with open(spec["reference"]) as f:
        ref = json.load(f)["tensors"]
    server = Server(torch, ref, dev)
    pinned = None
    if method.stream is None:
        pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True).fill_(7)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    reserved = torch.cuda.memory_reserved(dev)
    path = ""
    with PeakSampler(torch, dev) as sampler:
        started = time.perf_counter()
        if pinned is not None:
            nbytes = server.fill_from(pinned)
        else:
            assert method.stream is not None
            pairs, end = method.stream(ctx)
            for tname, tensor in pairs:
                server.load(tname, tensor)
                del tensor
            path = end()
            nbytes = sum(t["bytes"] for t in ref.values())
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - started
    result.update(status="ok", bytes=nbytes, seconds=seconds,
                  **{"GB/s": nbytes / 1e9 / seconds if seconds > 0 else 0.0},
                  tensors=len(server.loaded), path=path, budget=spec["budget"],
                  **{"peak torch": torch.cuda.max_memory_allocated(dev) - base,
                     "peak reserved": torch.cuda.max_memory_reserved(dev) - reserved,
                     "peak device": sampler.peak - sampler.base})
    if "exported" in ctx.state:
        result["peak exported"] = ctx.state["exported"]["peak"]
    if "slots" in ctx.state:
        result["slots"] = ctx.state["slots"]
    if pinned is not None:
        emit(exact="n/a", mismatch=None)
        return 0
    missing = sorted(set(ref) - server.loaded)
    if missing:
        emit(exact=False, mismatch=f"{missing[0]}: never loaded ({len(missing)} missing)")
        return 0
    mismatch = bf.compare(server.views(), ref, dev)
    emit(exact=mismatch is None, mismatch=mismatch)
    return 0


# --- orchestration (bench_fresh's, with this worker) -----------------------------------

def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    import make_model

    src = os.path.join(args.work, f"model-{args.shape}")
    if not os.path.exists(os.path.join(src, "config.json")):
        t = time.perf_counter()
        info = make_model.make(int(args.size_gb * 1e9), src, shape=args.shape)
        bf.log(f"generated {info} in {time.perf_counter() - t:.1f} s")
    return src


def summarize(labels: list[str], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = bf.summarize(labels, records)
    for row in rows:
        ok = [r for r in records if r["method"] == row["method"] and r["status"] == "ok"]
        for key in PEAKS:
            vals = [r[key] for r in ok if key in r]
            row[f"max {key} MiB"] = round(max(vals) / 2**20, 1) if vals else None
        row["paths"] = sorted({r.get("path", "") for r in ok} - {""})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [bf.render_table(rows), "", "| method | max peak torch MiB | "
             "max peak reserved MiB | max peak device MiB | max peak exported MiB | path |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['max peak torch MiB']} | "
                     f"{r['max peak reserved MiB']} | "
                     f"{r['max peak device MiB']} | {r['max peak exported MiB']} | "
                     f"{','.join(r['paths'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="methods: " + ", ".join(METHODS))
    p.add_argument("--shape", choices=("llama3-8b", "synthetic"), default="llama3-8b")
    p.add_argument("--size-gb", type=float, default=14.7, help="for --shape synthetic")
    p.add_argument("--work", default="/dev/shm/csi-pmem-vllm")
    p.add_argument("--model", help="use this safetensors directory instead")
    p.add_argument("--volume", help="the volume file for ours (default WORK/volume.img)")
    p.add_argument("--methods", default="all")
    p.add_argument("--budget", default="1Gi",
                   help="extra device memory for ours (a quantity, default 1Gi)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--budget-s", type=float)
    p.add_argument("--json")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--trace", action="store_true",
                   help="log the loader's debug lines (each batch's request, allocation "
                        "and copies, in ms) to each worker's stderr in WORK/logs")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--make-reference", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, json.loads(args.spec))
    if args.make_reference:
        return bf.reference_main(json.loads(args.spec), args.make_reference)
    from csi_pmem.sizes import parse_quantity

    names = list(METHODS) if args.methods == "all" else [
        m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    os.makedirs(os.path.join(args.work, "logs"), exist_ok=True)
    logs = os.path.join(args.work, "logs")
    src = model_dir(args)
    files = sorted(str(f) for f in Path(src).glob("*.safetensors"))
    nbytes, ntensors = bf.tensor_bytes(files)
    args.volume = [args.volume] if args.volume else None
    volumes = bf.stage_volumes(args, src) if any(METHODS[n].volume for n in names) else []
    common = {"files": files, "device": args.device, "nbytes": nbytes,
              "scratch": args.work, "budget": parse_quantity(args.budget),
              "trace": args.trace,
              "reference": os.path.join(args.work, f"reference-{args.shape}.json")}
    if not os.path.exists(common["reference"]):
        ref_env = bf.make_reference(common, args, logs, script=__file__)
    else:
        with open(common["reference"]) as f:
            ref_env = json.load(f)["env"]
    env = bf.environment(args, src, volumes, ref_env)
    bf.log(f"model {nbytes / 1e9:.2f} GB, {ntensors} tensors in {len(files)} files; {env}")
    with contextlib.ExitStack() as stack:
        node_dir = None
        if any(METHODS[n].node for n in names):
            from csi_pmem.driver.standalone import published

            node_dir = stack.enter_context(published(volumes[0],
                                                     os.path.join(args.work, "published")))
        entries = [(n, n, node_dir if METHODS[n].node else
                    volumes[0] if METHODS[n].volume else None) for n in names]
        labels = [e[0] for e in entries]

        def save(records: list[dict[str, Any]], done: int) -> None:
            if not args.json:
                return
            rows = summarize(labels, records)
            with open(args.json + ".tmp", "w") as f:
                json.dump({"environment": env, "model": {"dir": src, "bytes": nbytes,
                                                         "tensors": ntensors,
                                                         "shape": args.shape},
                           "budget": common["budget"], "methods": labels,
                           "rounds_asked": args.rounds, "rounds_done": done,
                           "rounds": records, "summary": rows, "table": render(rows)},
                          f, indent=1)
            os.replace(args.json + ".tmp", args.json)

        records = bf.run_rounds(entries, args.rounds, lambda label, base, vol, rnd: bf.measure(
            label, base, vol, rnd, common, args, logs, script=__file__, keys=EXTRA_KEYS),
            on_round=save, budget_s=args.budget_s)
    rows = summarize(labels, records)
    print(f"\n{env.get('gpu', '?')}, torch {env.get('torch', '?')}: model "
          f"{nbytes / 1e9:.2f} GB, {ntensors} tensors, vLLM-shaped, a fresh process each\n")
    print(render(rows))
    bad = [r for r in records if r["status"] not in ("ok", "not installed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
