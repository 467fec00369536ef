"""A model's revision when none is given: a fingerprint of its content.

Why here, beside :mod:`.staging` and not in the sidecar: ``csi-pmem-weights stage`` and
the staging sidecar must name the same source the same way, or each copies again what
the other staged. Both record this fingerprint as the model's revision when no
``--revision`` is given, and both import it from here (the sidecar package imports
:mod:`.staging`, so staging could not import the sidecar's copy without a cycle).

Why sampled: re-hashing a 100 GB source on every pod start costs minutes on network
storage, and mtimes change with every copy or re-download. What the sample reads (file
names, sizes and kinds, every safetensors header, 4 KiB at the start of each tensor, 32
spread blocks and the tail of each file, small auxiliary files whole) and what it misses:
docs/sidecar.md. ``full`` hashes every byte.

The same digest can be taken of a staged copy (:func:`staged_fingerprint`), reading the
volume instead of the source: it is how a model staged without a recorded revision (by
earlier versions of ``stage``) is recognised as the source's content and adopted
without a copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from csi_pmem.loader.sources import SourceError, open_file
from csi_pmem.sizes import MiB
from csi_pmem.weights import checksum
from csi_pmem.weights.layout import KIND_SAFETENSORS, FileEntry, ModelEntry, SourceFile
from csi_pmem.weights.stformat import Header, parse_header, read_header
from csi_pmem.weights.volume import Volume

SAMPLE_BYTES = 4096
SPREAD_SAMPLES = 32
MAX_TENSOR_SAMPLES = 1024
WHOLE_AUX_LIMIT = MiB  # auxiliary files up to this size are hashed whole

FINGERPRINTS = ("sample", "full")

# (offset, length) -> exactly that many bytes of one file.
Reader = Callable[[int, int], bytes]
# -> (where the tensor data starts, tensor offsets), relative to the file.
Tensors = Callable[[], tuple[int, list[int]]]


def _evenly(items: list[int], k: int) -> list[int]:
    if len(items) <= k:
        return items
    return [items[i * (len(items) - 1) // (k - 1)] for i in range(k)]


def _sample_offsets(size: int, kind: str, tensors: Tensors) -> tuple[int, list[int]]:
    """(bytes hashed whole from the start, offsets of the 4 KiB samples after them)."""
    if kind != KIND_SAFETENSORS:
        if size <= WHOLE_AUX_LIMIT:
            return size, []
        head = 0
        starts: list[int] = []
    else:
        head, offsets = tensors()
        starts = _evenly(sorted({o for o in offsets if o < size}), MAX_TENSOR_SAMPLES)
    span = max(size - head - SAMPLE_BYTES, 0)
    spread = [head + span * i // (SPREAD_SAMPLES - 1) for i in range(SPREAD_SAMPLES)]
    tail = [max(size - SAMPLE_BYTES, head)]
    return head, sorted(set(starts + spread + tail) - {size})


def _digest(name: str, size: int, kind: str, mode: str, read: Reader,
            tensors: Tensors) -> str:
    h = hashlib.sha256(f"{name}\0{size}\0{kind}\0".encode())
    samples: list[int]
    if mode == "full":
        head, samples = size, []
    else:
        head, samples = _sample_offsets(size, kind, tensors)
    for off in range(0, head, 16 * MiB):
        h.update(read(off, min(16 * MiB, head - off)))
    for off in samples:
        h.update(off.to_bytes(8, "little"))
        h.update(read(off, min(SAMPLE_BYTES, size - off)))
    return h.hexdigest()


def _relative(header: Header, base: int) -> tuple[int, list[int]]:
    return header.data_start - base, [t.offset - base for t in header.tensors.values()]


def _source_digest(src: SourceFile, mode: str) -> str:
    reader = open_file(src)
    try:
        def read(offset: int, length: int) -> bytes:
            try:
                return reader.read(offset, length)
            except SourceError as exc:
                raise SourceError(f"{exc} (while it was being fingerprinted)") from exc

        return _digest(src.name, src.size, src.kind, mode, read,
                       lambda: _relative(read_header(read, src.size, src.path), 0))
    finally:
        reader.close()


def _etag_fingerprint(sources: list[SourceFile]) -> str:
    """An object store's own word for the content: names, sizes, kinds and ETags."""
    h = hashlib.sha256(b"csi-pmem-fingerprint-1 etag\n")
    for s in sorted(sources, key=lambda s: s.name):
        h.update(f"{s.name}\0{s.size}\0{s.kind}\0{s.etag}\n".encode())
    return "etag-" + h.hexdigest()[:20]


def _combine(mode: str, digests: list[str]) -> str:
    total = hashlib.sha256(f"csi-pmem-fingerprint-1 {mode}\n".encode())
    for d in digests:
        total.update(d.encode())
    return ("fp-" if mode == "sample" else "sha-") + total.hexdigest()[:20]


def _check_mode(mode: str) -> None:
    if mode not in FINGERPRINTS:
        raise ValueError(f"fingerprint mode {mode!r}; use one of {FINGERPRINTS}")


def fingerprint(sources: list[SourceFile], mode: str = "sample",
                threads: int | None = None) -> str:
    """A revision string for a source tree: ``fp-…`` (sampled) or ``sha-…`` (every byte).

    Independent of mtimes and of where the tree lives, so a copy of the same model
    elsewhere gets the same revision. Objects in a store (every file with an ETag) get
    ``etag-…`` in mode ``sample`` instead: their names, sizes and ETags, which the
    listing already gave, so a restart reads no data to know its revision.
    """
    _check_mode(mode)
    if mode == "sample" and sources and all(s.etag for s in sources):
        return _etag_fingerprint(sources)
    ordered = sorted(sources, key=lambda s: s.name)
    with ThreadPoolExecutor(threads or checksum.default_threads(),
                            thread_name_prefix="fingerprint") as pool:
        return _combine(mode, list(pool.map(lambda s: _source_digest(s, mode), ordered)))


def staged_fingerprint(volume: Volume, model: ModelEntry, mode: str = "sample",
                       threads: int | None = None) -> str:
    """What :func:`fingerprint` gives for the source ``model`` was staged from, read from
    the volume's copy (a few MiB for ``sample``). Equal to the source's fingerprint when
    the copy holds the source's bytes wherever the fingerprint looks."""
    _check_mode(mode)

    def digest(entry: FileEntry) -> str:
        def read(offset: int, length: int) -> bytes:
            return bytes(volume.view(entry.offset + offset, length))

        def tensors() -> tuple[int, list[int]]:
            header = parse_header(volume.buffer, entry.offset, entry.length,
                                  source=f"{volume.source}: {entry.name}")
            return _relative(header, entry.offset)

        return _digest(entry.name, entry.length, entry.kind, mode, read, tensors)

    ordered = sorted(model.files, key=lambda f: f.name)
    with ThreadPoolExecutor(threads or checksum.default_threads(),
                            thread_name_prefix="fingerprint") as pool:
        return _combine(mode, list(pool.map(digest, ordered)))
