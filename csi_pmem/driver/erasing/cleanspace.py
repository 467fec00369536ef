"""The clean-space ledger: which regions' free space is known to read as zeros.

Why: persistent memory keeps its bytes when a namespace is destroyed, so a new volume
must not be handed out over unerased space. Zeroing every new namespace (and every
deleted one) writes each byte twice over its life and makes both RPCs grow with the
volume. The ledger lets each byte be erased once: a region is *clean* while every
namespace the driver destroyed there was erased and verified first and nothing of
unknown history was ever freed there; a CreateVolume in a clean region does not zero.

The rules, each in one method, each called under the driver's node-wide lock:

- A region the ledger has never seen is dirty ("first seen"): the media may hold
  anything (a previous installation, another operating system). So is a region whose
  record is unreadable.
- :meth:`must_zero` (CreateVolume): dirty regions zero the new namespace; the region
  stays dirty, since the rest of its free space is still unknown.
- :meth:`mark_dirty` is written *before* a namespace is destroyed without an erase
  (``eraseOnDelete: false``): a crash between the two leaves the region dirty, never
  clean over old data. An erased namespace keeps the region clean: the driver destroys
  it only after the erase has been verified, and a crash before that resumes the
  erase (the volume's DELETING record), so no crash point releases unerased space.
- Free space the driver did not release: the record keeps the free bytes the driver
  expects (:meth:`expect_freed` before its own destroys, :meth:`note_used` after its
  own creates). If a region ever shows more free space than that, someone destroyed
  a namespace there by hand: the region becomes dirty. Less free space than expected
  (a namespace made by hand, or a crash between the driver's own steps) only lowers the
  expectation. Orphans (namespaces named like volumes without a record) make their
  region dirty at start-up too.
- A volatile pool (``Pool.media``) whose clean record predates this boot is dirty at
  start-up: after a node restart its memory holds what the firmware, the kernel or a
  tenant left there.
- Only a scrub (:mod:`csi_pmem.driver.erasing.scrub`) makes a region clean: it covers
  all of the free space with scratch namespaces, zeroes them and destroys them. ``generation`` grows
  with every change to dirty, so a scrub that began before one cannot claim the region.

Back ends whose new namespaces always read as zeros (the emulated back end's fresh
files) need no ledger: every region counts as clean and nothing is written.

Known limit: a namespace made and destroyed by hand between two of the driver's looks
leaves the free space as it was and goes unnoticed; after such work, delete the
region's record (``<state-dir>/regions/<region>.json``) while the driver is stopped:
the region is then first seen again, dirty, and scrubbed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from csi_pmem.driver.backends.base import Backend, Pool
from csi_pmem.driver.state import RegionRecord, StateStore
from csi_pmem.sizes import format_bytes

log = logging.getLogger(__name__)

FIRST_SEEN = "first seen by the driver: its free space may hold anything"


def boot_time(proc: str = "/proc") -> float:
    """When this boot began (Unix time); 0 when unknown (then nothing predates it)."""
    try:
        with open(f"{proc}/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


class CleanSpace:
    """Per-region clean/dirty records in the state store (see the module docstring)."""

    def __init__(self, store: StateStore, backend: Backend) -> None:
        self.store = store
        self.backend = backend
        self.enabled = not getattr(backend, "zeroes_new_namespaces", False)
        # Readers (metrics, GetCapacity) and the node-locked writers share this cache.
        self._lock = threading.Lock()
        self._cache: dict[str, RegionRecord] = {}

    # ------------------------------------------------------------------ reading
    def record(self, pool: str) -> RegionRecord:
        """The region's record; a dirty "first seen" one (not yet written) if none."""
        with self._lock:
            rec = self._cache.get(pool)
        if rec is None:
            rec = self.store.get_region(pool) or RegionRecord(pool=pool, clean=False,
                                                              reason=FIRST_SEEN)
            with self._lock:
                rec = self._cache.setdefault(pool, rec)
        return replace(rec, scrub=list(rec.scrub))  # callers change their own copy

    def is_clean(self, pool: str) -> bool:
        return not self.enabled or self.record(pool).clean

    def known_dirty(self) -> list[str]:
        """Dirty regions among those read or written since start-up (no listing)."""
        if not self.enabled:
            return []
        with self._lock:
            return sorted(name for name, rec in self._cache.items() if not rec.clean)

    def _put(self, rec: RegionRecord) -> None:
        self.store.put_region(rec)
        with self._lock:
            self._cache[rec.pool] = rec

    # ------------------------------------------------------------------ checks
    def check(self, pool: Pool) -> RegionRecord:
        """Compare the region with what the driver expects; make it dirty if space was
        freed behind its back (see the module docstring). Node lock held."""
        rec = self.record(pool.name)
        if not self.enabled:
            return rec
        if rec.clean and rec.free >= 0 and pool.free > rec.free:
            self.mark_dirty(pool.name, f"{format_bytes(pool.free - rec.free)} were freed "
                                       "outside the driver (a namespace destroyed by hand?)")
            return self.record(pool.name)
        if rec.free >= 0 and pool.free < rec.free:
            rec.free = pool.free
            self._put(rec)
        return rec

    def must_zero(self, pool: Pool) -> bool:
        """Whether a namespace carved from ``pool`` now must be zeroed before use."""
        return self.enabled and not self.check(pool).clean

    # ------------------------------------------------------------------ changes
    def note_used(self, pool: str, nbytes: int) -> None:
        """After the driver carved ``nbytes`` (a create that succeeded)."""
        self._adjust(pool, -nbytes)

    def expect_freed(self, pool: str, nbytes: int) -> None:
        """Before the driver destroys an erased namespace of ``nbytes``."""
        self._adjust(pool, nbytes)

    def _adjust(self, pool: str, delta: int) -> None:
        if not self.enabled:
            return
        rec = self.record(pool)
        if rec.free >= 0:
            rec.free = max(0, rec.free + delta)
            self._put(rec)

    def mark_dirty(self, pool: str, reason: str) -> None:
        """Write-ahead: the region's free space is about to hold (or holds) unknown bytes."""
        if not self.enabled:
            return
        rec = self.record(pool)
        was_clean = rec.clean
        rec.clean, rec.reason, rec.generation = False, reason, rec.generation + 1
        self._put(rec)
        if was_clean:
            log.info("region %s is dirty: %s; new volumes there are zeroed on create "
                     "until it is scrubbed", pool, reason)

    def begin_scrub(self, pool: Pool) -> None:
        """A scrub starts: from now on the driver tracks the region's free space, so
        that space freed behind its back during the scrub keeps the region dirty."""
        rec = self.record(pool.name)
        rec.free = pool.free
        self._put(rec)

    def mark_clean(self, pool: Pool, generation: int) -> bool:
        """A scrub zeroed all of the free space it found; True if the region is clean
        now (False when it became dirty again meanwhile)."""
        rec = self.record(pool.name)
        if rec.generation != generation:
            log.info("region %s: scrub done, but the region became dirty meanwhile (%s)",
                     pool.name, rec.reason)
            return False
        if rec.free >= 0 and pool.free > rec.free:
            self.mark_dirty(pool.name, f"{format_bytes(pool.free - rec.free)} were freed "
                                       "outside the driver during a scrub")
            return False
        rec.clean, rec.reason, rec.free, rec.scrub = True, "", pool.free, []
        self._put(rec)
        log.info("region %s is clean: %s of free space scrubbed", pool.name,
                 format_bytes(pool.free))
        return True

    def set_scrub(self, pool: str, names: list[str]) -> None:
        """Write-ahead: the scratch namespaces a scrub is about to create (or holds)."""
        rec = self.record(pool)
        rec.scrub = list(names)
        self._put(rec)

    # ------------------------------------------------------------------ start-up
    def start(self, pools: list[Pool], orphans: dict[str, list[str]]) -> None:
        """At start-up (node lock held): write first-seen records, dirty the regions of
        orphans, and compare every clean region with its expectation."""
        if not self.enabled:
            return
        with self._lock:
            self._cache.clear()
        for pool in pools:
            rec = self.store.get_region(pool.name)
            if rec is None:
                self._put(RegionRecord(pool=pool.name, clean=False, reason=FIRST_SEEN))
                log.info("region %s: %s; it is dirty until scrubbed", pool.name, FIRST_SEEN)
                continue
            if orphans.get(pool.name):
                self.mark_dirty(pool.name, "namespaces of unknown history: "
                                + ", ".join(orphans[pool.name]))
                continue
            if pool.volatile and rec.clean and rec.updated_at < boot_time():
                # Volatile memory after a node restart holds whatever the firmware, the
                # kernel (kmem) or a tenant left: what the ledger knew is of another boot.
                self.mark_dirty(pool.name, "volatile memory: the node restarted since "
                                "its free space was known to be zero")
                continue
            if not rec.scrub:
                self.check(pool)
