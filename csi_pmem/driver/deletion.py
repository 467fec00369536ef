"""DeleteVolume and what a crash left of a create or a delete: the
:class:`~csi_pmem.driver.core.Driver`'s :class:`Deleter`, which it builds and calls.

Erasing (docs/design.md §6.9): DeleteVolume with ``eraseOnDelete`` queues the erase on
the background eraser (:mod:`csi_pmem.driver.erasing.eraser`) and returns; the namespace
is destroyed once its erase is verified, so its space shows as free only then. Which
regions' free space is known to be zeros lives in the clean-space ledger
(:mod:`csi_pmem.driver.erasing.cleanspace`): CreateVolume zeroes only in dirty regions,
and scrubs (:mod:`csi_pmem.driver.erasing.scrub`) make them clean again.

Why a collaborator (as aws-ebs-csi-driver and topolvm cut their drivers), not a part of
the Driver class: the delete path needs only what its constructor names (the in-flight
slots, the node lock, the ledger, the erase queue, the scrubber, the namespace eraser
and the copy service), shares them with the core by reference, and never calls back
into the core; start-up's reconcile and a CreateVolume of a name being deleted reach
the same code through :meth:`Deleter.finish_pending`.
"""

from __future__ import annotations

import logging
import os
import threading

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.eraser import DELETE, EraseQueue
from csi_pmem.driver.erasing.namespace import NamespaceEraser
from csi_pmem.driver.erasing.scrub import Scrubber
from csi_pmem.driver.locks import InFlight
from csi_pmem.driver.params import FSDAX
from csi_pmem.driver.state import CREATING, DELETING, StateStore, VolumeRecord, is_volume_id
from csi_pmem.errors import Aborted, FailedPrecondition
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.sizes import format_bytes

log = logging.getLogger(__name__)


class Deleter:
    """The delete path; see the module docstring."""

    def __init__(self, backend: Backend, store: StateStore, *, inflight: InFlight,
                 node_lock: threading.Lock, ledger: CleanSpace, eraser: EraseQueue,
                 scrubber: Scrubber, namespace_eraser: NamespaceEraser,
                 gpu_copy: ServiceLink | None, node_id: str, delete_wait: float,
                 erase_wait: float) -> None:
        self.backend = backend
        self.store = store
        self.inflight = inflight
        self.node_lock = node_lock
        self.ledger = ledger
        self.eraser = eraser  # the background erase queue
        self.scrubber = scrubber
        self.namespace_eraser = namespace_eraser
        self.gpu_copy = gpu_copy
        self.node_id = node_id
        self.delete_wait = delete_wait  # how long DeleteVolume waits for its erase
        self.erase_wait = erase_wait    # how long a CreateVolume waits for one

    def delete_volume(self, vid: str) -> None:
        if not is_volume_id(vid):
            return  # not one of ours: nothing to delete (DeleteVolume is idempotent)
        with self.inflight.hold(vid, "DeleteVolume"):
            rec = self.store.get(vid)
            if rec is None:
                if self.backend.get(vid) is not None:
                    raise FailedPrecondition(
                        f"namespace {vid} exists but has no state record on node "
                        f"{self.node_id}; it is left alone, inspect it by hand")
                return
            if rec.state == DELETING:
                self._continue_delete(rec)  # deleted already; the erase may still run
                self.eraser.wait(vid, self.delete_wait)
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
            self.eraser.wait(vid, self.delete_wait)

    def finish_pending(self, rec: VolumeRecord, wait: bool = True) -> None:
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
            if wait and not self.eraser.wait(rec.id, self.erase_wait):
                raise Aborted(
                    f"volume {rec.name!r} was deleted and its {format_bytes(rec.size)} are "
                    "still being erased; a new volume of that name can be made when the "
                    "erase is done: retry shortly")
            if self.store.get(rec.id) is None:
                log.info("finished deletion of %s (%s)", rec.id, rec.name)

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
            self.namespace_eraser.erase(ns, cancel)
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
