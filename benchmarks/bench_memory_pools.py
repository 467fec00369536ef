#!/usr/bin/env python3
"""CreateVolume on the memory back end's DRAM pools, against memset of the same size.

Why: a memory pool allocates every page of a volume at CreateVolume (hugetlbfs also
clears them there, tmpfs at each page's first use), so that a pod maps pages that
exist, on their node, and is charged for none of them. That moves the cost of first
touch to the provisioner's call, and an operator sizing a node wants to know what a
16 GiB volume costs there. The yardstick is
what the same bytes cost any process: memset of a fresh anonymous mapping of the same
size (its page faults, the kernel's zeroing and the writes), in the same run.

What is measured: client-side wall time of CreateVolume (gRPC over a unix socket to a
real ``csi-pmem serve --backend memory`` process, which mounts a tmpfs per pool with
``mpol=bind``; hugetlbfs pools where ``--fs`` asks for them and the node has reserved
the huge pages), for each ``--sizes`` entry, ``--rounds`` times, interleaved with memset;
each volume is deleted (not timed) before the next. Prints the medians and bests, and
the NUMA layout (``numactl -H`` when installed), and writes ``--json``.

Needs root (the pools are mounts). Everything it creates is removed at the end.
``--reserve`` (hugetlbfs) reserves node 0's huge pages for the pool before the driver
starts and before each create, and gives them back after each delete, so that the
memset of the same size has the memory: a 24 GiB host cannot hold 16 GiB of reserved
pages beside a 16 GiB memset. The reserving is not timed.

Usage: benchmarks/bench_memory_pools.py [--sizes 1Gi,4Gi] [--rounds 3] [--fs tmpfs]
                                        [--pages 2M] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import bench_driver as bd  # noqa: E402

from csi_pmem.sizes import parse_quantity  # noqa: E402

MADV_HUGEPAGE = 14


class MemoryDriver(bd.DriverProcess):
    """``csi-pmem serve --backend memory`` with one pool on NUMA node 0."""

    def __init__(self, base: Path, pool: int, fs: str, pages: str):
        super().__init__(base, base / "memory", f"0={pool}", "warning")
        self.fs, self.pages = fs, pages

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.socket}", "--node-id", "bench-node",
                "--state-dir", str(self.state), "--kubelet-dir", str(self.kubelet),
                "--backend", "memory", "--memory-pools", self.regions,
                "--memory-root", str(self.pool_root), "--memory-fs", self.fs,
                "--memory-pages", self.pages, "--log-level", self.log_level]


def memset_seconds(size: int, huge: bool) -> float:
    """A fresh anonymous mapping of ``size`` bytes written whole, then unmapped."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(MADV_HUGEPAGE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        t0 = time.perf_counter()
        ctypes.memset(addr, 0x5A, size)
        seconds = time.perf_counter() - t0
        del addr
        return seconds
    finally:
        with contextlib.suppress(BufferError):
            m.close()


class Reserve:
    """Node 0's reserved huge pages of ``pages`` size, set and given back (``--reserve``)."""

    def __init__(self, pages: str, nbytes: int):
        kib = {"2M": 2048, "1G": 1048576}[pages]
        self.path = Path(f"/sys/devices/system/node/node0/hugepages/hugepages-{kib}kB/"
                         "nr_hugepages")
        self.count = -(-nbytes // (kib * 1024))
        self.before = int(self.path.read_text())

    def take(self) -> None:
        self.path.write_text(str(self.before + self.count))
        got = int(self.path.read_text())
        if got < self.before + self.count:
            self.give_back()
            raise SystemExit(f"bench_memory_pools: node 0 reserved {got - self.before} of "
                             f"the {self.count} huge pages asked ({self.path})")

    def give_back(self) -> None:
        self.path.write_text(str(self.before))


def mapping_facts(path: str) -> dict:
    """What a process that maps the volume's file gets: the kernel's page size for the
    mapping and its pages per NUMA node (``/proc/self/smaps``, ``numa_maps``), each
    page read once. Why: the pool's page size is a promise the pod's mapping must
    keep (tmpfs ``huge=always`` falls back to 4 KiB pages where it cannot get 2 MiB)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        for off in range(0, size, 4096):
            buf[off]  # the read maps the page
        facts: dict = {"bytes": size}
        lines = Path("/proc/self/smaps").read_text().splitlines()
        for i, line in enumerate(lines):
            if line.endswith(" " + path) or line.endswith(" " + os.path.realpath(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if hi - lo != size:
                    continue
                for field in lines[i + 1:i + 30]:
                    key, _, value = field.partition(":")
                    # tmpfs's 2 MiB pages show as ShmemPmdMapped (KernelPageSize
                    # stays 4 kB there); hugetlbfs's in KernelPageSize.
                    if key in ("KernelPageSize", "Rss", "ShmemPmdMapped", "FilePmdMapped",
                               "Shared_Hugetlb"):  # hugetlbfs pages are not in Rss
                        facts[key + " kB"] = int(value.split()[0])
                    if key == "VmFlags":
                        break
                for entry in Path("/proc/self/numa_maps").read_text().splitlines():
                    if entry.startswith(f"{lo:x} "):
                        fields = dict(w.split("=", 1) for w in entry.split()[1:]
                                      if "=" in w)
                        page = int(fields.get("kernelpagesize_kB", 4))  # N<k> counts these
                        facts["numa_maps MiB"] = {
                            k: int(v) * page // 1024 for k, v in fields.items()
                            if k.startswith("N") and k[1:].isdigit()}
                break
        return facts
    finally:
        buf.close()


def numa_layout() -> str:
    if shutil.which("numactl") is None:
        nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        return f"numactl not installed; NUMA nodes: {', '.join(nodes)}"
    out = subprocess.run(["numactl", "-H"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


def run(args: argparse.Namespace) -> dict:
    sizes = [(s, parse_quantity(s)) for s in args.sizes.split(",")]
    largest = max(n for _, n in sizes)
    # Room for the largest and its metadata (a 64th of the volume, 2 MiB aligned: 272 MiB
    # for 16 GiB, so a flat 256 MiB was too little there).
    # hugetlbfs pools hold whole pages, so on 1G pages the metadata takes a page more.
    page = {"4k": 4096, "2M": 2**21, "1G": 2**30}[args.pages]
    pool = -(-(largest + max(256 * 2**20, largest // 32)) // page) * page
    rows: dict[str, dict[str, list[float]]] = {s: {"create": [], "memset": []}
                                               for s, _ in sizes}
    mapped: dict[str, dict] = {}
    base = Path(tempfile.mkdtemp(prefix="csi-pmem-bench-mem-"))
    drv = MemoryDriver(base, pool, args.fs, args.pages)
    reserve = Reserve(args.pages, pool) if args.reserve else None
    try:
        if reserve is not None:
            reserve.take()
        drv.start()
        for rnd in range(args.rounds):
            for label, size in sizes:
                if reserve is not None:
                    reserve.take()
                t0 = time.perf_counter()
                vid = drv.create(f"bench-{rnd}-{label}", size,
                                 {"numaNode": "0", "eraseOnDelete": "false"})
                rows[label]["create"].append(time.perf_counter() - t0)
                if rnd == 0:  # not timed
                    mapped[label] = mapping_facts(drv.contexts[vid]["device"])
                drv.delete(vid)
                if reserve is not None:
                    reserve.give_back()
                rows[label]["memset"].append(memset_seconds(size, args.pages != "4k"))
    finally:
        drv.stop()
        if reserve is not None:
            reserve.give_back()
        with contextlib.suppress(OSError):
            for mnt in sorted((base / "memory").glob("region*"), reverse=True):
                subprocess.run(["umount", str(mnt)], timeout=60, check=False,
                               capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
    table = []
    for label, size in sizes:
        c, m = rows[label]["create"], rows[label]["memset"]
        table.append({"size": label, "bytes": size,
                      "create median s": statistics.median(c), "create best s": min(c),
                      "memset median s": statistics.median(m), "memset best s": min(m),
                      "create / memset (medians)": statistics.median(c) / statistics.median(m),
                      "create GB/s (median)": size / 1e9 / statistics.median(c),
                      "mapping": mapped.get(label), "rounds": {"create": c, "memset": m}})
    return {"fs": args.fs, "pages": args.pages, "rounds": args.rounds,
            "reserve": bool(args.reserve),
            "host": {"cpus": os.cpu_count(), "kernel": os.uname().release,
                     "numa": numa_layout()}, "table": table}


def render(doc: dict) -> str:
    lines = [doc["host"]["numa"], "",
             f"memory pools: {doc['fs']}, pages {doc['pages']}, {doc['rounds']} rounds",
             "| size | CreateVolume median s | best s | memset median s | best s | "
             "create / memset | create GB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["table"]:
        lines.append(f"| {r['size']} | {r['create median s']:.3f} | {r['create best s']:.3f} "
                     f"| {r['memset median s']:.3f} | {r['memset best s']:.3f} | "
                     f"{r['create / memset (medians)']:.2f} | {r['create GB/s (median)']:.2f} |")
    for r in doc["table"]:
        m = r.get("mapping") or {}
        lines.append(f"a {r['size']} volume mapped: KernelPageSize {m.get('KernelPageSize kB')}"
                     f" kB, 2 MiB-mapped (tmpfs) {m.get('ShmemPmdMapped kB')} kB of "
                     f"{m.get('Rss kB')} kB resident, hugetlb {m.get('Shared_Hugetlb kB')} "
                     f"kB, pages per node (MiB) "
                     f"{m.get('numa_maps MiB')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1Gi,4Gi")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fs", choices=("tmpfs", "hugetlbfs"), default="tmpfs")
    ap.add_argument("--pages", choices=("4k", "2M", "1G"), default="2M")
    ap.add_argument("--reserve", action="store_true",
                    help="hugetlbfs: reserve node 0's pages around each create only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.reserve and (args.fs != "hugetlbfs" or args.pages == "4k"):
        ap.error("--reserve is for hugetlbfs pools of 2M or 1G pages")
    if os.geteuid() != 0:
        print("bench_memory_pools: needs root (the pools are mounts)", file=sys.stderr)
        return 2
    doc = run(args)
    print(render(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
