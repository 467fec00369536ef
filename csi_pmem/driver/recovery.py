"""Volumes of volatile pools come back: the :class:`~csi_pmem.driver.core.Driver`'s
:class:`Recovery`, which it builds and calls.

Volatile pools (``Pool.media``, docs/media.md): a volume outlives its pods, not its
node. When a READY volume's namespace is gone from a volatile pool (the node restarted,
the tmpfs of an emulated pool was mounted again, a region was created again), start-up
and NodePublish/NodeStageVolume carve it again under the same id at its recorded size,
pool and align (:meth:`Recovery._recreate`), zero it through the same path as a create in
a dirty region (:class:`~csi_pmem.driver.erasing.namespace.NamespaceEraser`), and only
then serve it. The volume's condition says its contents were lost and when
(``VolumeRecord.contents_lost_at``); a staged model is simply absent, so the staging
sidecar stages it again. Where it cannot be carved (the pool is gone or full) it stays
abnormal with that reason (:meth:`Recovery.why_lost`) and is retried at the next start
or publish. On persistent pools a lost namespace is only ever reported.

Why a collaborator, not a part of the Driver class: recovery needs only what its
constructor names (the node lock, the ledger, the scrubber's create guard, the namespace
eraser), keeps its own state (why a volume cannot be carved) and never calls back into
the core; the core asks it before a publish or stage and at start-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from csi_pmem.driver.backends.base import Backend, Namespace
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.namespace import NamespaceEraser
from csi_pmem.driver.erasing.scrub import Scrubber
from csi_pmem.driver.state import StateStore, VolumeRecord
from csi_pmem.errors import BackendError, CsiPmemError, FailedPrecondition, ResourceExhausted
from csi_pmem.sizes import describe_size, format_bytes

log = logging.getLogger(__name__)


class Recovery:
    """The return of lost volumes; see the module docstring."""

    def __init__(self, backend: Backend, store: StateStore, *, node_lock: threading.Lock,
                 ledger: CleanSpace, scrubber: Scrubber, namespace_eraser: NamespaceEraser,
                 on_recreate: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.store = store
        self.node_lock = node_lock
        self.ledger = ledger
        self.scrubber = scrubber
        self.namespace_eraser = namespace_eraser
        # Called with the pool's name when a volume of a volatile pool was carved again
        # after its contents were lost (metrics count it).
        self.on_recreate = on_recreate or (lambda pool: None)
        # Volumes of which nothing could be carved again, with why (their condition).
        self._unrecoverable: dict[str, str] = {}

    def why_lost(self, rec: VolumeRecord) -> str:
        """The condition of a READY volume whose namespace is not listed."""
        why = self._unrecoverable.get(rec.id)
        if why is not None:
            return why
        pool = self.backend.pool(rec.pool)
        if pool is not None and pool.volatile:
            return (f"the namespace of volume {rec.id} has disappeared from volatile pool "
                    f"{rec.pool} (contents lost at a node restart?); it is carved again, "
                    "empty, at its next publish or driver start")
        return f"the namespace of volume {rec.id} has disappeared"

    def reconcile_lost(self, rec: VolumeRecord,
                        ns: Namespace | None) -> tuple[VolumeRecord, Namespace] | None:
        """At start-up: carve a lost volume of a volatile pool again (or finish a carve a
        crash cut short); report any other lost volume. The new record and namespace,
        or None."""
        pool = self.backend.pool(rec.pool)
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

    def restore_if_lost(self, rec: VolumeRecord) -> VolumeRecord:
        """Before a publish or stage: a lost volume of a volatile pool is carved again
        (FAILED_PRECONDITION saying why when it cannot be); other volumes as they are."""
        ns = self.backend.get(rec.id)
        if ns is not None and not rec.recreating:
            return rec
        pool = self.backend.pool(rec.pool)
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
                pool = self.backend.pool(rec.pool)
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
            self.namespace_eraser.erase(ns)  # reset memory may hold another tenant's bytes
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
