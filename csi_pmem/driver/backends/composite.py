"""Several kinds of pool on one node: one back end that routes to others by pool name.

Why: a node may have NVDIMM or CXL persistent memory (ndctl regions, ``regionN``) and
soft-reserved or CXL volatile memory (dax regions, ``daxN``) at once. The driver core,
the state store, the erase, dax.sock and the NRI device node stay one design over one
:class:`~csi_pmem.driver.backends.base.Backend`; this class is that back end for
``--backend=ndctl,daxctl``. A StorageClass picks a kind with ``media``
(:mod:`csi_pmem.driver.params`).

Routing: ``create``/``create_scratch`` go to the back end that lists the pool, every
operation on a namespace to the back end that owns its pool; pool names must be unique
across back ends (each back end names its own: ``regionN``, ``daxN``), and a clash is
refused at listing time rather than routed by guess. A destroy goes to the back end
that lists the name, or to all when none does (a create cut short may have left
something that only its own back end can recognise).
"""

from __future__ import annotations

import logging
import threading

from csi_pmem.driver.backends.base import Backend, Namespace, Pool
from csi_pmem.errors import BackendError, CsiPmemError, Unavailable

log = logging.getLogger(__name__)


class CompositeBackend(Backend):
    """Routes to ``backends`` by pool name (see the module docstring)."""

    kind = "composite"

    def __init__(self, backends: list[Backend]) -> None:
        if not backends:
            raise ValueError("a composite back end needs at least one back end")
        self.backends = list(backends)
        self.kind = ",".join(b.kind for b in self.backends)
        # The ledger is one for all pools: it is off only if no pool needs it.
        self.zeroes_new_namespaces = all(b.zeroes_new_namespaces for b in self.backends)
        self._owner: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def pools(self) -> list[Pool]:
        out: list[Pool] = []
        owner: dict[str, Backend] = {}
        for b in self.backends:
            for p in b.pools():
                if p.name in owner:
                    raise BackendError(f"pool {p.name} is listed by both the {owner[p.name].kind} "
                                       f"and the {b.kind} back end; pool names must be unique")
                owner[p.name] = b
                out.append(p)
        with self._lock:
            self._owner = owner
        return out

    def _backend_of(self, pool: str) -> Backend:
        with self._lock:
            found = self._owner.get(pool)
        if found is None:
            self.pools()
            with self._lock:
                found = self._owner.get(pool)
        if found is None:
            raise Unavailable(f"pool {pool} is not present on this node")
        return found

    def namespaces(self) -> list[Namespace]:
        return [ns for b in self.backends for ns in b.namespaces()]

    def get(self, name: str) -> Namespace | None:
        for b in self.backends:
            ns = b.get(name)
            if ns is not None:
                return ns
        return None

    def create(self, name: str, pool: str, size: int, align: int,
               mode: str = "devdax") -> Namespace:
        return self._backend_of(pool).create(name, pool, size, align, mode=mode)

    def create_scratch(self, name: str, pool: str, size: int) -> Namespace:
        return self._backend_of(pool).create_scratch(name, pool, size)

    def destroy(self, name: str) -> None:
        owners = [b for b in self.backends if b.get(name) is not None]
        for b in owners or self.backends:
            b.destroy(name)

    def open_device(self, ns: Namespace, readonly: bool, exclusive: bool = False) -> int:
        return self._backend_of(ns.pool).open_device(ns, readonly, exclusive=exclusive)

    def device_present(self, ns: Namespace) -> bool:
        try:
            return self._backend_of(ns.pool).device_present(ns)
        except CsiPmemError:
            return False

    def probe(self) -> tuple[bool, str]:
        said = [(b.kind, *b.probe()) for b in self.backends]
        ready = any(ok for _, ok, _ in said)
        if all(reason == "ok" for _, _, reason in said):
            return True, "ok"
        return ready, "; ".join(f"{kind}: {reason}" for kind, _, reason in said)

    def max_volumes(self) -> int:
        """0 (unbounded) when any back end with a usable pool is unbounded."""
        counts = []
        for b in self.backends:
            if any(p.usable for p in b.pools()):
                counts.append(b.max_volumes())
        return 0 if not counts or 0 in counts else sum(counts)

    def setup_node(self) -> None:
        for b in self.backends:
            b.setup_node()
        self.invalidate()  # what one made (a CXL pmem region), another lists

    def invalidate(self) -> None:
        for b in self.backends:
            b.invalidate()

    def close(self) -> None:
        for b in self.backends:
            b.close()
