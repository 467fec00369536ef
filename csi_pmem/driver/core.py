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

The Driver's parts are collaborators it builds and calls, as aws-ebs-csi-driver and
topolvm cut theirs: each gets what it needs in its constructor (the shared locks, the
ledger and the queues by reference), logs under its own name and never calls back into
the core. :class:`~csi_pmem.driver.deletion.Deleter` deletes volumes and finishes what
a crash left of a create or a delete; :class:`~csi_pmem.driver.recovery.Recovery`
carves lost volumes of volatile pools again; the
:class:`~csi_pmem.driver.erasing.namespace.NamespaceEraser` is the one erase that
create, delete, recovery and the scrubber share. Why not one class with a declared
protocol: the three files shared the class's attributes and reached each other's
methods through ``self`` (an ``_erase`` stub in one file stood for the real one in
another), so a reader of one file could not tell what it depends on; as collaborators
the constructor says it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace, Pool
from csi_pmem.driver.config import DriverConfig
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.deletion import Deleter
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.eraser import DELETE, STOP_TIMEOUT, EraseQueue
from csi_pmem.driver.erasing.namespace import NamespaceEraser
from csi_pmem.driver.erasing.scrub import Scrubber
from csi_pmem.driver.host import filesystems
from csi_pmem.driver.host.filesystems import Usage
from csi_pmem.driver.host.mounter import HostMounter, Mounter
from csi_pmem.driver.locks import InFlight
from csi_pmem.driver.node import NodePublisher
from csi_pmem.driver.node.access import Access, PublishRequest
from csi_pmem.driver.node.devdax import DevdaxNode
from csi_pmem.driver.node.fsdax import FsdaxNode
from csi_pmem.driver.params import DEVDAX, FSDAX, VolumeParams
from csi_pmem.driver.recovery import Recovery
from csi_pmem.driver.state import (
    CREATING,
    DELETING,
    READY,
    UNPUBLISHING,
    StateStore,
    VolumeRecord,
    is_volume_id,
    volume_id_for,
)
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
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
    DEVDAX_ALIGNS,
    describe_size,
    format_bytes,
    human_size,
    round_down,
    round_up,
)

log = logging.getLogger(__name__)

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


def aligned_up(request: int, size: int, align: int) -> str:
    """What the devdax alignment makes of ``request`` (needing ``size`` bytes of DAX
    memory), when it makes it bigger: the part of a refusal that says why a small
    volume does not fit ("64.0 MiB rounded up to the 1.0 GiB alignment is 1.0 GiB, ...").
    Empty when ``request`` is a multiple of ``align`` already."""
    aligned = round_up(request, align)
    if aligned == request:
        return ""
    text = (f"{human_size(request)} rounded up to the {human_size(align)} alignment is "
            f"{human_size(aligned)}")
    if size > aligned:
        text += f", which takes {describe_size(size)} of DAX memory with its metadata"
    return f"{text} (parameter align: {format_bytes(align)})"


def utc_stamp(when: float) -> str:
    """``when`` (Unix time) as an RFC 3339 UTC time, as Kubernetes prints times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


@dataclass(frozen=True)
class Capacity:
    available: int
    maximum_volume_size: int


@dataclass(frozen=True)
class VolumeCondition:
    abnormal: bool
    message: str


class Driver:
    """Owns the back end, the state store, the dax socket server, the locks and the
    collaborators (module docstring)."""

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
        # eraser, the erase of one namespace (on_erase and on_erase_error count it), and
        # the scrubs that make dirty regions clean.
        self.ledger = CleanSpace(store, backend)
        self.eraser = EraseQueue(config.erase_workers)
        self.namespace_eraser = NamespaceEraser(
            backend, threads=config.erase_threads, verify=config.erase_verify,
            on_erase=on_erase, on_erase_error=on_erase_error)
        self.scrubber = Scrubber(backend, self.ledger, self.node_lock, self.eraser,
                                 self.namespace_eraser.erase, enabled=config.scrub)
        self.deleter = Deleter(
            backend, store, inflight=self.inflight, node_lock=self.node_lock,
            ledger=self.ledger, eraser=self.eraser, scrubber=self.scrubber,
            namespace_eraser=self.namespace_eraser, gpu_copy=gpu_copy,
            node_id=config.node_id, delete_wait=config.delete_wait,
            erase_wait=config.erase_wait)
        # on_recreate counts the volumes of volatile pools carved again.
        self.recovery = Recovery(
            backend, store, node_lock=self.node_lock, ledger=self.ledger,
            scrubber=self.scrubber, namespace_eraser=self.namespace_eraser,
            on_recreate=on_recreate)

    # ------------------------------------------------------------------ capacity
    def capacity(self, params: VolumeParams) -> Capacity:
        """Free space as usable bytes, so the scheduler compares like with like.

        Space of deleted volumes counts only once erased and destroyed (their namespaces
        hold it until then); space a scrub holds counts as free, since a create takes
        it back at once (csi_pmem.driver.erasing.scrub).
        """
        # One reading of both: a scrub carving (or destroying) its scratch namespaces
        # between them would count that space twice.
        pools, held = self.scrubber.pools_and_held(lambda: self._pools_for(params))
        available = sum(self._usable_in(p.free + sum(held[p.name]), p, params.align)
                        for p in pools)
        largest = max((self._usable_in(max([p.largest_extent, *held[p.name]]), p, params.align)
                       for p in pools), default=0)
        return Capacity(available=available, maximum_volume_size=largest)

    @staticmethod
    def _usable_in(nbytes: int, pool: Pool, align: int) -> int:
        return pool.usable_in(nbytes, align)

    def _pools_for(self, params: VolumeParams) -> list[Pool]:
        return [p for p in self.backend.pools() if not p.problem_for(params.device_mode)
                and (params.numa_node is None or p.numa_node == params.numa_node)
                and params.accepts_media(p.media)]

    # ------------------------------------------------------------------ create
    def create_volume(self, name: str, required: int, limit: int,
                      params: VolumeParams, fs_type: str = "") -> VolumeRecord:
        """CreateVolume; ``fs_type``: the file system an fsdax volume's mount capability
        named, recorded for NodeStageVolume (empty: none named)."""
        if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"volume name is longer than {MAX_NAME_BYTES} bytes")
        request = self._request_size(required, limit)
        vid = volume_id_for(name)
        with self.inflight.hold(vid, "CreateVolume"):
            existing = self.store.get(vid)
            if existing is not None and existing.state != READY:
                self.deleter.finish_pending(existing)
                existing = self.store.get(vid)
            if existing is not None:
                self._check_compatible(existing, name, required, limit, params, fs_type)
                return existing
            return self._create(vid, name, request, required, limit, params, fs_type)

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
                params: VolumeParams, fs_type: str) -> VolumeRecord:
        with self.scrubber.creating():  # no scrub holds free space while we carve
            pool, record, ns, zero = self._carve(vid, name, request, required, limit, params)
        failpoints.hit(failpoints.CREATE_AFTER_NAMESPACE)
        if zero:
            self.namespace_eraser.erase(ns)  # a dirty region: it may hold earlier data
        capacity = promised_size(ns.usable_size, limit, params.align)
        intent, record = record, replace(record, state=READY, size=ns.size,
                                         usable_size=capacity, device=ns.device,
                                         numa_node=ns.numa_node, fs_type=fs_type)
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
                self.deleter.finish_pending(intent)
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
                f"this node ({self.config.node_id}) has no DAX memory on NUMA node "
                f"{params.numa_node} (it has NUMA nodes {have}); the scheduler should pick "
                "another node")
        kinds = [p for p in candidates if params.accepts_media(p.media)]
        if not kinds:
            have_media = ", ".join(sorted(f"{p.name}: {p.media}" for p in candidates))
            raise ResourceExhausted(
                f"this node ({self.config.node_id}) has no {params.media} pool"
                + ("" if params.numa_node is None else f" on NUMA node {params.numa_node}")
                + f" (its pools: {have_media}); the scheduler should pick another node, "
                "or use a StorageClass with media: any")
        candidates = kinds
        usable_pools = [p for p in candidates if not p.problem_for(params.device_mode)]
        if not usable_pools:
            raise Unavailable(f"no region can carve a {params.device_mode} volume: " + "; ".join(
                f"{p.name}: {p.problem_for(params.device_mode)}" for p in candidates))
        sized = []
        for p in usable_pools:
            size, usable = p.allocation(request, params.align)
            capacity = promised_size(usable, limit, params.align)
            if capacity < request:
                raise OutOfRange(
                    f"no volume of at least {describe_size(request)} fits under limit_bytes "
                    f"{describe_size(limit)} "
                    f"with align {format_bytes(params.align)} (sizes come in "
                    f"{format_bytes(params.align)} steps); raise the limit")
            sized.append((p, size, capacity))
        fits_ever = [s for s in sized if s[1] <= s[0].size]
        inflated = aligned_up(request, sized[0][1], params.align)
        if not fits_ever:
            biggest = max(p.size for p in usable_pools)
            if inflated:
                hint = "; use align 2Mi for a volume this small" \
                    if params.align > DEVDAX_ALIGNS["2Mi"] else ""
                raise OutOfRange(
                    f"a volume of {describe_size(request)}: {inflated}, more than the "
                    f"largest region on this node ({describe_size(biggest)}){hint}")
            raise OutOfRange(
                f"a volume of {describe_size(request)} needs {describe_size(sized[0][1])} of "
                f"DAX memory "
                f"(metadata and {format_bytes(params.align)} alignment included), more than "
                f"the largest region on this node ({describe_size(biggest)})")
        fits_now = [s for s in fits_ever if s[1] <= s[0].largest_extent]
        if not fits_now:
            free = ", ".join(f"{p.name} (NUMA {p.numa_node}): {describe_size(p.largest_extent)}"
                             for p, _, _ in fits_ever)
            if inflated:
                raise ResourceExhausted(
                    f"not enough free DAX memory for a volume of {describe_size(request)}: "
                    f"{inflated}, more than is free (largest free extents: {free})")
            raise ResourceExhausted(
                f"not enough free DAX memory for {describe_size(sized[0][1])}; largest free "
                f"extents: {free}")
        # Most free space first keeps NUMA nodes balanced for numaNode=auto.
        return max(fits_now, key=lambda s: (s[0].free, -s[0].numa_node))

    def _check_compatible(self, rec: VolumeRecord, name: str, required: int, limit: int,
                          params: VolumeParams, fs_type: str = "") -> None:
        pool = self.backend.pool(rec.pool)
        problems = params.compatible_with(rec.params, rec.numa_node,
                                          media=pool.media if pool is not None else None)
        if rec.usable_size < required:
            problems.append(f"size: existing {describe_size(rec.usable_size)}, requested "
                            f"{describe_size(required)}")
        if limit and rec.usable_size > limit:
            problems.append(f"size: existing {describe_size(rec.usable_size)} exceeds limit "
                            f"{describe_size(limit)}")
        if fs_type and rec.fs_type and fs_type != rec.fs_type:
            problems.append(f"fsType: existing {rec.fs_type}, requested {fs_type}")
        if problems:
            raise AlreadyExists(
                f"volume {name!r} already exists with different properties ("
                + "; ".join(problems) + "); use another name or delete it first")

    # ------------------------------------------------------------------ delete
    def delete_volume(self, vid: str) -> None:
        """DeleteVolume (csi_pmem.driver.deletion)."""
        self.deleter.delete_volume(vid)

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
            return VolumeCondition(True, self.recovery.why_lost(rec))
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
    def check_target(self, target: str, field: str = "target_path") -> str:
        """Refuse targets the driver does not manage; return the normalised path."""
        if "\x00" in target or not os.path.isabs(target) or os.path.normpath(target) != target \
                or target == "/":
            raise InvalidArgument(
                f"{field} {target!r} must be an absolute, normalised path other than /")
        if len(os.fsencode(target)) >= PATH_MAX \
                or any(len(os.fsencode(part)) > NAME_MAX for part in target.split("/")):
            raise InvalidArgument(
                f"{field} {target[:80]!r}... is too long: at most {PATH_MAX - 1} bytes, "
                f"{NAME_MAX} per component")
        parent = os.path.realpath(os.path.dirname(target))
        real = os.path.join(parent, os.path.basename(target))
        if os.path.commonpath([real, self._kubelet_real]) != self._kubelet_real \
                or real == self._kubelet_real:
            raise InvalidArgument(
                f"{field} {target!r} is outside the kubelet directory "
                f"{self.config.kubelet_dir} that this driver publishes into (--kubelet-dir)")
        return target

    # ------------------------------------------------------------------ node
    def _node(self, rec: VolumeRecord) -> NodePublisher:
        return self.nodes[FSDAX if rec.device_mode == FSDAX else DEVDAX]

    def fs_type(self, vid: str, asked: str) -> str:
        """The file system an fsdax mount of ``vid`` gets: ``asked`` (a node call's
        capability), else the one CreateVolume named, else ext4. Asking for another one
        than CreateVolume named is INVALID_ARGUMENT, before anything is formatted."""
        recorded = self.get(vid).fs_type
        if asked and recorded and asked != recorded:
            raise InvalidArgument(
                f"volume {vid} was created for {recorded} (CreateVolume's fsType), not "
                f"{asked}: stage it as {recorded}, or leave fsType empty")
        return asked or recorded or filesystems.DEFAULT_FS_TYPE

    def stage(self, vid: str, path: str, access: Access) -> None:
        """NodeStageVolume: mount an fsdax file system once per node; nothing for devdax
        (each publish is self-contained) or for fsdax block volumes."""
        path = self.check_target(path, "staging_target_path")
        with self.inflight.hold(vid, "NodeStageVolume"):
            rec = self.recovery.restore_if_lost(self.get(vid))
            self._node(rec).stage(rec, path, access)

    def unstage(self, vid: str, path: str) -> None:
        # What stage refuses, unstage refuses alike.
        path = self.check_target(path, "staging_target_path")
        with self.inflight.hold(vid, "NodeUnstageVolume"):
            rec = self.get(vid)
            self._node(rec).unstage(rec, path)

    def publish(self, vid: str, request: PublishRequest) -> None:
        """NodePublishVolume: the shared policy here (target paths, single writer), the
        device mode's own story in its publisher (csi_pmem.driver.node).

        The publisher gets ``request`` with the paths this policy settled: the checked
        target, and the checked staging path for an fsdax volume or none for a devdax
        one, so no publisher repeats a check or reads a path it must not use."""
        target = self.check_target(request.target)
        with self.inflight.hold(vid, "NodePublishVolume"):
            rec = self.recovery.restore_if_lost(self.get(vid))
            self._check_single_writer(rec, request)
            # Only fsdax file systems are staged; a devdax publish ignores the path.
            staging = self.check_target(request.staging, "staging_target_path") \
                if request.staging and rec.device_mode == FSDAX else ""
            self._node(rec).publish(rec, replace(request, target=target, staging=staging))

    @staticmethod
    def _check_single_writer(rec: VolumeRecord, request: PublishRequest) -> None:
        """SINGLE_NODE_SINGLE_WRITER: one writable publication per volume on the node, in
        every device mode (a publication of the same target again is idempotent)."""
        if request.access_mode != "SINGLE_NODE_SINGLE_WRITER" or request.readonly:
            return
        writers = [t for t, p in rec.publications.items()
                   if not p.readonly and t != request.target]
        if writers:
            raise FailedPrecondition(
                f"volume {rec.id} is SINGLE_NODE_SINGLE_WRITER and already published "
                f"writable at {writers[0]}; unpublish it there first (or publish read-only)")

    def unpublish(self, vid: str, target: str) -> None:
        # A path publish refuses is refused here too, not answered "done": nothing was
        # ever published there, and success would tell the caller otherwise.
        target = self.check_target(target)
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
                    self.deleter.finish_pending(rec, wait=False)  # deletes resume in the background
                    continue
                if ns is None or rec.recreating:
                    found = self.recovery.reconcile_lost(rec, ns)
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
    "VolumeCondition",
    "is_volume_id",
    "volume_id_for",
]
