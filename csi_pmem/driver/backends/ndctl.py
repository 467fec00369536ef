"""The real back end: devdax and fsdax namespaces on NVDIMM regions, carved with ``ndctl``.

Why: this is the production path. Each volume is one labelled devdax or fsdax namespace
whose alt-name is the volume id, so the label area is the durable record of which namespace
belongs to which volume (docs/design.md §4, §6.3). Everything goes through ``ndctl`` with
JSON output (argv lists, timeouts, ``LC_ALL=C``: :mod:`csi_pmem.driver.host.runner`); sysfs under
``/sys/bus/nd/devices`` is read only for facts ``ndctl list`` does not print. What ndctl
and sysfs say, normalised (the listing model, the sysfs readers, the region problems and
the failure kinds of ndctl's stderr), is :mod:`csi_pmem.driver.backends.ndctl_listing`;
this module acts on it: carving, destroying, opening, the listing cache and what it
learns from failed creates.

Locking: :meth:`create` and :meth:`destroy` write namespace labels. Concurrent ndctl
writes have corrupted labels and oopsed kernels (pmem/ndctl#91, #96), so they must be
serialised node-wide. The driver core already holds its node-wide lock around every
create/destroy (``Driver.node_lock``); this class adds no second lock and is not safe
for concurrent writers on its own. Reads (:meth:`pools`, :meth:`namespaces`) are safe
to run at any time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
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
    ListingCache,
    Namespace,
    Pool,
    open_node,
)
from csi_pmem.driver.backends.ndctl_listing import (
    NDCTL_START_ALIGN,
    Listing,
    Sysfs,
    as_int,
    classify,
    device_kind,
    device_name,
    disabled_problem,
    interleave_ways,
    is_configured,
    is_disabled,
    label_slots,
    labelled,
    labelless_problem,
    last_line,
    misaligned_problem,
    mode_problems,
    no_devdax_problem,
    no_fsdax_problem,
    no_mode_problem,
    normalise,
    numa_node,
    pool_align,
    readonly_problem,
    to_namespace,
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
from csi_pmem.sizes import (
    REGION_ALIGN,
    devdax_usable,
    format_bytes,
    round_down,
)

log = logging.getLogger(__name__)

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
        self._cache: ListingCache[Listing] = ListingCache(cache_seconds)

    # -- listing --------------------------------------------------------------------
    def _list(self) -> Listing:
        # One call gives regions (numa_node needs --verbose), their namespaces including
        # disabled ones (--idle: a destroy interrupted after disable must still be
        # found), the dax devices (--verbose implies -X) and DIMM mappings (--dimms).
        argv = [self._ndctl, "list", "--regions", "--namespaces", "--dimms", "--idle",
                "--verbose"]
        generation = self._cache.generation()
        listing = normalise(self._runner.run_json(argv, timeout=self._timeout))
        self._cache.keep(generation, listing)
        return listing

    def _cached_list(self) -> Listing:
        return self._cache.get(self._list)

    def invalidate(self) -> None:
        self._cache.invalidate()

    @staticmethod
    def _pmem_regions(listing: Listing) -> Iterable[dict[str, Any]]:
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
                if ns.get("mode") in VOLUME_MODES and ns.get("name") and is_configured(ns):
                    out.append(to_namespace(self._sysfs, ns, pool))
        return out

    # -- pools ----------------------------------------------------------------------
    def _pool(self, region: dict[str, Any], listing: Listing) -> Pool:
        name = str(region["dev"])
        found = self._problems(region)
        problems = [text for _, text in found]
        align = pool_align(self._sysfs, region)
        free = as_int(region.get("available_size"))
        extent = region.get("max_available_extent")
        # Kernels before 4.19 lack max_available_extent: the free total is the best guess.
        largest = as_int(extent) if extent is not None else free
        if problems:
            free = largest = 0  # nothing can be carved, whatever the kernel counts
        return Pool(
            name=name,
            numa_node=numa_node(self._sysfs, region),
            size=as_int(region.get("size")),
            free=free,
            largest_extent=round_down(largest, align),
            align=align,
            problem="; ".join(problems) or None,
            reasons=tuple(reason for reason, _ in found),
            label_slots=0 if problems else label_slots(self._sysfs, region, listing),
            mode_problems=() if problems else mode_problems(self._sysfs, name),
            # NVDIMM and CXL persistent memory: namespaces (labels) and bytes survive.
            media=PERSISTENT,
        )

    def _problems(self, region: dict[str, Any]) -> list[tuple[str, str]]:
        """(reason, message) for each cause that makes the region unusable: the reason
        is one of base.REASONS (metrics), the message says what to do (log, CO)."""
        name = str(region["dev"])
        problems = []
        # sysfs is live, the listing may be a few seconds old: an unbound region is
        # disabled whatever the listing says (its seeds read empty then, which would
        # otherwise be mistaken for missing kernel support).
        disabled = is_disabled(region) or self._sysfs.bound(name) is False
        if disabled:
            problems.append((REASON_DISABLED, disabled_problem(name)))
        if labelled(self._sysfs, region) is False:
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

    def _present_pool(self, listing: Listing, pool: str) -> tuple[dict, Pool]:
        """The pmem region ``pool`` and its pool, or Unavailable saying why not."""
        region = listing.region(pool)
        if region is None or region.get("type", "pmem") != "pmem":
            raise Unavailable(f"pmem region {pool} is not present on this node")
        target = self._pool(region, listing)
        if target.problem:
            raise Unavailable(target.problem)
        return region, target

    def _usable_pool(self, listing: Listing, pool: str, size: int, align: int,
                     mode: str) -> Pool:
        region, target = self._present_pool(listing, pool)
        ways = interleave_ways(self._sysfs, region)
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
        if not isinstance(out, dict) or out.get("mode") != mode or not device_name(out):
            log.warning("unexpected create-namespace output for %s: %r; re-reading", name, out)
            ns = self.get(name)
            if ns is None:
                raise BackendError(f"ndctl create-namespace for {name} succeeded but the "
                                   "namespace cannot be found")
            return ns
        out = dict(out)
        out.setdefault("name", name)
        ns = to_namespace(self._sysfs, out, pool, raw_size=size)
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
                if ns.get("mode") == mode and not is_disabled(ns) and device_name(ns)]
        if len(found) == 1 and done:
            log.warning("create of %s reported failure (%s) but the namespace is complete",
                        name, err)
            return to_namespace(self._sysfs, done[0][1], pool)
        for _, ns in found:
            log.warning("removing partial namespace %s (%s) left by the failed create",
                        ns.get("dev"), name)
            try:
                self._destroy_one(str(ns["dev"]), active=not is_disabled(ns))
            except CsiPmemError as e:
                log.error("cannot remove partial namespace %s: %s", ns.get("dev"), e)
        return None

    def _translate(self, err: CommandError, pool: Pool, size: int, align: int,
                   name: str, mode: str = "devdax") -> CsiPmemError:
        """Turn an ndctl failure into the domain error a user can act on."""
        kind = classify(err.stderr)
        said = last_line(err.stderr)
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
                f"could not enable the {mode} {device_kind(mode)} (exit {err.returncode}); "
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
            confirmed &= self._destroy_one(handle, active=not is_disabled(ns))
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
        return not any(ns.get("dev") == handle and is_configured(ns)
                       for r in listing.regions for ns in r.get("namespaces") or [])

    # -- devices --------------------------------------------------------------------
    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        if not ns.device:
            raise Unavailable(f"namespace {ns.name} ({ns.handle}) has no "
                              f"{device_kind(ns.mode)}; is it disabled? try "
                              f"'ndctl enable-namespace {ns.handle}'")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC
        if exclusive and ns.mode == "fsdax":
            flags |= os.O_EXCL  # a block device: EBUSY while a file system is mounted
        return open_node(ns, flags)

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

