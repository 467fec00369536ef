"""What ``ndctl list`` and sysfs say about NVDIMM regions and namespaces, normalised.

Why a module of its own: the ndctl back end (:mod:`csi_pmem.driver.backends.ndctl`)
acts on these facts (carves, destroys, opens, caches, learns from failures) while this
module only reads them: the JSON of ``ndctl list`` handed in by the caller, the stderr of
a failed ndctl command, and attributes under ``/sys/bus/nd/devices``. Nothing here runs
a command or writes. The coming CXL/daxctl back end needs the same facts from the same
places (a region's NUMA node, alignment and interleave, its label state and seeds, a
namespace's raw size), so it can import them from here without importing a back end.

What ``ndctl list`` prints (ndctl ``ndctl/list.c`` ``region_to_json``,
``ndctl/json.c`` ``util_namespace_to_json``, ``daxctl/json.c``):

- ``--regions``: ``dev``, ``size``, ``align``, ``available_size``,
  ``max_available_extent``, ``type`` ("pmem"), ``numa_node``/``target_node`` (only with
  ``--verbose``), ``iset_id`` (only for labelled regions, see below), ``mappings`` (only
  with ``--dimms``), ``state: "disabled"`` (only with ``--idle``),
  ``persistence_domain``. No physical start address.
- ``--namespaces`` nested in each region: ``dev``, ``mode``, ``map``, ``size`` (for
  devdax the *usable* size of the dax device, for fsdax that of the pfn device, i.e. of
  the block device; never the raw namespace size; absent while disabled), ``uuid``,
  ``daxregion`` (devdax, with ``--verbose``/``-X``; its ``devices[].chardev`` is the
  ``daxX.Y`` node) or ``chardev``, ``sector_size`` (all but devdax), ``align`` (devdax
  and fsdax), ``blockdev`` (fsdax ``pmemX.Y``, sector ``pmemX.Ys``, raw; only while
  enabled), ``name`` (the alt-name, only when set), ``numa_node`` (verbose),
  ``state: "disabled"`` (idle namespaces, including size-0 seeds and destroyed
  namespaces). ``create-namespace`` prints the same object for the new namespace,
  without the verbose fields.
- With both ``--regions`` and ``--dimms`` the output is one object
  ``{"dimms": [...], "regions": [...]}``; with one class it is an array; with nothing
  to show it is empty.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csi_pmem.driver.backends.base import Namespace, Pool
from csi_pmem.errors import BackendError
from csi_pmem.sizes import REGION_ALIGN, MiB, allocation_for

log = logging.getLogger(__name__)

# ndctl refuses fsdax/devdax namespaces whose physical start is not 16 MiB aligned
# (``check_dax_align()`` in ndctl/namespace.c, hard-coded SZ_16M, not the region align).
NDCTL_START_ALIGN = 16 * MiB
DEFAULT_DEVDAX_ALIGN = 2 * MiB
# ndctl's fallback when the pfn seed has no align attribute (validate_namespace_options()).
DEFAULT_FSDAX_ALIGN = 2 * MiB
# include/uapi/linux/ndctl.h: the region's ``nstype`` sysfs attribute.
ND_DEVICE_NAMESPACE_IO = 4     # label-less ("legacy") pmem: one namespace per region
ND_DEVICE_NAMESPACE_PMEM = 5   # labelled pmem: sub-dividable

# ------------------------------------------------------------ region problems
# What to tell the administrator about a region that cannot be carved, and how
# to fix it; the back end reports them as pool problems and in its errors.
LABELLESS_FIX = "ndctl disable-region all; ndctl init-labels -f all; ndctl enable-region all"


def labelless_problem(region: str) -> str:
    return (f"{region} is label-less: its NVDIMMs have no initialised namespace label "
            "area, so the kernel exposes the whole region as one fixed namespace and ndctl "
            "refuses to sub-divide it (\"Legacy / label-less namespaces do not support "
            "sub-dividing a region\"). Initialise the labels while nothing uses the "
            f"NVDIMMs (this discards every namespace on them): {LABELLESS_FIX}")


def misaligned_problem(region: str, start: int | None) -> str:
    if start is not None and start % NDCTL_START_ALIGN:
        what = f"{region} starts at physical address {start:#x}, which is not 16 MiB aligned"
    else:
        what = (f"a new namespace on {region} would start at a physical address that is not "
                "16 MiB aligned")
    return (f"{what}; ndctl refuses every devdax/fsdax namespace there (\"misaligned to "
            "16M, adjust region alignment and retry\") and lowering the region's align does "
            "not help. Make the platform place the region on a 16 MiB boundary "
            "(firmware/BIOS memory map; in QEMU add align=16M to each NVDIMM's "
            "memory-backend-file)")


def disabled_problem(region: str) -> str:
    return f"{region} is disabled: enable it with 'ndctl enable-region {region}'"


def readonly_problem(region: str) -> str:
    return (f"{region} is read-only (the kernel marks a region read-only when an NVDIMM "
            f"cannot persist writes): check 'ndctl list -DH -r {region}'; once the NVDIMMs "
            f"are healthy, 'echo 0 > /sys/bus/nd/devices/{region}/read_only'")


def no_devdax_problem(region: str) -> str:
    return (f"{region} offers no device-dax instance (dax_seed is empty): the kernel lacks "
            "CONFIG_NVDIMM_DAX / the dax_pmem and device_dax modules; load them with "
            "'modprobe dax_pmem device_dax'")


def no_fsdax_problem(region: str) -> str:
    return (f"{region} offers no fsdax (pfn) instance: the kernel lacks CONFIG_NVDIMM_PFN "
            "(which needs CONFIG_ZONE_DEVICE) or CONFIG_FS_DAX, or the nd_pmem module is "
            "not loaded; load it with 'modprobe nd_pmem'")


def no_mode_problem(region: str, mode: str) -> str:
    return no_fsdax_problem(region) if mode == "fsdax" else no_devdax_problem(region)


# ---------------------------------------------------------------------------- sysfs
class Sysfs:
    """Read-only access to ``<root>/bus/nd/devices/<dev>/<attr>``; None if unreadable.

    Attributes can be missing (older kernels), hidden (``region_visible()``), root-only
    (``resource`` is 0400) or fail with ENXIO on disabled devices: all mean "unknown".
    ``root`` is a parameter so that tests can hand in a fake sysfs tree.
    """

    def __init__(self, root: str | os.PathLike = "/sys"):
        self.base = Path(root) / "bus" / "nd" / "devices"

    def read(self, dev: str, attr: str) -> str | None:
        try:
            return (self.base / dev / attr).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def bound(self, dev: str) -> bool | None:
        """Whether ``dev`` has its driver bound (an enabled region); None if unknown."""
        # Every real sysfs device has a subsystem link; without it (a partial copy of
        # sysfs, as in tests) a missing driver link proves nothing.
        if not (self.base / dev / "subsystem").exists():
            return None
        return (self.base / dev / "driver").exists()

    def read_int(self, dev: str, attr: str) -> int | None:
        text = self.read(dev, attr)
        if not text:
            return None
        try:
            return int(text, 0)  # resource and align are hex ("0x1000000"), others decimal
        except ValueError:
            return None


# ------------------------------------------------------------------- listing model
@dataclass
class Listing:
    """One ``ndctl list`` snapshot, normalised to regions and DIMMs."""

    regions: list[dict[str, Any]] = field(default_factory=list)
    dimms: list[dict[str, Any]] = field(default_factory=list)

    def region(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.regions if r.get("dev") == name), None)

    def named(self, name: str, modes: Iterable[str] | None = None,
              ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(region, namespace) pairs of configured namespaces with this alt-name.

        ``modes`` limits the match (None: any mode).
        """
        wanted = None if modes is None else set(modes)
        return [(r, ns) for r in self.regions for ns in r.get("namespaces") or []
                if ns.get("name") == name and is_configured(ns)
                and (wanted is None or ns.get("mode", "raw") in wanted)]


def normalise(doc: Any) -> Listing:
    """Accept every shape ``ndctl list`` prints (array, platform object, bus array)."""
    out = Listing()
    if isinstance(doc, dict):
        if "dev" in doc:  # a lone object (ndctl with --human, or very old releases)
            doc = [doc]
        else:
            out.regions.extend(doc.get("regions") or [])
            out.dimms.extend(doc.get("dimms") or [])
            for bus in doc.get("buses") or []:
                out.regions.extend(bus.get("regions") or [])
                out.dimms.extend(bus.get("dimms") or [])
            return out
    if not isinstance(doc, list):
        raise BackendError(f"unexpected 'ndctl list' output: {type(doc).__name__}")
    for item in doc:
        if not isinstance(item, dict):
            continue
        dev = str(item.get("dev", ""))
        if "provider" in item:  # a bus object
            out.regions.extend(item.get("regions") or [])
            out.dimms.extend(item.get("dimms") or [])
        elif dev.startswith("region"):
            out.regions.append(item)
        elif dev.startswith("nmem"):
            out.dimms.append(item)
    return out


def as_int(value: Any, default: int = 0) -> int:
    """ndctl prints sizes as JSON integers (strings only with --human, which we never use)."""
    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int):
        return value
    try:
        return int(str(value), 0)
    except ValueError:
        return default


def is_configured(ns: dict[str, Any]) -> bool:
    """False for idle seeds and destroyed namespaces (raw, size 0, null uuid)."""
    if as_int(ns.get("size")) > 0:
        return True
    if ns.get("mode") in ("devdax", "fsdax", "sector"):
        return True
    return bool(str(ns.get("uuid", "")).strip("0-"))


def is_disabled(obj: dict[str, Any]) -> bool:
    return obj.get("state") == "disabled"


def device_name(ns: dict[str, Any]) -> str:
    """The node under /dev of an enabled namespace ("" while it has none).

    devdax namespaces get a character device (``daxX.Y``), fsdax ones a block device
    (``pmemX.Y``, ndctl's ``blockdev``); neither exists while the namespace is disabled.
    """
    if ns.get("mode") == "fsdax":
        return str(ns.get("blockdev") or "")
    return str(dax_device(ns).get("chardev") or "")


def device_kind(mode: str) -> str:
    return "block device" if mode == "fsdax" else "dax device"


def dax_device(ns: dict[str, Any]) -> dict[str, Any]:
    """The namespace's dax device entry (chardev, size, align) if ndctl printed one."""
    devices = (ns.get("daxregion") or {}).get("devices") or []
    sized = [d for d in devices if as_int(d.get("size")) > 0]
    if sized or devices:
        return (sized or devices)[0]
    if ns.get("chardev"):
        return {"chardev": ns["chardev"]}
    return {}


# ------------------------------------------------------------ sysfs readers
# Region facts from the listing, or from sysfs where ndctl does not print them.
def mode_problems(sysfs: Sysfs, name: str) -> tuple[tuple[str, str], ...]:
    """Modes the kernel cannot create on an otherwise usable region: device-dax
    without dax_pmem/device_dax (no ``dax_seed``), fsdax without the pfn driver (no
    ``pfn_seed``). Unknown (unreadable sysfs) counts as supported."""
    out = []
    if sysfs.read(name, "dax_seed") == "":
        out.append(("devdax", no_devdax_problem(name)))
    if sysfs.read(name, "pfn_seed") == "":
        out.append(("fsdax", no_fsdax_problem(name)))
    return tuple(out)


def labelled(sysfs: Sysfs, region: dict[str, Any]) -> bool | None:
    """Whether the region supports labelled (sub-dividable) namespaces.

    Detection, most authoritative first:

    1. sysfs ``regionN/nstype``: 5 (ND_DEVICE_NAMESPACE_PMEM) is labelled, 4
       (ND_DEVICE_NAMESPACE_IO) is label-less. The kernel derives it in
       ``nd_region_to_nstype()`` (drivers/nvdimm/region_devs.c) from the
       NDD_LABELING flag of the region's DIMMs, which the DIMM driver sets only
       when it finds a valid namespace index block in the label area. ndctl's own
       refusal ("Legacy / label-less namespaces do not support sub-dividing a
       region", ``validate_namespace_options()`` in ndctl/namespace.c) tests exactly
       ``ndctl_region_get_nstype() == ND_DEVICE_NAMESPACE_IO``, so this predicts
       the failure precisely.
    2. Without sysfs (non-root tests, odd mounts): libndctl reads the interleave-set
       cookie only for nstype PMEM (``region_set_type()``,
       ``ndctl_region_get_interleave_set()``), so ``ndctl list`` prints ``iset_id``
       only for labelled regions; and it reports ``available_size`` and
       ``max_available_extent`` as 0 for any other nstype. A pmem region with no
       ``iset_id`` and zero available size is label-less.

    Label-less regions typically also show one raw namespace spanning the whole
    region with no uuid, but a labelled region can look alike, so that is not used.
    """
    nstype = sysfs.read_int(str(region["dev"]), "nstype")
    if nstype == ND_DEVICE_NAMESPACE_IO:
        return False
    if nstype == ND_DEVICE_NAMESPACE_PMEM:
        return True
    if "iset_id" in region:
        return True
    if as_int(region.get("available_size")) == 0 and \
            as_int(region.get("max_available_extent")) == 0:
        return False
    return None


def interleave_ways(sysfs: Sysfs, region: dict[str, Any]) -> int:
    """How many DIMMs the region interleaves across (at least 1).

    Sizes and aligns are multiples of it (:func:`pool_align`); ``ndctl list`` shows the
    mappings only with ``--dimms``, sysfs ``regionN/mappings`` counts them always.
    """
    mappings = region.get("mappings")
    if mappings:
        return len(mappings)
    return max(1, sysfs.read_int(str(region["dev"]), "mappings") or 1)


def pool_align(sysfs: Sysfs, region: dict[str, Any]) -> int:
    """Granularity of namespace sizes in this region.

    ndctl demands a size that is a multiple of the region ``align`` (16 MiB by
    default, times the interleave ways when 16 MiB does not divide evenly across
    them: ``default_align()`` in region_devs.c) and of the devdax align times the
    interleave ways (``validate_namespace_options()``). Sizes are also kept at 16 MiB
    multiples even if someone lowered the region align, because every namespace after
    an odd-sized one would start misaligned and be refused.
    """
    region_align = as_int(region.get("align")) or \
        sysfs.read_int(str(region["dev"]), "align") or REGION_ALIGN
    ways = interleave_ways(sysfs, region)
    return math.lcm(region_align, REGION_ALIGN, DEFAULT_DEVDAX_ALIGN * ways)


def numa_node(sysfs: Sysfs, region: dict[str, Any]) -> int:
    """The NUMA node a region's memory is local to (0 when the platform gives none).

    Why here: every volume is placed and reported by this node (the topology a pod's
    GPU is matched against), and any back end over ``/sys/bus/nd`` regions, CXL ones
    included, learns it the same way: ``numa_node`` from the verbose listing, else the
    region's sysfs ``numa_node``.
    """
    node = region.get("numa_node")
    if node is None:
        node = sysfs.read_int(str(region["dev"]), "numa_node")
    # -1 (or absent) means the platform gave no proximity domain: a single node.
    return node if isinstance(node, int) and node >= 0 else 0


def region_dimms(sysfs: Sysfs, region: dict[str, Any]) -> list[str]:
    """The ``nmemX`` devices behind a region, from the listing or sysfs ``mappingN``."""
    dimms = [str(m["dimm"]) for m in region.get("mappings") or [] if m.get("dimm")]
    if dimms:
        return dimms
    name = str(region["dev"])
    for i in range(sysfs.read_int(name, "mappings") or 0):
        entry = sysfs.read(name, f"mapping{i}")  # "nmem0,start,size[,position]"
        if entry:
            dimms.append(entry.split(",", 1)[0])
    return dimms


def label_slots(sysfs: Sysfs, region: dict[str, Any], listing: Listing) -> int:
    """How many namespaces this region can hold in total, limited by label space.

    Each namespace of a region takes one label on every DIMM of the region.
    sysfs ``nmemX/available_slots`` is the number of free label slots minus the one
    the kernel keeps for updates (``available_slots_show()`` in dimm_devs.c); the
    namespaces already configured on regions using that DIMM hold the others. The
    region's capacity is the minimum over its DIMMs. 0 means unknown.
    """
    counts: dict[str, int] = {}
    for other in listing.regions:
        used = sum(1 for ns in other.get("namespaces") or [] if is_configured(ns))
        for dimm in region_dimms(sysfs, other):
            counts[dimm] = counts.get(dimm, 0) + used
    totals = []
    for dimm in region_dimms(sysfs, region):
        free = sysfs.read_int(dimm, "available_slots")
        if free is not None:
            totals.append(free + counts.get(dimm, 0))
    return min(totals, default=0)


# --------------------------------------------------------------- namespaces
def to_namespace(sysfs: Sysfs, ns: dict[str, Any], pool: Pool,
                 raw_size: int | None = None) -> Namespace:
    """The :class:`Namespace` an ndctl namespace object describes, on ``pool``.

    ``raw_size`` is the size just requested from create-namespace, when known.
    """
    mode = str(ns.get("mode") or "raw")
    if mode == "fsdax":
        # The pfn device's size and align: the block device's capacity.
        align = as_int(ns.get("align")) or DEFAULT_FSDAX_ALIGN
        usable = as_int(ns.get("size"))
    else:
        dax = dax_device(ns)
        align = as_int(ns.get("align")) or as_int(dax.get("align")) or \
            as_int((ns.get("daxregion") or {}).get("align")) or DEFAULT_DEVDAX_ALIGN
        usable = as_int(dax.get("size")) or as_int(ns.get("size"))
    handle = str(ns.get("dev", ""))
    node = ns.get("numa_node")
    device = device_name(ns)
    return Namespace(
        name=str(ns["name"]),
        pool=pool.name,
        numa_node=node if isinstance(node, int) and node >= 0 else pool.numa_node,
        size=raw_namespace_size(sysfs, handle, usable, align, pool, raw_size),
        usable_size=usable,
        align=align,
        device=f"/dev/{device}" if device else "",
        handle=handle,
        mode=mode,
        # Real pmem: an fsdax pfn device holds struct pages (map=dev), so the pmem
        # driver marks the block device DAX-capable and "mount -o dax" works on it.
        fs_dax=True,
    )


def raw_namespace_size(sysfs: Sysfs, handle: str, usable: int, align: int, pool: Pool,
                       known: int | None = None) -> int:
    """The raw namespace size; ndctl prints only the device's usable size.

    sysfs ``namespaceX.Y/size`` has it. Without sysfs, use what was requested
    (``known``, right after a create) or invert the sizing the driver used to create
    it (exact for namespaces this driver made).
    """
    size = sysfs.read_int(handle, "size") if handle else None
    if size:
        return size
    if known:
        return known
    if usable <= 0:
        return 0
    estimate = allocation_for(usable, align, pool.align)[0]
    log.debug("%s: raw size not readable from sysfs, estimated %d", handle, estimate)
    return estimate


# ------------------------------------------------------------------ ndctl failures
# Texts from ndctl/namespace.c (printed under LC_ALL=C); first match wins.
_FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
        ("labelless", r"label-less namespaces do not support sub-dividing"),
        ("misaligned", r"misaligned to 16M"),
        ("exists", r"already exists|File exists"),
        ("space", r"No space left on device|insufficient capacity"),
        ("size", (r"must align to interleave-width|align setting is .* is misaligned"
                  r"|must be >= 16MiB|alt name overflow")),
        ("align", r"unsupported align"),
        # devdax: "Kernel does not support devdax mode" (no dax seed); fsdax without a
        # pfn seed: "Kernel does not support setting an alignment in fsdax mode" (we
        # always pass --align) or "<region> cannot support requested mode".
        ("nodax", r"Kernel does not support .*mode|cannot support requested mode"),
        ("readonly", r"read-only"),
    ))


def classify(stderr: str) -> str | None:
    """Name the known ndctl failure in ``stderr`` (None if it is not a known one)."""
    return next((kind for kind, pattern in _FAILURES if pattern.search(stderr)), None)


def last_line(stderr: str) -> str:
    """The line of ndctl's stderr that says why (not the generic summary after it)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    # ndctl prints the reason as the first "Error:" line, hints after it, and ends with a
    # generic "failed to create namespace: <strerror>".
    errors = [line for line in lines if line.startswith("Error:")]
    if errors:
        return errors[0].removeprefix("Error:").strip()
    specific = [line for line in lines if not line.startswith("failed to ")]
    return (specific or lines or ["no error output"])[-1]
