"""The staging sidecar: keep one model revision staged, verified and announced on a volume.

Why a long-running process: in a pod it runs as a native sidecar (an init container with
``restartPolicy: Always``, Kubernetes >= 1.29). Kubelet starts the serving container only
once the sidecar's startupProbe passes, so ``/readyz`` is the gate between "the weights
on this node's volume are the wanted revision, committed and checked" and "load them".
After that it keeps answering probes, re-verifies when asked, and exits 0 on SIGTERM.

Why it exists at all: the point of a PMEM volume is that weights stay resident on the
node across pod restarts. So start-up must first find out, cheaply, whether the volume
already holds what the source holds, and only copy when it does not:

- The wanted revision is ``--revision`` when given (a Hugging Face commit, an image
  digest: the cheapest and most exact answer). Otherwise it is a fingerprint of the
  source: file names, sizes and kinds, every safetensors header in full (names, dtypes,
  shapes, offsets, ``__metadata__``), and a sample of the data (4 KiB at the start of
  each tensor, up to 1024 tensors per file, plus 32 evenly spaced 4 KiB blocks and the
  tail of every file; small auxiliary files whole). That reads a few MiB of a 100 GB
  model. Re-hashing the whole source (what the staging checksums would need: they are
  SHA-256 over 64 MiB chunks of every byte) costs minutes per pod start on network
  storage; mtimes are free but change with every copy or re-download, which would
  re-copy 100 GB for nothing. The sample catches a new fine-tune (every tensor
  changes, same names and sizes) and any header change; it misses a change confined to
  bytes no sample reaches, for which ``--revision`` or ``--fingerprint full`` exist.
- An already staged model is checked with its index (header checksum, committed flag,
  file list) and, by default, a sample of its checksum chunks of at most 256 MiB
  whatever the model's size (first chunks, which hold the safetensors headers, spread
  over the shards): no copy, no full re-hash (``--verify-on-start full`` asks for
  one). Fresh copies are verified in full before the sidecar says ready.

Old revisions of the same model: the index holds one entry per model name and
name-less loads need exactly one committed model, so the previous revision is kept
under a retired name only while the new one is staged beside it (pods on the node still
reading it keep valid bytes), then released. When the new revision does not fit beside
it, older revisions of that model are released first. Another model is never touched:
if only removing it would make room, the sidecar refuses and says so.

Crash safety comes from the staging code (plan written first, files marked done,
commit last); this module adds an advisory lock on the volume so two sidecars on one
node do not stage into the same volume at once.

A directory volume (an fsdax ``Filesystem`` volume: no ``dax.sock``) is its image file
``csi-pmem-weights.img``: created when missing, grown to what the model needs beside the
other models it holds (older revisions of this one are released rather than kept when
the image has no room for both: growing to keep them would grow it at every new
revision, since a model is placed after the last committed one), never shrunk.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from csi_pmem import daxclient, failpoints, logs
from csi_pmem.loader import checksum
from csi_pmem.loader.errors import (
    ChecksumError,
    LayoutError,
    LoaderError,
    ReadOnlyVolumeError,
    SafetensorsFormatError,
    VolumeError,
    VolumeTooSmallError,
)
from csi_pmem.loader.layout import (
    COMMITTED,
    KIND_SAFETENSORS,
    STAGING,
    Index,
    ModelEntry,
    SourceFile,
    allocate,
    read_index,
    required_size,
    write_index,
)
from csi_pmem.loader.staging import open_for_staging, scan_source, stage
from csi_pmem.loader.stformat import read_header_file
from csi_pmem.loader.volume import MiB, Volume, format_size, open_volume, volume_image

log = logging.getLogger(__name__)

# Kill the sidecar (SIGKILL) once staging has copied half the model: the
# interrupted-staging test needs a kill that lands mid-copy every time.
FP_STAGE_HALF = "sidecar-stage-half"

SAMPLE_BYTES = 4096
SPREAD_SAMPLES = 32
MAX_TENSOR_SAMPLES = 1024
WHOLE_AUX_LIMIT = MiB  # auxiliary files up to this size are hashed whole
SAMPLE_BUDGET = 256 * MiB  # what --verify-on-start sample hashes at most
RETIRED_PREFIX = ".retired/"
MAX_BACKOFF = 60.0
PROGRESS_INTERVAL = 2.0

FINGERPRINTS = ("sample", "full")
VERIFY_MODES = ("sample", "full", "none")


class SourceError(LoaderError):
    """The model source is missing, empty or not valid safetensors."""


def _event(msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """One log line: a message plus machine-readable fields (JSON mode shows both)."""
    log.log(level, msg, extra={"fields": fields})


# --- the wanted revision --------------------------------------------------------------

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
    elsewhere gets the same revision (see the module docstring for what it reads).
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


# --- the volume lock ------------------------------------------------------------------

def _lock_fd(path: str) -> int:
    """An fd of the volume's device (or file): flock on it is node-wide, whichever pod
    or publish the fd came through, because all of them share the device's inode. A
    directory volume's is its image file's (the directory's until there is one)."""
    image = volume_image(path)
    if image is not None:
        target = image if os.path.exists(image) else path
        return os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    is_socket = os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode)
    if os.path.isdir(path) or is_socket:
        try:
            _, fd = daxclient.open_volume(path)
        except daxclient.DaxSocketError as exc:
            raise VolumeError(str(exc)) from exc
        return fd
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


@contextlib.contextmanager
def volume_lock(path: str) -> Iterator[float]:
    """Hold the volume's staging lock; yields the seconds spent waiting for it."""
    fd = _lock_fd(path)
    started = time.monotonic()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _event("another process is staging into this volume; waiting for it",
                   logging.WARNING, volume=path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - started
    finally:
        os.close(fd)


# --- revisions and space --------------------------------------------------------------

def retired_name(name: str) -> str:
    return RETIRED_PREFIX + name


def _same_files(model: ModelEntry, sources: list[SourceFile]) -> bool:
    return (sorted((s.name, s.size, s.kind) for s in sources)
            == sorted((f.name, f.length, f.kind) for f in model.files))


def _is_wanted(model: ModelEntry | None, revision: str, sources: list[SourceFile]) -> bool:
    return (model is not None and model.state == COMMITTED and model.revision == revision
            and _same_files(model, sources))


@dataclass
class SpacePlan:
    """How room is made for a new revision: ``fresh`` (no older revision on the volume),
    ``beside`` (older revisions stay until the new one commits) or ``release`` (older
    revisions are dropped first); ``why`` is the sentence the logs and /status show."""

    kind: str
    release: list[ModelEntry] = field(default_factory=list)
    why: str = ""


def _fits(align: int, keep: list[ModelEntry], name: str, revision: str,
          sources: list[SourceFile], volume_size: int) -> VolumeTooSmallError | None:
    try:
        allocate(Index(align=align, models=list(keep)), name, revision, sources, volume_size)
        return None
    except VolumeTooSmallError as exc:
        return exc


def plan_space(index: Index, name: str, revision: str, sources: list[SourceFile],
               volume_size: int) -> SpacePlan:
    """Decide where the new revision goes, or raise :class:`VolumeTooSmallError`.

    Pure: reads the index, writes nothing. The layout places a new model after the last
    committed one, so only space at the end can be reused.
    """
    committed = index.committed()
    olds = [m for m in committed if m.name in (name, retired_name(name))]
    others = [m for m in committed if m not in olds]
    label = f"{name}@{revision}"
    old_labels = ", ".join(m.label() for m in olds)
    if _fits(index.align, committed, name, revision, sources, volume_size) is None:
        if not olds:
            return SpacePlan("fresh")
        return SpacePlan("beside", why=(
            f"{label} fits beside {old_labels}: the older revision stays readable until "
            f"{label} is committed, then its space is released"))
    if olds and _fits(index.align, others, name, revision, sources, volume_size) is None:
        return SpacePlan("release", olds, why=(
            f"no room for {label} beside {old_labels}: released the older revision(s) of "
            f"{name} first (pods on this node still reading them must reload)"))
    alone = _fits(index.align, [], name, revision, sources, volume_size)
    if alone is not None:
        raise VolumeTooSmallError(f"model larger than the volume: {alone}",
                                  needed=alone.needed, available=alone.available)
    blocked = _fits(index.align, others, name, revision, sources, volume_size)
    assert blocked is not None  # else "release" (or "beside") above would have fit
    other_labels = ", ".join(m.label() for m in others)
    freed = (f"; releasing the older revision(s) of {name} ({old_labels}) would not "
             "help, because a new model is placed after the last committed one and "
             f"{other_labels} sits after them" if olds else "")
    raise VolumeTooSmallError(
        f"no room for {label}: it needs {format_size(blocked.needed)} but only "
        f"{format_size(blocked.available)} are free after the other model(s) on this "
        f"volume ({other_labels}). The sidecar never removes another model{freed}. Give "
        f"{name} a volume of its own or a larger one, or clear this one with "
        "csi-pmem-weights stage --replace (discards every model on it)",
        needed=blocked.needed, available=blocked.available)


def _apply(volume: Volume, index: Index, plan: SpacePlan, name: str) -> list[str]:
    """Make the index match the plan before staging; returns the labels released."""
    released = [m.label().replace(RETIRED_PREFIX, "", 1) for m in plan.release]
    if plan.why:
        _event(plan.why, space=plan.kind, released=released)
    current = index.find(name)
    if plan.release:
        index.models = [m for m in index.models if m not in plan.release]
    elif current is not None and current.state == COMMITTED:
        current.name = retired_name(name)  # keeps its bytes out of the allocator's way
    else:
        return released
    write_index(volume, index)
    return released


def _drop_retired(volume: Volume, name: str) -> list[str]:
    index = read_index(volume)
    if index is None:
        return []
    gone = [m for m in index.models if m.name == retired_name(name)]
    if not gone:
        return []
    index.models = [m for m in index.models if m not in gone]
    write_index(volume, index)
    labels = [f"{name}@{m.revision}" for m in gone]
    _event("released older revision(s) now that the wanted one is committed",
           released=labels)
    return labels


def _restore(volume: Volume, index: Index, name: str, revision: str,
             sources: list[SourceFile]) -> ModelEntry | None:
    """A rollback to the revision kept beside the current one: swap names, copy nothing."""
    for m in index.models:
        if m.name == retired_name(name) and _is_wanted(m, revision, sources):
            current = index.find(name)
            if current is not None and current.state == COMMITTED:
                current.name = retired_name(name)
            elif current is not None:
                index.models.remove(current)  # an abandoned staging entry
            m.name = name
            write_index(volume, index)
            return m
    return None


# --- verification ---------------------------------------------------------------------

def _spread(items: list[Any]) -> list[Any]:
    """``items`` reordered so that every prefix is spread over the whole list
    (bit-reversed positions: first, middle, quarters, ...)."""
    width = max(len(items) - 1, 1).bit_length()
    order = sorted(range(len(items)),
                   key=lambda i: (int(format(i, f"0{width}b")[::-1], 2), i))
    return [items[i] for i in order]


def _sample(chunks: list[checksum.Chunk], budget: int = SAMPLE_BUDGET) -> list[checksum.Chunk]:
    """First chunks (they hold the safetensors headers), then last chunks, spread over
    the files, until ``budget`` bytes: a constant cost whatever the model's size."""
    last = {c.file: c.index for c in chunks}
    firsts = [c for c in chunks if c.index == 0]
    lasts = [c for c in chunks if c.index and c.index == last[c.file]]
    picked: list[checksum.Chunk] = []
    used = 0
    for c in _spread(firsts) + _spread(lasts):
        if picked and used + c.length > budget:
            continue
        picked.append(c)
        used += c.length
    return picked


def verify_model(volume: Volume, model: ModelEntry, mode: str,
                 threads: int | None = None) -> tuple[list[checksum.Mismatch], int]:
    """(mismatches, bytes hashed): ``full``, ``none``, or ``sample`` (:func:`_sample`).

    The sample is cheap on purpose: the index already proved the model committed and
    complete, and every load verifies the chunks it reads (``start_load(verify=True)``).
    """
    if mode == "none":
        return [], 0
    chunks = checksum.model_chunks(model)
    if mode == "sample":
        chunks = _sample(chunks)
    bad = checksum.verify_chunks(volume, chunks, threads=threads)
    return bad, sum(c.length for c in chunks)


def _damage(model: ModelEntry, bad: list[checksum.Mismatch]) -> str:
    return (f"{len(bad)} chunk(s) of {model.label()} do not match their staged checksums, "
            f"first: {bad[0]}")


# --- one reconcile pass -----------------------------------------------------------------

@dataclass
class Outcome:
    """What a pass did: ``already-staged``, ``staged``, ``resumed``, ``repaired`` or
    ``restored``, with the bytes copied and reused, the revisions released and the
    seconds spent staging and verifying."""

    action: str
    model: ModelEntry
    copied: int = 0
    reused: int = 0
    released: list[str] = field(default_factory=list)
    space: str = ""
    verify_mode: str = ""
    verified_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


_DOING = {"staged": "staging", "resumed": "resuming", "repaired": "repairing"}


def _needs_write(volume: Volume, why: str, readonly_reason: str) -> None:
    if volume.writable:
        return
    raise ReadOnlyVolumeError(
        f"{why}, and {readonly_reason or 'the volume is read-only'}. The sidecar's "
        "publish must be writable: leave the pod volume's persistentVolumeClaim.readOnly "
        "unset (false) and do not use a ReadOnlyMany claim; put readOnly: true on the "
        "serving container's volumeMount instead (its loads map the volume read-only)")


def _timed_verify(volume: Volume, model: ModelEntry, mode: str, threads: int | None,
                  seconds: dict[str, float]) -> tuple[list[checksum.Mismatch], int]:
    t = time.monotonic()
    try:
        return verify_model(volume, model, mode, threads)
    finally:
        seconds["verify"] = seconds.get("verify", 0.0) + time.monotonic() - t


def ensure_model(volume: Volume, source: str, sources: list[SourceFile], name: str,
                 revision: str, *, verify_mode: str = "sample", threads: int | None = None,
                 progress: Callable[[int, int, str], None] | None = None,
                 readonly_reason: str = "",
                 on_phase: Callable[[str], None] | None = None) -> Outcome:
    """Make ``name@revision`` the committed, verified model ``name`` on the volume.

    Writes nothing when it already is (a warm restart); otherwise stages, resumes,
    repairs or restores it (see :class:`Outcome`) under the rules in the module
    docstring. Raises a :class:`LoaderError` that says what to change when it cannot.
    ``on_phase`` hears "staging" and "verifying" as they start.
    """
    phase = on_phase or (lambda _: None)
    seconds: dict[str, float] = {}
    t = time.monotonic()
    index = read_index(volume) or Index(align=volume.align)
    seconds["index"] = time.monotonic() - t
    current = index.find(name)
    label = f"{name}@{revision}"
    if _is_wanted(current, revision, sources):
        assert current is not None
        bad, hashed = _timed_verify(volume, current, verify_mode, threads, seconds)
        if not bad:
            released = _drop_retired(volume, name) if volume.writable else []
            return Outcome("already-staged", current, reused=current.size, released=released,
                           verify_mode=verify_mode, verified_bytes=hashed, seconds=seconds)
        _needs_write(volume, _damage(current, bad), readonly_reason)
        _event("the staged copy is damaged; copying the damaged files again",
               logging.WARNING, model=label, bad_chunks=len(bad), first=str(bad[0]))
        current.state = STAGING  # loads refuse it until the repair commits
        write_index(volume, index)
        action, plan = "repaired", SpacePlan("fresh")
    else:
        what = (f"the volume holds {current.label()} ({current.state})"
                if current is not None else "the volume does not hold it")
        _needs_write(volume, f"{label} must be staged ({what})", readonly_reason)
        restored = _restore(volume, index, name, revision, sources)
        if restored is not None:
            bad, hashed = _timed_verify(volume, restored, "full", threads, seconds)
            if bad:
                raise ChecksumError(_damage(restored, bad) + "; restart to stage it again")
            _event("restored the revision kept beside the current one", model=label)
            return Outcome("restored", restored, reused=restored.size, verify_mode="full",
                           released=_drop_retired(volume, name), verified_bytes=hashed,
                           seconds=seconds)
        if (current is not None and current.state == STAGING
                and current.revision == revision and _same_files(current, sources)):
            action, plan = "resumed", SpacePlan("fresh")
        else:
            if volume.growable:
                # An image file: room for the model beside the other models it holds,
                # so that releasing older revisions of this one is always enough.
                keep = [m for m in index.committed()
                        if m.name not in (name, retired_name(name))]
                volume.grow(required_size(Index(align=index.align, models=keep), sources))
            action, plan = "staged", plan_space(index, name, revision, sources, volume.size)
    released = _apply(volume, index, plan, name) if action == "staged" else []
    _event(f"{_DOING[action]} {label}", model=name, revision=revision, space=plan.kind)
    phase("staging")
    t = time.monotonic()
    result = stage(volume, source, name=name, revision=revision, threads=threads,
                   progress=progress)
    seconds["stage"] = time.monotonic() - t
    phase("verifying")
    bad, hashed = _timed_verify(volume, result.model, "full", threads, seconds)
    if bad:
        raise ChecksumError(_damage(result.model, bad) + " right after staging; the "
                            "volume may have media errors (check the node's kernel log)")
    released += _drop_retired(volume, name)
    return Outcome(action, result.model, copied=result.copied, reused=result.reused,
                   released=released, space=plan.why, verify_mode="full",
                   verified_bytes=hashed, seconds=seconds)


# --- status ----------------------------------------------------------------------------

def classify(exc: BaseException) -> str:
    """A short, stable name for the kind of failure (``/status`` ``error_kind``)."""
    if isinstance(exc, SourceError | SafetensorsFormatError):
        return "source"
    if isinstance(exc, ReadOnlyVolumeError):
        return "read-only"
    if isinstance(exc, VolumeTooSmallError):
        return "too-small"
    if isinstance(exc, VolumeError):
        return "dax-socket" if isinstance(exc.__cause__, daxclient.DaxSocketError) else "volume"
    if isinstance(exc, ChecksumError):
        return "checksum"
    if isinstance(exc, LayoutError):
        return "layout"
    return "error" if isinstance(exc, LoaderError | OSError) else "internal"


class Status:
    """What ``/status`` shows; updated by the worker, read by the HTTP threads."""

    def __init__(self, **initial: Any):
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {
            "state": "starting", "ready": False, "healthy": True, "model": None,
            "revision": None, "revision_from": None, "bytes": None, "bytes_done": 0,
            "bytes_copied": 0, "bytes_reused": 0, "action": None, "released": [],
            "space": "", "last_error": None, "error_kind": None, "attempts": 0,
            "startup_seconds": None, "phases": {}, "last_verified": None,
            "verify_mode": None, "needed": None, "available": None, "retry_in": None,
            "pid": os.getpid(), **initial}

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._data.update(fields)

    def phase(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data["phases"][name] = round(seconds, 4)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._data)

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data.get(key)


def process_age() -> float | None:
    """Seconds since this process started (interpreter start-up included)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class _Progress:
    """Staging progress into /status and, throttled, into the log."""

    def __init__(self, status: Status, interval: float = PROGRESS_INTERVAL):
        self.status, self.interval = status, interval
        self.started = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        self.status.update(state="staging", bytes_done=done, bytes=total)
        if total > done and 2 * done >= total:
            failpoints.hit(FP_STAGE_HALF)
        now = time.monotonic()
        if now - self.last < self.interval and done < total:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9) / 1e9
        _event("progress", bytes_done=done, bytes_total=total,
               percent=round(100 * done / total, 1) if total else 100.0,
               gbps=round(rate, 3), file=what)


# --- the HTTP endpoints -----------------------------------------------------------------

def parse_listen(text: str) -> tuple[str, int]:
    """``:8081``, ``0.0.0.0:8081``, ``127.0.0.1:0`` or ``[::]:8081`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: expected HOST:PORT or :PORT")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: invalid port {port!r}")
    return host.strip("[]"), number


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], status: Status):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.status = status
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "csi-pmem-sidecar"

    def do_GET(self) -> None:
        snap = self.server.status.snapshot()
        path = self.path.split("?", 1)[0]
        if path == "/readyz":
            reason = snap["last_error"] or f"state {snap['state']}"
            self._send(200 if snap["ready"] else 503,
                       "ok\n" if snap["ready"] else f"not ready: {reason}\n")
        elif path == "/healthz":
            self._send(200 if snap["healthy"] else 500,
                       "ok\n" if snap["healthy"] else f"unhealthy: {snap['last_error']}\n")
        elif path == "/status":
            self._send(200, json.dumps(snap, indent=1) + "\n", "application/json")
        else:
            self._send(404, "not found: try /readyz, /healthz or /status\n")

    def _send(self, code: int, body: str, ctype: str = "text/plain; charset=utf-8") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


# --- the process ------------------------------------------------------------------------

@dataclass
class Config:
    volume: str
    source: str
    name: str
    revision: str | None = None
    fingerprint: str = "sample"
    listen: tuple[str, int] | None = ("", 8081)
    ready_file: str | None = None
    verify_interval: float = 0.0
    verify_on_start: str = "sample"
    threads: int | None = None
    once: bool = False


def _open_for_staging(path: str) -> tuple[Volume, str]:
    """The volume writable when it can be, else read-only plus the reason: a read-only
    volume that already holds the wanted revision needs no write to be ready. A
    directory volume's image file is created here when missing."""
    try:
        return open_for_staging(path), ""
    except ReadOnlyVolumeError as exc:
        try:
            return open_volume(path), str(exc)
        except VolumeError:
            if volume_image(path) is None:
                raise
            raise exc from None  # no image, and none can be made: say why not


class Sidecar:
    """The worker thread reconciles and re-verifies; the main thread waits for signals."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.status = Status(model=cfg.name, volume=cfg.volume, source=cfg.source)
        self.stop = threading.Event()
        self.done = threading.Event()
        self.wake = threading.Event()  # set by a signal or by the worker ending
        self.busy = threading.Event()  # set while the worker may be writing the volume
        self.exit_code = 0
        self.server: _Server | None = None

    # One pass: scan, fingerprint, open, lock, ensure, report.
    def reconcile(self, verify_mode: str | None = None) -> Outcome:
        cfg, st = self.cfg, self.status
        started = time.monotonic()
        st.update(state="scanning", phases={})
        with self._phase("scan"):
            if not os.path.isdir(cfg.source):
                missing = "does not exist" if not os.path.exists(cfg.source) else \
                    "is not a directory"
                raise SourceError(
                    f"source {cfg.source} {missing}: mount the model files there (a "
                    "read-only PVC, an image volume) or fix --source")
            try:
                sources = scan_source(cfg.source)
            except LoaderError as exc:  # its messages name the file already
                raise SourceError(str(exc)) from exc
        with self._phase("fingerprint"):
            revision = cfg.revision or fingerprint(sources, cfg.fingerprint, cfg.threads)
        st.update(revision=revision, bytes=sum(s.size for s in sources),
                  revision_from="--revision" if cfg.revision else
                  f"fingerprint ({cfg.fingerprint})")
        with self._phase("open"):
            volume, readonly_reason = _open_for_staging(cfg.volume)
        with volume, volume_lock(cfg.volume) as waited:
            st.phase("lock", waited)
            volume.refresh()  # an image file another stager grew while we waited
            st.update(state="checking")
            self.busy.set()
            try:
                outcome = ensure_model(
                    volume, cfg.source, sources, cfg.name, revision,
                    verify_mode=verify_mode or cfg.verify_on_start, threads=cfg.threads,
                    progress=_Progress(st), readonly_reason=readonly_reason,
                    on_phase=lambda name: st.update(state=name))
            finally:
                self.busy.clear()
            writable = volume.writable
        for phase, secs in outcome.seconds.items():
            st.phase(phase, secs)
        st.phase("total", time.monotonic() - started)
        _event("model ready", model=cfg.name, revision=revision, action=outcome.action,
               bytes=outcome.model.size, copied=outcome.copied, reused=outcome.reused,
               released=outcome.released, verify=outcome.verify_mode,
               verified_bytes=outcome.verified_bytes, phases=st.get("phases"),
               writable=writable)
        return outcome

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.status.phase(name, time.monotonic() - t)

    def _attempt(self, verify_mode: str | None = None) -> bool:
        st = self.status
        st.update(attempts=st.get("attempts") + 1)
        try:
            outcome = self.reconcile(verify_mode)
        except (LoaderError, OSError) as exc:
            self._not_ready("error", exc)
            return False
        age = process_age()
        st.update(state="ready", ready=True, last_error=None, error_kind=None,
                  needed=None, available=None, action=outcome.action,
                  bytes=outcome.model.size, bytes_done=outcome.model.size,
                  bytes_copied=outcome.copied, bytes_reused=outcome.reused,
                  released=outcome.released, space=outcome.space,
                  verify_mode=outcome.verify_mode, last_verified=time.time())
        if st.get("startup_seconds") is None:
            st.update(startup_seconds=round(age, 3) if age is not None else None)
            _event("ready", startup_seconds=st.get("startup_seconds"),
                   action=outcome.action, phases=st.get("phases"))
        self._ready_file(True)
        return True

    def _not_ready(self, state: str, exc: BaseException | str) -> None:
        message = str(exc)
        kind = classify(exc) if isinstance(exc, BaseException) else state
        extra = {}
        if isinstance(exc, VolumeTooSmallError):
            extra = {"needed": exc.needed, "available": exc.available}
        self.status.update(state=state, ready=False, last_error=message, error_kind=kind,
                           **extra)
        self._ready_file(False)
        _event("not ready", logging.ERROR, state=state, error_kind=kind, error=message,
               **extra)

    def _ready_file(self, ready: bool) -> None:
        path = self.cfg.ready_file
        if not path:
            return
        if not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        snap = self.status.snapshot()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model": snap["model"], "revision": snap["revision"],
                       "ready_at": time.time()}, f)
        os.replace(tmp, path)

    def _recheck(self) -> None:
        """Periodic: is our revision still the committed one, and are its bytes intact?"""
        cfg, st = self.cfg, self.status
        revision = st.get("revision")
        started = time.monotonic()
        try:
            with open_volume(cfg.volume) as volume:
                index = read_index(volume)
                model = index.find(cfg.name) if index else None
                if model is None or model.state != COMMITTED or model.revision != revision:
                    have = model.label() + f" ({model.state})" if model else "nothing"
                    self._not_ready("superseded", f"{cfg.name}@{revision} is no longer the "
                                    f"committed model on the volume (it holds {have}); "
                                    "another stager replaced it. Restart this pod to "
                                    "stage its revision again")
                    return
                bad, hashed = verify_model(volume, model, "full", cfg.threads)
        except (LoaderError, OSError) as exc:
            self._not_ready("error", exc)
            return
        if bad:
            self._not_ready("damaged", ChecksumError(_damage(model, bad)))
            self._attempt("full")  # copies the damaged files again (when writable)
            return
        seconds = time.monotonic() - started
        if not st.get("ready"):
            self._attempt()
        st.update(last_verified=time.time(), verify_mode="full")
        _event("re-verified", model=model.label(), bytes=hashed, seconds=round(seconds, 3))

    def _work(self) -> None:
        """Reconcile until ready (retrying with backoff), then re-verify or idle."""
        try:
            delay = 1.0
            while not self.stop.is_set() and not self._attempt():
                if self.cfg.once:
                    self.exit_code = 1
                    return
                self.status.update(retry_in=delay)
                if self.stop.wait(delay):
                    return
                delay = min(delay * 2, MAX_BACKOFF)
            self.status.update(retry_in=None)
            if self.cfg.once:
                return
            if not self.cfg.verify_interval:
                self.stop.wait()
            while not self.stop.wait(self.cfg.verify_interval):
                self._recheck()
        except BaseException as exc:  # a bug: say so and exit non-zero; kubelet restarts us
            log.exception("sidecar worker failed")
            self.status.update(healthy=False, ready=False, state="failed",
                               last_error=f"internal error: {exc!r}", error_kind="internal")
            self.exit_code = 1
        finally:
            self.done.set()
            self.wake.set()

    def _serve(self) -> bool:
        if self.cfg.listen is None:
            return True
        try:
            self.server = _Server(self.cfg.listen, self.status)
        except OSError as exc:
            _event("cannot listen", logging.ERROR, listen=list(self.cfg.listen),
                   error=str(exc))
            return False
        host, port = self.server.server_address[:2]
        _event("listening", address=f"{host}:{port}", port=port)
        threading.Thread(target=self.server.serve_forever, name="http", daemon=True).start()
        return True

    def run(self) -> int:
        cfg = self.cfg
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)
        self._ready_file(False)  # a file left by an earlier run says nothing about now
        _event("sidecar starting", volume=cfg.volume, source=cfg.source, model=cfg.name,
               revision=cfg.revision or f"(fingerprint: {cfg.fingerprint})",
               verify_on_start=cfg.verify_on_start, verify_interval=cfg.verify_interval,
               pid=os.getpid())
        if not self._serve():
            return 1
        threading.Thread(target=self._work, name="sidecar", daemon=True).start()
        while not self.wake.wait(1.0):
            pass
        if self.stop.is_set():
            self._shutdown()
        if cfg.once:
            print(json.dumps(self.status.snapshot(), indent=1), flush=True)
        return self.exit_code

    def _signalled(self, signum: int, _frame: object) -> None:
        self.stop_signal = signal.Signals(signum).name
        self.state_at_stop = self.status.get("state")
        self.status.update(state="stopping", ready=False)
        self.stop.set()
        self.wake.set()

    def _shutdown(self) -> None:
        """Exit 0 at once. A copy in flight is abandoned, which staging is built for: the
        entry stays ``staging`` (loads refuse it) and the next start resumes it. No
        thread is waited for: copy and hash pools would hold the exit for minutes."""
        _event("stopping", signal=getattr(self, "stop_signal", "?"),
               state=getattr(self, "state_at_stop", None), interrupted=self.busy.is_set())
        self._ready_file(False)
        if self.server is not None:
            self.server.server_close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --- logging and the command line -------------------------------------------------------

def configure_logging(fmt: str) -> None:
    """The project's log format (:mod:`csi_pmem.logs`) on the handlers already set up,
    at INFO at least: the sidecar's events are what its operators read."""
    root = logging.getLogger()
    formatter = logs.formatter(fmt)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(formatter)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--volume", required=True, metavar="PATH",
                   help="the PMEM volume: its mount directory (a devdax volume's, with "
                        "dax.sock, or an fsdax file system volume's, which gets the image "
                        "file csi-pmem-weights.img), a device or a plain file; must be "
                        "writable to stage")
    p.add_argument("--source", required=True, metavar="DIR",
                   help="directory holding the model files")
    p.add_argument("--name", required=True, metavar="NAME", help="model name on the volume")
    p.add_argument("--revision", default=None, metavar="REV",
                   help="wanted revision (default: a fingerprint of the source)")
    p.add_argument("--fingerprint", choices=FINGERPRINTS, default="sample",
                   help="without --revision: sample (headers plus a few MiB of data; "
                        "default) or full (hash every byte of the source)")
    p.add_argument("--listen", type=parse_listen, default=("", 8081), metavar="[HOST]:PORT",
                   help="HTTP address for /readyz, /healthz, /status (default :8081)")
    p.add_argument("--ready-file", default=None, metavar="PATH",
                   help="write this file (JSON: model, revision) while ready")
    p.add_argument("--verify-interval", type=_seconds, default=0.0, metavar="SECONDS",
                   help="re-verify every byte of the model every SECONDS (0: never)")
    p.add_argument("--verify-on-start", choices=VERIFY_MODES, default="sample",
                   help="checks of an already staged model at start: sample (at most "
                        "256 MiB of checksum chunks, headers first; default), full, none")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="copy and hash threads")
    p.add_argument("--once", action="store_true",
                   help="stage/verify, print the status as JSON and exit (0 when ready)")
    p.add_argument("--log-format", choices=("json", "text"), default="json")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    cfg = Config(volume=args.volume, source=args.source, name=args.name,
                 revision=args.revision, fingerprint=args.fingerprint,
                 listen=None if args.once else args.listen, ready_file=args.ready_file,
                 verify_interval=args.verify_interval, verify_on_start=args.verify_on_start,
                 threads=args.threads, once=args.once)
    return Sidecar(cfg).run()


__all__ = ["FP_STAGE_HALF", "Config", "Outcome", "Sidecar", "SourceError", "SpacePlan",
           "add_arguments", "ensure_model", "fingerprint", "plan_space", "run",
           "verify_model", "volume_lock"]
