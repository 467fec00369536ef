"""The shipped Grafana dashboard and alert rules query only metrics csi-pmem exports.

Why against a real scrape: a renamed metric or label (like the move to csi-lib-utils'
method names) must break this test, not a dashboard in someone's Grafana. The exported
names come from the driver's registry after real calls (in-process) and from the weights
sidecar's collector over a status with every field set, as Prometheus parses them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from csi_pmem.driver.metrics import Metrics
from csi_pmem.driver.servicers import rpc as rpc_module
from csi_pmem.loader.sidecar.metrics import StatusCollector
from csi_pmem.loader.sidecar.status import Status

from conftest import MiB
from inprocess import DRIVER_NAME, InProcessNode

CHART = Path(__file__).resolve().parents[2] / "charts" / "csi-pmem"
DASHBOARD = CHART / "dashboards" / "csi-pmem.json"
ALERTS = CHART / "monitoring" / "alerts.yaml"

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(?!\s*\()")
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels, keywords out)."""
    text = _GROUPING.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub(" ", expr))))
    return {m for m in _IDENT.findall(text) if m.lower() not in KEYWORDS}


def test_metric_names_parses_what_the_files_use():
    assert metric_names('histogram_quantile(0.99, sum by (le, method_name) (rate('
                        'csi_plugin_operations_seconds_bucket{driver_name=~"$driver"}'
                        '[$__rate_interval])))') == {"csi_plugin_operations_seconds_bucket"}
    assert metric_names("a / (b > 0) < 0.10 and ignoring (reason) c == 1") == {"a", "b", "c"}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    node = InProcessNode()
    m = Metrics(DRIVER_NAME, backend="emulated")
    m.watch_pools(node.backend, lambda: node.driver.orphans)
    rpc_module.observers.append(m.observe_rpc)
    try:
        vol = node.create("d1", size=64 * MiB).volume
        node.delete(vol.volume_id)
        m.dax_connections.labels("accepted").inc()
        text = generate_latest(m.registry).decode()
    finally:
        rpc_module.observers.remove(m.observe_rpc)
        node.close()
    st = Status(model="m")
    st.update(state="error", last_error="too small", error_kind="too-small", bytes=10,
              startup_seconds=1.0, last_verified=1.0, phases={"total": 1.0})
    st.verified("full", "ok", 10)
    side = CollectorRegistry()
    side.register(StatusCollector(st.snapshot))
    text += generate_latest(side).decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "csi_pmem_weights_verifications_total" in names  # every family has a sample
    return names


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            arg = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query["query"])
            assert arg, query
            exprs.append(arg.group(1))
    return exprs


def test_the_dashboard_queries_only_exported_metrics(exported):
    used = set().union(*map(metric_names, dashboard_exprs()))
    assert {"csi_pmem_pool_capacity_bytes", "csi_pmem_pool_free_bytes",
            "csi_plugin_operations_seconds_bucket",
            "csi_plugin_operations_seconds_count"} <= used
    assert used <= exported, sorted(used - exported)


def test_the_dashboard_has_capacity_per_node_and_numa_pool_and_latency():
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(dashboard_exprs())
    assert "sum by (node, numa_node)" in exprs and "histogram_quantile(0.99" in exprs
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "node", "driver"}


def test_the_alerts_query_only_exported_metrics(exported):
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "CsiPmemNoUsablePool", "CsiPmemOrphanNamespaces", "CsiPmemPoolNearlyFull",
        "CsiPmemEraseFailures", "CsiPmemWeightsSidecarNotReady"}
    used = set().union(*(metric_names(r["expr"]) for r in rules))
    assert used <= exported, sorted(used - exported)
