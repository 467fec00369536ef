"""The on-volume layout: a small checksummed index, then files copied verbatim.

Why this shape:
- Files are copied byte for byte (safetensors shards, config and tokenizer files), so
  any model can be staged and exported back unchanged, and the loader parses the
  safetensors headers straight from the mapping.
- Safetensors files start on the volume's align (2 MiB or 1 GiB): a reader may map one
  file alone (devdax only maps aligned ranges), and huge-page and registration
  boundaries line up with file starts. Small auxiliary files are packed at 4 KiB in
  the gap before the first aligned offset, so a 1 GiB align does not waste a GiB each.
- The index lives in two slots at the start of the volume (A/B). Each write goes to the
  slot not holding the newest generation, and a header checksum covers the whole
  slot's content, so a torn index write leaves the previous generation in force. A
  model is trusted only once its entry says ``committed``; that entry is written after
  its data was copied, checksummed and msynced. An interrupted stage therefore leaves
  an entry in ``staging`` state that loads refuse and a later stage resumes.
  While a file is being copied, the index also records each chunk already persisted
  (``partial``: chunk number to checksum), so a resumed stage verifies and keeps those
  chunks and copies only the rest; the file's ``chunks`` list is written once all are.
- Checksums cover 64 MiB chunks of each file, with the algorithm the model entry names
  (``algo``): ``wsum64`` (:mod:`.wsum`, written since the GPU loader checks it on the
  device at memory speed) or ``sha256`` (volumes staged before; still loaded and
  verified). A file's digest is the SHA-256 of its chunk checksums.

Header of a slot (64 bytes, little-endian): magic ``CSIPMEMW``, version u32, header
size u32, generation u64, JSON length u64, then SHA-256 of those 32 bytes plus the JSON
that follows the header.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import posixpath
import struct
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from csi_pmem import failpoints
from csi_pmem.sizes import MiB, describe_size, round_up
from csi_pmem.weights.errors import LayoutError, NoModelError, VolumeTooSmallError
from csi_pmem.weights.volume import Volume

MAGIC = b"CSIPMEMW"
VERSION = 1
_FIELDS = struct.Struct("<8sIIQQ")
HEADER_SIZE = _FIELDS.size + 32
SLOT_SIZE = 4 * MiB
SLOTS = 2
INDEX_AREA = SLOTS * SLOT_SIZE
CHUNK_SIZE = 64 * MiB
AUX_ALIGN = 4096
ALGO = "wsum64"  # what new stages write (csi_pmem.weights.wsum)
# Checksum algorithms this version reads, and the length of one chunk's hex checksum.
ALGOS = {"wsum64": 32, "sha256": 64}

STAGING = "staging"
COMMITTED = "committed"
KIND_SAFETENSORS = "safetensors"
KIND_AUX = "aux"


def chunk_ranges(length: int, chunk: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """(offset, length) of each checksum chunk of a file of ``length`` bytes."""
    return [(o, min(chunk, length - o)) for o in range(0, length, chunk)]


def root_digest(chunks: list[str]) -> str:
    return hashlib.sha256("".join(chunks).encode()).hexdigest()


@dataclass
class FileEntry:
    name: str
    offset: int
    length: int
    kind: str
    chunks: list[str] = field(default_factory=list)
    done: bool = False
    source_size: int | None = None
    source_mtime_ns: int | None = None
    # Chunks of a file not yet done that are persisted: chunk number -> checksum.
    partial: dict[int, str] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def digest(self) -> str | None:
        return root_digest(self.chunks) if self.done else None

    def to_json(self) -> dict[str, Any]:
        doc = {"name": self.name, "offset": self.offset, "length": self.length,
               "kind": self.kind, "chunks": self.chunks, "done": self.done,
               "source_size": self.source_size, "source_mtime_ns": self.source_mtime_ns}
        if self.partial and not self.done:  # older readers ignore it: resume per file
            doc["partial"] = {str(i): d for i, d in sorted(self.partial.items())}
        return doc


@dataclass
class ModelEntry:
    name: str
    revision: str
    state: str
    files: list[FileEntry]
    chunk_size: int = CHUNK_SIZE
    algo: str = ALGO
    updated: float = 0.0

    @property
    def end(self) -> int:
        return max((f.end for f in self.files), default=0)

    @property
    def size(self) -> int:
        return sum(f.length for f in self.files)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def safetensors(self) -> list[FileEntry]:
        return [f for f in self.files if f.kind == KIND_SAFETENSORS]

    def label(self) -> str:
        return f"{self.name}@{self.revision}" if self.revision else self.name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "revision": self.revision, "state": self.state,
                "chunk_size": self.chunk_size, "algo": self.algo, "updated": self.updated,
                "files": [f.to_json() for f in self.files]}


@dataclass
class Index:
    generation: int = 0
    align: int = 2 * MiB
    models: list[ModelEntry] = field(default_factory=list)

    @property
    def end(self) -> int:
        """First byte after the index area and every model's files."""
        return max([INDEX_AREA] + [m.end for m in self.models])

    def to_json(self) -> dict[str, Any]:
        return {"format": "csi-pmem-weights", "align": self.align,
                "models": [m.to_json() for m in self.models]}

    def committed(self) -> list[ModelEntry]:
        return [m for m in self.models if m.state == COMMITTED]

    def find(self, name: str) -> ModelEntry | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def select(self, name: str | None = None) -> ModelEntry:
        """The committed model to load: the one named, or the only one."""
        committed = self.committed()
        if name is not None:
            model = self.find(name)
            if model is None:
                have = ", ".join(m.label() for m in self.models) or "none"
                raise NoModelError(f"the volume holds no model {name!r} (it holds: {have})")
            if model.state != COMMITTED:
                raise NoModelError(_interrupted(model))
            return model
        if len(committed) == 1:
            return committed[0]
        if committed:
            raise NoModelError(
                "the volume holds several models (" + ", ".join(m.label() for m in committed)
                + "); name the one to load")
        if self.models:
            raise NoModelError(_interrupted(self.models[-1]))
        raise NoModelError("the volume holds no staged model; run csi-pmem-weights stage")


def copied_bytes(model: ModelEntry) -> int:
    """Bytes of ``model`` the index records as persisted: done files and the chunks
    recorded of the others."""
    total = 0
    for f in model.files:
        if f.done:
            total += f.length
        elif f.partial:
            ranges = chunk_ranges(f.length, model.chunk_size)
            total += sum(ranges[i][1] for i in f.partial if i < len(ranges))
    return total


def _interrupted(model: ModelEntry) -> str:
    done = sum(1 for f in model.files if f.done)
    return (f"model {model.label()} is not committed: its staging was interrupted or is "
            f"still running ({done} of {len(model.files)} files copied, "
            f"{describe_size(copied_bytes(model))} of {describe_size(model.size)}); run "
            "csi-pmem-weights stage again to resume it")


# --- serialisation -----------------------------------------------------------------

def _safe_name(name: Any) -> TypeGuard[str]:
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    if name.startswith("/") or posixpath.normpath(name) != name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _int(doc: dict[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LayoutError(f"index: {where} has invalid {key} {value!r}")
    return value


def _file_from(doc: Any, where: str, hex_len: int = 64) -> FileEntry:
    if not isinstance(doc, dict):
        raise LayoutError(f"index: {where} is not an object")
    name = doc.get("name")
    if not _safe_name(name):
        raise LayoutError(f"index: {where} has unsafe file name {name!r}")
    kind = doc.get("kind")
    if kind not in (KIND_SAFETENSORS, KIND_AUX):
        raise LayoutError(f"index: file {name!r} has unknown kind {kind!r}")
    chunks = doc.get("chunks") or []
    if not isinstance(chunks, list) or not all(
            isinstance(c, str) and len(c) == hex_len for c in chunks):
        raise LayoutError(f"index: file {name!r} has malformed checksums")
    partial = doc.get("partial") or {}
    if not isinstance(partial, dict) or not all(
            isinstance(k, str) and k.isascii() and k.isdigit()
            and isinstance(c, str) and len(c) == hex_len
            for k, c in partial.items()):
        raise LayoutError(f"index: file {name!r} has malformed partial checksums")
    src_size, src_mtime = doc.get("source_size"), doc.get("source_mtime_ns")
    return FileEntry(name=name, offset=_int(doc, "offset", f"file {name!r}"),
                     length=_int(doc, "length", f"file {name!r}"), kind=kind,
                     chunks=list(chunks), done=bool(doc.get("done")),
                     source_size=src_size if isinstance(src_size, int) else None,
                     source_mtime_ns=src_mtime if isinstance(src_mtime, int) else None,
                     partial={int(k): c for k, c in partial.items()})


def _model_from(doc: Any) -> ModelEntry:
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        raise LayoutError("index: a model entry has no name")
    name = doc["name"]
    state = doc.get("state")
    if state not in (STAGING, COMMITTED):
        raise LayoutError(f"index: model {name!r} has unknown state {state!r}")
    # Entries written before the algorithm was recorded per model are SHA-256.
    algo = doc.get("algo", "sha256")
    if algo not in ALGOS:
        raise LayoutError(f"index: model {name!r} uses checksum {algo!r}; this version "
                          f"knows {', '.join(sorted(ALGOS))} (upgrade csi-pmem)")
    files = doc.get("files")
    if not isinstance(files, list):
        raise LayoutError(f"index: model {name!r} has no file list")
    return ModelEntry(name=name, revision=str(doc.get("revision") or ""), state=state,
                      files=[_file_from(f, f"model {name!r} file #{i}", ALGOS[algo])
                             for i, f in enumerate(files)],
                      chunk_size=_chunk_size(doc, name), algo=algo,
                      updated=_seconds(doc.get("updated"), name))


def _chunk_size(doc: dict[str, Any], name: str) -> int:
    size = _int(doc, "chunk_size", f"model {name!r}") or CHUNK_SIZE
    if size < AUX_ALIGN:  # stages write CHUNK_SIZE; a tiny one is damage, not a choice
        raise LayoutError(f"index: model {name!r} has checksum chunks of {size} bytes, "
                          f"below {AUX_ALIGN}")
    return size


def _seconds(value: Any, name: str) -> float:
    """The ``updated`` time stamp: a number (seconds since the epoch) or absent."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise LayoutError(f"index: model {name!r} has invalid updated {value!r}")
    return float(value)


def validate(index: Index, volume_size: int) -> None:
    """Check offsets, alignment, bounds, overlaps and checksum counts of every file.

    Loads build views from these numbers, and a view past the mapping is a SIGBUS, so
    nothing from the volume is believed before this passed.
    """
    spans: list[tuple[int, int, str]] = []
    for model in index.models:
        names = [f.name for f in model.files]
        if len(set(names)) != len(names):
            raise LayoutError(f"index: model {model.label()} lists a file twice")
        for f in model.files:
            where = f"file {f.name!r} of model {model.label()}"
            align = index.align if f.kind == KIND_SAFETENSORS else AUX_ALIGN
            if f.offset % align:
                raise LayoutError(f"index: {where} starts at offset {f.offset}, not a "
                                  f"multiple of {describe_size(align)} (misaligned)")
            if f.offset < INDEX_AREA or f.end > volume_size:
                raise LayoutError(f"index: {where} spans [{f.offset}, {f.end}), outside "
                                  f"the data area [{INDEX_AREA}, {volume_size})")
            # Counted, not listed: a damaged index may claim a file of the whole volume.
            if f.done and len(f.chunks) != -(-f.length // model.chunk_size):
                raise LayoutError(f"index: {where} has {len(f.chunks)} checksums for "
                                  f"{f.length} bytes")
            if f.partial and max(f.partial) >= -(-f.length // model.chunk_size):
                raise LayoutError(f"index: {where} records chunk {max(f.partial)} as "
                                  f"copied, past its {f.length} bytes")
            if model.state == COMMITTED and not f.done:
                raise LayoutError(f"index: {where} is part of a committed model but was "
                                  "never completely copied")
            spans.append((f.offset, f.end, where))
    spans.sort()
    for (_, a_end, a), (b_start, _, b) in itertools.pairwise(spans):
        if b_start < a_end:
            raise LayoutError(f"index: {a} overlaps {b}")


def index_from_json(doc: Any, generation: int, volume_size: int) -> Index:
    if not isinstance(doc, dict) or doc.get("format") != "csi-pmem-weights":
        raise LayoutError("index: not a csi-pmem-weights index document")
    align = _int(doc, "align", "the index")
    if align < 4096 or align & (align - 1):
        raise LayoutError(f"index: align {align} is not a power of two")
    models = doc.get("models")
    if not isinstance(models, list):
        raise LayoutError("index: no model list")
    index = Index(generation=generation, align=align, models=[_model_from(m) for m in models])
    validate(index, volume_size)
    return index


def encode(index: Index, generation: int) -> bytes:
    body = json.dumps(index.to_json(), sort_keys=True, separators=(",", ":")).encode()
    if HEADER_SIZE + len(body) > SLOT_SIZE:
        raise LayoutError(f"index of {len(body)} bytes exceeds its {SLOT_SIZE}-byte slot "
                          "(too many files or chunks for one volume)")
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_SIZE, generation, len(body))
    return fields + hashlib.sha256(fields + body).digest() + body


def _decode_slot(raw: memoryview, slot: int) -> tuple[int, dict[str, Any]] | str | None:
    """(generation, document) of a valid slot, None for a blank one, else why not."""
    head = bytes(raw[:HEADER_SIZE])
    if head[:8] == b"\0" * 8:
        return None
    magic, version, hsize, generation, length = _FIELDS.unpack_from(head)
    if magic != MAGIC:
        return f"slot {slot}: no csi-pmem index here (starts with {head[:8]!r})"
    if version > VERSION:
        return (f"slot {slot}: index version {version} was written by a newer csi-pmem; "
                "upgrade this one")
    if hsize != HEADER_SIZE or length > SLOT_SIZE - HEADER_SIZE:
        return f"slot {slot}: header claims {length} bytes of index (truncated or corrupt)"
    body = bytes(raw[HEADER_SIZE:HEADER_SIZE + length])
    if hashlib.sha256(head[:_FIELDS.size] + body).digest() != head[_FIELDS.size:]:
        return f"slot {slot}: header checksum mismatch (corrupt or torn write)"
    try:
        return generation, json.loads(body)
    except ValueError as exc:  # checksum passed, so this is a writer bug
        return f"slot {slot}: index is not JSON ({exc})"
    except RecursionError:  # json nests by recursion
        return f"slot {slot}: index is not JSON (nested too deeply)"


def read_index(volume: Volume) -> Index | None:
    """The newest valid index generation; None when the volume was never staged."""
    if volume.size < INDEX_AREA:
        raise LayoutError(f"{volume.source}: volume of {describe_size(volume.size)} is "
                          f"smaller than the {describe_size(INDEX_AREA)} index area")
    problems: list[str] = []
    best: tuple[int, dict[str, Any]] | None = None
    for slot in range(SLOTS):
        got = _decode_slot(volume.view(slot * SLOT_SIZE, SLOT_SIZE), slot)
        if isinstance(got, str):
            problems.append(got)
        elif got is not None and (best is None or got[0] > best[0]):
            best = got
    if best is None:
        if not problems:
            return None
        raise LayoutError(f"{volume.source}: the weights index is unreadable: "
                          + "; ".join(problems)
                          + ". Nothing on it is trusted; restage with stage --replace")
    try:
        return index_from_json(best[1], best[0], volume.size)
    except LayoutError as exc:
        raise LayoutError(f"{volume.source}: {exc}") from exc


def index_heads(volume: Volume) -> bytes:
    """The headers of both index slots, as they are now: a token that changes with every
    index write (each one stores a new header, generation and checksum).

    Why: a reader that only needs to know whether the index moved since it last read it
    (the GPU copy service, before every pod's first request) compares this instead of
    hashing and parsing both slots, which is most of a millisecond on the path to a
    fresh pod's first copy. A header being rewritten shows up as a change; the reader
    then reads the index properly. Empty for a volume too small to hold an index
    (:func:`read_index` says why).
    """
    if volume.size < INDEX_AREA:
        return b""
    return b"".join(bytes(volume.view(slot * SLOT_SIZE, HEADER_SIZE)) for slot in range(SLOTS))


def write_index(volume: Volume, index: Index, *, commit: bool = False) -> None:
    """Write the next generation into the older slot and persist it.

    The body is persisted before the header is stored, and the header after: with
    cache-flush persistence (device-dax) nothing orders two stores' arrival on the
    media otherwise, and a reader that finds the new header must find its body. A
    header torn on its own fails its checksum, and readers take the other slot.
    """
    generation = index.generation + 1
    blob = encode(index, generation)
    start = (generation % SLOTS) * SLOT_SIZE
    view = volume.view(start, SLOT_SIZE)
    # Body first, header last: a reader that sees the new header sees a complete body
    # (the checksum would catch a tear either way).
    view[HEADER_SIZE:len(blob)] = blob[HEADER_SIZE:]
    volume.persist(start + HEADER_SIZE, len(blob) - HEADER_SIZE)
    if commit:
        failpoints.hit(failpoints.WEIGHTS_INDEX_BODY)
    view[:HEADER_SIZE] = blob[:HEADER_SIZE]
    volume.persist(start, HEADER_SIZE)
    index.generation = generation


# --- allocation ----------------------------------------------------------------------

@dataclass(frozen=True)
class SourceFile:
    """One file of a model's source. ``path`` is where it is read from (a file's path,
    or ``s3://bucket/key`` for an object); ``mtime_ns`` is the object's last-modified
    time for an object; ``etag`` is an object's ETag (empty for files): what the
    object store says changes with its content."""

    name: str
    path: str
    size: int
    mtime_ns: int
    kind: str
    etag: str = ""


def plan_files(sources: list[SourceFile], start: int, align: int) -> list[FileEntry]:
    """Offsets for a model's files from ``start``: auxiliary files packed at 4 KiB,
    then each safetensors file on the volume align."""
    entries = []
    cursor = start
    ordered = ([s for s in sources if s.kind == KIND_AUX]
               + [s for s in sources if s.kind == KIND_SAFETENSORS])
    for s in ordered:
        cursor = round_up(cursor, align if s.kind == KIND_SAFETENSORS else AUX_ALIGN)
        entries.append(FileEntry(s.name, cursor, s.size, s.kind,
                                 source_size=s.size, source_mtime_ns=s.mtime_ns))
        cursor += s.size
    return entries


def _data_start(index: Index) -> int:
    """Where a new model goes: after the index area and every committed model."""
    return max([INDEX_AREA] + [m.end for m in index.models if m.state == COMMITTED])


def required_size(index: Index, sources: list[SourceFile]) -> int:
    """The smallest volume size that takes ``sources`` as a new model beside the
    index's committed models: the index area, those models, then the files at the
    offsets :func:`allocate` gives them, rounded up to the index align. What an image
    file (a directory volume) is grown to before a stage."""
    start = _data_start(index)
    files = plan_files(sources, start, index.align)
    return round_up(max([start] + [f.end for f in files]), index.align)


def allocate(index: Index, name: str, revision: str, sources: list[SourceFile],
             volume_size: int) -> ModelEntry:
    """A new staging entry placed after the committed models; refuses if it won't fit."""
    start = _data_start(index)
    files = plan_files(sources, start, index.align)
    end = max([start] + [f.end for f in files])
    if end > volume_size:
        needed = end - start
        available = max(0, volume_size - start)
        data = sum(s.size for s in sources)
        alone = required_size(Index(align=index.align), sources)
        raise VolumeTooSmallError(
            f"model {name} does not fit: it needs {describe_size(needed)} on this volume "
            f"({len(sources)} files, {describe_size(data)} of data plus alignment to "
            f"{describe_size(index.align)}), but only {describe_size(available)} of the "
            f"volume's {describe_size(volume_size)} are free. Use a volume of at least "
            f"{describe_size(alone)} for this model alone",
            needed=needed, available=available)
    return ModelEntry(name=name, revision=revision, state=STAGING, files=files,
                      updated=time.time())
