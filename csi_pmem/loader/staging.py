"""Stage a model directory into a volume, verify it, list it, export it back.

Why a separate step from loading: staging writes (a sidecar with a read-write mount),
loading only reads (the server, mounted read-only). Staging is restartable: the index
records the plan first, then each chunk as it completes and each file, done, as soon as
its last chunk is, after their bytes are copied, checksummed and persisted
(:mod:`~csi_pmem.weights.persist`: a CPU cache flush on device-dax, msync on page-cache
files), and commits the model last, so a crash or signal at any point leaves either the
previous state or a ``staging`` entry that loads refuse and the next ``stage`` resumes
(every chunk already recorded is verified and kept, not copied again).

A committed model is not trusted blindly when it is staged again: :func:`stage` checks
every chunk it would skip and :func:`repair` copies again only the damaged chunks (a
whole file only where the source no longer holds the bytes that were staged), the same
code the staging sidecar repairs with. Without a revision, :func:`stage` can record the
source's fingerprint (:mod:`csi_pmem.loader.fingerprint`), the sidecar's revision, so
neither copies again what the other staged.

Copies go straight from the source file into the mapping (``preadv`` into a view of
it): one copy, no intermediate buffer, and several chunks in flight on a thread pool
because ``preadv`` and hashlib release the GIL.

A directory volume (an fsdax file system volume: no ``dax.sock``) is the image file
``csi-pmem-weights.img`` inside it (:data:`~csi_pmem.weights.image.IMAGE_NAME`).
:func:`open_for_staging` creates it, and :func:`stage` grows it to
:func:`~csi_pmem.weights.layout.required_size` (the index area, the committed models
kept, then the new model's files at their aligned offsets, rounded up to the align)
before it writes the plan; it never shrinks, and is fsynced once the model is committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from csi_pmem import failpoints
from csi_pmem.loader.fingerprint import fingerprint as source_fingerprint
from csi_pmem.loader.fingerprint import staged_fingerprint
from csi_pmem.loader.sources import (
    Reader,
    SourceError,
    default_name,
    default_threads,
    open_file,
)
from csi_pmem.loader.sources import scan as scan_location
from csi_pmem.sizes import describe_size, round_up
from csi_pmem.weights import checksum
from csi_pmem.weights.errors import (
    ChecksumError,
    LayoutError,
    LoaderError,
    ReadOnlyVolumeError,
)
from csi_pmem.weights.image import prepare_image, volume_image
from csi_pmem.weights.layout import (
    COMMITTED,
    INDEX_AREA,
    KIND_SAFETENSORS,
    STAGING,
    FileEntry,
    Index,
    ModelEntry,
    SourceFile,
    allocate,
    chunk_ranges,
    read_index,
    required_size,
    write_index,
)
from csi_pmem.weights.volume import DEFAULT_ALIGN, Volume, open_volume

log = logging.getLogger(__name__)

# Called with (bytes done, bytes total, what is happening).
Progress = Callable[[int, int, str], None]


@dataclass
class Repair:
    """What :func:`repair` copied again: ``chunks`` damaged chunks in ``files`` files,
    ``whole`` of those files copied whole (the source no longer held the staged bytes),
    ``copied`` bytes in all; ``checked`` bytes were hashed to find the damage."""

    chunks: int = 0
    files: list[str] = field(default_factory=list)
    whole: list[str] = field(default_factory=list)
    copied: int = 0
    checked: int = 0


@dataclass
class StageResult:
    """``action``: ``staged``, ``resumed``, ``already-staged`` (checked, nothing copied)
    or ``repaired`` (``repair`` says what was copied again); ``adopted`` when the model
    was staged without a revision and is now recorded under the source's fingerprint."""

    model: ModelEntry
    copied: int
    reused: int
    seconds: float
    already: bool = False
    action: str = "staged"
    repair: Repair | None = None
    checked: int = 0
    adopted: bool = False


def scan_source(location: str) -> list[SourceFile]:
    """Every file of the model at ``location`` (a directory, or ``s3://bucket/prefix/``:
    :mod:`csi_pmem.loader.sources`), safetensors headers validated up front; refused
    when it holds no safetensors file or its shard index names a missing shard."""
    found = scan_location(location)
    if not any(s.kind == KIND_SAFETENSORS for s in found):
        raise SourceError(f"{location} holds no *.safetensors file; nothing to stage")
    _check_shard_index(location, found)
    return found


def _check_shard_index(src_dir: str, found: list[SourceFile]) -> None:
    names = {s.name for s in found}
    for s in found:
        if not s.name.endswith(".safetensors.index.json"):
            continue
        try:
            reader = open_file(s)
            try:
                weight_map = json.loads(reader.read(0, s.size)).get("weight_map", {})
            finally:
                reader.close()
        except (OSError, ValueError, AttributeError) as exc:
            raise LoaderError(f"{s.path} is not a valid shard index: {exc}") from exc
        prefix = os.path.dirname(s.name)
        missing = sorted({shard for shard in weight_map.values()
                          if (f"{prefix}/{shard}" if prefix else shard) not in names})
        if missing:
            raise LoaderError(f"{s.path} names shards missing from {src_dir}: "
                              + ", ".join(missing))


def _same_files(model: ModelEntry, sources: list[SourceFile]) -> bool:
    want = sorted((s.name, s.size, s.kind) for s in sources)
    return want == sorted((f.name, f.length, f.kind) for f in model.files)


def _open_index(volume: Volume, replace: bool) -> Index:
    try:
        index = read_index(volume)
    except LayoutError as exc:
        if not replace:
            raise LayoutError(f"{exc}; pass --replace (replace=True) to discard the "
                              "volume's contents and stage anew") from exc
        log.warning("discarding unreadable index: %s", exc)
        index = None
    if index is None:
        return Index(align=volume.align)
    if replace:
        return Index(generation=index.generation, align=volume.align)
    return index


def _copy_chunk(volume: Volume, reader: Reader, entry: FileEntry, off: int,
                length: int, algo: str) -> str:
    failpoints.hit(failpoints.WEIGHTS_BEFORE_CHUNK)
    view = volume.view(entry.offset + off, length)
    reader.readinto(view, off)
    # Durable before the index can say the file is done; in this thread, because the
    # fence of a cache-flush persist orders only the calling thread's flushes.
    volume.persist(entry.offset + off, length)
    return checksum.digest(view, algo)


class _Copier:
    """Copies files chunk-parallel and records each chunk in the index as it completes.

    Completions are consumed as they come (each chunk's future puts itself on a queue),
    not after the whole pool is done: every batch of completed chunks is recorded in
    the index (``FileEntry.partial``) and reported to ``progress``, and a file is
    recorded done, with its checksums, as soon as its last chunk is. One index write
    covers every chunk that completed meanwhile, so the pool never waits on the index.
    On any exception (Ctrl-C too) the queued chunks are cancelled, the running ones
    finished, and every completed chunk recorded before the exception goes on.
    """

    def __init__(self, volume: Volume, index: Index, model: ModelEntry,
                 sources: dict[str, SourceFile], threads: int, progress: Progress | None,
                 total: int, done: int):
        self.volume, self.index, self.model = volume, index, model
        self.sources, self.threads, self.progress = sources, threads, progress
        self.total, self.done = total, done
        self.readers: dict[str, Reader] = {}
        self.left: dict[str, int] = {}
        self.pending: dict[Future[str], tuple[FileEntry, int, int]] = {}

    def run(self, files: list[FileEntry]) -> None:
        """Copy the chunks of ``files`` not in their ``partial`` (verified by the
        caller) and record each file done."""
        finished: queue.SimpleQueue[Future[str]] = queue.SimpleQueue()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="stage")
        try:
            for f in files:  # in the try: a file that cannot be opened closes the others
                self.readers[f.name] = open_file(self.sources[f.name])
            try:
                for f in files:
                    ranges = chunk_ranges(f.length, self.model.chunk_size)
                    todo = [(i, r) for i, r in enumerate(ranges) if i not in f.partial]
                    self.left[f.name] = len(todo)
                    for i, (off, length) in todo:
                        fut = pool.submit(_copy_chunk, self.volume, self.readers[f.name],
                                          f, off, length, self.model.algo)
                        self.pending[fut] = (f, i, length)
                        fut.add_done_callback(finished.put)
                    if not todo:
                        self._finish(f)
                while self.pending:
                    batch = [finished.get()]
                    with contextlib.suppress(queue.Empty):
                        while True:
                            batch.append(finished.get_nowait())
                    self._record(batch)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                self._salvage()
                raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for reader in self.readers.values():
                reader.close()

    def _record(self, batch: list[Future[str]], *, salvage: bool = False) -> None:
        """Record the chunks of ``batch`` (completed futures) in the index, finishing
        each file whose last chunk this is; then raise the first chunk's error."""
        error: BaseException | None = None
        recorded, unwritten = 0, False
        for fut in batch:
            if fut not in self.pending:
                continue
            f, i, length = self.pending[fut]
            if fut.cancelled() or fut.exception() is not None:
                if not fut.cancelled():
                    error = error or fut.exception()
                del self.pending[fut]
                continue
            f.partial[i] = fut.result()
            del self.pending[fut]
            self.done += length
            self.left[f.name] -= 1
            recorded += 1
            unwritten = True
            if self.left[f.name] == 0:
                failpoints.hit(failpoints.WEIGHTS_AFTER_COPY)
                try:
                    self._finish(f)  # writes the index: this file and every chunk so far
                except LoaderError as exc:
                    if not salvage:
                        raise
                    log.warning("%s", exc)  # the next stage copies that file again
                    continue
                unwritten = False
                failpoints.hit(failpoints.WEIGHTS_AFTER_FILE)
        if unwritten and not salvage:
            write_index(self.volume, self.index)
        for _ in range(recorded):
            failpoints.hit(failpoints.WEIGHTS_AFTER_CHUNK)
        if recorded and self.progress and not salvage:
            self.progress(self.done, self.total, f.name)
        if error is not None and not salvage:
            raise error

    def _salvage(self) -> None:
        """After an exception: record the chunks that completed and were not recorded
        yet (the pool is shut down, so every future is done or cancelled)."""
        try:
            self._record([fut for fut in list(self.pending) if fut.done()], salvage=True)
            # Also what an exception in the middle of a batch left unwritten.
            write_index(self.volume, self.index)
        except Exception as exc:  # the first error is the one to report
            log.warning("could not record the chunks copied before the stage stopped: %s",
                        exc)

    def _finish(self, f: FileEntry) -> None:
        self.readers[f.name].check_unchanged()
        n = len(chunk_ranges(f.length, self.model.chunk_size))
        f.chunks, f.done, f.partial = [f.partial[i] for i in range(n)], True, {}
        write_index(self.volume, self.index)
        log.info("staged %s (%s)", f.name, describe_size(f.length))


def open_for_staging(path: str | os.PathLike[str], *, align: int | None = None,
                     size: int | None = None) -> Volume:
    """Open a volume writable to stage into.

    For a directory volume (no ``dax.sock``: an fsdax file system volume's mount) this
    creates its image file when missing, holding just the index area (:func:`stage`
    grows it to fit the model), and grows it to ``size`` first when given. Every other
    volume is opened as :func:`~csi_pmem.weights.volume.open_volume` opens it.
    """
    image = volume_image(path)
    if image is not None:
        prepare_image(image, round_up(max(INDEX_AREA, size or 0), align or DEFAULT_ALIGN))
    return open_volume(path, writable=True, align=align)


def adopt(volume: Volume, index: Index, model: ModelEntry, sources: list[SourceFile],
          revision: str, mode: str, threads: int | None = None) -> bool:
    """Record ``revision`` (the sources' fingerprint in ``mode``) on a committed ``model``
    staged without one (by earlier versions of ``stage``) when its copy is the sources'
    content wherever the fingerprint looks; True when adopted. Writes only the index."""
    if (model.state != COMMITTED or model.revision or not revision
            or not _same_files(model, sources)
            or staged_fingerprint(volume, model, mode, threads) != revision):
        return False
    model.revision = revision
    write_index(volume, index)
    log.info("recorded revision %s on %s: its copy matches the source", revision, model.name)
    return True


def repair(volume: Volume, index: Index, model: ModelEntry, sources: list[SourceFile],
           bad: list[checksum.Mismatch] | None = None, *, threads: int | None = None,
           progress: Progress | None = None) -> Repair:
    """Copy again, from ``sources``, only what is damaged in the committed ``model``.

    ``bad`` is what a full check found; None checks every chunk first. Each damaged
    chunk is read again from its source file and must then match the checksum it was
    staged with; where it does not, the source no longer holds the staged bytes and the
    whole file is copied again (new checksums). The model is ``staging`` meanwhile
    (loads refuse it; an interrupted repair is resumed by the next stage) and committed
    again at the end. Used by ``csi-pmem-weights stage`` and by the staging sidecar.
    """
    if not volume.writable:
        raise ReadOnlyVolumeError(
            f"{volume.source} is opened read-only; repairing needs a writable volume")
    threads = threads or checksum.default_threads()
    result = Repair()
    if bad is None:
        chunks = checksum.model_chunks(model)
        bad = checksum.verify_chunks(volume, chunks, threads=threads)
        result.checked = sum(c.length for c in chunks)
    if not bad:
        return result
    by_name = {s.name: s for s in sources}
    damaged: dict[str, list[checksum.Chunk]] = {}
    for m in bad:
        damaged.setdefault(m.chunk.file, []).append(m.chunk)
    missing = sorted(set(damaged) - set(by_name))
    if missing:
        raise LoaderError(f"cannot repair {model.label()}: the source has no "
                          + ", ".join(missing))
    model.state = STAGING  # loads refuse it until the repair is committed
    model.updated = time.time()
    write_index(volume, index)
    total = sum(c.length for chunks in damaged.values() for c in chunks)
    with ThreadPoolExecutor(threads, thread_name_prefix="repair") as pool:
        for fname, chunks in damaged.items():
            entry, src = model.file(fname), by_name[fname]
            reader = open_file(src)
            try:
                got = list(pool.map(lambda c, e=entry, r=reader: _copy_chunk(
                    volume, r, e, c.offset - e.offset, c.length, c.algo), chunks))
            finally:
                reader.close()
            result.files.append(fname)
            result.chunks += len(chunks)
            result.copied += sum(c.length for c in chunks)
            if any(g != c.expected for g, c in zip(got, chunks, strict=True)):
                result.whole.append(fname)
            if progress:
                progress(result.copied, total, fname)
    if result.whole:
        log.warning("repair: %s no longer hold(s) the bytes staged as %s; copying the "
                    "whole file(s) again", ", ".join(result.whole), model.label())
        again = [model.file(n) for n in result.whole]
        for f in again:
            f.done, f.chunks, f.partial = False, [], {}
            f.source_size, f.source_mtime_ns = by_name[f.name].size, by_name[f.name].mtime_ns
        _Copier(volume, index, model, by_name, threads, progress,
                total + sum(f.length for f in again), result.copied).run(again)
        result.copied += sum(f.length for f in again)
    model.state = COMMITTED
    model.updated = time.time()
    write_index(volume, index, commit=True)
    volume.sync()
    log.info("repaired %s: %d chunk(s) of %d file(s), %s copied", model.label(),
             result.chunks, len(result.files), describe_size(result.copied))
    return result


def _check_committed(volume: Volume, index: Index, model: ModelEntry,
                     sources: list[SourceFile], threads: int | None,
                     progress: Progress | None, started: float,
                     adopted: bool) -> StageResult:
    """Stage over a committed copy of the same revision: check every chunk it would
    skip, and copy again only the damaged ones."""
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], model.size, "checking the staged copy")

    bad = checksum.verify_chunks(volume, checksum.model_chunks(model), threads=threads,
                                 progress=tick)
    if not bad:
        return StageResult(model, 0, model.size, time.monotonic() - started, already=True,
                           action="already-staged", checked=model.size, adopted=adopted)
    log.warning("%s: %d chunk(s) do not match their checksums, first: %s; copying them "
                "again", model.label(), len(bad), bad[0])
    fixed = repair(volume, index, model, sources, bad, threads=threads, progress=progress)
    return StageResult(model, fixed.copied, model.size - fixed.copied,
                       time.monotonic() - started, action="repaired", repair=fixed,
                       checked=model.size, adopted=adopted)


def _reusable(volume: Volume, model: ModelEntry, sources: dict[str, SourceFile],
              threads: int) -> int:
    """Before a resumed stage copies: keep what an earlier run recorded as persisted
    (whole files and single chunks of the others) where the source file is unchanged
    (size and mtime as planned) and the chunk still matches its checksum; forget the
    rest so that it is copied. Returns the bytes kept."""
    chunks: list[checksum.Chunk] = []
    for f in model.files:
        src = sources[f.name]
        if (f.source_size, f.source_mtime_ns) != (src.size, src.mtime_ns):
            f.done, f.chunks, f.partial = False, [], {}
            f.source_size, f.source_mtime_ns = src.size, src.mtime_ns
            continue
        if f.done:  # verified chunk by chunk, like the chunks of an unfinished file
            f.done, f.partial, f.chunks = False, dict(enumerate(f.chunks)), []
        for i, (off, length) in enumerate(chunk_ranges(f.length, model.chunk_size)):
            if i in f.partial:
                chunks.append(checksum.Chunk(f.name, i, f.offset + off, length,
                                             f.partial[i], model.algo))
    bad = checksum.verify_chunks(volume, chunks, threads=threads) if chunks else []
    for m in bad:
        log.warning("resume: %s no longer matches its checksum; copying it again", m)
        del model.file(m.chunk.file).partial[m.chunk.index]
    kept = {(c.file, c.index) for c in chunks} - {(m.chunk.file, m.chunk.index) for m in bad}
    for f in model.files:  # whole files again where every chunk was kept
        n = len(chunk_ranges(f.length, model.chunk_size))
        if f.partial and len(f.partial) == n:
            f.done, f.chunks, f.partial = True, [f.partial[i] for i in range(n)], {}
    reused = sum(c.length for c in chunks if (c.file, c.index) in kept)
    if chunks:
        whole = sum(1 for f in model.files if f.done)
        log.info("resume: %s of %s verified and kept (%d whole files, %d chunks of others)",
                 describe_size(reused), describe_size(model.size), whole,
                 sum(len(f.partial) for f in model.files))
    return reused


def stage(volume: Volume, src: str, *, name: str | None = None,
          revision: str | None = "", fingerprint: str = "sample", replace: bool = False,
          threads: int | None = None, progress: Progress | None = None,
          scanned: list[SourceFile] | None = None) -> StageResult:
    """Copy the model at ``src`` (a directory or ``s3://bucket/prefix/``) into the volume
    as model ``name`` (default: the directory's name, or the prefix's last component).
    ``scanned``: what :func:`scan_source` gave for ``src`` moments ago (the sidecar
    scans before it plans), so that it is not listed and its headers read again.

    ``revision=None`` records the source's fingerprint in mode ``fingerprint`` (what the
    staging sidecar records without ``--revision``), and adopts a model of that name
    staged without a revision when its copy has that fingerprint. A committed model of
    the same revision and files is checked chunk by chunk and repaired (:func:`repair`),
    never copied whole again.
    """
    if not volume.writable:
        raise ReadOnlyVolumeError(
            f"{volume.source} is opened read-only; staging needs a writable volume")
    started = time.monotonic()
    name = name or default_name(src)
    threads = threads or default_threads(src, checksum.default_threads())
    sources = scanned if scanned is not None else scan_source(src)
    fingerprinted = revision is None
    if revision is None:
        revision = source_fingerprint(sources, fingerprint, threads)
    index = _open_index(volume, replace)
    existing = index.find(name)
    if existing is not None and existing.state == COMMITTED:
        adopted = fingerprinted and adopt(volume, index, existing, sources, revision,
                                          fingerprint, threads)
        if existing.revision == revision and _same_files(existing, sources):
            return _check_committed(volume, index, existing, sources, threads, progress,
                                    started, adopted)
        raise LayoutError(
            f"the volume already holds model {existing.label()}; staging "
            f"{name}@{revision or '-'} over it needs --replace (which discards every "
            "model on the volume)")
    resume = (existing is not None and existing.revision == revision
              and _same_files(existing, sources))
    index.models = [m for m in index.models if m.state == COMMITTED]
    if not resume and volume.growable:
        volume.grow(required_size(index, sources))  # an image file: make room first
    model = existing if resume and existing else allocate(index, name, revision, sources,
                                                          volume.size)
    model.state = STAGING
    model.updated = time.time()
    index.models.append(model)
    write_index(volume, index)  # the plan is on the volume before any data is
    failpoints.hit(failpoints.WEIGHTS_AFTER_PLAN)

    by_name = {s.name: s for s in sources}
    total = model.size
    reused = _reusable(volume, model, by_name, threads)
    if progress:  # the bar appears now, not with the first chunk
        progress(reused, total, f"reused {describe_size(reused)} verified" if reused
                 else "copying")
    copy = [f for f in model.files if not f.done]
    copier = _Copier(volume, index, model, by_name, threads, progress, total, reused)
    copier.run(copy)
    failpoints.hit(failpoints.WEIGHTS_BEFORE_COMMIT)
    model.state = COMMITTED
    model.updated = time.time()
    write_index(volume, index, commit=True)
    volume.sync()  # an image file: fsync (data, size, allocation)
    failpoints.hit(failpoints.WEIGHTS_AFTER_COMMIT)
    return StageResult(model, total - reused, reused, time.monotonic() - started,
                       action="resumed" if resume else "staged")


def verify_models(volume: Volume, name: str | None = None, *, threads: int | None = None,
                  progress: Progress | None = None
                  ) -> list[tuple[ModelEntry, list[checksum.Mismatch]]]:
    """Each committed model (all of them, or the one named) with its problems."""
    index = read_index(volume)
    if index is None:
        raise LayoutError(f"{volume.source} holds no staged model")
    models = [index.select(name)] if name else index.committed()
    if not models:
        index.select()  # raises the right "not committed" message
    out = []
    total = sum(m.size for m in models)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total, "verifying")

    for m in models:
        out.append((m, checksum.verify_chunks(volume, checksum.model_chunks(m),
                                              threads=threads, progress=tick)))
    return out


def verify(volume: Volume, name: str | None = None, *, threads: int | None = None,
           progress: Progress | None = None) -> dict[str, list[checksum.Mismatch]]:
    """Problems per committed model's label (all of them, or the one named)."""
    return {m.label(): bad for m, bad in verify_models(volume, name, threads=threads,
                                                       progress=progress)}


def export(volume: Volume, dest: str, name: str | None = None, *, overwrite: bool = False,
           threads: int | None = None, progress: Progress | None = None) -> list[str]:
    """Write a committed model's files under ``dest``, verified chunk by chunk while
    written; each file appears under its name only once complete."""
    index = read_index(volume)
    if index is None:
        raise LayoutError(f"{volume.source} holds no staged model")
    model = index.select(name)
    targets = [os.path.join(dest, *f.name.split("/")) for f in model.files]
    clash = [t for t in targets if os.path.exists(t)]
    if clash and not overwrite:
        raise LoaderError(f"{clash[0]} exists; pass --overwrite to replace "
                          f"({len(clash)} files would be replaced)")
    done = 0
    written = []
    with ThreadPoolExecutor(threads or checksum.default_threads(),
                            thread_name_prefix="export") as pool:
        for f, target in zip(model.files, targets, strict=True):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            partial = os.path.join(os.path.dirname(target),
                                   f".{os.path.basename(target)}.partial")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                chunks = checksum.model_chunks(model, [f])
                for problem in pool.map(lambda c, fd=fd, f=f: _export_chunk(
                        volume, fd, c, c.offset - f.offset), chunks):
                    if problem is not None:
                        raise ChecksumError(f"export stopped: {problem}; the volume copy is "
                                            "damaged, stage the model again")
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(partial)
                raise
            os.close(fd)
            os.replace(partial, target)
            written.append(target)
            done += f.length
            if progress:
                progress(done, model.size, f.name)
    return written


def _export_chunk(volume: Volume, fd: int, chunk: checksum.Chunk,
                  file_off: int) -> checksum.Mismatch | None:
    view = volume.view(chunk.offset, chunk.length)
    got = checksum.digest(view, chunk.algo)
    if got != chunk.expected:
        return checksum.Mismatch(chunk, got)
    off = 0
    while off < chunk.length:
        off += os.pwrite(fd, view[off:], file_off + off)
    return None
