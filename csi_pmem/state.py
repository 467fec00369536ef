"""Per-volume records on disk: what the device cannot remember.

Why: the namespace (named with the volume id) is the truth about allocation, but the
CSI name, the requested size, the parameters and the publish targets live nowhere on
the device. Each volume gets one small JSON file, written *before* the driver acts
(so a crash leaves an intent that start-up can finish or roll back) and atomically
(temp file, fsync, rename, fsync of the directory: a crash never leaves a torn record).

Regions get a record too (:class:`RegionRecord`, ``regions/<pool>.json``), written the
same way: whether the region's free space is known to read as zeros, which is what lets
CreateVolume skip zeroing (:mod:`csi_pmem.cleanspace` owns its rules).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    # DELETING: the erase was verified and only the destroy is left, so a resumed delete
    # destroys without erasing again. It also resumes a destroy cut short after ndctl's
    # disable-namespace, whose device is gone and could not be erased again anyway.
    erased: bool = False

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
    """What the driver knows about one region's free space (see csi_pmem.cleanspace).

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
    """Temp file, fsync, rename, fsync of the directory: all or nothing after a crash."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    """A directory of ``<volume id>.json`` records with atomic, durable writes, and one
    of ``<pool>.json`` region records beside it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root) / "volumes"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.regions_root = Path(root) / "regions"
        self.regions_root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, volume_id: str) -> Path:
        if not _ID.match(volume_id):
            raise ValueError(f"not a volume id: {volume_id!r}")
        return self.root / f"{volume_id}.json"

    def get(self, volume_id: str) -> VolumeRecord | None:
        try:
            return VolumeRecord.from_json(self.path(volume_id).read_text())
        except FileNotFoundError:
            return None

    def put(self, record: VolumeRecord) -> None:
        write_atomic(self.path(record.id), record.to_json().encode())

    def delete(self, volume_id: str) -> None:
        try:
            self.path(volume_id).unlink()
        except FileNotFoundError:
            return
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
        fsync_dir(self.root)

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
        write_atomic(self.region_path(record.pool), record.to_json().encode())

    def all_regions(self) -> list[RegionRecord]:
        out = []
        for p in sorted(self.regions_root.glob("*.json")):
            rec = self.get_region(p.stem)
            if rec is not None:
                out.append(rec)
        return out
