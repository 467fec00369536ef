#!/usr/bin/env python3
"""How fast a fresh process's worker threads can read a volume file into host buffers,
by the way they read it: memcpy from a new mapping, memcpy after populating each chunk's
page tables (MADV_POPULATE_READ), or pread() from the file.

Why: the in-pod GPU path copies each chunk from the volume's mapping into a pinned
bounce buffer. A restarted pod maps the volume afresh, so each of those memcpys first
faults the source's pages in. On a device-dax namespace or a 2 MiB-page file that is
one fault per 2 MiB; on a 4 KiB-page file (tmpfs, an fsdax file system without huge
alignment) it is one fault per 4 KiB, or per fault-around window (64 KiB by default).
This measures that cost without a GPU, so that the loader's choice rests on numbers from
the host it runs on. Each method runs in its own fresh process (as a restarted pod
would), rounds interleaved; no GPU, no torch.

  python3 benchmarks/bench_source_faults.py FILE [FILE...] --threads 12 --chunk-mib 4
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from csi_pmem.weights.mapping import buffer_address, libc
from csi_pmem.weights.volume import MADV_POPULATE_READ

METHODS = ("memcpy", "populate+memcpy", "pread")


def _worker_run(path: str, method: str, threads: int, chunk: int, buffers: int) -> float:
    """One fresh-process measurement: seconds to move the whole file."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    # The destination buffers are faulted in before the clock, as the loader's pinned
    # buffers are before their first use.
    dst = mmap.mmap(-1, buffers * chunk)
    dst.write(b"\0" * len(dst))
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    nchunks = (size + chunk - 1) // chunk
    next_chunk = [0]
    lock = threading.Lock()
    src = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) \
        if method != "pread" else None
    src_addr = buffer_address(src) if src is not None else 0
    madvise = libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def work(slot: int) -> None:
        my = dst_addr + (slot % buffers) * chunk
        target = memoryview(dst)[(slot % buffers) * chunk:(slot % buffers + 1) * chunk]
        while True:
            with lock:
                i = next_chunk[0]
                next_chunk[0] += 1
            if i >= nchunks:
                return
            off = i * chunk
            n = min(chunk, size - off)
            if method == "pread":
                if os.preadv(fd, [target[:n]], off) != n:  # a short read would flatter it
                    raise OSError(f"short read of {path} at {off}")
                continue
            if method == "populate+memcpy":
                madvise(src_addr + off, n, MADV_POPULATE_READ)
            ctypes.memmove(my, src_addr + off, n)

    start = time.perf_counter()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="files to read (their page size is the "
                    "file system's: tmpfs, huge tmpfs, an fsdax mount)")
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunk = args.chunk_mib << 20
    if args._one:
        seconds = _worker_run(args._one[0], args._one[1], args.threads, chunk, args.threads)
        print(json.dumps({"seconds": seconds}))
        return 0
    if not args.files:
        ap.error("name at least one file")
    methods = args.methods.split(",")
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for path in args.files:
            size = os.path.getsize(path)
            for method in methods:
                out = subprocess.run(
                    [sys.executable, __file__, "--threads", str(args.threads), "--chunk-mib",
                     str(args.chunk_mib), "--_one", path, method],
                    capture_output=True, text=True, timeout=300, check=True)
                gbps = size / json.loads(out.stdout)["seconds"] / 1e9
                results.setdefault(path, {}).setdefault(method, []).append(gbps)
    if args.json:
        print(json.dumps(results, indent=1))
    print(f"{os.cpu_count()} CPUs, {args.threads} threads, {args.chunk_mib} MiB chunks, "
          f"{args.rounds} rounds, a fresh process per load", file=sys.stderr)
    for path, by_method in results.items():
        for method, values in by_method.items():
            print(f"{path:40} {method:16} best {max(values):6.2f} GB/s  median "
                  f"{statistics.median(values):6.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
