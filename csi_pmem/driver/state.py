"""Per-volume records on disk: what the device cannot remember.

Why: the namespace (named with the volume id) is the truth about allocation, but the
CSI name, the requested size, the parameters and the publish targets live nowhere on
the device. Each volume gets one small JSON file, written *before* the driver acts
(so a crash leaves an intent that start-up can finish or roll back) and atomically
(temp file, fsync, rename, fsync of the directory: a crash never leaves a torn record).

Regions get a record too (:class:`RegionRecord`, ``regions/<pool>.json``), written the
same way: whether the region's free space is known to read as zeros, which is what lets
CreateVolume skip zeroing (:mod:`csi_pmem.driver.erasing.cleanspace` owns its rules).

Because every mutating RPC writes a record before it acts, a full, over-quota or
read-only state directory stops them all. :class:`StateStore` says so in the RPC's
status (RESOURCE_EXHAUSTED or FAILED_PRECONDITION naming the state directory and what
it needs), not as an INTERNAL error whose reason is only in the log; a failed write
leaves nothing behind (its temp file is removed, and temp files a crash left are
removed at start-up), so the driver carries on without a restart once there is room.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from csi_pmem import failpoints
from csi_pmem.durable import fsync_dir
from csi_pmem.errors import CsiPmemError, FailedPrecondition, from_os_error

log = logging.getLogger(__name__)

# Volume states. CREATING only stays after a crash; DELETING means deleted for the CO
# (gone from ListVolumes) while the erase and destroy finish in the background.
CREATING, READY, DELETING = "creating", "ready", "deleting"
# Publish states, per target.
PUBLISHING, PUBLISHED, UNPUBLISHING = "publishing", "published", "unpublishing"
# Stage states, per staging path (fsdax file systems only).
STAGING, STAGED = "staging", "staged"
# What a publication is: devdax's tmpfs with dax.sock, an fsdax block device bound onto
# a file, or a bind mount of an fsdax file system staged at ``staging``.
DAX, BLOCK, MOUNT = "dax", "block", "mount"

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# Volume ids: the prefix and 32 hex digits of the CSI name's SHA-256, so that a retried
# CreateVolume finds its volume and the id is a valid namespace alt-name.
VOLUME_ID_PREFIX = "pmem-"


def volume_id_for(name: str) -> str:
    """Deterministic id (37 chars, a valid namespace alt-name) for a CSI volume name."""
    return VOLUME_ID_PREFIX + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def is_volume_id(text: str) -> bool:
    rest = text[len(VOLUME_ID_PREFIX):]
    return (text.startswith(VOLUME_ID_PREFIX) and len(rest) == 32
            and all(c in "0123456789abcdef" for c in rest))
TMP_SUFFIX = ".tmp"  # write_atomic's temp files: .<name>.<random>.tmp beside it
# What the state directory needs room for, said when it has none.
NEEDS = ("the driver writes a small record (about 1 KiB) per volume there before every "
         "create, delete, stage and publish, and cannot act without it")


@dataclass
class Publication:
    target: str
    readonly: bool
    state: str = PUBLISHING
    pod_uid: str | None = None
    mount_group: int | None = None
    access_mode: str = ""
    kind: str = DAX
    staging: str = ""
    view: str = ""  # read-only Block publication: the read-only loop device bound there


@dataclass
class Stage:
    """An fsdax file system mounted (with -o dax where the device can) at ``path``."""

    path: str
    fs_type: str
    mount_flags: list[str] = field(default_factory=list)
    state: str = STAGING
    dax: bool = True


@dataclass
class VolumeRecord:
    id: str
    name: str
    state: str
    params: dict
    required_bytes: int
    limit_bytes: int = 0
    pool: str = ""
    numa_node: int = -1
    size: int = 0
    usable_size: int = 0
    align: int = 0
    device: str = ""
    created_at: float = field(default_factory=time.time)
    publications: dict[str, Publication] = field(default_factory=dict)
    stages: dict[str, Stage] = field(default_factory=dict)
    # fsdax: published as a raw block device at least once (its data may carry no
    # file-system signature, so it is never formatted); a mkfs was started and has not
    # yet been followed by a successful mount (a retry formats again).
    block_used: bool = False
    formatting: bool = False
    # fsdax: the file system CreateVolume's mount capability named (empty: none named),
    # what NodeStageVolume makes when its own capability names none.
    fs_type: str = ""
    # DELETING: the erase was verified and only the destroy is left, so a resumed delete
    # destroys without erasing again. It also resumes a destroy cut short after ndctl's
    # disable-namespace, whose device is gone and could not be erased again anyway.
    erased: bool = False
    # Volatile pools (csi_pmem.driver.backends.base, Pool.media): the Unix time the driver found
    # this volume's contents lost (a node restart, or its pool reset) and carved it again,
    # empty; 0 if never. Kept for the volume's life, so its condition says so after every
    # driver restart. ``recreating``: written before that carve and cleared once the new
    # namespace is zeroed, so a crash in between makes the next start zero it again
    # before anyone is served from it.
    contents_lost_at: float = 0.0
    recreating: bool = False

    @property
    def device_mode(self) -> str:
        return self.params.get("deviceMode", "devdax")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> VolumeRecord:
        raw = json.loads(text)
        pubs = {t: Publication(**p) for t, p in raw.pop("publications", {}).items()}
        stages = {t: Stage(**s) for t, s in raw.pop("stages", {}).items()}
        return cls(**raw, publications=pubs, stages=stages)


@dataclass
class RegionRecord:
    """What the driver knows about one region's free space (see csi_pmem.driver.erasing.cleanspace).

    ``clean``: every byte of free space reads as zeros. ``free``: the free bytes the
    driver last saw after its own change; more free space than that later means someone
    else destroyed a namespace there. ``generation`` grows on every change to dirty, so
    a scrub that started before it cannot mark the region clean. ``scrub``: names of the
    scratch namespaces a scrub is about to create or holds (the write-ahead intent).
    """

    pool: str
    clean: bool
    reason: str = ""
    free: int = -1
    generation: int = 0
    scrub: list[str] = field(default_factory=list)
    updated_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RegionRecord:
        return cls(**json.loads(text))


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync of the directory: all or nothing after a crash.

    Any failure (a full file system, EIO, a signal) removes the temp file before the
    error goes up, so a failed write leaves ``path`` as it was and nothing beside it.
    Each write makes a fresh temp file of its own (``.<name>.<random>.tmp``, created
    exclusively, never through a symlink): one a crash left behind can neither fail nor
    redirect a later write, and :class:`StateStore` removes those at start-up. A short
    write (what a nearly full file system returns before ENOSPC) is continued, never
    renamed into place torn.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                     | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            failpoints.hit(failpoints.STATE_WRITE, tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        _remove_tmp(tmp)
        raise
    fsync_dir(path.parent)


def _remove_tmp(tmp: Path) -> None:
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # the original error is the one to report
        log.error("cannot remove temp file %s: %s", tmp, exc.strerror)




class StateStore:
    """A directory of ``<volume id>.json`` records with atomic, durable writes, and one
    of ``<pool>.json`` region records beside it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.base = Path(root)  # the state directory (--state-dir), named in errors
        self.root = self.base / "volumes"
        self.regions_root = self.base / "regions"
        for directory in (self.root, self.regions_root):
            try:
                directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                stale = sorted(directory.glob(f".*{TMP_SUFFIX}"))
            except OSError as exc:
                raise self._error(exc, f"cannot create {directory}") from exc
            for tmp in stale:  # a write a crash cut short: its record is the old one
                log.info("removing %s, left by a write that a crash cut short", tmp)
                _remove_tmp(tmp)

    def _error(self, exc: OSError, doing: str) -> CsiPmemError:
        """``exc`` on the state directory, as an error naming it and what it needs."""
        doing = f"{doing} in the state directory {self.base}"
        if exc.errno == errno.ENOENT:
            gone = Path(exc.filename).parent if isinstance(exc.filename, str) else self.root
            return FailedPrecondition(
                f"{doing}: {gone} is gone ({exc.strerror}); was the "
                "state directory removed while the driver runs? Restart the driver to "
                "create it again (records removed with it are lost: their namespaces are "
                "then reported as orphans)")
        # The directory written to: its own file system where one is mounted there.
        fs = Path(exc.filename).parent if isinstance(exc.filename, str) else self.base
        return from_os_error(exc, doing, fs=str(fs), needs=NEEDS)

    def path(self, volume_id: str) -> Path:
        if not _ID.match(volume_id):
            raise ValueError(f"not a volume id: {volume_id!r}")
        return self.root / f"{volume_id}.json"

    def get(self, volume_id: str) -> VolumeRecord | None:
        path = self.path(volume_id)
        try:
            return VolumeRecord.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(exc, f"cannot read the record of volume {volume_id}") from exc

    def put(self, record: VolumeRecord) -> None:
        try:
            write_atomic(self.path(record.id), record.to_json().encode())
        except OSError as exc:
            raise self._error(exc, f"cannot save the record of volume {record.id}") from exc

    def delete(self, volume_id: str) -> None:
        try:
            self.path(volume_id).unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error(exc, f"cannot remove the record of volume {volume_id}") \
                from exc
        self._fsync_dir()

    def all(self) -> list[VolumeRecord]:
        """Every readable record; unreadable ones are logged and skipped, never deleted."""
        records = []
        for p in sorted(self.root.glob("*.json")):
            try:
                records.append(VolumeRecord.from_json(p.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.error("state record %s is unreadable and is left alone: %s", p, exc)
        return records

    def _fsync_dir(self) -> None:
        try:
            fsync_dir(self.root)
        except OSError as exc:
            raise self._error(exc, f"cannot persist a change to {self.root}") from exc

    # -- regions --------------------------------------------------------------------
    def region_path(self, pool: str) -> Path:
        if not _ID.match(pool):
            raise ValueError(f"not a region name: {pool!r}")
        return self.regions_root / f"{pool}.json"

    def get_region(self, pool: str) -> RegionRecord | None:
        """The region's record; None if never written (or unreadable: logged, and then
        treated as unknown, which is the safe side)."""
        path = self.region_path(pool)
        try:
            return RegionRecord.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            log.error("region record %s is unreadable; the region counts as dirty: %s",
                      path, exc)
            return None

    def put_region(self, record: RegionRecord) -> None:
        record.updated_at = time.time()
        try:
            write_atomic(self.region_path(record.pool), record.to_json().encode())
        except OSError as exc:
            raise self._error(
                exc, f"cannot save the clean-space record of region {record.pool}") from exc

    def all_regions(self) -> list[RegionRecord]:
        out = []
        for p in sorted(self.regions_root.glob("*.json")):
            rec = self.get_region(p.stem)
            if rec is not None:
                out.append(rec)
        return out
