"""Devdax volumes on dynamic dax regions (soft-reserved memory, CXL volatile memory),
carved with ``daxctl``.

Why: NVDIMMs are gone from new servers; the DAX memory nodes have now is CXL Type-3
memory and firmware "specific purpose" (soft-reserved) ranges, which the kernel exposes
as dax regions whose devices can be cut to size (docs/media.md). Each volume is one
devdax device, ``daxctl create-device -r REGION -s SIZE -a ALIGN``, removed with
``daxctl disable-device`` and ``daxctl destroy-device``. Everything goes through daxctl
with JSON output (argv lists, timeouts, ``LC_ALL=C``: :mod:`csi_pmem.driver.host.runner`);
what it says is parsed in :mod:`csi_pmem.driver.backends.daxctl_listing`.

What differs from ndctl, and how it is handled:

- **Identity.** A dax device has no name: the back end records which device it made
  for which volume (:mod:`csi_pmem.driver.backends.daxctl_identity`), valid within one
  boot. After a node restart the devices are gone and so is every volume: every pool
  here is volatile, and the driver carves lost volumes again, zeroed
  (:mod:`csi_pmem.driver.recovery`).
- **Capacity** is the region's ``available_size``. A device may be built from ranges
  that are not contiguous (drivers/dax/bus.c), so the largest volume that fits is all
  the free space: there is no fragmentation. Struct pages live in system RAM, so a
  device's usable size is its size (``Pool.struct_pages_on_media`` False).
- **NUMA.** Pools are placed on the node whose CPUs are nearest to the region's target
  node (:class:`~csi_pmem.driver.backends.daxctl_listing.Topology`).
- **Devdax only.** There is no block device for fsdax: such requests get a precise
  reason (``Pool.mode_problems``).
- **Firmware and set-up states** are pool problems with a reason each, instead of zero
  capacity: no dax region at all, regions onlined as system RAM, a kernel-made device
  holding a whole region, CXL memory devices without a region.
- **Node set-up is opt-in** (``--dax-setup=reconfigure``): only then does the back end
  hand the kernel's boot-time device of each region (``daxN.0``) back to device-dax
  (``daxctl reconfigure-device --mode=devdax -f``, which offlines that memory) and
  shrink it to 0, so the region can be carved. A failure (EBUSY) is the pool's reason
  and is retried, never a crash. Devices that anyone else made are never touched.

Locking: like ndctl, every create/destroy runs under the driver's node lock; the back
end adds its own write lock so that its set-up (which may run from a listing) never
races a create.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path

from csi_pmem.driver.backends.base import (
    REASON_FOREIGN_DEVICE,
    REASON_SYSTEM_RAM,
    VOLATILE,
    Backend,
    ListingCache,
    Namespace,
    Pool,
    open_node,
)
from csi_pmem.driver.backends.cxl_setup import CxlRegionMaker, await_region_children
from csi_pmem.driver.backends.daxctl_identity import DeviceRecords, match, pending, record
from csi_pmem.driver.backends.daxctl_listing import (
    CxlState,
    DaxDevice,
    DaxRegion,
    Topology,
    boot_id,
    classify,
    device_numa_node,
    foreign_problem,
    is_dynamic,
    no_region_problem,
    parse_cxl,
    parse_device,
    parse_regions,
    read_text,
    said,
    setup_failed_problem,
    system_ram_problem,
)
from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
    CommandError,
    CsiPmemError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from csi_pmem.sizes import MiB, format_bytes, round_down

log = logging.getLogger(__name__)

SETUP_MODES = ("off", "reconfigure")
SETUP_RETRY = 60.0  # seconds between set-up attempts on a region that refused
REGION_WAIT = 15.0  # seconds for the kernel to probe a CXL region the set-up made
SCRATCH_PREFIX = "csi-pmem-scrub-"  # csi_pmem.driver.erasing.scrub: never listed
NO_REGION_POOL = "dax"  # the placeholder pool that carries "no dax region" and why
FSDAX_PROBLEM = ("dax pool {pool} serves devdax volumes only: soft-reserved and CXL "
                 "volatile memory is carved into dax character devices, with no block "
                 "device for a file system; use deviceMode devdax (or media: persistent "
                 "for an fsdax volume on a pmem region)")


class DaxctlBackend(Backend):
    """Devdax devices on dynamic dax regions (see the module docstring)."""

    kind = "daxctl"
    zeroes_new_namespaces = False  # freed ranges keep their bytes: the driver erases

    def __init__(self, runner: Runner | None = None, daxctl: str = "daxctl",
                 cxl: str = "cxl", state_path: str | os.PathLike | None = None,
                 sysfs_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc",
                 dev_root: str | os.PathLike = "/dev", setup: str = "off",
                 timeout: float = 120, cache_seconds: float = 5.0):
        if setup not in SETUP_MODES:
            raise InvalidArgument(f"dax set-up {setup!r}: use one of {', '.join(SETUP_MODES)}")
        self._runner = runner if runner is not None else Runner()
        self._daxctl, self._cxl = daxctl, cxl
        self._sysfs, self._proc, self._dev = Path(sysfs_root), Path(proc_root), Path(dev_root)
        self._topology = Topology(sysfs_root)
        self._records = DeviceRecords(state_path)
        self.setup = setup
        self._timeout = timeout
        self._cache: ListingCache[list[DaxRegion]] = ListingCache(cache_seconds)
        # The pool that says why there is no region: cxl list is not free.
        self._no_region: ListingCache[Pool] = ListingCache(max(cache_seconds, 30))
        self._write_lock = threading.RLock()
        self._setup_failed: dict[int, tuple[str, float]] = {}  # region -> (why, when)
        self._placed: dict[str, tuple[int, str]] = {}  # pool -> (node, how), as logged
        self._cxl_regions = (CxlRegionMaker(self._runner, cxl, timeout)
                             if setup == "reconfigure" else None)

    # -- listing ------------------------------------------------------------------------
    def _list(self, prepare: bool = True) -> list[DaxRegion]:
        # Regions with their devices (-D), the devices' ranges (-M: part of identity),
        # and size-0 seeds (-i: their target_node places a region with no device yet).
        argv = [self._daxctl, "list", "--regions", "--devices", "--mappings", "--idle"]
        if prepare and self._cxl_regions is not None:
            self._make_cxl_regions()  # at most once a minute: retries, hot-added devices
        generation = self._cache.generation()
        regions = [r for r in parse_regions(self._runner.run_json(argv, timeout=self._timeout))
                   if is_dynamic(r, self._sysfs)]
        if prepare and self.setup == "reconfigure" and self._prepare(regions):
            return self._list(prepare=False)
        self._cache.keep(generation, regions)
        return regions

    def _cached_list(self) -> list[DaxRegion]:
        return self._cache.get(self._list)

    def invalidate(self) -> None:
        self._cache.invalidate()
        self._no_region.invalidate()

    def _owned(self, regions: list[DaxRegion]) -> dict[str, DaxDevice]:
        return match(self._records.entries(), regions, boot_id(self._proc))

    # -- pools ----------------------------------------------------------------------------
    def pools(self) -> list[Pool]:
        regions = self._cached_list()
        if not regions:
            return [self._no_region_pool()]
        owned = {d.chardev for d in self._owned(regions).values()}
        return [self._pool(r, owned) for r in regions]

    def _pool(self, region: DaxRegion, owned: set[str]) -> Pool:
        foreign = [d for d in region.sized() if d.chardev not in owned]
        problems: list[tuple[str, str]] = []
        if region.available == 0:
            system_ram = [d for d in foreign if d.mode == "system-ram"]
            boot_devices = [d for d in foreign if d.instance == 0]
            failed = self._setup_failed.get(region.id)
            if system_ram:
                problems.append((REASON_SYSTEM_RAM, failed[0] if failed else
                                 system_ram_problem(region, system_ram, self.setup)))
            elif boot_devices:
                problems.append((REASON_FOREIGN_DEVICE, failed[0] if failed else
                                 foreign_problem(region, boot_devices, self.setup)))
        align = math.lcm(region.align, 2 * MiB)
        node, how = self._place(region)
        if self._placed.get(region.name) != (node, how):
            self._placed[region.name] = (node, how)
            log.info("pool %s (%s, target node %s) is on NUMA node %d: %s", region.name,
                     region.kind, region.target_node(), node, how)
        free = 0 if problems else region.available
        return Pool(
            name=region.name, numa_node=node, size=region.size, free=free,
            # Devices may span ranges that are not contiguous: all free space is one extent.
            largest_extent=round_down(free, align), align=align,
            problem="; ".join(text for _, text in problems) or None,
            reasons=tuple(reason for reason, _ in problems),
            mode_problems=(("fsdax", FSDAX_PROBLEM.format(pool=region.name)),),
            media=VOLATILE, struct_pages_on_media=False)

    def _place(self, region: DaxRegion) -> tuple[int, str]:
        first = next(iter(region.devices), None)
        device_node = device_numa_node(self._sysfs, first.chardev) if first else None
        return self._topology.place(region.target_node(), device_node)

    def _no_region_pool(self) -> Pool:
        """No dynamic dax region: one unusable pool that says why, so that logs, metrics
        (``csi_pmem_pool_usable{reason}``) and CreateVolume name the cause."""
        return self._no_region.get(self._list_no_region)

    def _list_no_region(self) -> Pool:
        generation = self._no_region.generation()
        reason, text = no_region_problem(read_text(self._proc / "cmdline"),
                                         read_text(self._proc / "iomem"), self._cxl_state())
        pool = Pool(name=NO_REGION_POOL, numa_node=-1, size=0, free=0, largest_extent=0,
                    align=2 * MiB, problem=text, reasons=(reason,), media=VOLATILE,
                    struct_pages_on_media=False)
        self._no_region.keep(generation, pool)
        return pool

    def _cxl_state(self) -> CxlState | None:
        try:
            memdevs = self._runner.run_json([self._cxl, "list", "--memdevs"],
                                            timeout=self._timeout)
            regions = self._runner.run_json([self._cxl, "list", "--regions"],
                                            timeout=self._timeout)
        except CsiPmemError as exc:  # no cxl tool, no CXL bus: not a CXL node
            log.debug("cxl list: %s", exc)
            return None
        return parse_cxl(memdevs, regions)

    def namespaces(self) -> list[Namespace]:
        regions = self._cached_list()
        owned = self._owned(regions)
        chardevs = {d.chardev for d in owned.values()}
        pools = {r.id: self._pool(r, chardevs) for r in regions}
        return [self._namespace(name, dev, pools[dev.region])
                for name, dev in sorted(owned.items())
                if not name.startswith(SCRATCH_PREFIX) and dev.region in pools]

    def _namespace(self, name: str, dev: DaxDevice, pool: Pool, mode: str = "devdax") -> Namespace:
        return Namespace(name=name, pool=pool.name, numa_node=pool.numa_node, size=dev.size,
                         usable_size=dev.size, align=dev.align or 2 * MiB,
                         device=str(self._dev / dev.chardev) if dev.enabled else "",
                         handle=dev.chardev, mode=mode, fs_dax=False)

    # -- create ---------------------------------------------------------------------------
    def create(self, name: str, pool: str, size: int, align: int,
               mode: str = "devdax") -> Namespace:
        if mode != "devdax":
            raise Unavailable(FSDAX_PROBLEM.format(pool=pool) if mode == "fsdax"
                              else f"unknown device mode {mode!r}: dax pools carve devdax only")
        return self._carve(name, pool, size, align, "devdax")

    def create_scratch(self, name: str, pool: str, size: int) -> Namespace:
        """A devdax device over ``size`` bytes: with no metadata on the memory, zeroing
        its mapping zeroes every byte of that space (the scrub's contract)."""
        return self._carve(name, pool, size, 2 * MiB, "raw")

    def _carve(self, name: str, pool: str, size: int, align: int, mode: str) -> Namespace:
        if not name:
            raise InvalidArgument("refusing to create a dax device without a name")
        with self._write_lock:
            try:
                regions = self._list()
                region = next((r for r in regions if r.name == pool), None)
                if region is None:
                    raise Unavailable(f"dax region {pool} is not present on this node")
                owned = self._owned(regions)
                if name in owned:
                    raise AlreadyExists(f"a dax device for {name} already exists "
                                        f"({owned[name].chardev} on {pool})")
                target = self._pool(region, {d.chardev for d in owned.values()})
                if target.problem:
                    raise Unavailable(target.problem)
                step = math.lcm(target.align, align)
                if size <= 0 or size % step:
                    raise InvalidArgument(f"dax device size {size} on {pool} must be a "
                                          f"positive multiple of {format_bytes(step)}")
                boot = boot_id(self._proc)
                self._records.put(name, pending(region, size, align, boot))
                argv = [self._daxctl, "create-device", "-r", str(region.id), "-s", str(size),
                        "-a", str(align)]
                try:
                    out = self._runner.run_json(argv, timeout=self._timeout)
                except CommandError as exc:
                    raise self._failed_create(exc, name, target, size, align) from exc
                dev = self._created(out, name, region.id, boot)
                self._records.put(name, record(dev, boot))
                self._drop_stale(name, dev)
            finally:
                self.invalidate()
        log.info("created %s (%s) on %s as %s", name, format_bytes(dev.size), pool,
                 dev.chardev)
        return self._namespace(name, dev, target, mode=mode)

    def _created(self, out: object, name: str, region: int, boot: str) -> DaxDevice:
        """The new device, read again: create-device prints no mappings, and a record
        without them would be a weaker identity."""
        items = out if isinstance(out, list) else [out]
        devs = [parse_device(d) for d in items if isinstance(d, dict) and d.get("chardev")]
        self.invalidate()
        regions = self._list(prepare=False)
        listed = {d.chardev: d for r in regions for d in r.devices if d.size > 0}
        found = listed.get(devs[0].chardev) if devs else None
        if found is None:  # output not understood: the pending record finds it
            log.warning("unexpected create-device output for %s: %r; re-reading", name, out)
            found = self._owned(regions).get(name)
        if found is None:
            raise BackendError(f"daxctl create-device for {name} in region {region} "
                               f"succeeded but its device cannot be found (printed {out!r})")
        return found

    def _drop_stale(self, name: str, dev: DaxDevice) -> None:
        """Records of other names naming the same device number are of destroyed
        devices (the kernel reuses numbers): they go, so they can never claim it."""
        stale = [n for n, e in self._records.entries().items()
                 if n != name and e.get("chardev") == dev.chardev]
        self._records.drop(*stale)

    def _failed_create(self, exc: CommandError, name: str, pool: Pool, size: int,
                       align: int) -> CsiPmemError:
        """Remove what a failed create left (a device of the pending record), drop the
        record, and say why in the caller's terms."""
        self.invalidate()
        try:
            leftover = self._owned(self._list(prepare=False)).get(name)
            if leftover is not None:
                log.warning("removing %s, left by the failed create of %s", leftover.chardev,
                            name)
                self._destroy_device(leftover)
            self._records.drop(name)
        except CsiPmemError as cleanup:
            log.error("cannot clean up after the failed create of %s: %s (its record stays "
                      "and is retried)", name, cleanup)
        kind, text = classify(exc.stderr), said(exc.stderr)
        if kind == "space":
            return ResourceExhausted(
                f"{pool.name} (NUMA node {pool.numa_node}) has no {format_bytes(size)} free "
                f"for a dax device (daxctl: {text}); use a smaller volume or another node")
        if kind == "align":
            return InvalidArgument(
                f"{pool.name} refused a dax device of {size} bytes with align "
                f"{format_bytes(align)} (region align {format_bytes(pool.align)}; daxctl: "
                f"{text}); use align 2Mi")
        return exc

    # -- destroy ---------------------------------------------------------------------------
    def destroy(self, name: str) -> None:
        """Destroy the device recorded for ``name`` (none is fine); only a device the
        records prove ours is ever destroyed."""
        if not name:
            raise InvalidArgument("refusing to destroy a dax device without a name")
        with self._write_lock:
            try:
                dev = self._owned(self._list()).get(name)
                if dev is not None:
                    log.info("destroying %s (%s)", dev.chardev, name)
                    self._destroy_device(dev)
                self._records.drop(name)
            finally:
                self.invalidate()

    def _destroy_device(self, dev: DaxDevice) -> None:
        steps = []
        if dev.enabled:
            steps.append([self._daxctl, "disable-device", dev.chardev])
        steps.append([self._daxctl, "destroy-device", dev.chardev])
        for argv in steps:
            try:
                self._runner.run(argv, timeout=self._timeout)
            except CommandError as exc:
                self.invalidate()
                if not any(d.chardev == dev.chardev and d.size > 0
                           for r in self._list(prepare=False) for d in r.devices):
                    log.info("%s vanished while being destroyed: %s", dev.chardev, exc)
                    return
                if classify(exc.stderr) == "busy":
                    raise Unavailable(f"dax device {dev.chardev} is busy and cannot be "
                                      f"destroyed (daxctl: {said(exc.stderr)}); retried") \
                        from exc
                raise

    # -- node set-up (opt-in) -------------------------------------------------------------
    def setup_node(self) -> None:
        """With ``--dax-setup=reconfigure``: create the CXL regions the node lacks
        (:mod:`csi_pmem.driver.backends.cxl_setup`) before the first listing."""
        if self._cxl_regions is not None:
            self._make_cxl_regions()

    def _make_cxl_regions(self) -> None:
        assert self._cxl_regions is not None
        with self._write_lock:
            made = self._cxl_regions.ensure()
        if made:
            await_region_children(self._sysfs, made, REGION_WAIT)
            self.invalidate()

    def _prepare(self, regions: list[DaxRegion]) -> bool:
        """With ``--dax-setup=reconfigure``: hand each region's boot-time device back to
        device-dax and shrink it to 0. True when something changed (list again)."""
        changed = False
        with self._write_lock:
            owned = {d.chardev for d in self._owned(regions).values()}
            for region in regions:
                boot_devices = [d for d in region.sized()
                                if d.instance == 0 and d.chardev not in owned]
                failed = self._setup_failed.get(region.id)
                if not boot_devices or (failed and time.monotonic() - failed[1] < SETUP_RETRY):
                    continue
                for dev in boot_devices:
                    changed |= self._give_back(region, dev)
        if changed:
            self.invalidate()
        return changed

    def _give_back(self, region: DaxRegion, dev: DaxDevice) -> bool:
        steps = []
        if dev.mode == "system-ram":
            steps.append([self._daxctl, "reconfigure-device", "--mode=devdax", "-f",
                          dev.chardev])
        if dev.enabled or dev.mode == "system-ram":
            steps.append([self._daxctl, "disable-device", dev.chardev])
        steps.append([self._daxctl, "reconfigure-device", "-s", "0", dev.chardev])
        done = False
        for argv in steps:
            try:
                self._runner.run(argv, timeout=self._timeout)
                done = True
            except CsiPmemError as exc:
                stderr = exc.stderr if isinstance(exc, CommandError) else str(exc)
                why = setup_failed_problem(region, dev.chardev, said(stderr) or str(exc))
                if self._setup_failed.get(region.id, ("",))[0] != why:
                    log.error("dax set-up: %s", why)
                self._setup_failed[region.id] = (why, time.monotonic())
                return done
        self._setup_failed.pop(region.id, None)
        log.warning("dax set-up: %s (%s, %s) given back to device-dax and shrunk to 0 so "
                    "that %s can be carved (--dax-setup=reconfigure)", dev.chardev,
                    dev.mode, format_bytes(dev.size), region.name)
        return True

    # -- devices ---------------------------------------------------------------------------
    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        if not ns.device:
            raise Unavailable(f"dax device {ns.handle} of volume {ns.name} is disabled; "
                              f"enable it with 'daxctl enable-device {ns.handle}'")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC
        return open_node(ns, flags)

    # -- health ----------------------------------------------------------------------------
    def probe(self) -> tuple[bool, str]:
        try:
            pools = self.pools()
        except CsiPmemError as e:
            return False, f"daxctl is not usable: {e}"
        bad = [f"{p.name}: {p.problem}" for p in pools if not p.usable]
        if len(bad) == len(pools):
            return False, "no usable dax region: " + "; ".join(bad)
        return True, "ok" + (f" (unusable: {'; '.join(bad)})" if bad else "")

    def max_volumes(self) -> int:
        return 0  # no label slots: devices are bounded by memory only
