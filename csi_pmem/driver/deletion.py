"""DeleteVolume and the erase before reuse: the :class:`~csi_pmem.driver.core.Driver`'s
delete path, cut out of the core by job.

Erasing (docs/design.md §6.9): DeleteVolume with ``eraseOnDelete`` queues the erase on
the background eraser (:mod:`csi_pmem.driver.erasing.eraser`) and returns; the namespace
is destroyed once its erase is verified, so its space shows as free only then. Which
regions' free space is known to be zeros lives in the clean-space ledger
(:mod:`csi_pmem.driver.erasing.cleanspace`): CreateVolume zeroes only in dirty regions,
and scrubs (:mod:`csi_pmem.driver.erasing.scrub`) make them clean again.

Why a mixin and not a collaborator: every step runs under the driver's in-flight slot,
node lock, ledger and eraser, and start-up's reconcile resumes deletes through the same
methods; a second object would only pass all of that back and forth.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace
from csi_pmem.driver.config import DriverConfig
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.erase import EraseCancelled, zero_fd
from csi_pmem.driver.erasing.eraser import DELETE, EraseQueue
from csi_pmem.driver.erasing.scrub import Scrubber
from csi_pmem.driver.locks import InFlight
from csi_pmem.driver.params import FSDAX
from csi_pmem.driver.state import CREATING, DELETING, StateStore, VolumeRecord, is_volume_id
from csi_pmem.errors import Aborted, FailedPrecondition
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.numa import node_cpus
from csi_pmem.sizes import format_bytes

log = logging.getLogger("csi_pmem.driver.core")


class Deletion:
    """The delete path of :class:`csi_pmem.driver.core.Driver` (which sets these)."""

    config: DriverConfig
    backend: Backend
    store: StateStore
    inflight: InFlight
    node_lock: threading.Lock
    ledger: CleanSpace
    eraser: EraseQueue
    scrubber: Scrubber
    gpu_copy: ServiceLink | None
    on_erase: Callable[[int, float], None]
    on_erase_error: Callable[[], None]

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
