"""Scrubs: zero all of a dirty region's free space, so that the region is clean again.

Why: a region is dirty when it was first seen (its media may hold anything), when a
volume was deleted there without an erase, or when space was freed behind the
driver's back (:mod:`csi_pmem.driver.erasing.cleanspace`). While it is dirty every
CreateVolume there zeroes its new namespace; a scrub is the only way back to clean,
after which creates there write nothing.

How, and why so:

1. Under the node lock: write the intent (the scratch namespace's name, in the
   region's record) *before* creating it, then create a scratch namespace over the
   largest free extent (:meth:`Backend.create_scratch`: raw, so its device covers every
   byte of the space, with no info block or struct pages left unzeroed), and repeat
   until no free extent is left.
2. Outside the lock: zero and verify each scratch namespace (the same erase as volumes).
3. Under the lock: destroy them, clear the intent, and mark the region clean if
   nothing made it dirty meanwhile (the record's generation) and no space was freed
   behind the driver's back.

A crash at any step leaves the intent: start-up destroys the named scratch namespaces
(the name proves they are ours; they never held a tenant's data) and the region stays
dirty until the scrub runs again.

Giving way: while scratch namespaces hold a region's free space nobody can carve
there, so a scrub must never be why a CreateVolume fails. CreateVolume enters
:meth:`Scrubber.creating`, which stops running scrubs (their erase stops at the next
chunk and the scratch namespaces are destroyed) and keeps new ones from starting; the
create then takes the dirty path (it zeroes its own namespace) and the scrub is queued
again when the last create leaves. GetCapacity counts space held by a scrub as free:
a create would get it. It reads the listing and the held space together
(:meth:`Scrubber.pools_and_held`): a scrub changes the two one after the other (it
carves a scratch namespace, then records it; it destroys them, then forgets them), and
a listing from before a change added to what was held after it counted the same space
twice (issue 45 item 6: GetCapacity over-reported while a scrub carved).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace, Pool
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.erase import EraseCancelled
from csi_pmem.driver.erasing.eraser import SCRUB, EraseQueue
from csi_pmem.sizes import format_bytes, round_down

log = logging.getLogger(__name__)

SCRATCH_PREFIX = "csi-pmem-scrub-"
MAX_SCRATCH = 32  # scratch namespaces per scrub (free extents of a fragmented region)
YIELD_TIMEOUT = 120.0  # longest a create waits for a scrub to give its space back


def scratch_name(pool: str, index: int) -> str:
    return f"{SCRATCH_PREFIX}{pool}-{index}"


def job_key(pool: str) -> str:
    return f"scrub:{pool}"


class Scrubber:
    """Scrub jobs on the erase queue; see the module docstring."""

    def __init__(self, backend: Backend, ledger: CleanSpace, node_lock: threading.Lock,
                 eraser: EraseQueue, erase: Callable[[Namespace, threading.Event], object],
                 enabled: bool = True) -> None:
        self.backend = backend
        self.ledger = ledger
        self.node_lock = node_lock
        self.eraser = eraser
        self.erase = erase
        self.enabled = enabled and ledger.enabled
        self._lock = threading.Lock()
        self._creates = 0
        self._held: dict[str, list[Namespace]] = {}
        # Odd while a scrub changes held space (the namespaces and _held disagree);
        # pools_and_held() waits for even and reads again when it moved meanwhile.
        self._changes = 0
        self._settled = threading.Condition(self._lock)

    # ------------------------------------------------------------------ creates
    @contextmanager
    def creating(self) -> Iterator[None]:
        """Held by CreateVolume: no scrub runs while any create is in progress."""
        with self._lock:
            self._creates += 1
        try:
            jobs = [self.eraser.cancel(j.key) for j in self.eraser.jobs(SCRUB)]
            for job in jobs:
                if job is not None and not job.done.wait(YIELD_TIMEOUT):
                    log.error("scrub %s did not give its space back within %.0f s",
                              job.key, YIELD_TIMEOUT)
            yield
        finally:
            with self._lock:
                self._creates -= 1
                last = self._creates == 0
            if last:
                self.schedule_dirty()

    def held(self, pool: str) -> list[int]:
        """Sizes of the scratch namespaces a running scrub holds in ``pool``."""
        with self._lock:
            return [ns.size for ns in self._held.get(pool, [])]

    def pools_and_held(self, list_pools: Callable[[], list[Pool]]
                       ) -> tuple[list[Pool], dict[str, list[int]]]:
        """``list_pools()`` and :meth:`held` of each of them, as of one moment between
        the scrubs' changes: never a listing from before a scratch namespace was carved
        (or destroyed) with the held space from after it."""
        while True:
            with self._settled:
                while self._changes % 2:
                    self._settled.wait()
                seen = self._changes
            pools = list_pools()
            with self._lock:
                if self._changes == seen:
                    return pools, {p.name: [ns.size for ns in self._held.get(p.name, [])]
                                   for p in pools}

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Around a change of held space: the namespaces and ``_held`` together."""
        with self._lock:
            self._changes += 1
        try:
            yield
        finally:
            with self._settled:
                self._changes += 1
                self._settled.notify_all()

    # ------------------------------------------------------------------ scheduling
    def schedule(self, pool: str, rerun: bool = False) -> None:
        """Queue a scrub of ``pool``. With ``rerun`` (the region was dirtied just now), a
        scrub of it that is running already runs once more after it ends: it covered the
        free space it found at its start, not what was freed since."""
        if self.enabled:
            self.eraser.submit(job_key(pool), SCRUB, pool, 0,
                               lambda cancel: self.run(pool, cancel), rerun=rerun)

    def schedule_dirty(self) -> None:
        """Queue a scrub for every region the ledger knows to be dirty. From the
        ledger's records, not a listing: this runs after every CreateVolume, and on
        ndctl a listing right after a create is one more ``ndctl list`` exec."""
        if self.enabled:
            for name in self.ledger.known_dirty():
                self.schedule(name)

    # ------------------------------------------------------------------ the job
    def run(self, pool_name: str, cancel: threading.Event) -> None:
        made: list[Namespace] = []
        with self.node_lock:
            with self._lock:
                if self._creates:
                    return  # queued again when the last create leaves
            pool = self._pool(pool_name)
            if pool is None or not pool.usable:
                return
            rec = self.ledger.check(pool)
            if rec.clean:
                return
            generation = rec.generation
            self.ledger.begin_scrub(pool)
            covered = False  # every free extent has a scratch namespace
            try:
                while len(made) < MAX_SCRATCH and not cancel.is_set():
                    size = round_down(pool.largest_extent, pool.align)
                    if size <= 0:
                        covered = True
                        break
                    name = scratch_name(pool_name, len(made))
                    self.ledger.set_scrub(pool_name, [*(ns.name for ns in made), name])
                    failpoints.hit(failpoints.SCRUB_AFTER_RECORD)
                    with self._changing():
                        made.append(self.backend.create_scratch(name, pool_name, size))
                        with self._lock:
                            self._held[pool_name] = list(made)
                    pool = self._pool(pool_name) or pool
            except BaseException:
                self._teardown(pool_name, made)
                raise
        if not made:
            with self.node_lock:
                self._teardown(pool_name, made)
                if not cancel.is_set():
                    self._finish(pool_name, generation)  # no free space: vacuously clean
            return
        failpoints.hit(failpoints.SCRUB_AFTER_CREATE)
        log.info("scrubbing %s: %s of free space in %d scratch namespace(s)", pool_name,
                 format_bytes(sum(ns.size for ns in made)), len(made))
        try:
            for ns in made:
                if cancel.is_set():
                    raise EraseCancelled(f"scrub of {pool_name} gave way")
                self.erase(ns, cancel)
            failpoints.hit(failpoints.SCRUB_AFTER_ERASE)
        except BaseException:
            # Not erased (a failure, a cancellation): the region stays dirty.
            with self.node_lock:
                self._teardown(pool_name, made)
            raise
        with self.node_lock:
            self._teardown(pool_name, made)
            if cancel.is_set():
                return
            if not covered:
                log.warning("scrubbing %s covered %d free extents, not all of them; it stays "
                            "dirty (new volumes there are zeroed when created)", pool_name,
                            len(made))
                return
            self._finish(pool_name, generation)

    def _finish(self, pool_name: str, generation: int) -> None:
        pool = self._pool(pool_name)
        if pool is not None:
            self.ledger.mark_clean(pool, generation)

    def _teardown(self, pool_name: str, made: list[Namespace]) -> None:
        """Destroy the scratch namespaces and clear the intent (node lock held)."""
        with self._changing():
            for ns in made:
                self.backend.destroy(ns.name)
            with self._lock:
                self._held.pop(pool_name, None)
        self.ledger.set_scrub(pool_name, [])

    def _pool(self, name: str) -> Pool | None:
        self.backend.invalidate()
        return self.backend.pool(name)

    # ------------------------------------------------------------------ start-up
    def recover(self) -> None:
        """Destroy scratch namespaces a crash left (node lock held by the caller)."""
        for rec in self.ledger.store.all_regions():
            if not rec.scrub:
                continue
            for name in rec.scrub:
                log.warning("destroying scratch namespace %s of an interrupted scrub of %s",
                            name, rec.pool)
                self.backend.destroy(name)
            self.ledger.set_scrub(rec.pool, [])
