"""A second release of the chart for nodes that need other values (csiDriver.create).

Why: a DaemonSet has one pod template, so nodes with another kubelet dir or other
emulated pools need a DaemonSet of their own; the cluster tier's two-node test bed
installs one release per node (e2e/cluster/README.md, "Two nodes"). helm refuses to
install a release that renders an object another release owns, so the second release
must render none of the first's cluster-wide or namespaced objects: no CSIDriver, no
StorageClasses, its own RBAC, ServiceAccount, Service and DaemonSet. These tests render
both with ``helm template`` and hold them to that.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import test_chart
import yaml
from test_chart import CHART, EMULATED_VALUES, NAMESPACE, Manifests, render

from csi_pmem import DEFAULT_DRIVER_NAME

SECOND = ("--set", "csiDriver.create=false",
          "--set", "storageClasses.default.create=false",
          "--set", "storageClasses.fsdax.create=false",
          "--set-json", "storageClasses.perNuma=[]",
          "--set-json", "nodeSelector=" + json.dumps({"example.com/pmem-layout": "b"}),
          "--set-json", "backend.emulated.regions=" + json.dumps([{"numaNode": 1, "size": "4Gi"}]),
          "--set", "kubeletDir=/var/lib/kubelet-b", "--set", "stateDir=/var/lib/csi-pmem-b")

helm = test_chart.helm  # the session fixture that builds (or finds) helm


def render_release(helm: str, release: str, *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run([helm, "template", release, str(CHART), "--namespace", NAMESPACE,
                           "-f", str(EMULATED_VALUES), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def keys(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
            for d in docs}


def test_second_release_renders_no_object_of_the_first(helm: str) -> None:
    first = render_release(helm, "csi-pmem")
    second = render_release(helm, "csi-pmem-b", *SECOND)
    assert not keys(first) & keys(second), keys(first) & keys(second)
    kinds = {d["kind"] for d in second}
    assert "CSIDriver" not in kinds and "StorageClass" not in kinds, kinds
    assert {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds, kinds


def test_second_release_serves_its_nodes_with_its_own_values(helm: str) -> None:
    m = Manifests(render_release(helm, "csi-pmem-b", *SECOND))
    assert m.pod["nodeSelector"] == {"kubernetes.io/os": "linux",
                                     "example.com/pmem-layout": "b"}
    env = m.env("driver")
    assert env["CSI_PMEM_DRIVER_NAME"] == DEFAULT_DRIVER_NAME   # the one CSIDriver's name
    assert env["CSI_PMEM_EMULATED_REGIONS"] == "1=4Gi"
    assert env["CSI_PMEM_KUBELET_DIR"] == "/var/lib/kubelet-b"
    assert m.host_path("kubelet-dir") == "/var/lib/kubelet-b"
    assert m.host_path("plugin-dir") == f"/var/lib/kubelet-b/plugins/{DEFAULT_DRIVER_NAME}"
    assert m.host_path("registration-dir") == "/var/lib/kubelet-b/plugins_registry"
    assert m.host_path("state-dir") == "/var/lib/csi-pmem-b"
    # Its provisioner publishes its nodes' capacity, owned by its own DaemonSet.
    args = m.container("csi-provisioner")["args"]
    assert "--enable-capacity" in args and "--capacity-ownerref-level=1" in args, args


def test_csidriver_create_defaults_to_true_and_is_a_boolean(helm: str) -> None:
    assert Manifests(render(helm)).one("CSIDriver", DEFAULT_DRIVER_NAME)
    proc = subprocess.run([helm, "template", "csi-pmem", str(CHART),
                           "--set", "csiDriver.create=no"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "/csiDriver/create" in proc.stderr and "want boolean" in proc.stderr, proc.stderr
