"""Prometheus metrics: CSI operation latency, pool capacity, erase work, dax sockets.

Erase work: bytes and seconds zeroed (counters), the erase queue (jobs and bytes still
to erase, read at scrape time from the eraser), how long each background job took from
DeleteVolume to freed space (histogram), and whether each region is clean.

Why a collector for pools: capacity must be read at scrape time from the back end
(the device is the truth), not cached in gauges that drift. Each driver instance owns
its registry so several drivers can live in one test process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from csi_pmem.backends.base import Backend
from csi_pmem.cleanspace import CleanSpace
from csi_pmem.eraser import EraseQueue, Job

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PoolCollector:
    def __init__(self, backend: Backend, orphans) -> None:
        self.backend = backend
        self.orphans = orphans

    def collect(self):
        labels = ["pool", "numa_node"]
        cap = GaugeMetricFamily("csi_pmem_pool_capacity_bytes", "Size of the region", labels=labels)
        free = GaugeMetricFamily("csi_pmem_pool_free_bytes", "Free bytes in the region",
                                 labels=labels)
        vols = GaugeMetricFamily("csi_pmem_pool_volumes", "Namespaces in the region",
                                 labels=labels)
        usable = GaugeMetricFamily(
            "csi_pmem_pool_usable", "1 when volumes can be carved from the region, 0 when it is "
            "label-less, misaligned or otherwise unusable (see the driver log)",
            labels=[*labels, "problem"])
        try:
            pools = self.backend.pools()
            namespaces = self.backend.namespaces()
        except Exception:  # a scrape must not fail because ndctl did
            pools, namespaces = [], []
        for p in pools:
            lv = [p.name, str(p.numa_node)]
            cap.add_metric(lv, p.size)
            free.add_metric(lv, p.free)
            vols.add_metric(lv, sum(1 for n in namespaces if n.pool == p.name))
            usable.add_metric([*lv, p.problem or ""], 0 if p.problem else 1)
        orphans = GaugeMetricFamily("csi_pmem_orphan_namespaces",
                                    "Namespaces named like volumes but without a state record")
        orphans.add_metric([], len(self.orphans()))
        yield from (cap, free, vols, usable, orphans)


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
    def __init__(self, driver_name: str) -> None:
        self.driver_name = driver_name
        self.registry = CollectorRegistry()
        self.operations = Histogram(
            "csi_plugin_operations_seconds", "Duration of CSI operations",
            ["driver_name", "method_name", "grpc_status_code"], buckets=BUCKETS,
            registry=self.registry)
        self.erase_bytes = Counter("csi_pmem_erase_bytes", "Bytes zeroed before release",
                                   registry=self.registry)
        self.erase_seconds = Counter("csi_pmem_erase_seconds", "Seconds spent zeroing",
                                     registry=self.registry)
        self.erase_jobs = Histogram(
            "csi_pmem_erase_job_seconds", "Seconds from queueing an erase job to its end "
            "(for a deleted volume: until its space is free)", ["kind"],
            buckets=BUCKETS, registry=self.registry)
        self.dax_connections = Counter(
            "csi_pmem_dax_socket_connections", "Connections to dax.sock by result",
            ["result"], registry=self.registry)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.operations.labels(self.driver_name, method, code).observe(seconds)

    def observe_erase(self, nbytes: int, seconds: float) -> None:
        self.erase_bytes.inc(nbytes)
        self.erase_seconds.inc(seconds)

    def observe_erase_job(self, job: Job, seconds: float) -> None:
        self.erase_jobs.labels(job.kind).observe(seconds)

    def watch_erases(self, eraser: EraseQueue, ledger: CleanSpace, backend: Backend) -> None:
        eraser.on_done = self.observe_erase_job
        self.registry.register(EraseCollector(eraser, ledger, backend))

    def watch_pools(self, backend: Backend, orphans) -> None:
        self.registry.register(PoolCollector(backend, orphans))

    def serve(self, address: str):
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0",
                                           registry=self.registry)
        return server
