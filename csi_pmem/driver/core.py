"""The driver core: volume life cycle, publication and start-up reconciliation.

Why separate from the servicers: gRPC servicers validate requests and translate
results; everything that touches the back end and the state store lives here, behind
plain Python calls that the CLI, the tests and the servicers share. Node operations
apply the shared policy here and dispatch to one publisher per device mode
(:mod:`csi_pmem.driver.node`: devdax directories with dax.sock, fsdax devices and file
systems). Every mutating operation follows the same discipline:

1. take the volume's in-flight slot (a concurrent call gets ABORTED),
2. write the intent to the volume's record (so a crash leaves something to finish),
3. act (under the node-wide lock for namespace create/destroy),
4. write the outcome.

Start-up (:meth:`Driver.reconcile`) reads every record and every namespace and brings
them together: half-created volumes are rolled back, half-deleted ones are finished,
published volumes get their sockets served again, and namespaces that look like ours
but have no record are reported, never destroyed.

Erasing (docs/design.md §6.9): DeleteVolume with ``eraseOnDelete`` queues the erase on
the background eraser (:mod:`csi_pmem.driver.erasing.eraser`) and returns; the namespace is
destroyed
once its erase is verified, so its space shows as free only then. Which regions' free
space is known to be zeros lives in the clean-space ledger
(:mod:`csi_pmem.driver.erasing.cleanspace`):
CreateVolume zeroes only in dirty regions, and scrubs (:mod:`csi_pmem.driver.erasing.scrub`) make
them
clean again.

Volatile pools (``Pool.media``, docs/media.md): a volume outlives its pods, not its node.
When a READY volume's namespace is gone from a volatile pool (the node restarted, the
tmpfs of an emulated pool was mounted again, a region was created again), start-up and
NodePublish/NodeStageVolume carve it again under the same id at its recorded size,
pool and align (:meth:`Driver._recreate`), zero it through the same path as a create in
a dirty region, and only then serve it. The volume's condition says its contents were
lost and when (``VolumeRecord.contents_lost_at``); a staged model is simply absent, so
the staging sidecar stages it again. Where it cannot be carved (the pool is gone or
full) it stays abnormal with that reason and is retried at the next start or publish.
On persistent pools a lost namespace is only ever reported.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace, Pool
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.erase import SAMPLED, EraseCancelled, zero_fd
from csi_pmem.driver.erasing.eraser import DELETE, STOP_TIMEOUT, EraseQueue
from csi_pmem.driver.erasing.scrub import Scrubber
from csi_pmem.driver.host.filesystems import Usage
from csi_pmem.driver.host.mounter import HostMounter, Mounter
from csi_pmem.driver.locks import InFlight
from csi_pmem.driver.node import NodePublisher
from csi_pmem.driver.node.access import Access
from csi_pmem.driver.node.devdax import DevdaxNode
from csi_pmem.driver.node.fsdax import FsdaxNode
from csi_pmem.driver.params import DEVDAX, FSDAX, VolumeParams
from csi_pmem.driver.state import (
    CREATING,
    DELETING,
    READY,
    UNPUBLISHING,
    StateStore,
    VolumeRecord,
)
from csi_pmem.errors import (
    Aborted,
    AlreadyExists,
    BackendError,
    CsiPmemError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    SpaceBeingErased,
    Unavailable,
)
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.sizes import (
    allocation_for,
    allocation_step,
    describe_size,
    devdax_usable,
    format_bytes,
    round_down,
)

log = logging.getLogger(__name__)

VOLUME_ID_PREFIX = "pmem-"
MAX_NAME_BYTES = 128
PATH_MAX, NAME_MAX = 4096, 255  # Linux limits, in bytes (PATH_MAX counts the NUL)


def promised_size(usable: int, limit: int, align: int) -> int:
    """The size a volume reports and hands out: all of the device, capped by the limit.

    Region alignment can make the smallest namespace offer more than limit_bytes; the
    CO must then still see a capacity within its range, so the volume advertises the
    limit (rounded down to the devdax align, since mappings come in align steps) and the
    excess stays unused.
    """
    if not limit:
        return usable
    return min(usable, round_down(limit, align))


def volume_id_for(name: str) -> str:
    """Deterministic id (37 chars, a valid namespace alt-name) for a CSI volume name."""
    return VOLUME_ID_PREFIX + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def utc_stamp(when: float) -> str:
    """``when`` (Unix time) as an RFC 3339 UTC time, as Kubernetes prints times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def is_volume_id(text: str) -> bool:
    rest = text[len(VOLUME_ID_PREFIX):]
    return (text.startswith(VOLUME_ID_PREFIX) and len(rest) == 32
            and all(c in "0123456789abcdef" for c in rest))


@dataclass(frozen=True)
class DriverConfig:
    driver_name: str
    node_id: str
    kubelet_dir: str
    erase_threads: int | None = None
    erase_verify: str = SAMPLED  # csi_pmem.driver.erasing.erase: full, sampled or off
    erase_workers: int = 2       # background erase jobs at a time
    scrub: bool = True           # scrub dirty regions in the background
    erase_wait: float = 5.0      # how long CreateVolume waits for space being erased
    delete_wait: float = 1.0     # how long DeleteVolume waits for its background erase
    device_node: bool = False    # volume.json names the device node (the NRI plugin's)


@dataclass(frozen=True)
class Capacity:
    available: int
    maximum_volume_size: int


@dataclass(frozen=True)
class VolumeCondition:
    abnormal: bool
    message: str


class Driver:
    """Owns the back end, the state store, the dax socket server and the locks."""

    def __init__(self, config: DriverConfig, backend: Backend, store: StateStore,
                 dax: DaxSocketServer, on_erase: Callable[[int, float], None] | None = None,
                 gpu_copy: ServiceLink | None = None, mounter: Mounter | None = None,
                 on_erase_error: Callable[[], None] | None = None,
                 on_recreate: Callable[[str], None] | None = None):
        self.config = config
        self.backend = backend
        self.store = store
        self.dax = dax
        # The node's GPU copy service (csi_pmem.gpucopy), or None: devdax publications
        # then also serve gpu.sock, forwarded to it after the dax.sock checks.
        self.gpu_copy = gpu_copy
        self.inflight = InFlight()
        self.node_lock = threading.Lock()
        self.on_erase = on_erase or (lambda nbytes, seconds: None)
        # Called when zeroing a namespace fails (the delete then fails and is retried):
        # metrics count it, since data that outlives its volume is what erase prevents.
        self.on_erase_error = on_erase_error or (lambda: None)
        # Called with the pool's name when a volume of a volatile pool was carved again
        # after its contents were lost (metrics count it).
        self.on_recreate = on_recreate or (lambda pool: None)
        # Volumes of which nothing could be carved again, with why (their condition).
        self._unrecoverable: dict[str, str] = {}
        self.orphans: list[str] = []
        self._kubelet_real = os.path.realpath(config.kubelet_dir)
        # One publisher per device mode, behind one interface (csi_pmem.driver.node); what
        # they do to the host goes through the mounter (a fake in unit tests).
        mounter = mounter or HostMounter()
        self.nodes: dict[str, NodePublisher] = {
            DEVDAX: DevdaxNode(backend, store, dax, config.driver_name, mounter, gpu_copy,
                               device_node=config.device_node),
            FSDAX: FsdaxNode(backend, store, mounter),
        }
        # Erase once (docs/design.md §6.9): the clean-space ledger, the background
        # eraser, and the scrubs that make dirty regions clean.
        self.ledger = CleanSpace(store, backend)
        self.eraser = EraseQueue(config.erase_workers)
        self.scrubber = Scrubber(backend, self.ledger, self.node_lock, self.eraser,
                                 self._erase, enabled=config.scrub)

    # ------------------------------------------------------------------ capacity
    def capacity(self, params: VolumeParams) -> Capacity:
        """Free space as usable bytes, so the scheduler compares like with like.

        Space of deleted volumes counts only once erased and destroyed (their namespaces
        hold it until then); space a scrub holds counts as free, since a create takes
        it back at once (csi_pmem.driver.erasing.scrub).
        """
        pools = self._pools_for(params)
        held = {p.name: self.scrubber.held(p.name) for p in pools}
        available = sum(self._usable_in(p.free + sum(held[p.name]), p, params.align)
                        for p in pools)
        largest = max((self._usable_in(max([p.largest_extent, *held[p.name]]), p, params.align)
                       for p in pools), default=0)
        return Capacity(available=available, maximum_volume_size=largest)

    @staticmethod
    def _usable_in(nbytes: int, pool: Pool, align: int) -> int:
        return devdax_usable(round_down(nbytes, allocation_step(align, pool.align)), align)

    def _pools_for(self, params: VolumeParams) -> list[Pool]:
        return [p for p in self.backend.pools() if not p.problem_for(params.device_mode)
                and (params.numa_node is None or p.numa_node == params.numa_node)]

    # ------------------------------------------------------------------ create
    def create_volume(self, name: str, required: int, limit: int,
                      params: VolumeParams) -> VolumeRecord:
        if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"volume name is longer than {MAX_NAME_BYTES} bytes")
        request = self._request_size(required, limit)
        vid = volume_id_for(name)
        with self.inflight.hold(vid, "CreateVolume"):
            existing = self.store.get(vid)
            if existing is not None and existing.state != READY:
                self._finish_pending(existing)
                existing = self.store.get(vid)
            if existing is not None:
                self._check_compatible(existing, name, required, limit, params)
                return existing
            return self._create(vid, name, request, required, limit, params)

    @staticmethod
    def _request_size(required: int, limit: int) -> int:
        if required < 0 or limit < 0:
            raise InvalidArgument("capacity_range bytes must not be negative")
        if required == 0 and limit == 0:
            raise InvalidArgument(
                "capacity_range with required_bytes is required: a persistent-memory volume "
                "is carved to size (set resources.requests.storage on the PVC)")
        if limit and required > limit:
            raise InvalidArgument(
                f"capacity_range limit_bytes ({describe_size(limit)}) is below required_bytes "
                f"({describe_size(required)})")
        return required or limit

    def _create(self, vid: str, name: str, request: int, required: int, limit: int,
                params: VolumeParams) -> VolumeRecord:
        with self.scrubber.creating():  # no scrub holds free space while we carve
            pool, record, ns, zero = self._carve(vid, name, request, required, limit, params)
        failpoints.hit(failpoints.CREATE_AFTER_NAMESPACE)
        if zero:
            self._erase(ns)  # a dirty region: it may hold data of earlier tenants
        capacity = promised_size(ns.usable_size, limit, params.align)
        intent, record = record, replace(record, state=READY, size=ns.size,
                                         usable_size=capacity, device=ns.device,
                                         numa_node=ns.numa_node)
        if capacity < required:
            raise BackendError(
                f"namespace {vid} offers {describe_size(ns.usable_size)}, below the "
                f"{describe_size(required)} requested")
        try:
            self.store.put(record)
        except Exception:
            # No room for the outcome (a full state directory): give the namespace back
            # now, not only when a retry or a restart finds the CREATING intent.
            try:
                self._finish_pending(intent)
            except Exception:
                log.exception("could not roll back volume %s now; its creating record "
                              "rolls it back on the next CreateVolume or start", vid)
            raise
        log.info("created volume %s (%s) in %s: %s usable (device %s, %s)%s", vid, name,
                 pool.name, format_bytes(capacity), ns.device, format_bytes(ns.usable_size),
                 ", zeroed (dirty region)" if zero else "")
        return record

    def _carve(self, vid: str, name: str, request: int, required: int, limit: int,
               params: VolumeParams) -> tuple[Pool, VolumeRecord, Namespace, bool]:
        """Choose a pool and create the namespace; wait up to ``erase_wait`` seconds
        for space that deleted volumes' erases are about to free."""
        deadline = time.monotonic() + self.config.erase_wait
        while True:
            with self.node_lock:
                try:
                    pool, size, usable = self._choose_pool(request, limit, params)
                except ResourceExhausted as exc:
                    erasing = self._bytes_being_erased(params)
                    if not erasing:
                        raise
                    if time.monotonic() >= deadline:
                        raise SpaceBeingErased(
                            f"{exc}; {format_bytes(erasing)} of deleted volumes are still "
                            "being erased there and become free when the erase is done: "
                            "retry shortly") from exc
                else:
                    zero = self.ledger.must_zero(pool)
                    record = VolumeRecord(
                        id=vid, name=name, state=CREATING, params=params.to_dict(),
                        required_bytes=required, limit_bytes=limit, pool=pool.name,
                        numa_node=pool.numa_node, size=size, usable_size=usable,
                        align=params.align)
                    self.store.put(record)
                    failpoints.hit(failpoints.CREATE_AFTER_RECORD)
                    try:
                        ns = self.backend.create(vid, pool.name, size, params.align,
                                                 mode=params.device_mode)
                    except BaseException:
                        # Nothing was handed out: drop the intent so capacity adds up again.
                        if self.backend.get(vid) is None:
                            self.store.delete(vid)
                        raise
                    self.ledger.note_used(pool.name, ns.size)
                    return pool, record, ns, zero
            self.eraser.wait_any(max(0.01, min(0.5, deadline - time.monotonic())))

    def _bytes_being_erased(self, params: VolumeParams) -> int:
        return self.eraser.pending_bytes({p.name for p in self._pools_for(params)})

    def _choose_pool(self, request: int, limit: int, params: VolumeParams) -> tuple[Pool, int, int]:
        all_pools = self.backend.pools()
        candidates = [p for p in all_pools
                      if params.numa_node is None or p.numa_node == params.numa_node]
        if not candidates:
            have = sorted({p.numa_node for p in all_pools})
            raise ResourceExhausted(
                f"this node ({self.config.node_id}) has no persistent memory on NUMA node "
                f"{params.numa_node} (it has NUMA nodes {have}); the scheduler should pick "
                "another node")
        usable_pools = [p for p in candidates if not p.problem_for(params.device_mode)]
        if not usable_pools:
            raise Unavailable(f"no region can carve a {params.device_mode} volume: " + "; ".join(
                f"{p.name}: {p.problem_for(params.device_mode)}" for p in candidates))
        sized = []
        for p in usable_pools:
            size, usable = allocation_for(request, params.align, p.align)
            capacity = promised_size(usable, limit, params.align)
            if capacity < request:
                raise OutOfRange(
                    f"no volume of at least {describe_size(request)} fits under limit_bytes "
                    f"{describe_size(limit)} "
                    f"with align {format_bytes(params.align)} (sizes come in "
                    f"{format_bytes(params.align)} steps); raise the limit")
            sized.append((p, size, capacity))
        fits_ever = [s for s in sized if s[1] <= s[0].size]
        if not fits_ever:
            biggest = max(p.size for p in usable_pools)
            raise OutOfRange(
                f"a volume of {describe_size(request)} needs {describe_size(sized[0][1])} of "
                f"persistent memory "
                f"(metadata and {format_bytes(params.align)} alignment included), more than "
                f"the largest region on this node ({describe_size(biggest)})")
        fits_now = [s for s in fits_ever if s[1] <= s[0].largest_extent]
        if not fits_now:
            free = ", ".join(f"{p.name} (NUMA {p.numa_node}): {describe_size(p.largest_extent)}"
                             for p, _, _ in fits_ever)
            raise ResourceExhausted(
                f"not enough free persistent memory for {describe_size(sized[0][1])}; largest free "
                f"extents: {free}")
        # Most free space first keeps NUMA nodes balanced for numaNode=auto.
        return max(fits_now, key=lambda s: (s[0].free, -s[0].numa_node))

    def _check_compatible(self, rec: VolumeRecord, name: str, required: int, limit: int,
                          params: VolumeParams) -> None:
        problems = params.compatible_with(rec.params, rec.numa_node)
        if rec.usable_size < required:
            problems.append(f"size: existing {describe_size(rec.usable_size)}, requested "
                            f"{describe_size(required)}")
        if limit and rec.usable_size > limit:
            problems.append(f"size: existing {describe_size(rec.usable_size)} exceeds limit "
                            f"{describe_size(limit)}")
        if problems:
            raise AlreadyExists(
                f"volume {name!r} already exists with different properties ("
                + "; ".join(problems) + "); use another name or delete it first")

    # ------------------------------------------------------------------ delete
    def delete_volume(self, vid: str) -> None:
        if not is_volume_id(vid):
            return  # not one of ours: nothing to delete (DeleteVolume is idempotent)
        with self.inflight.hold(vid, "DeleteVolume"):
            rec = self.store.get(vid)
            if rec is None:
                if self.backend.get(vid) is not None:
                    raise FailedPrecondition(
                        f"namespace {vid} exists but has no state record on node "
                        f"{self.config.node_id}; it is left alone, inspect it by hand")
                return
            if rec.state == DELETING:
                self._continue_delete(rec)  # deleted already; the erase may still run
                self.eraser.wait(vid, self.config.delete_wait)
                return
            if rec.publications or rec.stages:
                where = sorted(rec.publications) or sorted(rec.stages)
                raise FailedPrecondition(
                    f"volume {vid} is still {'published' if rec.publications else 'staged'} "
                    f"at {', '.join(where)}; unpublish and unstage it (delete the pods using "
                    "it) first")
            self._check_not_in_use(rec)
            if self.gpu_copy is not None and rec.device_mode != FSDAX:
                self.gpu_copy.release(vid)  # its pins would keep the namespace busy
            rec.state = DELETING
            self.store.put(rec)
            failpoints.hit(failpoints.DELETE_AFTER_RECORD)
            self._continue_delete(rec)
            # A small erase is over within moments: then the space is free when the call
            # returns. A huge one goes on in the background after this bounded wait.
            self.eraser.wait(vid, self.config.delete_wait)

    def _check_not_in_use(self, rec: VolumeRecord) -> None:
        """An fsdax device mounted outside the driver (by hand, or a mount whose record
        was lost) refuses an exclusive open: say so before the volume starts deleting."""
        ns = self.backend.get(rec.id)
        if ns is not None and ns.mode == FSDAX:
            os.close(self.backend.open_device(ns, readonly=True, exclusive=True))

    @staticmethod
    def _erases(rec: VolumeRecord) -> bool:
        return rec.params.get("eraseOnDelete", "true") == "true"

    def _continue_delete(self, rec: VolumeRecord, resumed: bool = False) -> None:
        """After the DELETING record: queue the erase (its job destroys the namespace
        when the erase is verified), or destroy now when there is nothing to erase.

        A delete resumed at start-up always goes through the queue, erase or not: the
        queue retries a failed job, and nothing else would (the CO got its answer long
        ago), so a transient ndctl failure at start-up must not strand the volume."""
        def finish(cancel: threading.Event | None = None) -> None:
            self._finish_delete(rec, cancel)
            if resumed:
                log.warning("finished interrupted deletion of %s (%s)", rec.id, rec.name)

        if resumed or self.eraser.get(rec.id) is not None or (
                self._erases(rec) and not rec.erased and self.backend.get(rec.id) is not None):
            self.eraser.submit(rec.id, DELETE, rec.pool, rec.size, finish)
        else:
            finish()

    def _finish_delete(self, rec: VolumeRecord,
                       cancel: threading.Event | None = None) -> None:
        ns = self.backend.get(rec.id)
        erase = self._erases(rec)
        if ns is not None and erase and not rec.erased:
            self._erase(ns, cancel)
            # Write-ahead for the destroy: a stop or crash from here on resumes with the
            # destroy alone (csi_pmem.driver.state.VolumeRecord.erased).
            rec.erased = True
            self.store.put(rec)
        failpoints.hit(failpoints.DELETE_AFTER_ERASE)
        if ns is not None:
            with self.node_lock:
                if erase:
                    self.ledger.expect_freed(ns.pool, ns.size)
                else:
                    # Write-ahead: dirty before the unerased bytes become free space.
                    self.ledger.mark_dirty(ns.pool, f"volume {rec.id} ({rec.name}) was "
                                           "deleted without an erase (eraseOnDelete: false)")
                    failpoints.hit(failpoints.DELETE_AFTER_DIRTY)
                self.backend.destroy(rec.id)
        else:
            self._destroy_leftover(rec, erase)
        failpoints.hit(failpoints.DELETE_AFTER_DESTROY)
        self.store.delete(rec.id)
        log.info("deleted volume %s (%s)", rec.id, rec.name)
        if ns is not None and not erase:
            # A scrub running now may be past this space already: it runs once more.
            self.scrubber.schedule(ns.pool, rerun=True)

    def _destroy_leftover(self, rec: VolumeRecord, erase: bool) -> None:
        """No volume namespace of ``rec`` is listed, but a destroy cut short after
        ndctl's disable-namespace leaves one that the kernel then lists as a disabled
        raw namespace with the volume's name, holding its label slot and its space. The
        back end's destroy removes it (and does nothing if there is none). The ledger
        is told first: an erased one keeps the region clean, any other makes it dirty."""
        with self.node_lock:
            if erase and rec.erased:
                self.ledger.expect_freed(rec.pool, rec.size)
            else:
                self.ledger.mark_dirty(rec.pool, f"volume {rec.id} ({rec.name}) left a "
                                       "namespace that was not erased")
            self.backend.destroy(rec.id)

    def _erase(self, ns: Namespace, cancel: threading.Event | None = None) -> None:
        from csi_pmem.loader.numa import node_cpus  # the loader's, imported when needed

        try:
            fd = self.backend.open_device(ns, readonly=False, exclusive=True)
            try:
                st = os.fstat(fd)
                # A regular file (the emulated back end) is handed to the pod whole, so
                # all of it is erased, not just the usable size.
                length = st.st_size if stat.S_ISREG(st.st_mode) else ns.usable_size
                result = zero_fd(fd, length, threads=self.config.erase_threads,
                                 verify=self.config.erase_verify,
                                 cpus=node_cpus(ns.numa_node), cancel=cancel)
            finally:
                os.close(fd)
        except EraseCancelled:
            raise  # a scrub or erase given up on purpose, not a failure
        except Exception:
            self.on_erase_error()
            raise
        self.on_erase(result.bytes, result.seconds)
        log.info("erased %s: %s in %.3f s (%.2f GB/s, %d threads, %s, verify %s%s)",
                 ns.name, format_bytes(result.bytes), result.seconds,
                 result.bytes / max(result.seconds, 1e-9) / 1e9, result.threads,
                 result.method, result.verify, ", persisted" if result.persisted else "")

    def _finish_pending(self, rec: VolumeRecord, wait: bool = True) -> None:
        """Complete what a crash interrupted: roll back a create, finish a delete.

        A deleted volume's erase runs in the background; with ``wait`` (a CreateVolume
        of the same name) this waits up to ``erase_wait`` seconds for it, then says
        ABORTED: the name is free again only once the old namespace is gone.
        """
        if rec.state == CREATING:
            ns = self.backend.get(rec.id)
            with self.node_lock:
                if ns is not None:
                    self.ledger.expect_freed(ns.pool, ns.size)  # never handed out
                # Also without a listed volume: a create killed inside ndctl can leave a
                # raw namespace with the name, which the destroy removes (its freed
                # space then makes the region dirty, the safe side).
                self.backend.destroy(rec.id)
            self.store.delete(rec.id)
            log.warning("rolled back interrupted creation of %s (%s)", rec.id, rec.name)
        elif rec.state == DELETING:
            if not wait:
                log.warning("resuming interrupted deletion of %s (%s)", rec.id, rec.name)
            self._continue_delete(rec, resumed=not wait)
            if wait and not self.eraser.wait(rec.id, self.config.erase_wait):
                raise Aborted(
                    f"volume {rec.name!r} was deleted and its {format_bytes(rec.size)} are "
                    "still being erased; a new volume of that name can be made when the "
                    "erase is done: retry shortly")
            if self.store.get(rec.id) is None:
                log.info("finished deletion of %s (%s)", rec.id, rec.name)

    # ------------------------------------------------------------------ queries
    def get(self, vid: str) -> VolumeRecord:
        rec = self.store.get(vid) if is_volume_id(vid) else None
        if rec is None or rec.state != READY:
            raise NotFound(f"volume {vid!r} does not exist on node {self.config.node_id}")
        return rec

    def device_mode(self, vid: str) -> str:
        """The device mode of ``vid`` in any state, for validating node requests before
        the in-flight slot is taken (a busy volume must still answer ABORTED)."""
        rec = self.store.get(vid) if is_volume_id(vid) else None
        if rec is None:
            raise NotFound(f"volume {vid!r} does not exist on node {self.config.node_id}")
        return rec.device_mode

    def list_volumes(self) -> list[VolumeRecord]:
        return [r for r in self.store.all() if r.state == READY]

    def condition(self, rec: VolumeRecord) -> VolumeCondition:
        ns = self.backend.get(rec.id)
        if ns is None:
            why = self._unrecoverable.get(rec.id)
            if why is not None:
                return VolumeCondition(True, why)
            pool = self._pool_of(rec)
            if pool is not None and pool.volatile:
                return VolumeCondition(True, (
                    f"the namespace of volume {rec.id} has disappeared from volatile pool "
                    f"{rec.pool} (contents lost at a node restart?); it is carved again, "
                    "empty, at its next publish or driver start"))
            return VolumeCondition(True, f"the namespace of volume {rec.id} has disappeared")
        if rec.recreating:
            return VolumeCondition(True, (
                f"volume {rec.id} is being carved again after its contents were lost; it "
                "is zeroed before it is served"))
        if not self.backend.device_present(ns):
            return VolumeCondition(True, f"device {ns.device} of volume {rec.id} is missing")
        if rec.contents_lost_at:
            return VolumeCondition(False, (
                f"device {ns.device} is present; the volume's contents were lost at a node "
                f"restart at {utc_stamp(rec.contents_lost_at)} (pool {rec.pool} is volatile "
                "memory) and it was carved again, empty: stage its data again"))
        return VolumeCondition(False, f"device {ns.device} is present")

    # ------------------------------------------------------------------ publish
    def check_target(self, target: str) -> str:
        """Refuse targets the driver does not manage; return the normalised path."""
        if "\x00" in target or not os.path.isabs(target) or os.path.normpath(target) != target \
                or target == "/":
            raise InvalidArgument(
                f"target_path {target!r} must be an absolute, normalised path other than /")
        if len(os.fsencode(target)) >= PATH_MAX \
                or any(len(os.fsencode(part)) > NAME_MAX for part in target.split("/")):
            raise InvalidArgument(
                f"target_path {target[:80]!r}... is too long: at most {PATH_MAX - 1} bytes, "
                f"{NAME_MAX} per component")
        parent = os.path.realpath(os.path.dirname(target))
        real = os.path.join(parent, os.path.basename(target))
        if os.path.commonpath([real, self._kubelet_real]) != self._kubelet_real \
                or real == self._kubelet_real:
            raise InvalidArgument(
                f"target_path {target!r} is outside the kubelet directory "
                f"{self.config.kubelet_dir} that this driver publishes into (--kubelet-dir)")
        return target

    # ------------------------------------------------------------------ node
    def _node(self, rec: VolumeRecord) -> NodePublisher:
        return self.nodes[FSDAX if rec.device_mode == FSDAX else DEVDAX]

    def stage(self, vid: str, path: str, access: Access) -> None:
        """NodeStageVolume: mount an fsdax file system once per node; nothing for devdax
        (each publish is self-contained) or for fsdax block volumes."""
        path = self.check_target(path)
        with self.inflight.hold(vid, "NodeStageVolume"):
            rec = self._restore_if_lost(self.get(vid))
            self._node(rec).stage(rec, path, access)

    def unstage(self, vid: str, path: str) -> None:
        with self.inflight.hold(vid, "NodeUnstageVolume"):
            rec = self.get(vid)
            self._node(rec).unstage(rec, path)

    def publish(self, vid: str, target: str, readonly: bool, *, pod_uid: str | None = None,
                mount_group: int | None = None, access_mode: str = "",
                access: Access | None = None, staging: str = "") -> None:
        """NodePublishVolume: the shared policy here (target paths, single writer), the
        device mode's own story in its publisher (csi_pmem.driver.node)."""
        target = self.check_target(target)
        with self.inflight.hold(vid, "NodePublishVolume"):
            rec = self._restore_if_lost(self.get(vid))
            self._check_single_writer(rec, target, readonly, access_mode)
            # Only fsdax file systems are staged; a devdax publish ignores the path.
            staging = self.check_target(staging) if staging and rec.device_mode == FSDAX \
                else ""
            self._node(rec).publish(rec, target, readonly, access, staging,
                                    mount_group=mount_group, pod_uid=pod_uid,
                                    access_mode=access_mode)

    @staticmethod
    def _check_single_writer(rec: VolumeRecord, target: str, readonly: bool,
                             access_mode: str) -> None:
        """SINGLE_NODE_SINGLE_WRITER: one writable publication per volume on the node, in
        every device mode (a publication of the same target again is idempotent)."""
        if access_mode != "SINGLE_NODE_SINGLE_WRITER" or readonly:
            return
        writers = [t for t, p in rec.publications.items() if not p.readonly and t != target]
        if writers:
            raise FailedPrecondition(
                f"volume {rec.id} is SINGLE_NODE_SINGLE_WRITER and already published "
                f"writable at {writers[0]}; unpublish it there first (or publish read-only)")

    def unpublish(self, vid: str, target: str) -> None:
        with self.inflight.hold(vid, "NodeUnpublishVolume"):
            rec = self.get(vid)
            node = self._node(rec)
            if not node.owns(rec, target):
                return  # unknown target: nothing to do (idempotent)
            pub = rec.publications.get(target)
            if pub is not None:
                pub.state = UNPUBLISHING
                self.store.put(rec)
            node.unpublish(rec, target)

    def usage(self, vid: str, path: str) -> tuple[VolumeRecord, Usage | None]:
        """NodeGetVolumeStats: file system usage at ``path``, or None for a device.

        devdax volumes and fsdax block volumes are raw devices whose contents the driver
        cannot interpret: the caller reports them whole and free.
        """
        rec = self.get(vid)
        return rec, self._node(rec).usage(rec, path)

    # ------------------------------------------------------------------ start-up
    def reconcile(self) -> None:
        """Bring records, namespaces and mounts together after a start or a crash."""
        namespaces = {ns.name: ns for ns in self.backend.namespaces()}
        records = self.store.all()
        known = {r.id for r in records}
        self.orphans = sorted(n for n in namespaces if is_volume_id(n) and n not in known)
        with self.node_lock:
            self.scrubber.recover()  # scratch namespaces of a scrub a crash cut short
            by_pool: dict[str, list[str]] = {}
            for name in self.orphans:
                by_pool.setdefault(namespaces[name].pool, []).append(name)
            self.ledger.start(self.backend.pools(), by_pool)
        for rec in records:
            ns = namespaces.pop(rec.id, None)
            try:
                if rec.state != READY:
                    self._finish_pending(rec, wait=False)  # deletes resume in the background
                    continue
                if ns is None or rec.recreating:
                    found = self._reconcile_lost(rec, ns)
                    if found is None:
                        continue
                    rec, ns = found
                if ns.device != rec.device:
                    log.info("volume %s moved from %s to %s", rec.id, rec.device, ns.device)
                    rec.device = ns.device
                    self.store.put(rec)
                self._node(rec).reconcile(rec)
            except Exception:
                log.exception("could not reconcile volume %s; it is left as it is", rec.id)
        for name in self.orphans:
            log.warning("namespace %s looks like a csi-pmem volume but has no record on this "
                        "node; it is not touched (delete it by hand if it is not needed)", name)
        self.scrubber.schedule_dirty()

    # ------------------------------------------------------------------ volatile pools
    def _pool_of(self, rec: VolumeRecord) -> Pool | None:
        return next((p for p in self.backend.pools() if p.name == rec.pool), None)

    def _reconcile_lost(self, rec: VolumeRecord,
                        ns: Namespace | None) -> tuple[VolumeRecord, Namespace] | None:
        """At start-up: carve a lost volume of a volatile pool again (or finish a carve a
        crash cut short); report any other lost volume. The new record and namespace,
        or None."""
        pool = self._pool_of(rec)
        if ns is None and (pool is None or not pool.volatile):
            if pool is None:
                self._unrecoverable[rec.id] = self._pool_gone(rec)
            log.error("volume %s (%s) has a record but no namespace%s: reported as "
                      "abnormal, record kept", rec.id, rec.name,
                      "" if pool is not None else f", and its pool {rec.pool} is gone")
            return None
        try:
            rec = self._recover(rec, ns)
        except CsiPmemError as exc:
            log.error("volume %s (%s) stays abnormal: %s", rec.id, rec.name, exc)
            return None
        found = self.backend.get(rec.id)
        return None if found is None else (rec, found)

    def _restore_if_lost(self, rec: VolumeRecord) -> VolumeRecord:
        """Before a publish or stage: a lost volume of a volatile pool is carved again
        (FAILED_PRECONDITION saying why when it cannot be); other volumes as they are."""
        ns = self.backend.get(rec.id)
        if ns is not None and not rec.recreating:
            return rec
        pool = self._pool_of(rec)
        if pool is None:
            self._unrecoverable[rec.id] = self._pool_gone(rec)
            raise FailedPrecondition(self._unrecoverable[rec.id])
        if not pool.volatile:
            return rec  # persistent: reported (abnormal), never carved again
        return self._recover(rec, ns)

    def _pool_gone(self, rec: VolumeRecord) -> str:
        have = ", ".join(sorted(p.name for p in self.backend.pools())) or "none"
        return (f"the namespace of volume {rec.id} has disappeared, and its pool "
                f"{rec.pool} (NUMA node {rec.numa_node}) is gone from this node too (its "
                f"pools: {have}); it stays abnormal until {rec.pool} is back (retried at "
                "every publish and driver start), or delete the volume")

    def _recover(self, rec: VolumeRecord, ns: Namespace | None) -> VolumeRecord:
        """:meth:`_recreate`, remembering why it failed for the volume's condition."""
        try:
            rec = self._recreate(rec, ns)
        except CsiPmemError as exc:
            self._unrecoverable[rec.id] = str(exc)
            raise
        except Exception as exc:
            self._unrecoverable[rec.id] = (f"volume {rec.id} lost its contents and could "
                                           f"not be carved again: {exc}")
            raise
        self._unrecoverable.pop(rec.id, None)
        return rec

    def _recreate(self, rec: VolumeRecord, ns: Namespace | None) -> VolumeRecord:
        """Carve ``rec`` again in its volatile pool under the same id, at its recorded
        size, align and mode; zero it before anyone can map it; then count and log it.

        After a restart the memory may hold another tenant's bytes: the pool is marked
        dirty (the driver did not free that space) and the new namespace is zeroed
        exactly as CreateVolume zeroes one from a dirty region, which back ends whose
        new namespaces read as zeros (fresh emulated files) skip. ``recreating`` is
        written first: a crash before the zeroing is done makes the next start zero it.
        Called with the volume's in-flight slot held, or at start-up.
        """
        where = f"{rec.pool} (NUMA node {rec.numa_node})"
        with self.scrubber.creating():  # a scrub gives its space back first
            with self.node_lock:
                pool = self._pool_of(rec)
                if pool is None:
                    raise FailedPrecondition(self._pool_gone(rec))
                problem = pool.problem_for(rec.device_mode)
                if problem is None and pool.numa_node != rec.numa_node:
                    problem = (f"it is on NUMA node {pool.numa_node} now, the volume was "
                               f"on {rec.numa_node}")
                if problem is not None:
                    raise FailedPrecondition(
                        f"volume {rec.id} lost its contents and cannot be carved again in "
                        f"pool {rec.pool}: {problem}; retried at every publish and driver "
                        "start")
                ns = ns or self.backend.get(rec.id)
                if ns is not None:
                    # A carve that a crash (or a failed erase) cut short: its namespace
                    # was never zeroed, whatever the region's record says now.
                    zero = self.ledger.enabled
                else:
                    # The memory was reset behind the driver's back: nothing in the pool's
                    # free space is known any more, so the region is dirty and the new
                    # namespace is zeroed as any carved from a dirty region.
                    self.ledger.mark_dirty(pool.name, f"volume {rec.id} lost its namespace "
                                           "with the contents of volatile memory")
                    zero = self.ledger.must_zero(pool)
                    # A zeroed device holds no file system and no raw data to protect.
                    intent = replace(rec, recreating=True, contents_lost_at=time.time(),
                                     block_used=False, formatting=False)
                    self.store.put(intent)
                    try:
                        ns = self.backend.create(rec.id, pool.name, rec.size, rec.align,
                                                 mode=rec.device_mode)
                    except ResourceExhausted as exc:
                        self.store.put(rec)  # nothing was carved: as it was
                        raise FailedPrecondition(
                            f"volume {rec.id} lost its contents at a node restart and "
                            f"cannot be carved again: {exc}; free space in {where} (delete "
                            "volumes that are not needed), the driver retries at every "
                            "publish and start") from exc
                    except BaseException:
                        if self.backend.get(rec.id) is None:
                            self.store.put(rec)
                        raise
                    rec = intent
                    self.ledger.note_used(pool.name, ns.size)
        if ns.usable_size < rec.usable_size:
            raise BackendError(
                f"volume {rec.id} was carved again in {where} but offers "
                f"{describe_size(ns.usable_size)}, below its {describe_size(rec.usable_size)}")
        if zero:
            self._erase(ns)  # reset memory may hold another tenant's bytes
        rec = replace(rec, recreating=False, device=ns.device, numa_node=ns.numa_node,
                      contents_lost_at=rec.contents_lost_at or time.time())
        self.store.put(rec)
        self.on_recreate(pool.name)
        log.warning("volume %s (%s): contents lost at a node restart (its volatile pool %s "
                    "no longer held it); carved again, empty: %s in %s, device %s%s; pods "
                    "must stage its data again", rec.id, rec.name, rec.pool,
                    format_bytes(rec.usable_size), where, ns.device,
                    ", zeroed" if zero else "")
        return rec

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop within ``timeout`` seconds without leaving a namespace half-written.

        Running erases stop at their next chunk; a destroy already under way runs to its
        end (the eraser waits for it). Then the node lock is taken and kept: a namespace
        create or destroy of an RPC that gRPC's grace period left running ends first,
        and none starts after this returns, so the process never exits in the middle of
        ndctl writing labels. What is left unfinished is in the state store, which the
        next start resumes; the log says what that will be.
        """
        deadline = time.monotonic() + timeout
        unfinished = self.eraser.jobs()
        stuck = self.eraser.close(timeout)
        if not self.node_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.error("stopping while a namespace create or destroy still runs after "
                      "%.0f s; the next start finishes or rolls it back from its record",
                      timeout)
        for job in unfinished:
            self._report_unfinished(job.key, job.kind, job in stuck)
        self.dax.close()
        self.backend.close()

    def _report_unfinished(self, key: str, kind: str, running: bool) -> None:
        """Say what the next start resumes of a job that close() cut short."""
        still = " (still running at the stop)" if running else ""
        if kind == DELETE:
            rec = self.store.get(key)
            if rec is None or rec.state != DELETING:
                return  # it finished after all
            log.warning("stopping with the deletion of %s (%s) unfinished%s; the next start "
                        "%s", rec.id, rec.name, still,
                        "destroys its namespace (its erase was verified)" if rec.erased
                        else "erases it from the start and then destroys it")
        else:
            log.info("stopping with scrub %s unfinished%s; the next start destroys any "
                     "scratch namespaces it left and scrubs the region again", key, still)


__all__ = [
    "Capacity",
    "Driver",
    "DriverConfig",
    "VolumeCondition",
    "is_volume_id",
    "volume_id_for",
]
