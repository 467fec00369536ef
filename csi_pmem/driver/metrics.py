"""Prometheus metrics: CSI operation latency, pool capacity, erase work, dax sockets.

Volatile pools: ``csi_pmem_pool_volatile`` says which pools lose their contents at a
node restart, and ``csi_pmem_volumes_recreated_total{pool}`` counts the volumes carved
again, empty, after that happened (csi_pmem.driver.core, docs/media.md): each one is a cache
that pods must fill again.

Erase work: bytes and seconds zeroed (counters), the erase queue (jobs and bytes still
to erase, read at scrape time from the eraser), how long each background job took from
DeleteVolume to freed space (histogram), and whether each region is clean.

Why a collector for pools: capacity must be read at scrape time from the back end
(the device is the truth), not cached in gauges that drift. Each driver instance owns
its registry so several drivers can live in one test process.

Why the operation histogram copies csi-lib-utils (package metrics, which every CSI
sidecar uses): name ``csi_plugin_operations_seconds`` (its plugin subsystem), labels
``driver_name``, ``method_name`` as the full gRPC path, ``grpc_status_code`` as Go
spells it, and its buckets, so one dashboard or alert covers the sidecars'
``csi_sidecar_operations_seconds`` and ours. docs/metrics.md has the table.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from csi_pmem import __version__
from csi_pmem.driver.backends.base import Backend, Pool
from csi_pmem.driver.erasing.cleanspace import CleanSpace
from csi_pmem.driver.erasing.eraser import EraseQueue, Job

log = logging.getLogger(__name__)

# csi-lib-utils' operationsLatencyBuckets (metrics/metrics.go), to the second.
BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600)
# csi-lib-utils' operationsLatencyHelp; component-base prefixes the stability level.
OPERATIONS_HELP = ("[ALPHA] Container Storage Interface operation duration with gRPC error "
                   "code status total")
# ``csi_pmem_pool_usable{reason}`` of a usable pool, and of every last-known pool while
# the back end cannot list them (backends.base.REASONS has the others).
REASON_OK = "ok"
REASON_LISTING_FAILED = "listing_failed"


class PoolCollector:
    """Pool series read from the back end at scrape time.

    Why last-known pools: when the listing fails (ndctl missing, hung or answering
    garbage) the pool series must not vanish, or "no usable pool" and "pool nearly
    full" alerts would resolve exactly when the node is in trouble. So the pools of the
    last good listing are exported again, usable 0 with ``reason="listing_failed"``,
    next to ``csi_pmem_backend_up 0`` and a failure counter; the error goes to the log.
    """

    def __init__(self, backend: Backend, orphans: Callable[[], list]) -> None:
        self.backend = backend
        self.orphans = orphans
        self._lock = threading.Lock()
        self._last_pools: list[Pool] = []
        self._last_volumes: dict[str, int] = {}
        self._list_errors = 0
        self._last_success: float | None = None
        self._last_error: str | None = None

    def _list(self) -> tuple[list[Pool], dict[str, int], bool]:
        """(pools, volumes per pool, up): the listing, or the last good one and False."""
        try:
            pools = self.backend.pools()
            namespaces = self.backend.namespaces()
        except Exception as exc:  # a scrape must not fail because ndctl did
            with self._lock:
                self._list_errors += 1
                message = f"{type(exc).__name__}: {exc}"
                if message != self._last_error:  # once per distinct failure, not per scrape
                    log.error("metrics: cannot list pools (exporting the last known ones "
                              "as unusable): %s", message)
                self._last_error = message
                return self._last_pools, self._last_volumes, False
        volumes = {p.name: sum(1 for n in namespaces if n.pool == p.name) for p in pools}
        with self._lock:
            if self._last_error is not None:
                log.info("metrics: pools listed again after %s", self._last_error)
            self._last_pools, self._last_volumes = pools, volumes
            self._last_success, self._last_error = time.time(), None
        return pools, volumes, True

    def collect(self):
        pools, volumes, up = self._list()
        labels = ["pool", "numa_node"]
        cap = GaugeMetricFamily("csi_pmem_pool_capacity_bytes", "Size of the region", labels=labels)
        free = GaugeMetricFamily("csi_pmem_pool_free_bytes", "Free bytes in the region",
                                 labels=labels)
        vols = GaugeMetricFamily("csi_pmem_pool_volumes", "Namespaces in the region",
                                 labels=labels)
        usable = GaugeMetricFamily(
            "csi_pmem_pool_usable", "1 when volumes can be carved from the region, else 0; "
            "reason names why not (label_less, misaligned, disabled, read_only, mode, "
            "overcommitted; for dax regions no_dax_region, system_ram, foreign_device, "
            "cxl_no_region; listing_failed; ok when usable): the driver log says how to fix "
            "it",
            labels=[*labels, "reason"])
        volatile = GaugeMetricFamily(
            "csi_pmem_pool_volatile", "1 when the region is volatile memory (its volumes "
            "are lost at a node restart and carved again, empty), 0 when persistent",
            labels=labels)
        mode_usable = GaugeMetricFamily(
            "csi_pmem_pool_mode_usable", "1 when volumes of this device mode (devdax, fsdax) "
            "can be carved from the region, else 0 (e.g. a kernel without device_dax)",
            labels=[*labels, "mode"])
        for p in pools:
            lv = [p.name, str(p.numa_node)]
            cap.add_metric(lv, p.size)
            free.add_metric(lv, p.free)
            vols.add_metric(lv, volumes.get(p.name, 0))
            if not up:
                reason = REASON_LISTING_FAILED
            elif p.problem:
                reason = p.reasons[0] if p.reasons else "unknown"
            else:
                reason = REASON_OK
            usable.add_metric([*lv, reason], 1 if reason == REASON_OK else 0)
            volatile.add_metric(lv, 1 if p.volatile else 0)
            for mode in ("devdax", "fsdax"):
                mode_usable.add_metric([*lv, mode],
                                       1 if up and p.problem_for(mode) is None else 0)
        orphans = GaugeMetricFamily("csi_pmem_orphan_namespaces",
                                    "Namespaces named like volumes but without a state record")
        orphans.add_metric([], len(self.orphans()))
        backend_up = GaugeMetricFamily(
            "csi_pmem_backend_up", "1 when the last scrape could list the back end's pools "
            "and namespaces (ndctl), 0 when it failed (pool series then repeat the last "
            "good listing)")
        backend_up.add_metric([], 1 if up else 0)
        with self._lock:
            errors, last_success = self._list_errors, self._last_success
        list_errors = CounterMetricFamily(
            "csi_pmem_backend_list_errors", "Scrapes whose pool or namespace listing failed")
        list_errors.add_metric([], errors)
        yield from (cap, free, vols, usable, volatile, mode_usable, orphans, backend_up,
                    list_errors)
        if last_success is not None:
            success = GaugeMetricFamily(
                "csi_pmem_backend_last_success_timestamp_seconds",
                "Unix time of the last listing that succeeded")
            success.add_metric([], last_success)
            yield success


class EraseCollector:
    """The erase queue and the clean-space ledger, read at scrape time."""

    def __init__(self, eraser: EraseQueue, ledger: CleanSpace, backend: Backend) -> None:
        self.eraser, self.ledger, self.backend = eraser, ledger, backend

    def collect(self):
        jobs = GaugeMetricFamily("csi_pmem_erase_queue_length",
                                 "Erase jobs queued or running (deleted volumes, scrubs)",
                                 labels=["kind"])
        pending = GaugeMetricFamily(
            "csi_pmem_erase_pending_bytes",
            "Bytes of deleted volumes still being erased: free once their erase is done",
            labels=["pool"])
        clean = GaugeMetricFamily(
            "csi_pmem_region_clean",
            "1 when the region's free space is known to be zeros (CreateVolume does not "
            "zero there), 0 while it is dirty", labels=["pool"])
        all_jobs = self.eraser.jobs()
        for kind in ("delete", "scrub"):
            jobs.add_metric([kind], sum(1 for j in all_jobs if j.kind == kind))
        try:
            pools = self.backend.pools()
        except Exception:  # a scrape must not fail because ndctl did
            pools = []
        for p in pools:
            pending.add_metric([p.name], self.eraser.pending_bytes({p.name}))
            clean.add_metric([p.name], 1 if self.ledger.is_clean(p.name) else 0)
        yield from (jobs, pending, clean)


class Metrics:
    def __init__(self, driver_name: str, backend: str = "") -> None:
        self.driver_name = driver_name or "unknown-driver"  # csi-lib-utils' placeholder
        self.registry = CollectorRegistry()
        self.operations = Histogram(
            "csi_plugin_operations_seconds", OPERATIONS_HELP,
            ["driver_name", "method_name", "grpc_status_code"], buckets=BUCKETS,
            registry=self.registry)
        # -- build and process (csi-lib-utils registers process_start_time_seconds too)
        self.build_info = Info("csi_pmem_build", "The driver's version, Python and back end "
                               "(value 1)", registry=self.registry)
        self.build_info.info({"version": __version__, "python": platform.python_version(),
                              "backend": backend})
        ProcessCollector(registry=self.registry)
        self.erase_bytes = Counter("csi_pmem_erase_bytes", "Bytes zeroed before release",
                                   registry=self.registry)
        self.erase_seconds = Counter("csi_pmem_erase_seconds", "Seconds spent zeroing",
                                     registry=self.registry)
        self.erase_jobs = Histogram(
            "csi_pmem_erase_job_seconds", "Seconds from queueing an erase job to its end "
            "(for a deleted volume: until its space is free)", ["kind"],
            buckets=BUCKETS, registry=self.registry)
        self.erase_failures = Counter(
            "csi_pmem_erase_failures", "Erases (zeroing a namespace before release) that "
            "failed; the delete fails with them and is retried", registry=self.registry)
        self.volumes_recreated = Counter(
            "csi_pmem_volumes_recreated", "Volumes of a volatile pool carved again, empty "
            "and zeroed, after their contents were lost (a node restart): their data must "
            "be staged again", ["pool"], registry=self.registry)
        self.dax_connections = Counter(
            "csi_pmem_dax_socket_connections", "Connections to dax.sock by result",
            ["result"], registry=self.registry)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.operations.labels(self.driver_name, method, code).observe(seconds)

    def observe_erase(self, nbytes: int, seconds: float) -> None:
        self.erase_bytes.inc(nbytes)
        self.erase_seconds.inc(seconds)

    def observe_recreate(self, pool: str) -> None:
        self.volumes_recreated.labels(pool).inc()

    def observe_erase_job(self, job: Job, seconds: float) -> None:
        self.erase_jobs.labels(job.kind).observe(seconds)

    def watch_erases(self, eraser: EraseQueue, ledger: CleanSpace, backend: Backend) -> None:
        eraser.on_done = self.observe_erase_job
        self.registry.register(EraseCollector(eraser, ledger, backend))

    def watch_pools(self, backend: Backend, orphans: Callable[[], list]) -> None:
        self.registry.register(PoolCollector(backend, orphans))
        try:  # every pool's count from 0, so that increase() sees the first one
            for pool in backend.pools():
                self.volumes_recreated.labels(pool.name)
        except Exception as exc:  # the pools are listed again at every scrape
            log.warning("metrics: cannot list pools yet: %s", exc)

    def serve(self, address: str):
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0",
                                           registry=self.registry)
        return server
