"""CXL regions made by the driver at start, with ``--dax-setup=reconfigure`` only.

Why: on CXL memory the firmware usually commits no region (kernel 6.12 does not make
one by itself either), so a node with CXL expanders has memory devices with decoders
and no dax region, and nothing to carve. After every reboot the HDM decoders are reset,
so the regions must be created again, by a boot script or by the driver:

- a **ram** region becomes a dynamic dax region, which the daxctl back end carves
  (after the set-up gives the kernel's system-ram device back to device-dax);
- a **pmem** region becomes an nd region on bus ``CXL``, which the ndctl back end carves;
  made again after a reboot with the same decoder and device, it has the same
  interleave-set cookie, so the kernel finds the namespaces in the device's label
  storage (LSA) and the persistent volumes come back with their data.

Off by default: creating a ram region hands memory to the kernel, which onlines it as
system RAM; only an administrator's opt-in lets the driver do that. What runs is what a
person would run (docs/media.md, "Preparing a node"), one ``cxl create-region -m -d
ROOT -t TYPE -w 1 MEMDEV`` per memory device that has capacity of that type and no
region, in a root decoder above the device that allows the type and has room. Only
whole, non-interleaved devices are made (one region per device, ``-w 1``): interleave
sets need a plan only the administrator has. A failure is logged with cxl's words and
tried again after a minute; it never stops the driver.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csi_pmem.driver.backends.daxctl_listing import said
from csi_pmem.driver.backends.ndctl_listing import as_int
from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import CommandError, CsiPmemError
from csi_pmem.sizes import format_bytes

log = logging.getLogger(__name__)

RETRY_SECONDS = 60.0
# (memdev JSON size key, region type, root decoder capability key)
KINDS = (("ram_size", "ram", "volatile_capable"), ("pmem_size", "pmem", "pmem_capable"))


@dataclass(frozen=True)
class RegionPlan:
    """One ``cxl create-region`` to run."""

    memdev: str
    kind: str  # "ram" or "pmem"
    decoder: str  # the root decoder
    size: int
    serial: int = 0  # the device's serial number (0: none reported)

    def argv(self, cxl: str) -> list[str]:
        return [cxl, "create-region", "-m", "-d", self.decoder, "-t", self.kind, "-w", "1",
                self.memdev]


def _list(doc: Any) -> list[dict]:
    if isinstance(doc, dict):
        doc = [doc]
    return [d for d in doc if isinstance(d, dict)] if isinstance(doc, list) else []


def in_regions(regions: Any) -> set[tuple[str, str]]:
    """(memdev, type) pairs that some region already maps (``cxl list -R -T``)."""
    used = set()
    for r in _list(regions):
        for m in _list(r.get("mappings")):
            if m.get("memdev"):
                used.add((str(m["memdev"]), str(r.get("type", ""))))
    return used


def missing(memdevs: Any, regions: Any) -> list[tuple[str, str]]:
    """(memdev, type) pairs with capacity and no region of that type."""
    used = in_regions(regions)
    return [(str(d.get("memdev")), kind) for d in _list(memdevs)
            for size_key, kind, _ in KINDS
            if d.get("memdev") and as_int(d.get(size_key)) > 0
            and (str(d.get("memdev")), kind) not in used]


def plan_regions(memdevs: Any, regions: Any, roots: Any,
                 reach: dict[str, set[str]]) -> tuple[list[RegionPlan], dict[str, str]]:
    """The regions to create, and why a device that needs one gets none.

    ``memdevs``: ``cxl list -M``; ``regions``: ``cxl list -R -T``; ``roots``: ``cxl list
    -D -d root``; ``reach``: root decoder -> the memdevs below it (``cxl list -M -d
    DECODER``). A root decoder is used for one new region at most per pass (its free
    extent is read before any region is made)."""
    used = in_regions(regions)
    taken: set[str] = set()
    plans: list[RegionPlan] = []
    why: dict[str, str] = {}
    for dev in _list(memdevs):
        name = str(dev.get("memdev", ""))
        for size_key, kind, capable in KINDS:
            size = as_int(dev.get(size_key))
            if not name or size <= 0 or (name, kind) in used:
                continue
            fits = [d for d in _list(roots)
                    if name in reach.get(str(d.get("decoder")), set()) and d.get(capable)
                    and str(d.get("decoder")) not in taken]
            roomy = [d for d in fits if as_int(d.get("max_available_extent")) >= size]
            if not roomy:
                why[f"{name} {kind}"] = (
                    f"no root decoder above {name} allows {kind} with room for "
                    f"{format_bytes(size)}" if not fits else
                    f"the root decoders above {name} ({', '.join(str(d['decoder']) for d in fits)})"
                    f" have less than {format_bytes(size)} free")
                continue
            decoder = str(roomy[0]["decoder"])
            taken.add(decoder)
            plans.append(RegionPlan(name, kind, decoder, size, as_int(dev.get("serial"))))
    return plans, why


class CxlRegionMaker:
    """Creates the missing regions (see the module docstring); cheap to call often: it
    lists at most once a minute while nothing changes."""

    def __init__(self, runner: Runner, cxl: str = "cxl", timeout: float = 120):
        self._runner, self._cxl, self._timeout = runner, cxl, timeout
        self._last = -RETRY_SECONDS
        self.failed: dict[str, str] = {}  # "memN kind" -> what cxl said

    def ensure(self) -> list[str]:
        """Create what is missing; the names of the regions made (empty when none)."""
        now = time.monotonic()
        if now - self._last < RETRY_SECONDS:
            return []
        self._last = now
        try:
            memdevs = self._json("list", "-M")
            if not any(as_int(d.get(k)) > 0 for d in _list(memdevs) for k, _, _ in KINDS):
                return []  # no CXL memory here: nothing to do, nothing to say
            regions = self._json("list", "-R", "-T")
            if not missing(memdevs, regions):
                return []  # the steady state: two listings a minute, no more
            roots = self._json("list", "-D", "-d", "root")
            reach = {str(d.get("decoder")): {str(m.get("memdev")) for m in
                                             _list(self._json("list", "-M", "-d",
                                                              str(d.get("decoder"))))}
                     for d in _list(roots)}
        except CsiPmemError as exc:  # no cxl tool, no CXL bus
            log.debug("cxl set-up: cannot list CXL devices: %s", exc)
            return []
        plans, why = plan_regions(memdevs, regions, roots, reach)
        for key, text in why.items():
            if self.failed.get(key) != text:
                log.error("cxl set-up: %s: %s", key, text)
            self.failed[key] = text
        made = []
        for plan in plans:
            key = f"{plan.memdev} {plan.kind}"
            try:
                out = self._runner.run_json(plan.argv(self._cxl), timeout=self._timeout)
            except CsiPmemError as exc:
                text = (said(exc.stderr) if isinstance(exc, CommandError) else "") or str(exc)
                if self.failed.get(key) != text:
                    log.error("cxl set-up: '%s' failed: %s; retried in %.0f s",
                              " ".join(["cxl", *plan.argv(self._cxl)[1:]]), text,
                              RETRY_SECONDS)
                self.failed[key] = text
                continue
            self.failed.pop(key, None)
            region = str(next(iter(_list(out)), {}).get("region", "?"))
            if plan.kind == "pmem" and not plan.serial:
                log.warning("cxl set-up: %s reports no serial number: the kernel derives "
                            "region %s's interleave-set cookie from the devices' serial "
                            "numbers and offsets, here 0, and refuses namespace labels "
                            "with cookie 0 after a reboot; volumes on it will not come "
                            "back (give the device a serial number)", plan.memdev, region)
            made.append(region)
            log.warning("cxl set-up: created %s region %s of %s on %s in %s "
                        "(--dax-setup=reconfigure)", plan.kind, region,
                        format_bytes(plan.size), plan.memdev, plan.decoder)
        if made:
            self._last = -RETRY_SECONDS  # list again at once: the next call sees them
        return made

    def _json(self, *args: str) -> Any:
        return self._runner.run_json([self._cxl, *args], timeout=self._timeout)


def await_region_children(sysfs: str | os.PathLike, regions: list[str], timeout: float) -> bool:
    """Wait until the kernel has probed each region made: its ``dax_region*`` (ram) or
    ``pmem_region*`` (pmem) under ``/sys/bus/cxl/devices/REGION`` bound to a driver.
    The commit returns before that, and a listing made at once would miss the region
    (or, for pmem, its namespaces). False, with a warning, if some region has not shown
    its child by the deadline."""
    deadline = time.monotonic() + timeout
    left = list(regions)
    while left:
        left = [r for r in left if not _probed(Path(sysfs) / "bus/cxl/devices" / r)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        log.warning("cxl set-up: the kernel has not probed %s after %.0f s; its pool "
                    "appears when it does", ", ".join(left), timeout)
    return not left


def _probed(region: Path) -> bool:
    """The region's child device (``dax_regionN`` or ``pmem_regionN``) is bound to its
    driver: for pmem that driver has made the nd region and read the labels."""
    try:
        children = [e for e in os.scandir(region) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    return any(e.name.startswith(("dax_region", "pmem_region"))
               and os.path.exists(os.path.join(e.path, "driver")) for e in children)
