"""Memory back end (``--backend memory``): DRAM pools whose pages lie on their NUMA node.

Why: a GPU node's fast memory is its DRAM, and a volume there is only worth having when
its pages sit on the NUMA node the pod asked for (``numaNode``), in huge pages, and are
allocated when the volume is created rather than at a pod's first touch. The emulated
back end keeps its files on whatever file system holds its root, so their pages land
where the allocating thread runs (measured: a ``numaNode=0`` volume had 151 of its
171 MiB on node 1). This back end is the emulated one (files ``<root>/region<N>/...``,
the same sizing, naming, fd hand-out and volatile recovery) with each pool on a file
system of its own that the driver mounts at start:

- ``tmpfs`` pools (the default): a tmpfs per pool mounted ``mpol=bind:N``,
  ``huge=always`` (``--memory-pages 2M``) or ``huge=never`` (``4k``), ``size=`` the
  pool. The mount's policy is copied into each new file's *shared* policy
  (``mm/shmem.c``), and every page the file ever gets (fallocate at CreateVolume, a
  write, a fault in a pod, a page read back from swap) is taken under that policy,
  whichever task or CPU causes it. That is why the mount option and not a
  ``set_mempolicy`` around the fallocate: a thread policy covers only the pages that
  thread allocates while it is set, and a shmem file's own policy, when it has one,
  beats it. ``size=`` makes the kernel refuse the pool's overcommit too.
- ``hugetlbfs`` pools (``--memory-fs hugetlbfs``, pages 2M or 1G from the node's
  reserved huge page pool): hugetlbfs has no shared policy and no ``mpol`` option, so
  the volume's fallocate runs with the calling thread bound to the pool's node
  (:func:`csi_pmem.driver.backends.mempolicy.bound_to`); its pages cannot move
  afterwards (huge pages are neither reclaimed nor migrated), so that one allocation
  decides their node for good.

In both, CreateVolume's fallocate allocates every page (hugetlbfs clears them there,
tmpfs at each page's first use: benchmarks/bench_memory_pools.py): a pod maps pages
that exist, and is charged for none of them. The media is volatile: a node
restart empties the pools, and the driver's recovery carves each volume again, zeroed,
under its id. A pool whose mount vanished (unmounted by hand) is mounted again, empty,
at the next listing, the same way. A mount that is there with other options (a new
size, policy or page size after an upgrade) is remounted with the configured ones;
files already there keep the policy they were created with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Protocol

from csi_pmem.driver.backends import mempolicy
from csi_pmem.driver.backends.base import VOLATILE, Pool
from csi_pmem.driver.backends.emulated import EmulatedBackend
from csi_pmem.driver.host.mounter import LoopDevices
from csi_pmem.errors import CsiPmemError, FailedPrecondition, InvalidArgument, ResourceExhausted
from csi_pmem.mountinfo import MountInfo
from csi_pmem.sizes import MiB, describe_size

log = logging.getLogger(__name__)

TMPFS, HUGETLBFS = "tmpfs", "hugetlbfs"
FILE_SYSTEMS = (TMPFS, HUGETLBFS)
PAGES = {"4k": 4096, "2M": 2 * MiB, "1G": 1024 * MiB}
# What each file system can give: tmpfs base or transparent huge pages, hugetlbfs
# the node's reserved huge pages.
PAGES_OF = {TMPFS: ("4k", "2M"), HUGETLBFS: ("2M", "1G")}
SOURCE_PREFIX = "csi-pmem-pool:"
PLACEMENT = "bind"
MOUNT_OPTIONS = ["nosuid", "nodev", "noexec"]


class PoolMounter(LoopDevices, Protocol):
    """What the back end needs from the host: the mount table and ``mount(8)``
    (:class:`csi_pmem.driver.host.mounter.HostMounter`; a fake in unit tests), plus the
    loop devices its fsdax namespaces sit on."""

    def find(self, target: str) -> MountInfo | None: ...

    def mount(self, device: str, target: str, fstype: str, options: list[str]) -> None: ...


class MemoryBackend(EmulatedBackend):
    kind = "memory"

    def __init__(self, root: str | os.PathLike, regions: dict[int, int],
                 mounter: PoolMounter, fs: str = TMPFS, pages: str = "2M") -> None:
        if fs not in FILE_SYSTEMS:
            raise InvalidArgument(f"invalid memory file system {fs!r}: tmpfs or hugetlbfs")
        if pages not in PAGES_OF[fs]:
            raise InvalidArgument(f"--memory-pages {pages} is not offered by {fs} pools: "
                                  f"use {' or '.join(PAGES_OF[fs])}")
        self.fs, self.pages, self.mounter = fs, pages, mounter
        self.page_size = PAGES[pages]
        if fs == HUGETLBFS:
            # The kernel cuts a hugetlbfs size= to whole pages: a pool says what it holds.
            for node, size in sorted(regions.items()):
                if size < self.page_size:
                    raise InvalidArgument(
                        f"the memory pool of NUMA node {node} is {describe_size(size)}, "
                        f"less than one {pages} huge page")
            regions = {n: size // self.page_size * self.page_size
                       for n, size in regions.items()}
        self._mount_lock = threading.Lock()
        super().__init__(root, regions, loops=mounter, media=VOLATILE)
        for node in self.regions:
            self._mount(node, at_start=True)

    def _log_media(self, media: str, fstype: str | None) -> None:
        # Not the emulated back end's line: no --emulated-media was given, and the
        # root's own file system says nothing (each pool is a mount of its own).
        log.info("memory pools under %s are %s (DRAM: a node restart empties them)",
                 self.root, self.media)

    # -- mounts -------------------------------------------------------------------
    def _target(self, node: int) -> str:
        return str(self._dir(f"region{node}"))

    def options(self, node: int) -> list[str]:
        """The mount options of ``region<node>``'s file system (without remount)."""
        size = self.regions[node]
        if self.fs == HUGETLBFS:
            return [f"pagesize={self.pages}", f"size={size}", "mode=0700"]
        return [f"size={size}", f"mpol=bind:{node}",
                f"huge={'always' if self.pages != '4k' else 'never'}", "mode=0700"]

    def _as_configured(self, have: MountInfo, node: int) -> bool:
        """Whether the mount at the pool is ours with today's options (mountinfo prints
        tmpfs's size in KiB and leaves ``huge=never`` out; hugetlbfs prints its page
        size in MiB, 1G pages as ``pagesize=1024M``, and its size in bytes, cut to whole
        pages)."""
        if have.fstype != self.fs:
            return False
        if self.fs == HUGETLBFS:
            page = PAGES[self.pages]
            return (f"pagesize={page >> 20}M" in have.options
                    and f"size={self.regions[node] // page * page}" in have.options)
        huge = "huge=always" if self.pages != "4k" else None
        return (f"size={self.regions[node] // 1024}k" in have.options
                and f"mpol=bind:{node}" in have.options
                and (huge in have.options if huge else
                     not any(o.startswith("huge=") and o != "huge=never"
                             for o in have.options)))

    def _mount(self, node: int, at_start: bool = False) -> None:
        target = self._target(node)
        with self._mount_lock:
            have = self.mounter.find(target)
            if have is not None and self._as_configured(have, node):
                if at_start:  # a driver restart or rollout: the volumes are all there
                    log.info("memory pool region%d: kept the %s mounted at %s, with its "
                             "volumes", node, self.fs, target)
                return
            source = f"{SOURCE_PREFIX}region{node}"
            if have is None:
                Path(target).mkdir(parents=True, exist_ok=True)
                if any(Path(target).iterdir()):
                    raise FailedPrecondition(
                        f"{target} holds files, and the memory pool of NUMA node {node} "
                        "would be mounted over them; move them away or choose another "
                        "--memory-root")
                self.mounter.mount(source, target, self.fs, [*self.options(node),
                                                             *MOUNT_OPTIONS])
                log.info("memory pool region%d: %s at %s (%s)", node, self.fs, target,
                         ",".join(self.options(node)))
                return
            if have.fstype != self.fs:
                raise FailedPrecondition(
                    f"{target} is a {have.fstype} mount, not the {self.fs} the memory pool "
                    f"of NUMA node {node} needs; unmount it or choose another --memory-root")
            # A remount sets the per-mount flags anew: without them the pool would
            # lose nosuid, nodev and noexec.
            self.mounter.mount(source, target, self.fs,
                               ["remount", *self.options(node), *MOUNT_OPTIONS])
            log.warning("memory pool region%d at %s remounted with %s (it had %s); files "
                        "already there keep the policy they were created with", node,
                        target, ",".join(self.options(node)), ",".join(sorted(have.options)))

    def _region_ready(self, pool: str) -> str | None:
        """None when the pool's own mount is in place; a vanished one (unmounted, as at
        a node restart) is mounted again, empty: its volumes are then carved again by
        the driver's recovery, as on any volatile pool."""
        node = self._node(pool)
        try:
            self._mount(node)
        except (CsiPmemError, OSError) as exc:
            return f"cannot mount the memory pool of NUMA node {node}: {exc}"
        return None

    # -- Backend ------------------------------------------------------------------
    def pools(self) -> list[Pool]:
        """The file pools, with their pages and placement. A hugetlbfs pool's volumes
        come in whole pages (its ``align``): the kernel gives a file whole huge pages,
        so a 100 MiB volume on 1G pages takes 1 GiB of the pool and is counted so."""
        align = self.page_size if self.fs == HUGETLBFS else 0
        return [dataclasses.replace(p, page_size=self.page_size, placement=PLACEMENT,
                                    align=max(p.align, align))
                for p in super().pools()]

    def _allocate(self, name: str, pool: str, size: int, tail: str) -> Path:
        """As on every file pool; a hugetlbfs pool allocates with this thread bound to
        the pool's node (the module docstring says why), and a pool that cannot give
        the pages says which node is short."""
        node = self._node(pool)
        try:
            if self.fs == HUGETLBFS:
                with mempolicy.bound_to(node):
                    return super()._allocate(name, pool, size, tail)
            return super()._allocate(name, pool, size, tail)
        except ResourceExhausted as exc:
            raise ResourceExhausted(
                f"NUMA node {node} cannot give {describe_size(size)} of "
                f"{'huge pages' if self.fs == HUGETLBFS else 'memory'} to {pool}: {exc}") \
                from exc
        except mempolicy.MemPolicyError as exc:
            raise FailedPrecondition(f"cannot bind the allocation to NUMA node {node}: "
                                     f"{exc}") from exc
