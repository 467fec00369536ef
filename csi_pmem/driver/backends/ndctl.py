"""The real back end: devdax and fsdax namespaces on NVDIMM regions, carved with ``ndctl``.

Why: this is the production path. Each volume is one labelled devdax or fsdax namespace
whose alt-name is the volume id, so the label area is the durable record of which namespace
belongs to which volume (docs/design.md §4, §6.3). Everything goes through ``ndctl`` with
JSON output (argv lists, timeouts, ``LC_ALL=C``: :mod:`csi_pmem.driver.host.runner`); sysfs under
``/sys/bus/nd/devices`` is read only for facts ``ndctl list`` does not print.

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

Locking: :meth:`create` and :meth:`destroy` write namespace labels. Concurrent ndctl
writes have corrupted labels and oopsed kernels (pmem/ndctl#91, #96), so they must be
serialised node-wide. The driver core already holds its node-wide lock around every
create/destroy (``Driver.node_lock``); this class adds no second lock and is not safe
for concurrent writers on its own. Reads (:meth:`pools`, :meth:`namespaces`) are safe
to run at any time.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import (
    PERSISTENT,
    REASON_DISABLED,
    REASON_LABEL_LESS,
    REASON_MISALIGNED,
    REASON_MODE,
    REASON_READ_ONLY,
    Backend,
    Namespace,
    Pool,
    device_busy,
)
from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
    CommandError,
    CsiPmemError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_os_error,
)
from csi_pmem.sizes import (
    REGION_ALIGN,
    MiB,
    allocation_for,
    devdax_usable,
    format_bytes,
    round_down,
)

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
MAX_NAME_LEN = 63              # alt-name buffer is 64 bytes including the NUL
# Modes a volume can have (the ``mode`` of create()).
VOLUME_MODES = ("devdax", "fsdax")
# Modes a namespace named with one of our volume ids can have: a volume mode, or raw
# while a create was cut short. Sector (BTT) namespaces are never ours, whatever their
# name: the driver never makes one, so one carrying our id is someone else's mistake.
OUR_MODES = (*VOLUME_MODES, "raw")
# A problem learned from a failed create is kept this long, then sysfs/ndctl evidence
# is trusted again (an administrator may have fixed the region meanwhile).
LEARNED_PROBLEM_TTL = 300.0

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
class _Listing:
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
                if ns.get("name") == name and _configured(ns)
                and (wanted is None or ns.get("mode", "raw") in wanted)]


def _normalise(doc: Any) -> _Listing:
    """Accept every shape ``ndctl list`` prints (array, platform object, bus array)."""
    out = _Listing()
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


def _int(value: Any, default: int = 0) -> int:
    """ndctl prints sizes as JSON integers (strings only with --human, which we never use)."""
    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int):
        return value
    try:
        return int(str(value), 0)
    except ValueError:
        return default


def _configured(ns: dict[str, Any]) -> bool:
    """False for idle seeds and destroyed namespaces (raw, size 0, null uuid)."""
    if _int(ns.get("size")) > 0:
        return True
    if ns.get("mode") in ("devdax", "fsdax", "sector"):
        return True
    return bool(str(ns.get("uuid", "")).strip("0-"))


def _disabled(obj: dict[str, Any]) -> bool:
    return obj.get("state") == "disabled"


def _device_name(ns: dict[str, Any]) -> str:
    """The node under /dev of an enabled namespace ("" while it has none).

    devdax namespaces get a character device (``daxX.Y``), fsdax ones a block device
    (``pmemX.Y``, ndctl's ``blockdev``); neither exists while the namespace is disabled.
    """
    if ns.get("mode") == "fsdax":
        return str(ns.get("blockdev") or "")
    return str(_dax_device(ns).get("chardev") or "")


def _device_kind(mode: str) -> str:
    return "block device" if mode == "fsdax" else "dax device"


def _dax_device(ns: dict[str, Any]) -> dict[str, Any]:
    """The namespace's dax device entry (chardev, size, align) if ndctl printed one."""
    devices = (ns.get("daxregion") or {}).get("devices") or []
    sized = [d for d in devices if _int(d.get("size")) > 0]
    if sized or devices:
        return (sized or devices)[0]
    if ns.get("chardev"):
        return {"chardev": ns["chardev"]}
    return {}


# --------------------------------------------------------------- error translation
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


_F = TypeVar("_F", bound=Callable[..., Any])


def _writes(method: _F) -> _F:
    """A namespace write drops the cached listing when it ends: the one cached while it
    ran (its own lookup, or a concurrent GetCapacity's) shows the region as it was
    before, and would hide the change for up to ``cache_seconds``."""
    @functools.wraps(method)
    def wrapper(self: NdctlBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.invalidate()
    return cast(_F, wrapper)


# -------------------------------------------------------------------- the backend
class NdctlBackend(Backend):
    """Devdax and fsdax namespaces on real NVDIMM regions (see the module docstring)."""

    kind = "ndctl"
    zeroes_new_namespaces = False  # old data may be there: the driver erases new volumes

    def __init__(self, runner: Runner | None = None, ndctl: str = "ndctl",
                 sysfs_root: str | os.PathLike = "/sys", timeout: float = 120,
                 cache_seconds: float = 5.0):
        self._runner = runner if runner is not None else Runner()
        self._ndctl = ndctl
        self._sysfs = Sysfs(sysfs_root)
        self._timeout = timeout
        self._learned: dict[str, tuple[str, str, float]] = {}
        self._learned_lock = threading.Lock()  # pools() may run outside the node lock
        # Reads (GetCapacity, ListVolumes, metrics scrapes) share one listing for a short
        # while; create/destroy always list afresh and drop it, and the device watcher
        # drops it on every nd/dax uevent, so it is never stale about our own changes.
        self.cache_seconds = cache_seconds
        self._cache: tuple[float, _Listing] | None = None
        # Bumped by invalidate(): a listing that began before a change and ended after
        # it is stale, and must not become the cache (a scrape listing while a scrub
        # destroyed its scratch namespace made GetCapacity report the space taken).
        self._cache_generation = 0
        self._cache_lock = threading.Lock()

    # -- listing --------------------------------------------------------------------
    def _list(self) -> _Listing:
        # One call gives regions (numa_node needs --verbose), their namespaces including
        # disabled ones (--idle: a destroy interrupted after disable must still be
        # found), the dax devices (--verbose implies -X) and DIMM mappings (--dimms).
        argv = [self._ndctl, "list", "--regions", "--namespaces", "--dimms", "--idle",
                "--verbose"]
        with self._cache_lock:
            generation = self._cache_generation
        listing = _normalise(self._runner.run_json(argv, timeout=self._timeout))
        with self._cache_lock:
            if generation == self._cache_generation:
                self._cache = (time.monotonic(), listing)
        return listing

    def _cached_list(self) -> _Listing:
        with self._cache_lock:
            cached = self._cache
        if cached is not None and time.monotonic() - cached[0] < self.cache_seconds:
            return cached[1]
        return self._list()

    def invalidate(self) -> None:
        with self._cache_lock:
            self._cache = None
            self._cache_generation += 1

    @staticmethod
    def _pmem_regions(listing: _Listing) -> Iterable[dict[str, Any]]:
        return (r for r in listing.regions if r.get("type", "pmem") == "pmem" and r.get("dev"))

    def pools(self) -> list[Pool]:
        listing = self._cached_list()
        return [self._pool(r, listing) for r in self._pmem_regions(listing)]

    def namespaces(self) -> list[Namespace]:
        listing = self._cached_list()
        out = []
        for region in self._pmem_regions(listing):
            pool = self._pool(region, listing)
            for ns in region.get("namespaces") or []:
                if ns.get("mode") in VOLUME_MODES and ns.get("name") and _configured(ns):
                    out.append(self._namespace(ns, pool))
        return out

    # -- pools ----------------------------------------------------------------------
    def _pool(self, region: dict[str, Any], listing: _Listing) -> Pool:
        name = str(region["dev"])
        found = self._problems(region)
        problems = [text for _, text in found]
        align = self._pool_align(region)
        free = _int(region.get("available_size"))
        extent = region.get("max_available_extent")
        # Kernels before 4.19 lack max_available_extent: the free total is the best guess.
        largest = _int(extent) if extent is not None else free
        if problems:
            free = largest = 0  # nothing can be carved, whatever the kernel counts
        return Pool(
            name=name,
            numa_node=self._numa_node(region),
            size=_int(region.get("size")),
            free=free,
            largest_extent=round_down(largest, align),
            align=align,
            problem="; ".join(problems) or None,
            reasons=tuple(reason for reason, _ in found),
            label_slots=0 if problems else self._label_slots(region, listing),
            mode_problems=() if problems else self._mode_problems(name),
            # NVDIMM and CXL persistent memory: namespaces (labels) and bytes survive.
            media=PERSISTENT,
        )

    def _mode_problems(self, name: str) -> tuple[tuple[str, str], ...]:
        """Modes the kernel cannot create on an otherwise usable region: device-dax
        without dax_pmem/device_dax (no ``dax_seed``), fsdax without the pfn driver (no
        ``pfn_seed``). Unknown (unreadable sysfs) counts as supported."""
        out = []
        if self._sysfs.read(name, "dax_seed") == "":
            out.append(("devdax", no_devdax_problem(name)))
        if self._sysfs.read(name, "pfn_seed") == "":
            out.append(("fsdax", no_fsdax_problem(name)))
        return tuple(out)

    def _problems(self, region: dict[str, Any]) -> list[tuple[str, str]]:
        """(reason, message) for each cause that makes the region unusable: the reason
        is one of base.REASONS (metrics), the message says what to do (log, CO)."""
        name = str(region["dev"])
        problems = []
        # sysfs is live, the listing may be a few seconds old: an unbound region is
        # disabled whatever the listing says (its seeds read empty then, which would
        # otherwise be mistaken for missing kernel support).
        disabled = _disabled(region) or self._sysfs.bound(name) is False
        if disabled:
            problems.append((REASON_DISABLED, disabled_problem(name)))
        if self._labelled(region) is False:
            problems.append((REASON_LABEL_LESS, labelless_problem(name)))
        start = self._sysfs.read_int(name, "resource")
        if start is not None and start % NDCTL_START_ALIGN:
            problems.append((REASON_MISALIGNED, misaligned_problem(name, start)))
        if self._sysfs.read(name, "read_only") == "1":
            problems.append((REASON_READ_ONLY, readonly_problem(name)))
        if not disabled and self._sysfs.read(name, "dax_seed") == "" \
                and self._sysfs.read(name, "pfn_seed") == "":
            problems.append((REASON_MODE, no_devdax_problem(name) + "; "
                             + no_fsdax_problem(name)))
        learned = self._learned_problem(name)
        if learned and not problems:
            problems.append(learned)
        return problems

    def _labelled(self, region: dict[str, Any]) -> bool | None:
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
        nstype = self._sysfs.read_int(str(region["dev"]), "nstype")
        if nstype == ND_DEVICE_NAMESPACE_IO:
            return False
        if nstype == ND_DEVICE_NAMESPACE_PMEM:
            return True
        if "iset_id" in region:
            return True
        if _int(region.get("available_size")) == 0 and \
                _int(region.get("max_available_extent")) == 0:
            return False
        return None

    def _interleave_ways(self, region: dict[str, Any]) -> int:
        mappings = region.get("mappings")
        if mappings:
            return len(mappings)
        return max(1, self._sysfs.read_int(str(region["dev"]), "mappings") or 1)

    def _pool_align(self, region: dict[str, Any]) -> int:
        """Granularity of namespace sizes in this region.

        ndctl demands a size that is a multiple of the region ``align`` (16 MiB by
        default, times the interleave ways when 16 MiB does not divide evenly across
        them: ``default_align()`` in region_devs.c) and of the devdax align times the
        interleave ways (``validate_namespace_options()``). Sizes are also kept at 16 MiB
        multiples even if someone lowered the region align, because every namespace after
        an odd-sized one would start misaligned and be refused.
        """
        region_align = _int(region.get("align")) or \
            self._sysfs.read_int(str(region["dev"]), "align") or REGION_ALIGN
        ways = self._interleave_ways(region)
        return math.lcm(region_align, REGION_ALIGN, DEFAULT_DEVDAX_ALIGN * ways)

    def _numa_node(self, region: dict[str, Any]) -> int:
        node = region.get("numa_node")
        if node is None:
            node = self._sysfs.read_int(str(region["dev"]), "numa_node")
        # -1 (or absent) means the platform gave no proximity domain: a single node.
        return node if isinstance(node, int) and node >= 0 else 0

    def _region_dimms(self, region: dict[str, Any]) -> list[str]:
        dimms = [str(m["dimm"]) for m in region.get("mappings") or [] if m.get("dimm")]
        if dimms:
            return dimms
        name = str(region["dev"])
        for i in range(self._sysfs.read_int(name, "mappings") or 0):
            entry = self._sysfs.read(name, f"mapping{i}")  # "nmem0,start,size[,position]"
            if entry:
                dimms.append(entry.split(",", 1)[0])
        return dimms

    def _label_slots(self, region: dict[str, Any], listing: _Listing) -> int:
        """How many namespaces this region can hold in total, limited by label space.

        Each namespace of a region takes one label on every DIMM of the region.
        sysfs ``nmemX/available_slots`` is the number of free label slots minus the one
        the kernel keeps for updates (``available_slots_show()`` in dimm_devs.c); the
        namespaces already configured on regions using that DIMM hold the others. The
        region's capacity is the minimum over its DIMMs. 0 means unknown.
        """
        counts: dict[str, int] = {}
        for other in listing.regions:
            used = sum(1 for ns in other.get("namespaces") or [] if _configured(ns))
            for dimm in self._region_dimms(other):
                counts[dimm] = counts.get(dimm, 0) + used
        totals = []
        for dimm in self._region_dimms(region):
            free = self._sysfs.read_int(dimm, "available_slots")
            if free is not None:
                totals.append(free + counts.get(dimm, 0))
        return min(totals, default=0)

    # -- learned problems ---------------------------------------------------------
    def _learn(self, region: str, reason: str, problem: str) -> None:
        with self._learned_lock:
            self._learned[region] = (reason, problem, time.monotonic() + LEARNED_PROBLEM_TTL)

    def _learned_problem(self, region: str) -> tuple[str, str] | None:
        """(reason, message) learned from a failed create, until it expires."""
        with self._learned_lock:
            entry = self._learned.get(region)
            if entry and entry[2] < time.monotonic():
                del self._learned[region]
                return None
            return (entry[0], entry[1]) if entry else None

    # -- namespaces -----------------------------------------------------------------
    def _namespace(self, ns: dict[str, Any], pool: Pool, raw_size: int | None = None) -> Namespace:
        mode = str(ns.get("mode") or "raw")
        if mode == "fsdax":
            # The pfn device's size and align: the block device's capacity.
            align = _int(ns.get("align")) or DEFAULT_FSDAX_ALIGN
            usable = _int(ns.get("size"))
        else:
            dax = _dax_device(ns)
            align = _int(ns.get("align")) or _int(dax.get("align")) or \
                _int((ns.get("daxregion") or {}).get("align")) or DEFAULT_DEVDAX_ALIGN
            usable = _int(dax.get("size")) or _int(ns.get("size"))
        handle = str(ns.get("dev", ""))
        node = ns.get("numa_node")
        device = _device_name(ns)
        return Namespace(
            name=str(ns["name"]),
            pool=pool.name,
            numa_node=node if isinstance(node, int) and node >= 0 else pool.numa_node,
            size=self._raw_size(handle, usable, align, pool, raw_size),
            usable_size=usable,
            align=align,
            device=f"/dev/{device}" if device else "",
            handle=handle,
            mode=mode,
            # Real pmem: an fsdax pfn device holds struct pages (map=dev), so the pmem
            # driver marks the block device DAX-capable and "mount -o dax" works on it.
            fs_dax=True,
        )

    def _raw_size(self, handle: str, usable: int, align: int, pool: Pool,
                  known: int | None = None) -> int:
        """The raw namespace size; ndctl prints only the device's usable size.

        sysfs ``namespaceX.Y/size`` has it. Without sysfs, use what was requested
        (``known``, right after a create) or invert the sizing the driver used to create
        it (exact for namespaces this driver made).
        """
        size = self._sysfs.read_int(handle, "size") if handle else None
        if size:
            return size
        if known:
            return known
        if usable <= 0:
            return 0
        estimate = allocation_for(usable, align, pool.align)[0]
        log.debug("%s: raw size not readable from sysfs, estimated %d", handle, estimate)
        return estimate

    # -- create ---------------------------------------------------------------------
    @_writes
    def create(self, name: str, pool: str, size: int, align: int,
               mode: str = "devdax") -> Namespace:
        """Carve a ``mode`` namespace; both modes keep their struct pages on the device.

        ``--map=dev`` for fsdax too: with ``map=mem`` the struct pages would come out of
        system RAM (64 bytes per 4 KiB page), which the volume's size would not account
        for.
        """
        _check_name(name)
        if mode not in VOLUME_MODES:
            raise InvalidArgument(f"unknown namespace mode {mode!r}: use one of "
                                  f"{', '.join(VOLUME_MODES)}")
        if size <= 0 or align <= 0 or size % align:
            raise InvalidArgument(f"namespace size {size} must be a positive multiple of the "
                                  f"{mode} align {align}")
        listing = self._list()
        taken = listing.named(name)
        if taken:
            region, ns = taken[0]
            raise AlreadyExists(f"a namespace named {name} already exists "
                                f"({ns.get('dev')} on {region.get('dev')})")
        target = self._usable_pool(listing, pool, size, align, mode)
        argv = [self._ndctl, "create-namespace", f"--region={pool}", f"--mode={mode}",
                "--map=dev", f"--size={size}", f"--align={align}", f"--name={name}"]
        self.invalidate()
        try:
            out = self._runner.run_json(argv, timeout=self._timeout)
        except CommandError as e:
            recovered = self._after_failed_create(e, name, target, mode)
            if recovered is not None:
                return recovered
            raise self._translate(e, target, size, align, name, mode) from e
        return self._created(out, name, target, size, align, mode)

    @_writes
    def create_scratch(self, name: str, pool: str, size: int) -> Namespace:
        """A raw namespace over ``size`` bytes (see the Backend contract): no info block
        and no struct pages, so its block device ``/dev/pmemX.Y`` covers every byte and
        zeroing it leaves nothing of the space unzeroed."""
        _check_name(name)
        listing = self._list()
        if listing.named(name):
            raise AlreadyExists(f"a namespace named {name} already exists")
        _, target = self._present_pool(listing, pool)
        if size <= 0 or size % target.align:
            raise InvalidArgument(f"scratch namespace size {size} on {pool} must be a "
                                  f"positive multiple of {format_bytes(target.align)}")
        argv = [self._ndctl, "create-namespace", f"--region={pool}", "--mode=raw",
                f"--size={size}", f"--name={name}"]
        self.invalidate()
        try:
            out = self._runner.run_json(argv, timeout=self._timeout)
        except CommandError as e:
            with contextlib.suppress(CsiPmemError):
                self.destroy(name)  # a partial one carries the name: it is ours
            raise self._translate(e, target, size, REGION_ALIGN, name, "raw") from e
        if isinstance(out, list):
            out = out[0] if out else {}
        if not isinstance(out, dict) or not out.get("blockdev"):
            found = [ns for _, ns in self._list().named(name, ("raw",)) if ns.get("blockdev")]
            if not found:
                raise BackendError(f"ndctl made scratch namespace {name} without a block "
                                   "device; is the nd_pmem module loaded?")
            out = found[0]
        node = out.get("numa_node")
        return Namespace(name=name, pool=pool,
                         numa_node=node if isinstance(node, int) and node >= 0
                         else target.numa_node,
                         size=size, usable_size=size, align=target.align,
                         device=f"/dev/{out['blockdev']}", handle=str(out.get("dev", "")),
                         mode="raw", fs_dax=False)

    def _present_pool(self, listing: _Listing, pool: str) -> tuple[dict, Pool]:
        """The pmem region ``pool`` and its pool, or Unavailable saying why not."""
        region = listing.region(pool)
        if region is None or region.get("type", "pmem") != "pmem":
            raise Unavailable(f"pmem region {pool} is not present on this node")
        target = self._pool(region, listing)
        if target.problem:
            raise Unavailable(target.problem)
        return region, target

    def _usable_pool(self, listing: _Listing, pool: str, size: int, align: int,
                     mode: str) -> Pool:
        region, target = self._present_pool(listing, pool)
        ways = self._interleave_ways(region)
        if size % target.align or size % (align * ways):
            raise InvalidArgument(
                f"namespace size {size} on {pool} must be a multiple of "
                f"{format_bytes(target.align)} and of the {format_bytes(align)} {mode} align "
                f"times the {ways} interleave ways")
        return target

    def _created(self, out: Any, name: str, pool: Pool, size: int, align: int,
                 mode: str) -> Namespace:
        if isinstance(out, list):  # not what create-namespace prints, but harmless
            out = out[0] if out else {}
        if not isinstance(out, dict) or out.get("mode") != mode or not _device_name(out):
            log.warning("unexpected create-namespace output for %s: %r; re-reading", name, out)
            ns = self.get(name)
            if ns is None:
                raise BackendError(f"ndctl create-namespace for {name} succeeded but the "
                                   "namespace cannot be found")
            return ns
        out = dict(out)
        out.setdefault("name", name)
        ns = self._namespace(out, pool, raw_size=size)
        if ns.name != name:
            raise BackendError(f"ndctl created {ns.handle} named {ns.name!r}, not {name!r}")
        if ns.size != size:
            log.warning("%s: kernel reports raw size %d, requested %d", ns.handle, ns.size, size)
        expected = devdax_usable(size, align)
        if ns.usable_size != expected:
            log.warning("%s: kernel offers %d usable bytes, sizes.devdax_usable predicts %d "
                        "(size %d, align %d); reporting the kernel's value",
                        ns.handle, ns.usable_size, expected, size, align)
        if ns.align != align:
            log.warning("%s: %s align is %d, requested %d", ns.handle, mode, ns.align, align)
        log.info("created %s (%s, %s usable) on %s as %s", name, format_bytes(size),
                 format_bytes(ns.usable_size), pool.name, ns.device)
        return ns

    def _after_failed_create(self, err: CommandError, name: str, pool: Pool,
                             mode: str) -> Namespace | None:
        """After an unexplained failure (timeout, kill), see what the kernel holds.

        ndctl cleans up after the failures it recognises (--autorecover is the
        default), but not if it was killed half-way. A complete namespace of the
        requested mode with our name (enabled, with its dax or block device) means the
        create did finish; anything else with our name is a partial one and is removed,
        since the name proves it is ours and it was never handed out.
        """
        if classify(err.stderr) is not None:
            return None
        try:
            listing = self._list()
        except CsiPmemError as e:
            log.warning("cannot inspect %s after failed create: %s", name, e)
            return None
        found = listing.named(name, OUR_MODES)
        done = [(r, ns) for r, ns in found
                if ns.get("mode") == mode and not _disabled(ns) and _device_name(ns)]
        if len(found) == 1 and done:
            log.warning("create of %s reported failure (%s) but the namespace is complete",
                        name, err)
            return self._namespace(done[0][1], pool)
        for _, ns in found:
            log.warning("removing partial namespace %s (%s) left by the failed create",
                        ns.get("dev"), name)
            try:
                self._destroy_one(str(ns["dev"]), active=not _disabled(ns))
            except CsiPmemError as e:
                log.error("cannot remove partial namespace %s: %s", ns.get("dev"), e)
        return None

    def _translate(self, err: CommandError, pool: Pool, size: int, align: int,
                   name: str, mode: str = "devdax") -> CsiPmemError:
        """Turn an ndctl failure into the domain error a user can act on."""
        kind = classify(err.stderr)
        said = _last_line(err.stderr)
        if kind == "labelless":
            self._learn(pool.name, REASON_LABEL_LESS, labelless_problem(pool.name))
            return Unavailable(labelless_problem(pool.name))
        if kind == "misaligned":
            start = self._sysfs.read_int(pool.name, "resource")
            self._learn(pool.name, REASON_MISALIGNED, misaligned_problem(pool.name, start))
            return Unavailable(misaligned_problem(pool.name, start))
        if kind == "exists":
            return AlreadyExists(f"a namespace named {name} already exists (ndctl: {said})")
        if kind == "space":
            return ResourceExhausted(
                f"{pool.name} (NUMA node {pool.numa_node}) has no free extent of "
                f"{format_bytes(size)} for a {mode} namespace (ndctl: {said}); free "
                "space may be fragmented: use a smaller volume or another node")
        if kind == "size":
            return InvalidArgument(
                f"ndctl rejected a namespace of {size} bytes with align {format_bytes(align)} "
                f"on {pool.name} (region granularity {format_bytes(pool.align)}): {said}")
        if kind == "align":
            hint = "use 2Mi" + (", or enable 1Gi pages for device-dax"
                                if mode == "devdax" else "")
            return InvalidArgument(
                f"{pool.name} does not support the {format_bytes(align)} {mode} align "
                f"(ndctl: {said}); {hint}")
        if kind == "nodax":
            return Unavailable(no_mode_problem(pool.name, mode) + f" (ndctl: {said})")
        if kind == "readonly":
            return Unavailable(readonly_problem(pool.name))
        if "failed to enable" in err.stderr:
            modules = "nd_pmem module is" if mode == "fsdax" else \
                "dax_pmem and device_dax modules are"
            return CommandError(err.argv, err.returncode, err.stderr, message=(
                f"could not enable the {mode} {_device_kind(mode)} (exit {err.returncode}); "
                f"check dmesg and that the {modules} loaded"))
        return err

    # -- destroy --------------------------------------------------------------------
    @_writes
    def destroy(self, name: str) -> None:
        """Remove every configured devdax, fsdax or raw namespace named ``name``; none is fine.

        The driver calls this only with its own volume ids, and the exact id on a
        devdax/fsdax/raw namespace is the proof of ownership. Raw counts too: a create
        killed half-way can leave a raw namespace that already carries the name.
        Namespaces without a name are never touched, nor sector (BTT) ones, which this
        driver never makes.
        """
        if not name:
            raise InvalidArgument("refusing to destroy a namespace without a name")
        found = self._list().named(name, OUR_MODES)
        self.invalidate()
        confirmed = True
        for region, ns in found:
            handle = str(ns["dev"])
            log.info("destroying %s (%s) on %s", handle, name, region.get("dev"))
            confirmed &= self._destroy_one(handle, active=not _disabled(ns))
        # ndctl says "destroyed 1 namespace" when it did; only without that word is
        # one more listing worth its exec (about a third of a second under TCG).
        if found and not confirmed and self._list().named(name, OUR_MODES):
            raise BackendError(f"namespace {name} is still present after "
                               "'ndctl destroy-namespace'; see the driver log")

    def _destroy_one(self, handle: str, active: bool) -> bool:
        """Disable and destroy ``handle``; True if ndctl confirmed the destroy."""
        steps = []
        if active:
            steps.append([self._ndctl, "disable-namespace", handle])
        steps.append([self._ndctl, "destroy-namespace", handle, "--force"])
        said = ""
        for i, argv in enumerate(steps):
            if i:
                failpoints.hit(failpoints.DESTROY_MID)
            try:
                said = self._runner.run(argv, timeout=self._timeout).stderr or ""
            except CommandError as e:
                if self._handle_gone(handle):
                    log.info("%s vanished while being destroyed: %s", handle, e)
                    return True
                if classify(e.stderr) == "readonly":
                    region = handle.removeprefix("namespace").split(".")[0]
                    raise Unavailable(readonly_problem(f"region{region}")) from e
                raise
        # ndctl/namespace.c do_xaction_namespace(): "destroyed %d namespace%s".
        return re.search(r"\bdestroyed 1 namespace\b", said) is not None

    def _handle_gone(self, handle: str) -> bool:
        try:
            listing = self._list()
        except CsiPmemError:
            return False
        return not any(ns.get("dev") == handle and _configured(ns)
                       for r in listing.regions for ns in r.get("namespaces") or [])

    # -- devices --------------------------------------------------------------------
    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        if not ns.device:
            raise Unavailable(f"namespace {ns.name} ({ns.handle}) has no "
                              f"{_device_kind(ns.mode)}; is it disabled? try "
                              f"'ndctl enable-namespace {ns.handle}'")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC
        if exclusive and ns.mode == "fsdax":
            flags |= os.O_EXCL  # a block device: EBUSY while a file system is mounted
        try:
            return os.open(ns.device, flags)
        except FileNotFoundError as e:
            raise NotFound(f"device {ns.device} of volume {ns.name} does not exist; is /dev "
                           "the host's /dev in this container?") from e
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise device_busy(ns) from e
            raise from_os_error(e, f"cannot open {ns.device} of volume {ns.name}") from e

    # -- health ---------------------------------------------------------------------
    def probe(self) -> tuple[bool, str]:
        try:
            pools = self.pools()
        except CsiPmemError as e:
            return False, f"ndctl is not usable: {e}"
        if not pools:
            return False, ("ndctl found no pmem regions: check that the NVDIMMs are "
                           "configured for App Direct and the nfit/nd_pmem modules are loaded")
        bad = [f"{p.name}: {p.problem}" for p in pools if not p.usable]
        if len(bad) == len(pools):
            return False, "no usable region: " + "; ".join(bad)
        return True, "ok" + (f" (unusable: {'; '.join(bad)})" if bad else "")

    def max_volumes(self) -> int:
        """Label slots of the usable regions (0 when unknown, which means unbounded)."""
        return sum(p.label_slots for p in self.pools() if p.usable)


def _check_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_NAME_LEN or not name.isascii() \
            or not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidArgument(f"invalid namespace name {name!r}: 1 to {MAX_NAME_LEN} printable "
                              "ASCII characters without spaces")


def _last_line(stderr: str) -> str:
    """The line of ndctl's stderr that says why (not the generic summary after it)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    # ndctl prints the reason as the first "Error:" line, hints after it, and ends with a
    # generic "failed to create namespace: <strerror>".
    errors = [line for line in lines if line.startswith("Error:")]
    if errors:
        return errors[0].removeprefix("Error:").strip()
    specific = [line for line in lines if not line.startswith("failed to ")]
    return (specific or lines or ["no error output"])[-1]
