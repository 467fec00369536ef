"""What ``daxctl list``, ``cxl list`` and sysfs say about dynamic dax regions, normalised.

Why a module of its own: the daxctl back end (:mod:`csi_pmem.driver.backends.daxctl`)
acts on these facts (carves, destroys, reconfigures) while this module only reads them:
JSON handed in by the caller, a failed command's stderr, and files under ``/sys`` and
``/proc``. Nothing here runs a command or writes.

What ``daxctl list --regions --devices --mappings --idle`` prints (ndctl
``daxctl/list.c``, ``daxctl/json.c``; sizes are JSON integers without ``--human``):

- an array of regions: ``path`` (below ``/sys/devices``: ``/platform/hmem.0`` for
  soft-reserved memory, ``.../decoder0.1/region1/dax_region1`` for CXL, ``.../ndbus0/
  region0/dax0.0`` for a PMEM namespace), ``id``, ``size``, ``available_size`` (absent
  when 0, and on static PMEM regions, which cannot be split), ``align``, ``devices``;
- each device: ``chardev`` (``daxX.Y``), ``size``, ``target_node`` (absent when the
  platform gives none), ``align``, ``mode`` (``devdax`` or ``system-ram``),
  ``online_memblocks``/``total_memblocks``/``movable`` (system-ram only), ``state:
  "disabled"`` (not bound), ``mappings`` (``page_offset``, ``start``, ``end``, ``size``).
  ``--idle`` adds the size-0 seed devices, whose ``target_node`` is the region's.
- nothing at all (no output) when there is no dax region.

Dax devices carry no name, label or uuid: identity is the back end's business.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csi_pmem.driver.backends.ndctl_listing import as_int, last_line
from csi_pmem.errors import BackendError
from csi_pmem.numa import parse_cpulist
from csi_pmem.sizes import MiB, format_bytes

DEFAULT_REGION_ALIGN = 2 * MiB  # PMD_SIZE: dax_hmem and dax_cxl create regions with it

# Region kinds, for messages (the kernel object behind a dax region).
HMEM, CXL_RAM, PMEM, OTHER = "soft-reserved memory", "CXL volatile memory", "pmem", "dax memory"


# ------------------------------------------------------------------- the listing
@dataclass
class DaxDevice:
    chardev: str
    region: int
    size: int
    mode: str             # devdax or system-ram
    enabled: bool
    target_node: int | None
    align: int
    mappings: tuple[tuple[int, int], ...] = ()  # (start, end) physical ranges
    online_memblocks: int = 0

    @property
    def instance(self) -> int:
        return int(self.chardev.rsplit(".", 1)[1]) if "." in self.chardev else -1


@dataclass
class DaxRegion:
    id: int
    path: str
    size: int
    available: int
    align: int
    devices: list[DaxDevice] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The pool name: ``daxN``, unlike ndctl's ``regionN`` (pool names are unique
        across back ends on one node)."""
        return f"dax{self.id}"

    @property
    def kind(self) -> str:
        if "/ndbus" in self.path:
            return PMEM
        if "hmem" in self.path:
            return HMEM
        if re.search(r"ACPI0017|/root\d+/|decoder\d+\.\d+|dax_region\d+", self.path):
            return CXL_RAM
        return OTHER

    def target_node(self) -> int | None:
        nodes = [d.target_node for d in self.devices if d.target_node is not None]
        return nodes[0] if nodes else None

    def sized(self) -> list[DaxDevice]:
        return [d for d in self.devices if d.size > 0]


def parse_regions(doc: Any) -> list[DaxRegion]:
    """The regions of a ``daxctl list -R -D -M -i`` document (see the module docstring)."""
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise BackendError(f"unexpected 'daxctl list' output: {type(doc).__name__}")
    out = []
    for item in doc:
        if not isinstance(item, dict) or "id" not in item:
            continue
        rid = as_int(item.get("id"), -1)
        region = DaxRegion(id=rid, path=str(item.get("path", "")), size=as_int(item.get("size")),
                           available=as_int(item.get("available_size")),
                           align=as_int(item.get("align")) or DEFAULT_REGION_ALIGN)
        for dev in item.get("devices") or []:
            if isinstance(dev, dict) and dev.get("chardev"):
                region.devices.append(parse_device(dev, rid))
        out.append(region)
    return out


def parse_device(dev: dict[str, Any], region: int | None = None) -> DaxDevice:
    chardev = str(dev["chardev"])
    if region is None:
        match = re.match(r"dax(\d+)\.\d+$", chardev)
        region = int(match.group(1)) if match else -1
    node = dev.get("target_node")
    return DaxDevice(
        chardev=chardev, region=region, size=as_int(dev.get("size")),
        mode=str(dev.get("mode") or "devdax"), enabled=dev.get("state") != "disabled",
        target_node=node if isinstance(node, int) and node >= 0 else None,
        align=as_int(dev.get("align")),
        mappings=tuple((as_int(m.get("start")), as_int(m.get("end")))
                       for m in dev.get("mappings") or [] if isinstance(m, dict)),
        online_memblocks=as_int(dev.get("online_memblocks")))


def is_dynamic(region: DaxRegion, sysfs_root: str | os.PathLike) -> bool:
    """Whether daxctl can carve devices in ``region``.

    A PMEM namespace's region is static (``IORESOURCE_DAX_STATIC``: create-device fails
    with ENOSPC; those are the ndctl back end's). The kernel shows a region's ``create``
    attribute only when it is dynamic (``dax_region_visible()``, drivers/dax/bus.c);
    without sysfs the path says (PMEM regions hang below an ``ndbus``)."""
    attrs = Path(sysfs_root) / "devices" / region.path.lstrip("/") / "dax_region"
    if region.path and attrs.is_dir():
        return (attrs / "create").exists()
    return region.kind != PMEM


# ------------------------------------------------------------------- NUMA
class Topology:
    """The NUMA facts under ``<root>/devices/system/node`` that place a dax region.

    How a region's node is chosen (:meth:`place`): the memory of soft-reserved and
    especially CXL ranges often sits on a node of its own with no CPUs (its
    ``target_node``). Pods, GPUs and the driver's erase threads run on CPUs, so the
    pool is reported on the node whose CPUs are nearest:

    1. the target node itself when it has CPUs (``nodeN/cpulist`` not empty);
    2. else its best initiators as the firmware's HMAT lists them,
       ``nodeN/access0/initiators/nodeM`` (the nearest of them by distance, then the
       lowest id);
    3. else the node with CPUs at the smallest SLIT distance in ``nodeN/distance``
       (whose i-th column is the i-th node of ``online``);
    4. else the dax device's own ``numa_node`` (the kernel's
       ``numa_map_to_online_node()`` of the target: a memory-less node that is not
       online has no ``nodeN`` directory for steps 1-3);
    5. else the only node with CPUs (``has_cpu``), when there is one: a CXL ram
       region's node goes offline once its memory is offlined for devdax (kernel 6.12
       in the VM tier: target node 2, no ``node2`` directory, the device's numa_node 2
       too), and with one node of CPUs that one is the nearest whatever the distances;
    6. else the target node, or 0 when even that is unknown.
    """

    def __init__(self, sysfs_root: str | os.PathLike = "/sys") -> None:
        self.root = Path(sysfs_root)
        self.nodes = self.root / "devices" / "system" / "node"

    def _read(self, path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def has_cpus(self, node: int) -> bool | None:
        text = self._read(self.nodes / f"node{node}" / "cpulist")
        if text is None:
            return None
        try:
            return bool(parse_cpulist(text))
        except ValueError:
            return None

    def distances(self, node: int) -> dict[int, int]:
        text = self._read(self.nodes / f"node{node}" / "distance")
        if not text:
            return {}
        online_text = self._read(self.nodes / "online")
        try:
            values = [int(v) for v in text.split()]
            online = parse_cpulist(online_text) if online_text else list(range(len(values)))
        except ValueError:
            return {}
        if len(online) != len(values):
            online = list(range(len(values)))
        return dict(zip(online, values, strict=True))

    def initiators(self, node: int) -> list[int]:
        folder = self.nodes / f"node{node}" / "access0" / "initiators"
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return sorted(int(n[4:]) for n in names if re.fullmatch(r"node\d+", n))

    def place(self, target: int | None, device_node: int | None = None) -> tuple[int, str]:
        """(node, how it was found) for memory on ``target`` (see the class docstring)."""
        if target is None:
            if device_node is not None and device_node >= 0:
                return device_node, "the device's numa_node (no target node)"
            return 0, "no NUMA information: node 0"
        cpus = self.has_cpus(target)
        if cpus:
            return target, "target node"
        dist = self.distances(target)
        near = self.initiators(target)
        if near:
            best = min(near, key=lambda n: (dist.get(n, 1 << 30), n))
            return best, f"nearest initiator of CPU-less target node {target} (access0)"
        with_cpus = [n for n in dist if n != target and self.has_cpus(n)]
        if with_cpus:
            best = min(with_cpus, key=lambda n: (dist[n], n))
            return best, (f"node with CPUs nearest to CPU-less target node {target} "
                          f"(distance {dist[best]})")
        if device_node is not None and device_node >= 0 and device_node != target:
            return device_node, f"the device's numa_node for target node {target}"
        has_cpu = self._read(self.nodes / "has_cpu")
        try:
            cpu_nodes = parse_cpulist(has_cpu) if has_cpu else []
        except ValueError:
            cpu_nodes = []
        if len(cpu_nodes) == 1 and self.has_cpus(target) is None:
            return cpu_nodes[0], f"the only node with CPUs (target node {target} is offline)"
        return target, "target node (its CPUs are unknown)"


def device_numa_node(sysfs_root: str | os.PathLike, chardev: str) -> int | None:
    try:
        text = (Path(sysfs_root) / "bus" / "dax" / "devices" / chardev / "numa_node") \
            .read_text().strip()
        return int(text)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------- identity
def boot_id(proc_root: str | os.PathLike = "/proc") -> str:
    """This boot's id: dax devices of an earlier boot are gone, whatever their names."""
    try:
        return (Path(proc_root) / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def read_text(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------- cxl list
@dataclass
class CxlState:
    """What ``cxl list -M`` and ``cxl list -R`` say: volatile capacity without a region."""

    ram_memdevs: list[tuple[str, int]] = field(default_factory=list)  # (memdev, ram_size)
    ram_regions: list[str] = field(default_factory=list)


def parse_cxl(memdevs: Any, regions: Any) -> CxlState:
    state = CxlState()
    for m in memdevs if isinstance(memdevs, list) else []:
        if isinstance(m, dict) and as_int(m.get("ram_size")) > 0:
            state.ram_memdevs.append((str(m.get("memdev", "?")), as_int(m.get("ram_size"))))
    for r in regions if isinstance(regions, list) else []:
        if isinstance(r, dict) and r.get("type") == "ram":
            state.ram_regions.append(str(r.get("region", "?")))
    return state


# ------------------------------------------------------------------- problems
# What to tell the administrator, and how to fix it (docs/media.md, "Preparing a node").
def no_region_problem(cmdline: str, iomem: str, cxl: CxlState | None) -> tuple[str, str]:
    """(reason, message) when daxctl finds no dynamic dax region at all."""
    if cxl is not None and cxl.ram_memdevs:
        devs = ", ".join(f"{m} ({format_bytes(s)} volatile)" for m, s in cxl.ram_memdevs)
        if cxl.ram_regions:
            return ("cxl_no_region", (
                f"CXL ram region(s) {', '.join(cxl.ram_regions)} exist but offer no dax "
                "region: load the dax_cxl module (kernel 6.3 or later, CONFIG_DEV_DAX_CXL)"))
        first = cxl.ram_memdevs[0][0]
        return ("cxl_no_region", (
            f"CXL memory device(s) {devs} have decoders but no region, so no dax device "
            f"exists: create one, e.g. 'cxl create-region -m -t ram -d <root decoder> -w 1 "
            f"{first}' (cxl 77 or later; 'cxl list -D -d root' lists the root decoders, "
            "pick a volatile_capable one above the device's host bridge). A BIOS in "
            "'CXL Type 3 legacy' mode hands the memory to the OS as plain RAM: switch it "
            "to the CXL/EFI_MEMORY_SP mode"))
    if re.search(r"(^|\s)efi=\S*nosoftreserve", cmdline):
        return ("no_dax_region", (
            "no dax region: the kernel command line has efi=nosoftreserve, which makes "
            "specific-purpose (soft-reserved) memory ordinary RAM; remove it and reboot"))
    if "Soft Reserved" in iomem:
        return ("no_dax_region", (
            "no dax region although /proc/iomem has Soft Reserved ranges: load the "
            "dax_hmem and device_dax modules ('modprobe dax_hmem device_dax'; kernel "
            "CONFIG_DEV_DAX_HMEM)"))
    return ("no_dax_region", (
        "no dax region: no memory is marked soft-reserved, so the kernel made no dax "
        "device (pmem/ndctl#246). Have the firmware mark the memory EFI_MEMORY_SP "
        "('specific purpose' memory, with HMAT), or, for testing, reserve a range on the "
        "kernel command line: memmap=SIZE%OFFSET-1+0xefffffff (e.g. memmap=4G%8G-1+"
        "0xefffffff; needs CONFIG_EFI_SOFT_RESERVE and CONFIG_DEV_DAX_HMEM)"))


def system_ram_problem(region: DaxRegion, devices: list[DaxDevice], setup: str) -> str:
    held = ", ".join(f"{d.chardev} ({format_bytes(d.size)})" for d in devices)
    fix = ("the driver's --dax-setup=reconfigure (chart: backend.daxctl.setup) does this at "
           "start" if setup == "off" else "--dax-setup=reconfigure is on and will retry")
    return (f"{region.name} ({region.kind}, {format_bytes(region.size)}) is onlined as system "
            f"RAM by {held} (the kmem driver; kernel 6.12 does so by default), so nothing "
            f"is left to carve. Give it back to device-dax, which offlines that memory: "
            f"'daxctl reconfigure-device --mode=devdax -f {devices[0].chardev}' ({fix}); "
            "to keep it from being onlined at boot, keep the kmem module from loading "
            "(modprobe.blacklist=kmem)")


def foreign_problem(region: DaxRegion, devices: list[DaxDevice], setup: str) -> str:
    held = ", ".join(f"{d.chardev} ({format_bytes(d.size)})" for d in devices)
    dev = devices[0].chardev
    fix = ("or set --dax-setup=reconfigure" if setup == "off"
           else "--dax-setup=reconfigure is on and will retry")
    return (f"{region.name} ({region.kind}) is held whole by {held}, a device the kernel "
            f"made at boot and not a volume of this driver, so nothing is left to carve; "
            f"if nothing uses it, shrink it: 'daxctl disable-device {dev}; daxctl "
            f"reconfigure-device -s 0 {dev}' ({fix})")


def setup_failed_problem(region: DaxRegion, device: str, err: str) -> str:
    busy = "busy" in err.lower() or "EBUSY" in err
    why = ("EBUSY: the kernel could not offline that memory (it holds unmovable pages, "
           "e.g. it was onlined to ZONE_NORMAL; pmem/ndctl#256)" if busy else err)
    return (f"{region.name}: 'daxctl reconfigure-device --mode=devdax -f {device}' failed: "
            f"{why}. Online such memory movable (memhp_default_state=online_movable), or "
            "keep kmem from loading at boot (modprobe.blacklist=kmem), and reboot")


# ------------------------------------------------------------------- daxctl failures
_FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
        ("space", r"No space left on device|ENOSPC"),
        ("busy", r"Device or resource busy|EBUSY"),
        ("align", r"Invalid argument|EINVAL"),
        ("missing", r"No such device|ENODEV|ENXIO|No such device or address"),
    ))


def classify(stderr: str) -> str | None:
    """Name the known daxctl failure in ``stderr`` (None if it is not a known one)."""
    return next((kind for kind, pattern in _FAILURES if pattern.search(stderr)), None)


def said(stderr: str) -> str:
    """The line of daxctl's stderr that says why."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return errors[0] if errors else last_line(stderr)
