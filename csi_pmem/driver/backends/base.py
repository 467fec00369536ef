"""The one interface every back end implements: ndctl (NVDIMM and CXL persistent memory
regions), daxctl (dynamic dax regions: soft-reserved and CXL volatile memory), memory
(DRAM pools bound to their NUMA node), emulated (files), the composite that puts
several behind one (``--backend ndctl,daxctl``), and the test fakes.

Why an interface: the servicers and the driver core must behave identically whether
namespaces live on real NVDIMM regions (``ndctl``), on dax devices carved from dynamic
regions (``daxctl``) or in files (``emulated``). The contract, including the error types,
is fixed here; implementations hold no CSI knowledge. Sizes are raw namespace sizes
unless named ``usable``. What back ends share beyond the contract lives here too: the
device open (:func:`open_node`) and the short-lived listing cache (:class:`ListingCache`).

Contract:
- ``pools()`` lists every region, usable or not; unusable ones say why in ``problem``.
- ``namespaces()`` lists the namespaces that carry a name (the driver's volume ids are
  names); nameless ones are not ours and are never touched.
- ``create(name, pool, size, align, mode)`` makes a namespace of exactly ``size`` raw
  bytes (already a multiple of ``pool.align`` and ``align``) in ``mode``: ``devdax``
  (a character device, ``/dev/daxX.Y``) or ``fsdax`` (a block device, ``/dev/pmemX.Y``,
  whose usable size follows the same struct-page arithmetic); raises
  :class:`ResourceExhausted` when it does not fit and :class:`AlreadyExists` when the
  name is taken. It is called under the driver's node-wide lock.
- ``destroy(name)`` removes it (a volume or a scratch namespace); a missing name is not
  an error.
- ``create_scratch(name, pool, size)`` makes a namespace whose device maps all ``size``
  raw bytes, with no metadata of its own (ndctl: a raw namespace, ``/dev/pmemX.Y``), so
  that zeroing its device zeroes every byte of that space. The driver's scrub
  (:mod:`csi_pmem.driver.erasing.scrub`) uses it to clean a region's free space;
  ``namespaces()`` never lists such namespaces. Called under the node-wide lock.
- ``zeroes_new_namespaces``: True when a new namespace always reads as zeros whatever
  was deleted before (the emulated back end's fresh files); the driver then never
  zeroes on create and keeps no clean-space ledger.
- ``open_device(ns, readonly)`` returns a new fd that maps the usable bytes from
  offset 0 (O_RDONLY when ``readonly``); the caller owns and closes it.
- ``Namespace.fs_dax`` says whether a file system on an fsdax namespace can be mounted
  with ``-o dax`` (true on real pmem; false for the emulated loop devices, which are
  plain block devices).
- ``probe()`` says whether the back end can serve (False with a reason otherwise).
- ``Pool.media`` says what a node restart does to the region's contents: ``persistent``
  (NVDIMM, CXL persistent memory: namespaces and bytes survive) or ``volatile`` (DRAM,
  CXL volatile memory, soft-reserved ranges, an emulated pool on tmpfs: both are gone).
  The driver carves a lost volume of a volatile pool again, empty, under the same id;
  on a persistent pool a lost namespace is a fault it reports and never papers over.
"""

from __future__ import annotations

import abc
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from csi_pmem.errors import FailedPrecondition, NotFound, from_os_error
from csi_pmem.sizes import allocation_for, allocation_step, devdax_usable, round_down, round_up

# Why a region is unusable, as metrics say it (``csi_pmem_pool_usable{reason}``): a
# closed set, so an alert can match on it and the label stays low-cardinality.
REASON_DISABLED = "disabled"
REASON_LABEL_LESS = "label_less"
REASON_MISALIGNED = "misaligned"
REASON_READ_ONLY = "read_only"
REASON_MODE = "mode"  # the kernel offers neither devdax nor fsdax instances
REASON_OVERCOMMITTED = "overcommitted"  # namespaces use more than the region holds
# Dynamic dax regions (the daxctl back end): firmware and node set-up states.
REASON_NO_DAX_REGION = "no_dax_region"  # no memory marked soft-reserved, no region at all
REASON_SYSTEM_RAM = "system_ram"        # the region is onlined as system RAM (kmem)
REASON_FOREIGN_DEVICE = "foreign_device"  # a device the kernel made holds all of it
REASON_CXL_NO_REGION = "cxl_no_region"  # CXL memory devices with decoders but no region
REASONS = (REASON_DISABLED, REASON_LABEL_LESS, REASON_MISALIGNED, REASON_READ_ONLY,
           REASON_MODE, REASON_OVERCOMMITTED, REASON_NO_DAX_REGION, REASON_SYSTEM_RAM,
           REASON_FOREIGN_DEVICE, REASON_CXL_NO_REGION)

# What a node restart does to a region's contents (``Pool.media``, module docstring).
PERSISTENT = "persistent"
VOLATILE = "volatile"
MEDIA = (PERSISTENT, VOLATILE)


@dataclass(frozen=True)
class Pool:
    """A region of DAX memory on one NUMA node."""

    name: str
    numa_node: int
    size: int
    free: int
    largest_extent: int
    align: int
    problem: str | None = None
    label_slots: int = 0
    # Stable short names for ``problem`` (one per cause, in its order), for metrics and
    # alerts: REASONS below. The long text is for the log and the CO.
    reasons: tuple[str, ...] = ()
    # (mode, why) for device modes this region cannot carve although others work,
    # e.g. ("devdax", "no device-dax instance ...") on a kernel without device_dax.
    mode_problems: tuple[tuple[str, str], ...] = ()
    # PERSISTENT or VOLATILE; persistent unless the back end says otherwise, the side
    # on which a lost volume is reported rather than recreated empty.
    media: str = PERSISTENT
    # True where a devdax device keeps its struct pages on the memory itself (ndctl's
    # map=dev: 1/64 of the namespace); False where they live in system RAM (a device of
    # a dynamic dax region), so its usable size is its raw size.
    struct_pages_on_media: bool = True
    # The page size a volume's memory comes in (bytes; 0 where the back end cannot say,
    # as on device-dax and the emulated pools) and how its pages are kept on
    # ``numa_node`` ("bind": the memory back end binds every allocation there; "" where
    # the media itself is the node's, or nothing binds it).
    page_size: int = 0
    placement: str = ""

    @property
    def usable(self) -> bool:
        return self.problem is None

    @property
    def volatile(self) -> bool:
        return self.media == VOLATILE

    def problem_for(self, mode: str) -> str | None:
        """Why no ``mode`` namespace can be carved here (None when it can)."""
        return self.problem or dict(self.mode_problems).get(mode)

    def allocation(self, request: int, align: int) -> tuple[int, int]:
        """(raw size, usable size) of the smallest volume here offering ``request``."""
        if self.struct_pages_on_media:
            return allocation_for(request, align, self.align)
        size = round_up(max(request, 1), allocation_step(align, self.align))
        return size, size

    def usable_in(self, nbytes: int, align: int) -> int:
        """Usable bytes of a volume carved from ``nbytes`` of free space here."""
        size = round_down(nbytes, allocation_step(align, self.align))
        return devdax_usable(size, align) if self.struct_pages_on_media else size


@dataclass(frozen=True)
class Namespace:
    """A namespace (one per volume): devdax or fsdax."""

    name: str
    pool: str
    numa_node: int
    size: int
    usable_size: int
    align: int
    device: str
    handle: str = ""
    mode: str = "devdax"
    fs_dax: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def device_busy(ns: Namespace) -> FailedPrecondition:
    return FailedPrecondition(
        f"device {ns.device} of volume {ns.name} is in use (a file system on it is mounted, "
        "or something holds it open exclusively); unmount it first")


GONE_HINT = "is /dev the host's /dev in this container?"


def open_node(ns: Namespace, flags: int, gone: str = GONE_HINT) -> int:
    """open() of the volume's device node with every back end's error translation: a
    missing node is NOT_FOUND (``gone`` says what to check), EBUSY is
    :func:`device_busy`, any other errno is translated with the volume named."""
    try:
        return os.open(ns.device, flags)
    except FileNotFoundError as e:
        raise NotFound(f"device {ns.device} of volume {ns.name} does not exist; {gone}") from e
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise device_busy(ns) from e
        raise from_os_error(e, f"cannot open {ns.device} of volume {ns.name}") from e


class Backend(abc.ABC):
    """See the module docstring for the contract."""

    kind: str = "abstract"

    @abc.abstractmethod
    def pools(self) -> list[Pool]: ...

    @abc.abstractmethod
    def namespaces(self) -> list[Namespace]: ...

    def get(self, name: str) -> Namespace | None:
        for ns in self.namespaces():
            if ns.name == name:
                return ns
        return None

    def pool(self, name: str) -> Pool | None:
        """The pool called ``name``, or None when this node has none of that name."""
        return next((p for p in self.pools() if p.name == name), None)

    @abc.abstractmethod
    def create(self, name: str, pool: str, size: int, align: int,
               mode: str = "devdax") -> Namespace: ...

    @abc.abstractmethod
    def destroy(self, name: str) -> None: ...

    zeroes_new_namespaces: bool = False

    def create_scratch(self, name: str, pool: str, size: int) -> Namespace:
        """See the module docstring; back ends that cannot leave regions dirty."""
        raise NotImplementedError(f"the {self.kind} back end cannot scrub free space")

    @abc.abstractmethod
    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        """``exclusive`` opens a block device O_EXCL: EBUSY (:func:`device_busy`) while
        a file system on it is mounted, so an erase never runs under a live mount."""

    def probe(self) -> tuple[bool, str]:
        pools = self.pools()
        if not pools:
            return False, f"{self.kind} back end found no regions"
        bad = [p for p in pools if not p.usable]
        if len(bad) == len(pools):
            return False, "; ".join(f"{p.name}: {p.problem}" for p in bad)
        return True, "ok"

    def max_volumes(self) -> int:
        """How many volumes this node can hold at most (label slots), 0 if unbounded."""
        return sum(p.label_slots for p in self.pools())

    def device_present(self, ns: Namespace) -> bool:
        return os.path.exists(ns.device)

    def setup_node(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Prepare the node's memory before the first listing, where the administrator
        opted in (``--dax-setup=reconfigure``); never raises for a refusal, which
        becomes a pool's reason instead."""

    def invalidate(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Forget cached listings (called on device events); no-op without a cache."""

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Release resources (threads, caches). Namespaces stay."""


T = TypeVar("T")


class ListingCache(Generic[T]):
    """One listing (``ndctl list``, ``daxctl list``) shared by reads for ``seconds``.

    Reads (GetCapacity, ListVolumes, metrics scrapes) share it for a short while;
    creates and destroys list afresh and drop it, and the device watcher drops it on
    every nd/dax uevent, so it is never stale about the driver's own changes. A listing
    that began before :meth:`invalidate` and ended after it is stale and never becomes
    the cache (a scrape listing while a scrub destroyed its scratch namespace made
    GetCapacity report the space taken): take :meth:`generation` before listing and
    hand it to :meth:`keep` with the result.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._entry: tuple[float, T] | None = None
        self._generation = 0

    def generation(self) -> int:
        with self._lock:
            return self._generation

    def keep(self, generation: int, value: T) -> None:
        """Cache ``value``, listed since :meth:`generation` returned ``generation``."""
        with self._lock:
            if generation == self._generation:
                self._entry = (time.monotonic(), value)

    def get(self, list_afresh: Callable[[], T]) -> T:
        """The cached listing while it is fresh, else ``list_afresh()`` (which keeps
        what it lists)."""
        with self._lock:
            entry = self._entry
        if entry is not None and time.monotonic() - entry[0] < self.seconds:
            return entry[1]
        return list_afresh()

    def invalidate(self) -> None:
        with self._lock:
            self._entry = None
            self._generation += 1
