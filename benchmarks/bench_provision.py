#!/usr/bin/env python3
"""CreateVolume and DeleteVolume against volume size, and the erase against memset.

Why (issue 17): provisioning used to zero every new namespace and zero it again on
delete, so both RPCs grew with the volume at the media's write bandwidth. Now each
byte is erased once (on delete, in the background) and a create in a clean region
writes nothing. This benchmark shows it against a real ``csi-pmem serve`` process on
the emulated back end in ``--emulated-free-space reuse`` mode (pools on tmpfs; a
destroyed namespace's bytes are handed out again, as on persistent memory):

  clean        eraseOnDelete=true, the region scrubbed clean at start-up:
               CreateVolume, DeleteVolume, and DeleteVolume -> space back in
               GetCapacity (the background erase), for each size
  clean/wait0  the same with --delete-wait-seconds 0 (DeleteVolume never waits)
  dirty        eraseOnDelete=false and --scrub off: the region stays dirty, so every
               CreateVolume zeroes its namespace (what the next tenant pays)
  erase        on the backing file of one volume of the largest size, in this process:
               ctypes.memset with N threads on a mapping made once (warm: its pages are
               mapped already), the same on a fresh mapping each time (what any erase
               of a device must do: the emulated back end's 4 KiB tmpfs pages fault in,
               a devdax device's 2 MiB pages hardly), the driver's erase (zero_fd:
               libpmem non-temporal stores + sampled verification, its own mapping),
               zero_fd with full / no verification, and the erase's stores alone on
               the warm mapping; modes alternate each repetition
  share        CreateVolume/DeleteVolume on an in-process Driver whose back end is
               timed: how much of each call is the back end (on ndctl: the ndctl
               execs) and how much is the driver's own work

``--ndctl-share STATE_DIR`` measures only the share, on real regions through ndctl (the
VM tier runs it in the guest, e2e/vm/test_guest.py): the ndctl execs are timed in the
runner, so "ndctl" is the commands' wall time and "ours" is everything else but the
erase (parsing, records and their fsyncs, the ledger). STATE_DIR is a stopped driver's
state directory, so that its regions' clean records apply; never run it next to a
running driver.

Usage: benchmarks/bench_provision.py [--sizes 64Mi,1Gi,8Gi] [--reps 5] [--pool-dir /dev/shm]
                                     [--json] [--quick]
       benchmarks/bench_provision.py --ndctl-share STATE_DIR [--sizes 64Mi] [--reps 5]
Needs about the largest size times 1.2 of free tmpfs space.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_driver  # noqa: E402
from bench_driver import ERASE_OFF, ERASE_ON, Tracker, cleanup, log, machine  # noqa: E402

from csi_pmem.driver.erasing import erase  # noqa: E402
from csi_pmem.driver.erasing.erase import DEFAULT_CHUNK, default_threads, zero_fd  # noqa: E402
from csi_pmem.driver.host.runner import Runner  # noqa: E402
from csi_pmem.sizes import REGION_ALIGN, allocation_for, format_bytes, parse_quantity  # noqa: E402

GiB = 1 << 30


class Driver(bench_driver.DriverProcess):
    """bench_driver's process with extra flags."""

    def __init__(self, *args, extra: list[str], **kw):
        super().__init__(*args, **kw)
        self.extra = extra

    def argv(self) -> list[str]:
        return [*super().argv(), "--emulated-free-space", "reuse", *self.extra]

    def region_clean(self) -> bool:
        try:
            return json.loads((self.state / "regions" / "region0.json").read_text())["clean"]
        except (OSError, ValueError, KeyError):
            return False


def wait_for(check, what: str, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.002)
    return time.perf_counter() - t0


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def region_bytes(largest: int) -> int:
    size = allocation_for(largest, 2 << 20, REGION_ALIGN)[0]
    return -(-int(size * 1.05) // GiB) * GiB


def phase(d: Driver, tr: Tracker, sizes: list[int], reps: int, params: dict,
          name: str) -> dict:
    out = {}
    full = d.capacity()
    for size in sizes:
        create, delete, back = [], [], []
        for i in range(reps + 1):  # the first round warms up
            t0 = time.perf_counter()
            vid = tr.create(d, f"{name}-{size}-{i}", size, params)
            t1 = time.perf_counter()
            tr.delete(d, vid)
            t2 = time.perf_counter()
            wait_for(lambda: d.capacity() == full, "the space to come back")
            t3 = time.perf_counter()
            if i:
                create.append(t1 - t0)
                delete.append(t2 - t1)
                back.append(t3 - t1)
        out[format_bytes(size)] = {"create_p50_ms": p50(create), "delete_p50_ms": p50(delete),
                                   "space_back_p50_ms": p50(back), "n": reps}
        log(f"{name} {format_bytes(size)}: create {p50(create):.1f} ms, delete "
            f"{p50(delete):.1f} ms, space back {p50(back):.1f} ms")
    return out


def memset_mt(base: int, length: int, threads: int, fn=None) -> None:
    fn = fn or (lambda addr, size: ctypes.memset(addr, 0, size))
    chunks = [(o, min(DEFAULT_CHUNK, length - o)) for o in range(0, length, DEFAULT_CHUNK)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda c: fn(base + c[0], c[1]), chunks))


def fresh_memset(fd: int, length: int, threads: int) -> None:
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        memset_mt(ctypes.addressof(anchor), length, threads)
    finally:
        del anchor
        mm.close()


def erase_vs_memset(path: str, length: int, threads: int, reps: int) -> dict:
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    modes = {
        f"memset/{threads}": lambda: memset_mt(base, length, threads),
        f"mmap+memset/{threads}": lambda: fresh_memset(fd, length, threads),
        # The erase's own stores (erase._zero_range: libpmem non-temporal pmem_memset)
        # on the warm mapping: the stores alone, without mapping and faulting.
        "erase stores (warm)": lambda: memset_mt(base, length, threads, erase._zero_range),
        "erase (sampled verify)": lambda: zero_fd(fd, length, threads=threads,
                                                  verify="sampled"),
        "erase (full verify)": lambda: zero_fd(fd, length, threads=threads, verify="full"),
        "erase (no verify)": lambda: zero_fd(fd, length, threads=threads, verify="off"),
    }
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    try:
        ctypes.memset(base, 0x5A, length)  # every page present, as in a used volume
        for fn in modes.values():
            fn()
        for rep in range(reps):
            order = list(modes)[rep % len(modes):] + list(modes)[:rep % len(modes)]
            for m in order:
                ctypes.memset(base, 0x5A, min(length, 1 << 20))  # something to erase
                t0 = time.perf_counter()
                modes[m]()
                seconds[m].append(time.perf_counter() - t0)
    finally:
        del anchor
        mm.close()
        os.close(fd)
    res = {m: {"gb_s": length / statistics.median(ts) / 1e9, "median_ms": p50(ts)}
           for m, ts in seconds.items()}
    ref = res[f"memset/{threads}"]["gb_s"]
    fresh = res[f"mmap+memset/{threads}"]["gb_s"]
    for m in res:
        res[m]["vs_memset"] = res[m]["gb_s"] / ref
        res[m]["vs_fresh_memset"] = res[m]["gb_s"] / fresh
    return {"bytes": length, "threads": threads, "reps": reps, "modes": res}


class TimedBackend:
    """Wraps a back end and adds up the seconds spent in it."""

    def __init__(self, inner) -> None:
        self._inner, self.seconds = inner, 0.0

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return value(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def share(pool_dir: Path, size: int, reps: int) -> dict:
    """In-process Driver over a timed emulated back end (clean region, erase on)."""
    from csi_pmem.driver.backends.emulated import EmulatedBackend

    with tempfile.TemporaryDirectory(dir=pool_dir) as base:
        inner = EmulatedBackend(Path(base) / "pools", {0: region_bytes(size)},
                                free_space="reuse")
        backend = TimedBackend(inner)
        return share_on(backend, backend, Path(base) / "state", size, reps, {"numaNode": "0"},
                        scrub=True)


class TimedRunner(Runner):
    """The driver's runner, adding up the wall time and count of the commands."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.calls = 0.0, 0

    def run(self, argv, timeout=60.0, check=True, input=None):
        t0 = time.perf_counter()
        try:
            return super().run(argv, timeout=timeout, check=check, input=input)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def ndctl_share(state_dir: Path, size: int, reps: int, numa: str = "0") -> dict:
    """The share on real regions through ndctl (see the module docstring)."""
    from csi_pmem.driver.backends.ndctl import NdctlBackend

    runner = TimedRunner()
    backend = NdctlBackend(runner=runner)
    return share_on(backend, runner, state_dir, size, reps, {"numaNode": numa}, scrub=False)


def share_on(backend, timer, state_dir: Path, size: int, reps: int, params: dict,
             scrub: bool) -> dict:
    """CreateVolume then DeleteVolume (waiting for its erase), ``reps`` times after one
    warm-up: the call's wall time, ``timer.seconds`` (the back end, or ndctl) and the
    erase, per call (medians)."""
    from csi_pmem.driver.config import DriverConfig
    from csi_pmem.driver.core import Driver as Core
    from csi_pmem.driver.daxsock import DaxSocketServer
    from csi_pmem.driver.params import parse
    from csi_pmem.driver.state import StateStore

    store = StateStore(state_dir)
    erased = [0.0]
    core = Core(DriverConfig("bench", "n", str(state_dir), delete_wait=600, scrub=scrub),
                backend, store, DaxSocketServer(),
                on_erase=lambda nbytes, seconds: erased.__setitem__(0, erased[0] + seconds))
    try:
        core.reconcile()
        pools = [p.name for p in backend.pools()
                 if params.get("numaNode") in (None, str(p.numa_node))]
        if scrub:
            wait_for(lambda: all(core.ledger.is_clean(p) for p in pools), "a clean region")
        elif not all(core.ledger.is_clean(p) for p in pools):
            raise RuntimeError(f"{', '.join(pools)} not clean in {state_dir}: creates would "
                               "zero, which is not what this measures; let the driver scrub")
        wanted = parse(params)
        rows: dict[str, list] = {"CreateVolume": [], "DeleteVolume": []}
        zeroed = 0
        for i in range(reps + 1):
            for op in rows:
                timer.seconds, erased[0] = 0.0, 0.0
                calls = getattr(timer, "calls", 0)
                t0 = time.perf_counter()
                if op == "CreateVolume":
                    rec = core.create_volume(f"share-{os.getpid()}-{i}", size, 0, wanted)
                else:
                    core.delete_volume(rec.id)  # waits for the erase (delete_wait)
                total = time.perf_counter() - t0
                zeroed += op == "CreateVolume" and erased[0] > 0
                if i:
                    rows[op].append((total, timer.seconds, erased[0],
                                     getattr(timer, "calls", 0) - calls))
        out: dict = {}
        for op, samples in rows.items():
            total, back, erase, execs = (statistics.median(x[k] for x in samples)
                                         for k in range(4))
            out[op] = {"total_ms": total * 1000, "backend_ms": back * 1000,
                       "erase_ms": erase * 1000, "ours_ms": (total - back - erase) * 1000,
                       "backend_share": back / total, "ours_share": (total - back - erase) / total,
                       "execs": execs, "n": len(samples)}
        out["zeroed_creates"] = zeroed  # 0 on a clean region: creates wrote nothing
        return out
    finally:
        core.close()


def run(a: argparse.Namespace) -> dict:
    sizes = [parse_quantity(s) for s in a.sizes.split(",")]
    threads = default_threads()
    pool_root = Path(tempfile.mkdtemp(prefix="bench-provision-", dir=a.pool_dir))
    regions = f"0={region_bytes(max(sizes)) >> 20}Mi"
    report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(), "config": {"sizes": a.sizes, "reps": a.reps,
                                                    "regions": regions, "quick": a.quick,
                                                    "pool_dir": a.pool_dir,
                                                    "erase_threads": threads}}
    configs = {"clean": ([], ERASE_ON), "clean/wait0": (["--delete-wait-seconds", "0"], ERASE_ON),
               "dirty": (["--scrub", "off"], ERASE_OFF)}
    report["phases"] = {}
    try:
        for name, (extra, params) in configs.items():
            work = Path(tempfile.mkdtemp(prefix="bench-provision-work-"))
            pools = pool_root / name.replace("/", "-")
            d = Driver(work, pools, regions, "info", extra=extra)
            tr = Tracker()
            try:
                d.start()
                if name != "dirty":
                    wait_for(d.region_clean, "the start-up scrub")
                report["phases"][name] = phase(d, tr, sizes, a.reps, params, name)
                if name == "clean":
                    vid = tr.create(d, "erase-vs-memset", max(sizes), ERASE_ON)
                    path = next(str(p) for p in (pools / "region0").iterdir()
                                if p.name.startswith(vid))
                    report["erase"] = erase_vs_memset(path, max(sizes), threads,
                                                      max(3, a.reps))
                    tr.delete(d, vid)
            finally:
                cleanup(d, tr, [work, pools])
        report["share"] = share(pool_root, sizes[0], a.reps)
    finally:
        cleanup(None, Tracker(), [pool_root])
    return report


def print_report(r: dict) -> None:
    m, c = r["machine"], r["config"]
    print(f"csi-pmem provisioning benchmark, {r['date']}")
    print(f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB RAM, "
          f"Linux {m['kernel']}; emulated back end, reuse mode, pools in {c['pool_dir']}, "
          f"region {c['regions']}, {c['erase_threads']} erase threads"
          f"{', QUICK' if c['quick'] else ''}")
    print()
    head = f"{'phase':<12} {'size':>8} {'Create p50':>11} {'Delete p50':>11} {'space back':>11}"
    print(head + "   (ms, n=" + str(c["reps"]) + ")")
    print("-" * len(head))
    for name, rows in r["phases"].items():
        for size, v in rows.items():
            print(f"{name:<12} {size:>8} {v['create_p50_ms']:>11.1f} {v['delete_p50_ms']:>11.1f} "
                  f"{v['space_back_p50_ms']:>11.1f}")
    e = r["erase"]
    print()
    print(f"erase vs memset on one mapping of {format_bytes(e['bytes'])} "
          f"({e['threads']} threads, median of {e['reps']}):")
    for mode, v in e["modes"].items():
        print(f"  {mode:<24} {v['gb_s']:>7.2f} GB/s  {v['vs_memset']:>5.2f}x memset (warm), "
              f"{v['vs_fresh_memset']:>5.2f}x mmap+memset")
    print()
    print("share of the driver's time in the back end (in-process, emulated, "
          f"{c['sizes'].split(',')[0]}):")
    print_share(r["share"], "back end")


def print_share(share: dict, what: str) -> None:
    for op, v in share.items():
        if not isinstance(v, dict):
            continue
        execs = f" in {v['execs']:.0f} execs" if v.get("execs") else ""
        print(f"  {op:<13} total {v['total_ms']:8.2f} ms: {what} {v['backend_ms']:8.2f}{execs} "
              f"({v['backend_share']:.0%}), erase {v['erase_ms']:7.2f}, driver's own work "
              f"{v['ours_ms']:7.2f} ms ({v['ours_share']:.0%})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64Mi,1Gi,8Gi")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pool-dir", default=bench_driver.default_pool_dir())
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: 16Mi,64Mi, 2 reps")
    p.add_argument("--ndctl-share", metavar="STATE_DIR", type=Path,
                   help="only the share, on real regions through ndctl (module docstring)")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.reps = "16Mi,64Mi", 2
    if a.ndctl_share:
        size = parse_quantity(a.sizes.split(",")[0])
        r = ndctl_share(a.ndctl_share, size, a.reps)
        if a.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"share of the driver's time in ndctl ({format_bytes(size)}, n={a.reps}):")
            print_share(r, "ndctl")
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        r = run(a)
        print(json.dumps(r, indent=2) if a.json else "", end="")
        if not a.json:
            print_report(r)
        return 0
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
