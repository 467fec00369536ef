"""Metrics on /metrics, structured logs without secrets, and an honest Probe."""

from __future__ import annotations

import json
import platform
import socket
import urllib.request

from csi_pmem import __version__
from csi_pmem.csi import csi_pb2

from conftest import MiB, needs_root

pytestmark = needs_root()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics(driver_factory):
    port = free_port()
    d = driver_factory(extra=["--metrics-address", f"127.0.0.1:{port}"]).start()
    vol = d.create("m1", size=100 * MiB, params={"numaNode": "1"}).volume
    d.delete(vol.volume_id)
    d.create("m2", size=100 * MiB, params={"numaNode": "0"})
    m = scrape(port)
    ok = ('csi_plugin_operations_seconds_count{driver_name="csi-pmem.io",'
          'grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"}')
    assert m[ok] == 2
    assert m['csi_pmem_pool_capacity_bytes{numa_node="0",pool="region0"}'] == 1 << 30
    assert m['csi_pmem_pool_volumes{numa_node="0",pool="region0"}'] == 1
    assert m['csi_pmem_pool_volumes{numa_node="1",pool="region1"}'] == 0
    assert m['csi_pmem_pool_free_bytes{numa_node="1",pool="region1"}'] == 1 << 30
    assert m['csi_pmem_pool_free_bytes{numa_node="0",pool="region0"}'] < 1 << 30
    assert m['csi_pmem_pool_usable{numa_node="0",pool="region0",reason="ok"}'] == 1
    build = (f'csi_pmem_build_info{{backend="emulated",python="{platform.python_version()}",'
             f'version="{__version__}"}}')
    assert m[build] == 1
    assert m["csi_pmem_backend_up"] == 1
    assert m["csi_pmem_erase_bytes_total"] >= 100 * MiB
    assert m["csi_pmem_erase_seconds_total"] > 0
    assert m["csi_pmem_orphan_namespaces"] == 0


def test_json_logs_strip_secrets_and_keep_probe_quiet(driver_factory):
    d = driver_factory(extra=["--log-format", "json", "--log-level", "info"]).start()
    for _ in range(5):
        d.identity.Probe(csi_pb2.ProbeRequest())
    d.create("s1", secrets={"password": "hunter2"})
    d.stop()
    lines = [json.loads(line) for line in d.log.read_text().splitlines()
             if line.startswith("{")]
    assert lines, "expected JSON log lines"
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in lines), lines
    create = [r for r in lines if r.get("rpc") == "CreateVolume"]
    assert create and create[0]["code"] == "OK" and create[0]["seconds"] >= 0
    assert "hunter2" not in d.log.read_text()
    assert not [r for r in lines if r.get("rpc") == "Probe"]


def test_probe_not_ready_when_no_region_is_usable(driver_factory):
    d = driver_factory(regions="0=64Mi").start()
    d.create("fill", size=48 * MiB)
    d.stop()
    d.regions = "0=16Mi"  # the configuration shrank below what the namespaces use
    d.start()
    assert d.identity.Probe(csi_pb2.ProbeRequest()).ready.value is False
    assert "enlarge --emulated-regions" in d.log.read_text()
