"""Emulated back end: devdax-like namespaces as files in per-NUMA pools.

Why: the host kernel of a laptop, a CI runner or a GPU node without NVDIMMs has no
device-dax, yet the driver, its tests and the weight cache must behave exactly as on
PMEM. Each configured region is a directory ``<root>/region<N>`` with a fixed
capacity; each namespace is one file ``<volume id>~<align>.dax`` of its raw size,
space reserved with fallocate, so the fd a client receives maps the volume from offset
0 just like ``/dev/daxX.Y``. Sizing, alignment, naming, erase and restart behaviour
follow the ndctl back end: the same struct-page overhead is charged so usable sizes
and capacity add up the same way.

``free_space="reuse"`` makes the pools behave like media: a destroyed namespace's file
is kept as free space (``free-<hex>.free``, not counted as used) and the next namespace
that fits in it gets it back, old bytes and all, so the driver's clean-space ledger and
erases are tested for real (with ``"fresh"``, the default, every namespace is a new
zero-filled file and the driver never needs to zero on create). A create that fits in
no free file takes fresh space and drops the free files of its region: the bytes it
covers are gone, as if overwritten. Scratch namespaces (``<name>~<align>.raw``) are
plain files the driver's scrub zeroes.

``device_type="loop"`` additionally attaches each file to a loop device and hands out
the loop device: a real device node, so device-cgroup rules apply to it exactly as to
``/dev/daxX.Y`` (used by the fd-passing tests). Loop devices come from the
:class:`~csi_pmem.driver.host.mounter.LoopDevices` it is given: the host's by default, a fake in
unit tests (which then need no root).

``media`` says what a node restart does to the pools (``Pool.media``): ``volatile`` for
a root on tmpfs, ramfs or hugetlbfs, whose files are gone after a reboot or a remount
(the README's weight cache on GPU nodes), ``persistent`` for a root on a disk file
system. ``auto`` decides from the file system that holds the root, once at start-up
(:func:`media_of`). A volatile region whose directory has vanished (the tmpfs was
mounted again, empty) is made again, empty, as a reset region would come back.

fsdax namespaces (``<volume id>~<align>.fsdax``) are always attached to a loop device,
limited to the usable size: a real block device, so kubelet's raw-block path (its own
loop attach, the device cgroup) and mkfs/mount run exactly as on ``/dev/pmemX.Y``. A
loop device has no DAX, so ``Namespace.fs_dax`` is False and file systems on it are
mounted without ``-o dax``; the DAX mount itself is exercised on real libnvdimm in the
VM tier.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

from csi_pmem.driver.backends.base import (
    MEDIA,
    PERSISTENT,
    REASON_DISABLED,
    REASON_OVERCOMMITTED,
    VOLATILE,
    Backend,
    Namespace,
    Pool,
    open_node,
)
from csi_pmem.driver.host.mounter import HostMounter, LoopDevices
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
    InvalidArgument,
    ResourceExhausted,
)
from csi_pmem.mountinfo import MOUNTINFO, mountinfo
from csi_pmem.sizes import REGION_ALIGN, describe_size, devdax_usable, parse_quantity, round_down

log = logging.getLogger(__name__)

LABEL_SLOTS_PER_REGION = 510  # what one NVDIMM's label area holds (docs/design.md §4)
SUFFIXES = {".dax": "devdax", ".fsdax": "fsdax"}
SUFFIX_FOR = {mode: suffix for suffix, mode in SUFFIXES.items()}
TMP_SUFFIX = ".tmp"  # a backing file being allocated: not a namespace yet
SCRATCH_SUFFIX = ".raw"  # a scratch namespace of the driver's scrub: used, never listed
FREE_SUFFIX = ".free"  # free_space="reuse": a destroyed namespace's bytes, free again
FREE_SPACE = ("fresh", "reuse")
# File systems whose contents are memory: gone when the node restarts or they are
# mounted again. Anything else is taken to keep its files.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
AUTO = "auto"


def file_system_of(path: str | os.PathLike, table: str = MOUNTINFO) -> str:
    """The type of the file system holding ``path`` (its longest mount-point prefix)."""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    for m in mountinfo(table):
        point = m.mount_point.rstrip("/") or "/"
        inside = real == point or real.startswith(point + "/") or point == "/"
        if inside and len(point) >= best:  # the later of two equal mounts is on top
            best, fstype = len(point), m.fstype
    return fstype


def media_of(root: str | os.PathLike, setting: str = AUTO, table: str = MOUNTINFO) -> str:
    """``setting`` unless it is ``auto``: then volatile on a memory file system."""
    if setting != AUTO:
        return setting
    return VOLATILE if file_system_of(root, table) in MEMORY_FILE_SYSTEMS else PERSISTENT


def parse_regions(spec: str) -> dict[int, int]:
    """Parse ``"0=2Gi,1=2Gi"`` into {numa node: bytes}, rounded down to the region align."""
    regions: dict[int, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        node, sep, size = item.partition("=")
        if not sep or not node.strip().isdecimal():
            raise InvalidArgument(
                f"invalid emulated region {item!r}: use NUMA=SIZE, for example 0=2Gi,1=2Gi")
        n = int(node)
        if n in regions:
            raise InvalidArgument(f"emulated region for NUMA node {n} given twice")
        nbytes = round_down(parse_quantity(size), REGION_ALIGN)
        if nbytes <= 0:
            raise InvalidArgument(f"emulated region {item!r} is smaller than 16Mi")
        regions[n] = nbytes
    if not regions:
        raise InvalidArgument("no emulated regions configured (for example 0=2Gi,1=2Gi)")
    return regions


class EmulatedBackend(Backend):
    kind = "emulated"

    def __init__(self, root: str | os.PathLike, regions: dict[int, int],
                 device_type: str = "file", loops: LoopDevices | None = None,
                 free_space: str = "fresh", media: str = AUTO) -> None:
        if device_type not in ("file", "loop"):
            raise InvalidArgument(f"invalid emulated device type {device_type!r}: file or loop")
        if free_space not in FREE_SPACE:
            raise InvalidArgument(f"invalid emulated free space {free_space!r}: fresh or reuse")
        if media not in (AUTO, *MEDIA):
            raise InvalidArgument(f"invalid emulated media {media!r}: auto, persistent or "
                                  "volatile")
        self.reuse = free_space == "reuse"
        # Fresh files read as zeros: then no erase is needed on create.
        self.zeroes_new_namespaces = not self.reuse
        self.root = Path(root)
        self.regions = dict(sorted(regions.items()))
        self.device_type = device_type
        self.loops = loops or HostMounter()
        # Serialises loop attach/detach with unlinking backing files: listings attach
        # loop devices on demand and run outside the driver's node lock.
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self.media_setting = media
        fstype = file_system_of(self.root)
        self.media = media_of(self.root, media)
        self._log_media(media, fstype)
        for node in self.regions:
            region = self._dir(f"region{node}")
            region.mkdir(parents=True, exist_ok=True)
            for stale in region.glob(f".*{TMP_SUFFIX}"):  # a create cut short by a crash
                stale.unlink(missing_ok=True)

    def _log_media(self, media: str, fstype: str | None) -> None:
        log.info("emulated pools under %s are %s (%s)", self.root, self.media,
                 f"--emulated-media {media}" if media != AUTO else
                 f"on {fstype or 'an unknown file system'}")

    # -- layout -------------------------------------------------------------------
    def _dir(self, pool: str) -> Path:
        return self.root / pool

    def _files(self, pool: str) -> list[Path]:
        """Backing files that hold space: namespaces and scratch namespaces."""
        try:
            return sorted(p for p in self._dir(pool).iterdir()
                          if p.suffix in SUFFIXES or p.suffix == SCRATCH_SUFFIX)
        except FileNotFoundError:
            return []  # the region's directory is gone (see _region_ready)

    def _region_ready(self, pool: str) -> str | None:
        """None when the region's directory exists, else why the region is unusable.

        A volatile root that was mounted again lost its region directories with their
        files: the region comes back empty, as reset memory does. On a persistent
        root a vanished directory is damage to report, not to paper over.
        """
        region = self._dir(pool)
        if region.is_dir():
            return None
        if self.media == VOLATILE:
            fstype = file_system_of(self.root)
            if self.media_setting == AUTO and fstype not in MEMORY_FILE_SYSTEMS:
                return (f"the region directory {region} is missing and {self.root} is no "
                        f"longer on a memory file system (now {fstype or 'unknown'}): "
                        "mount it again")
            try:
                region.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                return f"cannot make the region directory {region} again: {exc.strerror}"
            log.warning("emulated region directory %s was gone (the volatile root was "
                        "emptied); made again, empty", region)
            return None
        return (f"the region directory {region} is missing (was {self.root} emptied or "
                "unmounted?); restore it or restart the driver on the right root")

    def _free_files(self, pool: str) -> list[tuple[Path, int]]:
        out = []
        for p in self._dir(pool).glob(f"*{FREE_SUFFIX}"):
            try:
                out.append((p, p.stat().st_size))
            except FileNotFoundError:
                continue
        return sorted(out, key=lambda item: item[1])

    def _named(self, name: str) -> list[Path]:
        """Every backing file carrying ``name`` (namespace or scratch), in any pool."""
        return [p for node in self.regions for p in self._files(f"region{node}")
                if p.stem.rpartition("~")[0] == name]

    def _sized_files(self, pool: str) -> list[tuple[Path, int]]:
        """Backing files with their sizes, skipping any destroyed since the listing.

        Reads are not under the driver's node lock, so a concurrent destroy may unlink
        a file between the glob and the stat: it is gone, not an error.
        """
        sized = []
        for path in self._files(pool):
            try:
                sized.append((path, path.stat().st_size))
            except FileNotFoundError:
                continue
        return sized

    @staticmethod
    def _parse_file(path: Path) -> tuple[str, int, str] | None:
        """(name, align, mode) from ``<name>~<align><suffix>``; None for other files."""
        mode = SUFFIXES.get(path.suffix)
        name, sep, align = path.stem.rpartition("~")
        if mode is None or not sep or not align.isdecimal() or not name:
            return None
        return name, int(align), mode

    # -- Backend ------------------------------------------------------------------
    def pools(self) -> list[Pool]:
        pools = []
        for node, size in self.regions.items():
            name = f"region{node}"
            missing = self._region_ready(name)
            used = sum(size for _, size in self._sized_files(name))
            free = max(0, size - used)
            problem, reasons = missing, (REASON_DISABLED,) if missing else ()
            if missing:
                free = 0
            elif used > size:
                problem = (f"namespaces use {used} bytes but the region is configured with "
                           f"{size}; enlarge --emulated-regions for NUMA node {node}")
                reasons = (REASON_OVERCOMMITTED,)
            pools.append(Pool(name=name, numa_node=node, size=size, free=free,
                              largest_extent=free, align=REGION_ALIGN, problem=problem,
                              reasons=reasons, label_slots=LABEL_SLOTS_PER_REGION,
                              media=self.media))
        return pools

    def namespaces(self) -> list[Namespace]:
        attached = self._loop_map() if self._has_loops() else {}
        result = []
        for node in self.regions:
            pool = f"region{node}"
            for path, size in self._sized_files(pool):
                parsed = self._parse_file(path)
                if parsed is None:
                    continue
                name, align, mode = parsed
                usable = devdax_usable(size, align)
                device = str(path)
                if self._uses_loop(mode):
                    loop = attached.get(str(path)) or self._attach(path, mode, usable)
                    if not loop:
                        continue  # destroyed since the listing
                    device = loop
                result.append(Namespace(name=name, pool=pool, numa_node=node, size=size,
                                        usable_size=usable, align=align, device=device,
                                        handle=str(path), mode=mode, fs_dax=False))
        return result

    def _uses_loop(self, mode: str) -> bool:
        return mode == "fsdax" or self.device_type == "loop"

    def create(self, name: str, pool: str, size: int, align: int,
               mode: str = "devdax") -> Namespace:
        if mode not in SUFFIX_FOR:
            raise InvalidArgument(f"unknown namespace mode {mode!r}: devdax or fsdax")
        path = self._allocate(name, pool, size, f"~{align}{SUFFIX_FOR[mode]}")
        try:
            ns = self.get(name)  # attaches the loop device of an fsdax namespace
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        if ns is None:  # pragma: no cover - the file was just created
            raise BackendError(f"namespace {name} vanished right after creation")
        return ns

    def create_scratch(self, name: str, pool: str, size: int) -> Namespace:
        path = self._allocate(name, pool, size, f"~{REGION_ALIGN}{SCRATCH_SUFFIX}")
        node = self._node(pool)
        return Namespace(name=name, pool=pool, numa_node=node, size=size, usable_size=size,
                         align=REGION_ALIGN, device=str(path), handle=str(path), mode="raw",
                         fs_dax=False)

    def _allocate(self, name: str, pool: str, size: int, tail: str) -> Path:
        """The backing file ``<name><tail>`` of ``size`` bytes, complete or not at all."""
        node = self._node(pool)
        if self._named(name):
            raise AlreadyExists(f"a namespace named {name} already exists")
        free = next(p.free for p in self.pools() if p.name == pool)
        if size > free:
            raise ResourceExhausted(
                f"{pool} (NUMA node {node}) has {describe_size(free)} free, "
                f"{describe_size(size)} needed")
        path = self._dir(pool) / f"{name}{tail}"
        # Allocated under a temporary name and linked into place when complete, so a
        # concurrent listing never sees (or loop-attaches) a half-allocated file.
        tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
        tmp.unlink(missing_ok=True)
        if self.reuse and self._take_free_file(pool, size, tmp):
            try:
                os.link(tmp, path)
            except FileExistsError as exc:
                raise AlreadyExists(f"a namespace named {name} already exists") from exc
            finally:
                tmp.unlink(missing_ok=True)
            return path
        for stale, _ in self._free_files(pool):  # covered by the fresh space taken now
            stale.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            os.fsync(fd)
            os.link(tmp, path)  # fails if the name appeared meanwhile: never clobbers
        except FileExistsError as exc:
            raise AlreadyExists(f"a namespace named {name} already exists") from exc
        except OSError as exc:
            raise ResourceExhausted(
                f"the file system under {self.root} has no room for {describe_size(size)} "
                f"({exc.strerror}); emulated regions promise more than it holds") from exc
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)
        return path

    def _take_free_file(self, pool: str, size: int, tmp: Path) -> bool:
        """Reuse the smallest free file that holds ``size`` bytes, with its old contents."""
        for path, have in self._free_files(pool):
            if have >= size:
                os.rename(path, tmp)
                os.truncate(tmp, size)
                return True
        return False

    def destroy(self, name: str) -> None:
        with self._lock:  # no listing may re-attach between detach and unlink
            for path in self._named(name):
                parsed = self._parse_file(path)  # None for a scratch file: never a loop
                if parsed is not None and self._uses_loop(parsed[2]):
                    for device, back in sorted(self.loops.loop_devices().items()):
                        if back == str(path):
                            self.loops.detach_loop(device)
                if self.reuse:
                    path.rename(path.with_name(f"free-{uuid.uuid4().hex}{FREE_SUFFIX}"))
                else:
                    path.unlink(missing_ok=True)

    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC
        if exclusive and ns.device != ns.handle:
            flags |= os.O_EXCL  # a block device: EBUSY while mounted
        return open_node(ns, flags, gone="its backing file is gone")

    def device_present(self, ns: Namespace) -> bool:
        return os.path.exists(ns.handle) and os.path.exists(ns.device)

    # -- helpers ------------------------------------------------------------------
    def _node(self, pool: str) -> int:
        for node in self.regions:
            if f"region{node}" == pool:
                return node
        raise InvalidArgument(f"unknown pool {pool!r}")

    def _loop_map(self) -> dict[str, str]:
        """{backing file: a loop device attached to it}."""
        return {back: name for name, back in sorted(self.loops.loop_devices().items(),
                                                    reverse=True)}

    def _has_loops(self) -> bool:
        """Whether any namespace may sit on a loop device (skip losetup otherwise)."""
        return self.device_type == "loop" or any(
            p.suffix == SUFFIX_FOR["fsdax"] for node in self.regions
            for p in self._files(f"region{node}"))

    def _attach(self, path: Path, mode: str, usable: int) -> str | None:
        """Attach ``path`` to a free loop device (an fsdax one ends at the usable size);
        None if the file was destroyed meanwhile."""
        with self._lock:
            existing = self._loop_map().get(str(path))
            if existing:
                return existing
            if not path.exists():
                return None
            return self.loops.attach_loop(str(path),
                                          sizelimit=usable if mode == "fsdax" else None)
