"""The wanted revision: ``--revision``, or a fingerprint of the source tree.

Why sampled: re-hashing a 100 GB source on every pod start costs minutes on network
storage, and mtimes change with every copy (what the sample reads and what it misses:
the package docstring, :mod:`csi_pmem.loader.sidecar`).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

from csi_pmem.loader.sidecar.events import SourceError
from csi_pmem.sizes import MiB
from csi_pmem.weights import checksum
from csi_pmem.weights.layout import KIND_SAFETENSORS, SourceFile
from csi_pmem.weights.stformat import read_header_file

SAMPLE_BYTES = 4096
SPREAD_SAMPLES = 32
MAX_TENSOR_SAMPLES = 1024
WHOLE_AUX_LIMIT = MiB  # auxiliary files up to this size are hashed whole

FINGERPRINTS = ("sample", "full")


def _evenly(items: list[int], k: int) -> list[int]:
    if len(items) <= k:
        return items
    return [items[i * (len(items) - 1) // (k - 1)] for i in range(k)]


def _sample_offsets(src: SourceFile) -> tuple[int, list[int]]:
    """(bytes hashed whole from the start, offsets of the 4 KiB samples after them)."""
    if src.kind != KIND_SAFETENSORS:
        if src.size <= WHOLE_AUX_LIMIT:
            return src.size, []
        head = 0
        starts: list[int] = []
    else:
        header = read_header_file(src.path)
        head = header.data_start
        starts = _evenly(sorted({t.offset for t in header.tensors.values()
                                 if t.offset < src.size}), MAX_TENSOR_SAMPLES)
    span = max(src.size - head - SAMPLE_BYTES, 0)
    spread = [head + span * i // (SPREAD_SAMPLES - 1) for i in range(SPREAD_SAMPLES)]
    tail = [max(src.size - SAMPLE_BYTES, head)]
    return head, sorted(set(starts + spread + tail) - {src.size})


def _read_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise SourceError(f"{path} became shorter while it was being fingerprinted")
    return data


def _file_digest(src: SourceFile, mode: str) -> str:
    h = hashlib.sha256(f"{src.name}\0{src.size}\0{src.kind}\0".encode())
    fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        samples: list[int]
        if mode == "full":
            head, samples = src.size, []
        else:
            head, samples = _sample_offsets(src)
        for off in range(0, head, 16 * MiB):
            h.update(_read_exact(fd, min(16 * MiB, head - off), off, src.path))
        for off in samples:
            h.update(off.to_bytes(8, "little"))
            h.update(_read_exact(fd, min(SAMPLE_BYTES, src.size - off), off, src.path))
    finally:
        os.close(fd)
    return h.hexdigest()


def fingerprint(sources: list[SourceFile], mode: str = "sample",
                threads: int | None = None) -> str:
    """A revision string for a source tree: ``fp-…`` (sampled) or ``sha-…`` (every byte).

    Independent of mtimes and of where the tree lives, so a copy of the same model
    elsewhere gets the same revision (what it reads: the package docstring,
    :mod:`csi_pmem.loader.sidecar`).
    """
    if mode not in FINGERPRINTS:
        raise ValueError(f"fingerprint mode {mode!r}; use one of {FINGERPRINTS}")
    ordered = sorted(sources, key=lambda s: s.name)
    with ThreadPoolExecutor(threads or checksum.default_threads(),
                            thread_name_prefix="fingerprint") as pool:
        digests = list(pool.map(lambda s: _file_digest(s, mode), ordered))
    total = hashlib.sha256(f"csi-pmem-fingerprint-1 {mode}\n".encode())
    for d in digests:
        total.update(d.encode())
    return ("fp-" if mode == "sample" else "sha-") + total.hexdigest()[:20]
