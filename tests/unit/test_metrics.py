"""The driver's /metrics text: csi-lib-utils' operation histogram, build info, pools
that stay visible when the listing fails, a reason enum an alert can match, erase
failures. In-process (the emulated back end, the fake mounter), read as Prometheus
would parse it."""

from __future__ import annotations

import platform

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from csi_pmem import __version__
from csi_pmem.csi import csi_pb2
from csi_pmem.driver.backends.base import REASONS
from csi_pmem.driver.erasing.erase import zero_fd
from csi_pmem.driver.metrics import BUCKETS, REASON_LISTING_FAILED, REASON_OK, Metrics
from csi_pmem.driver.servicers import rpc as rpc_module

from conftest import MiB, eventually
from inprocess import DRIVER_NAME, InProcessNode

# csi-lib-utils metrics/metrics.go (operationsLatencyBuckets), read at v0.24.0.
UPSTREAM_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600)


@pytest.fixture
def node():
    n = InProcessNode()
    yield n
    n.close()


@pytest.fixture
def metrics(node):
    m = Metrics(DRIVER_NAME, backend="emulated")
    m.watch_pools(node.backend, lambda: node.driver.orphans)
    node.driver.namespace_eraser.on_erase = m.observe_erase
    node.driver.namespace_eraser.on_erase_error = m.erase_failures.inc
    rpc_module.observers.append(m.observe_rpc)
    yield m
    rpc_module.observers.remove(m.observe_rpc)


def samples(m: Metrics) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


def names(m: Metrics, prefix: str) -> list[tuple[str, dict]]:
    return [(n, dict(lv)) for (n, lv) in samples(m) if n.startswith(prefix)]


def test_operations_use_csi_lib_utils_labels_and_buckets(node, metrics):
    node.create("ok1", size=64 * MiB)
    with pytest.raises(grpc.RpcError) as err:
        node.create("huge", size=64 << 30)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    node.identity.Probe(csi_pb2.ProbeRequest())
    count = "csi_plugin_operations_seconds_count"
    assert value(metrics, count, driver_name=DRIVER_NAME, grpc_status_code="OK",
                 method_name="/csi.v1.Controller/CreateVolume") == 1
    assert value(metrics, count, driver_name=DRIVER_NAME, grpc_status_code="OutOfRange",
                 method_name="/csi.v1.Controller/CreateVolume") == 1
    assert value(metrics, count, driver_name=DRIVER_NAME, grpc_status_code="OK",
                 method_name="/csi.v1.Identity/Probe") == 1
    assert BUCKETS == UPSTREAM_BUCKETS
    assert ("# HELP csi_plugin_operations_seconds [ALPHA] Container Storage Interface "
            "operation duration with gRPC error code status total\n"
            in generate_latest(metrics.registry).decode())
    les = sorted(float(labels["le"]) for n, labels in names(metrics, "csi_plugin_operations")
                 if n.endswith("_bucket") and labels["grpc_status_code"] == "OutOfRange")
    assert les == [*map(float, UPSTREAM_BUCKETS), float("inf")]
    # No short names or Python code names anywhere.
    assert not [lv for n, lv in names(metrics, "csi_plugin_operations")
                if not lv["method_name"].startswith("/csi.v1.") or "_" in lv["grpc_status_code"]]


def test_build_info_and_process_start_time(metrics):
    assert value(metrics, "csi_pmem_build_info", version=__version__,
                 python=platform.python_version(), backend="emulated") == 1
    assert value(metrics, "process_start_time_seconds") > 0


def test_pool_reason_is_ok_or_from_the_closed_set(node, metrics):
    assert value(metrics, "csi_pmem_pool_usable", pool="region0", numa_node="0",
                 reason=REASON_OK) == 1
    assert value(metrics, "csi_pmem_pool_mode_usable", pool="region0", numa_node="0",
                 mode="devdax") == 1
    assert value(metrics, "csi_pmem_backend_up") == 1
    assert value(metrics, "csi_pmem_backend_list_errors_total") == 0


def test_overcommitted_region_says_its_reason(node):
    node.create("fill", size=400 * MiB, params={"numaNode": "0"})
    node.stop()
    node.regions = {0: 128 * MiB, 1: 512 * MiB}  # shrank below what the namespaces use
    node.start()
    m = Metrics(DRIVER_NAME, backend="emulated")
    m.watch_pools(node.backend, lambda: node.driver.orphans)
    usable = [(lv["reason"], v) for (n, lvs), v in samples(m).items()
              if n == "csi_pmem_pool_usable" for lv in [dict(lvs)] if lv["pool"] == "region0"]
    assert usable == [("overcommitted", 0)]
    assert "overcommitted" in REASONS


def test_listing_failure_keeps_the_pools_as_unusable(node, metrics, monkeypatch, caplog):
    node.create("v1", size=64 * MiB, params={"numaNode": "1"})
    before = value(metrics, "csi_pmem_pool_capacity_bytes", pool="region1", numa_node="1")
    assert before == 512 * MiB

    def broken():
        raise OSError("ndctl: timed out after 30 s")

    monkeypatch.setattr(node.backend, "pools", broken)
    for _ in range(2):
        assert value(metrics, "csi_pmem_backend_up") == 0
    # Each scrape lists once: two failed above, this is the third.
    assert value(metrics, "csi_pmem_backend_list_errors_total") == 3
    assert value(metrics, "csi_pmem_pool_capacity_bytes", pool="region1", numa_node="1") == before
    assert value(metrics, "csi_pmem_pool_volumes", pool="region1", numa_node="1") == 1
    assert value(metrics, "csi_pmem_pool_usable", pool="region1", numa_node="1",
                 reason=REASON_LISTING_FAILED) == 0
    assert value(metrics, "csi_pmem_pool_mode_usable", pool="region1", numa_node="1",
                 mode="fsdax") == 0
    errors = [r for r in caplog.records if "cannot list pools" in r.getMessage()]
    assert len(errors) == 1 and "timed out" in errors[0].getMessage()  # once, not per scrape
    monkeypatch.undo()
    assert value(metrics, "csi_pmem_backend_up") == 1
    assert value(metrics, "csi_pmem_pool_usable", pool="region1", numa_node="1",
                 reason=REASON_OK) == 1
    assert value(metrics, "csi_pmem_backend_last_success_timestamp_seconds") > 0


def test_erase_failure_is_counted(node, metrics, monkeypatch):
    """A failed erase counts once per attempt; the background eraser retries it, and the
    retry that succeeds counts its bytes and no failure."""
    monkeypatch.setattr("csi_pmem.driver.erasing.eraser.RETRY_FIRST", 0.2)
    vol = node.create("e1", size=64 * MiB).volume
    calls = []

    def failing(*_a, **_k):
        calls.append(1)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("csi_pmem.driver.erasing.namespace.zero_fd", failing)
    node.delete(vol.volume_id)  # the erase goes on (and fails) in the background
    eventually(lambda: value(metrics, "csi_pmem_erase_failures_total") >= 1,
               "the failed erase counted")
    monkeypatch.setattr("csi_pmem.driver.erasing.namespace.zero_fd", zero_fd)
    eventually(lambda: value(metrics, "csi_pmem_erase_bytes_total") >= 64 * MiB,
               "the retried erase done", timeout=30)
    assert value(metrics, "csi_pmem_erase_failures_total") == len(calls)
