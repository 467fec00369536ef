"""CPU-side throughput of the loader, shared by ``csi-pmem-weights bench`` and
``benchmarks/bench_loader.py``.

Why measure the CPU side alone: the GPU path can be no faster than its memcpy threads
fill pinned buffers, nor the CPU path faster than a reader can stream through the
views; these numbers say where a slow GPU load is lost without needing a GPU.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from csi_pmem.loader.api import start_load
from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu.pipeline import BouncePipeline
from csi_pmem.loader.model import ModelView
from csi_pmem.numa import node_cpus
from csi_pmem.sizes import MiB
from csi_pmem.weights import checksum
from csi_pmem.weights.mapping import buffer_address


@dataclass
class Result:
    name: str
    nbytes: int
    seconds: float
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "bytes": self.nbytes, "seconds": round(self.seconds, 6),
                "GB/s": round(self.gbps, 3), "note": self.note}


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


class _HostBackend:
    """Pinned-buffer stand-in: plain host buffers, a transfer that does nothing (the
    fill is what we measure) or copies into a host destination."""

    def __init__(self, nbuffers: int, size: int, dest: bytearray | None):
        self.buffers = [bytearray(size) for _ in range(nbuffers)]
        self.addresses = [buffer_address(b) for b in self.buffers]
        self.dest = dest
        self.dest_addr = buffer_address(dest) if dest is not None else 0

    def buffer_address(self, buf: int) -> int:
        return self.addresses[buf]

    def transfer(self, buf: int, chunk: planning.Chunk) -> None:
        if self.dest is not None:
            ctypes.memmove(self.dest_addr + chunk.dst, self.addresses[buf], chunk.nbytes)

    def wait(self, buf: int) -> None:
        pass


def run_cpu(view: ModelView, *, threads: int = 12, buffers: int = 24,
            buffer_size: int = 16 * MiB, repeat: int = 3) -> list[Result]:
    """Views, read-through, bounce fill, checksum verification, and a memcpy baseline."""
    import numpy as np

    selection = view.select()
    tensors = [t for ts in selection.values() for t in ts]
    total = sum(t.nbytes for t in tensors)
    results = []

    views_s = _best(lambda: start_load(view, "cpu", framework="numpy", verify=False)
                    .result(), repeat)
    results.append(Result("cpu views (no copy)", total, views_s,
                          f"{len(tensors)} tensors, zero-copy"))

    arrays = start_load(view, "cpu", framework="numpy", verify=False).result()
    out = np.empty(max((t.nbytes for t in tensors), default=0), dtype=np.uint8)

    def read_all() -> None:
        for a in arrays.values():
            flat = a.reshape(-1).view(np.uint8)
            np.copyto(out[:flat.size], flat)

    results.append(Result("cpu read-through, 1 thread", total, _best(read_all, repeat),
                          "np.copyto from each view"))

    cpus = node_cpus(view.volume.numa_node)
    nthreads = max(1, min(threads, len(cpus)))
    backend = _HostBackend(buffers, buffer_size, None)
    pipe = BouncePipeline(backend, buffers, buffer_size, nthreads, cpus=cpus)
    try:
        chunks: list[planning.Chunk] = []
        for i, ts in enumerate(selection.values()):
            placements, _ = planning.place(ts)
            chunks += planning.bounce_chunks(placements, buffer_size, i, len(chunks))
        fill_s = _best(lambda: pipe.run(chunks, view.volume.address, lambda c: None), repeat)
    finally:
        pipe.close()
    results.append(Result(f"bounce fill, {nthreads} threads", total, fill_s,
                          f"{buffers} x {buffer_size // MiB} MiB buffers (GPU path, host side)"))

    chunk_list = checksum.model_chunks(view.model, [view.file(f) for f in selection])
    verify_bytes = sum(c.length for c in chunk_list)
    verify_s = _best(lambda: checksum.verify_chunks(view.volume, chunk_list,
                                                    threads=nthreads), 1)
    results.append(Result(f"{view.model.algo} verify on the host, {nthreads} threads",
                          verify_bytes, verify_s))

    src = np.ones(min(total, 1 << 30) or 1, dtype=np.uint8)
    dst = np.empty_like(src)
    base_s = _best(lambda: np.copyto(dst, src), repeat)
    results.append(Result("numpy memcpy baseline, 1 thread", src.nbytes, base_s,
                          "anonymous memory to anonymous memory"))
    return results
