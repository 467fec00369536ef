"""The cluster tier's two-node scenarios: Kubernetes places volumes by capacity.

Why: WaitForFirstConsumer with storage capacity tracking exists to choose a node where
the volume fits, and on one node there is nothing to choose. Here up.sh (E2E_NODES=2)
runs two kubelets, each with its own containerd, bridge and kubelet dir, and the chart
is installed once per node (README.md, "Two nodes": a DaemonSet's pod template cannot
differ per node, and these two nodes differ in kubelet dir and pools):

- node A (release ``csi-pmem``, the CSIDriver and the StorageClasses): two pools of
  2 GiB, on NUMA nodes 0 and 2;
- node B (release ``csi-pmem-b``, ``csiDriver.create=false``, no classes): one pool of
  4 GiB on NUMA node 1.

So a 3Gi claim fits only on B (A's largest volume is one 2 GiB pool), ``numaNode: "1"``
only B serves and ``numaNode: "0"`` only A. Every placement below is the scheduler's,
from the CSIStorageCapacity objects each node's provisioner publishes; nothing of ours
chooses a node. Run by run.sh after test_cluster.py (whose release serves node A
only); numbers go to $E2E_RESULTS/results-two-nodes.json.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="pip install -e '.[e2e]'")
from kubernetes import client
from kubernetes.utils import parse_quantity
from test_cluster import (
    DRIVER,
    DRIVER_NS,
    NS,
    REPO,
    RESULTS_DIR,
    TOPOLOGY_KEY,
    Cluster,
    DuplicateCapacity,
    Mi,
    wait_until,
)

ENV_FILE = os.environ.get("E2E_CLUSTER_ENV", "")


def _two_nodes() -> bool:
    if not ENV_FILE:
        return False
    return "NODE_B_NAME=" in Path(ENV_FILE).read_text()


pytestmark = [
    pytest.mark.skipif(not ENV_FILE, reason="needs a running test bed: make e2e-cluster"),
    pytest.mark.skipif(ENV_FILE and not _two_nodes(),
                       reason="needs the two-node test bed (E2E_NODES=2)"),
    pytest.mark.timeout(600),
]

RELEASE_A, RELEASE_B = "csi-pmem", "csi-pmem-b"
CLASS_AUTO, CLASS_N0, CLASS_N1 = "csi-pmem", "csi-pmem-numa0", "csi-pmem-numa1"
CLASS_FSDAX = "csi-pmem-fsdax"
CLASSES = (CLASS_AUTO, CLASS_N0, CLASS_N1, CLASS_FSDAX)
GiB = 1024**3
POOLS_A = [{"numaNode": 0, "size": "2Gi"}, {"numaNode": 2, "size": "2Gi"}]
POOLS_B = [{"numaNode": 1, "size": "4Gi"}]
RESULTS: dict[str, Any] = {}
# {node: {class: (capacity, maximumVolumeSize)}} of the empty pools.
EMPTY: dict[str, dict[str, tuple[int, int | None]]] = {}


def record(key: str, value: Any) -> None:
    RESULTS[key] = value
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "results-two-nodes.json").write_text(
        json.dumps(RESULTS, indent=2, sort_keys=True) + "\n")


class TwoNodes(Cluster):
    """The cluster with node A (``self.node``, from test_cluster) and node B."""

    def __init__(self) -> None:
        super().__init__()
        self.node_b = self.env["NODE_B_NAME"]
        self.nodes = (self.node, self.node_b)
        self.kubelet_dirs = {self.node: self.env["KUBELET_DIR"],
                             self.node_b: self.env["NODE_B_KUBELET_DIR"]}
        self.state_dirs = {self.node: self.env["STATE_DIR"],
                           self.node_b: self.env["NODE_B_STATE_DIR"]}

    # -- node plugins
    def driver_pod_on(self, node: str) -> client.V1Pod:
        pods = [p for p in self.core.list_namespaced_pod(
            DRIVER_NS, label_selector="app.kubernetes.io/component=node",
            field_selector=f"spec.nodeName={node}").items
            if p.metadata.deletion_timestamp is None]
        assert len(pods) == 1, (node, [p.metadata.name for p in pods])
        return pods[0]

    def driver_ready_on(self, node: str) -> client.V1Pod | None:
        try:
            pod = self.driver_pod_on(node)
        except AssertionError:
            return None
        st = pod.status.container_statuses or []
        return pod if st and all(c.ready for c in st) else None

    def restarts_on(self, node: str) -> int:
        return sum(c.restart_count for c in self.driver_pod_on(node).status.container_statuses)

    def socket(self, node: str) -> str:
        return f"unix://{self.kubelet_dirs[node]}/plugins/{DRIVER}/csi.sock"

    def get_capacity(self, node: str, params: dict[str, str]) -> dict[str, Any]:
        """GetCapacity on the node plugin's own socket (from the host, with the
        project's CLI), with a class's parameters."""
        args = [a for k, v in sorted(params.items()) for a in ("-p", f"{k}={v}")]
        p = subprocess.run([str(REPO / ".venv" / "bin" / "csi-pmem"), "volume",
                            "--endpoint", self.socket(node), "capacity", "-o", "json", *args],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (node, params, p.stdout, p.stderr)
        return json.loads(p.stdout)

    def log_since(self, node: str, since: dt.datetime, container: str = "driver") -> list[str]:
        """A container's log lines of the node plugin pod on ``node`` from ``since`` on."""
        pod = self.driver_pod_on(node).metadata.name
        text = self.core.read_namespaced_pod_log(pod, DRIVER_NS, container=container,
                                                 timestamps=True,
                                                 _preload_content=False).data.decode()
        out = []
        for line in text.splitlines():
            stamp, _, rest = line.partition(" ")
            try:
                t = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            except ValueError:
                out.append(line)  # a continuation line (a traceback): keep it
                continue
            if t >= since:
                out.append(rest)
        return out

    # -- capacity
    def capacities_on(self, node: str) -> dict[str, tuple[int, int | None]]:
        out: dict[str, tuple[int, int | None]] = {}
        for c in self.storage.list_namespaced_csi_storage_capacity(DRIVER_NS).items:
            labels = (c.node_topology.match_labels or {}) if c.node_topology else {}
            if labels.get(TOPOLOGY_KEY) != node:
                continue
            if c.storage_class_name in out:
                raise DuplicateCapacity(f"two objects for {c.storage_class_name} on {node}")
            out[c.storage_class_name] = (
                int(parse_quantity(c.capacity)) if c.capacity is not None else -1,
                int(parse_quantity(c.maximum_volume_size))
                if c.maximum_volume_size is not None else None)
        return out

    def capacity_objects(self) -> dict[tuple[str, str], list[client.V1CSIStorageCapacity]]:
        out: dict[tuple[str, str], list[client.V1CSIStorageCapacity]] = {}
        for c in self.storage.list_namespaced_csi_storage_capacity(DRIVER_NS).items:
            labels = (c.node_topology.match_labels or {}) if c.node_topology else {}
            out.setdefault((labels.get(TOPOLOGY_KEY, ""), c.storage_class_name), []).append(c)
        return out

    # -- workloads
    def node_of(self, pod: str) -> str:
        return self.core.read_namespaced_pod(pod, NS).spec.node_name

    def claim_node(self, claim: str) -> str:
        """The node of the claim's PV, from its node affinity (what pins its pods)."""
        pvc = self.core.read_namespaced_persistent_volume_claim(claim, NS)
        pv = self.core.read_persistent_volume(pvc.spec.volume_name)
        values = {v for t in pv.spec.node_affinity.required.node_selector_terms
                  for e in t.match_expressions if e.key == TOPOLOGY_KEY for v in e.values}
        assert len(values) == 1, values
        return values.pop()

    def pinned(self, node: str) -> dict[str, str]:
        return {"kubernetes.io/hostname": node}

    def scheduling_failures(self, pod: str) -> list[str]:
        return [e.message or "" for e in self.events(NS, pod) if e.reason == "FailedScheduling"]


@pytest.fixture(scope="module")
def k() -> TwoNodes:
    return TwoNodes()


def helm_install(k: TwoNodes, release: str, node: str, pools: list[dict[str, Any]],
                 *extra: str) -> subprocess.Popen:
    env = k.env

    def image(prefix: str, ref: str) -> list[str]:
        repo, tag = ref.rsplit(":", 1)
        return ["--set", f"{prefix}.image.repository={repo}", "--set",
                f"{prefix}.image.tag={tag}", "--set", f"{prefix}.image.pullPolicy=Never"]

    cmd = [str(k.bin / "helm"), "install", release, str(REPO / "charts" / "csi-pmem"),
           "--namespace", DRIVER_NS, "--create-namespace",
           "-f", str(REPO / "charts" / "csi-pmem" / "ci" / "emulated-values.yaml"),
           "--set-json", "backend.emulated.regions=" + json.dumps(pools),
           "--set-json", "nodeSelector=" + json.dumps(k.pinned(node)),
           "--set", f"kubeletDir={k.kubelet_dirs[node]}",
           "--set", f"stateDir={k.state_dirs[node]}",
           "--set", "driver.logFormat=text",
           *image("driver", env["DRIVER_IMAGE"]),
           *image("provisioner", env["PROVISIONER_IMAGE"]),
           *image("registrar", env["REGISTRAR_IMAGE"]),
           *image("livenessProbe", env["LIVENESSPROBE_IMAGE"]),
           *extra, "--wait", "--timeout", "5m"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, KUBECONFIG=k.kubeconfig))


@pytest.fixture(scope="module")
def release(k: TwoNodes):
    """Both releases, installed at once; the workloads' namespace (Pod Security
    "restricted"). test_cluster.py's release and namespace must be gone first: its
    capacity objects are garbage-collected after its DaemonSet, and a namespace being
    deleted refuses new objects."""
    wait_until("test_cluster.py's capacity objects gone", lambda: not k.storage
               .list_namespaced_csi_storage_capacity(DRIVER_NS).items, 120)
    t0 = time.monotonic()
    procs = [
        helm_install(k, RELEASE_A, k.node, POOLS_A, "--set-json",
                     "storageClasses.perNuma=[0,1]"),
        helm_install(k, RELEASE_B, k.node_b, POOLS_B,
                     "--set", "csiDriver.create=false",
                     "--set", "storageClasses.default.create=false",
                     "--set", "storageClasses.fsdax.create=false",
                     "--set-json", "storageClasses.perNuma=[]"),
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{' '.join(p.args[:3])} failed:\n{out[-3000:]}"
    for node in k.nodes:
        wait_until(f"driver pod on {node} ready", lambda node=node: k.driver_ready_on(node),
                   180)
    record("helm_install_both_to_ready_seconds", round(time.monotonic() - t0, 1))
    k.workload_namespace()
    yield k
    out = RESULTS_DIR / "driver-logs"
    out.mkdir(parents=True, exist_ok=True)
    for node in k.nodes:
        try:
            pod = k.driver_pod_on(node).metadata.name
        except AssertionError:
            continue
        p = k.run("kubectl", "-n", DRIVER_NS, "logs", pod, "--all-containers", "--prefix",
                  "--timestamps", check=False)
        (out / f"two-nodes-{node}-{pod}.log").write_text(p.stdout + p.stderr)
    k.core.delete_collection_namespaced_pod(NS, grace_period_seconds=1)
    wait_until("test pods gone", lambda: not k.core.list_namespaced_pod(NS).items, 120)
    k.core.delete_collection_namespaced_persistent_volume_claim(NS)
    wait_until("test PVs gone", lambda: not [
        pv for pv in k.core.list_persistent_volume().items
        if pv.spec.csi and pv.spec.csi.driver == DRIVER], 180)
    k.core.delete_namespace(NS)
    for rel in (RELEASE_B, RELEASE_A):
        k.run("helm", "uninstall", rel, "--namespace", DRIVER_NS, "--wait",
              "--timeout", "2m", check=False)


def class_params(k: TwoNodes, cls: str) -> dict[str, str]:
    return dict(k.storage.read_storage_class(cls).parameters or {})


def cleanup(k: TwoNodes, pods: list[str], claims: list[str]) -> None:
    for p in pods:
        k.delete_pod(p, wait=False)
    for p in pods:
        k.delete_pod(p)
    pvs = [k.delete_pvc(c, wait=False) for c in claims]
    for c in claims:
        wait_until(f"claim {c} gone", lambda c=c: not k._exists(
            k.core.read_namespaced_persistent_volume_claim, c, NS), 120)
    for pv in pvs:
        if pv:
            wait_until(f"PV {pv} gone", lambda pv=pv: not k._exists(
                k.core.read_persistent_volume, pv), 180)


def settled_empty(k: TwoNodes) -> None:
    """Every capacity object back to the empty pools (deletions refresh them one by
    one: the provisioner throttles its writes)."""
    for node in k.nodes:
        wait_until(f"capacity objects on {node} back to the empty pools",
                   lambda node=node: k.capacities_on(node) == EMPTY[node], 120)


# ------------------------------------------------------------------ scenarios
def test_each_node_has_its_own_plugin_registered(release: TwoNodes) -> None:
    """One node plugin pod per node, each from its own release's DaemonSet, registered
    with its own kubelet (CSINode), both under the one CSIDriver."""
    k = release
    owners = {}
    for node in k.nodes:
        pod = k.driver_pod_on(node)
        owners[node] = [r.name for r in pod.metadata.owner_references]

        def registered(node: str = node) -> dict[str, Any] | None:
            obj = json.loads(k.run("kubectl", "get", "csinode", node, "-o", "json",
                                   check=False).stdout or "{}")
            return {d["name"]: d for d in obj.get("spec", {}).get("drivers") or []}.get(DRIVER)
        entry = wait_until(f"CSINode entry of {node}", registered, 60)
        assert entry["nodeID"] == node, entry
        labels = k.core.read_node(node).metadata.labels
        assert labels.get(TOPOLOGY_KEY) == node, labels
    assert owners[k.node] != owners[k.node_b], owners
    assert len(k.storage.list_csi_driver().items) == 1
    record("node_plugin_owners", owners)


def test_capacity_objects_match_get_capacity_on_each_node(release: TwoNodes) -> None:
    """One CSIStorageCapacity per class and node, equal to what that node's plugin
    answers to GetCapacity with the class's parameters on its own socket; and the pools
    differ as configured (A: two 2 GiB pools on NUMA 0 and 2; B: 4 GiB on NUMA 1)."""
    k = release

    def complete() -> dict[str, dict[str, tuple[int, int | None]]] | None:
        caps = {node: k.capacities_on(node) for node in k.nodes}
        return caps if all(set(CLASSES) <= set(c) for c in caps.values()) else None
    caps = wait_until("a capacity object per class on each node", complete, 120)
    answers: dict[str, dict[str, Any]] = {}
    for node in k.nodes:
        answers[node] = {}
        for cls in CLASSES:
            reply = k.get_capacity(node, class_params(k, cls))
            answers[node][cls] = reply
            want = (int(reply.get("available_capacity", 0)),
                    int(reply["maximum_volume_size"]) if reply.get("maximum_volume_size")
                    else 0)
            have = caps[node][cls]
            assert have[0] == want[0], (node, cls, have, reply)
            assert (have[1] or 0) == want[1], (node, cls, have, reply)
    record("capacity_per_node", {n: {c: list(v) for c, v in caps[n].items()} for n in caps})
    a, b = caps[k.node], caps[k.node_b]
    # A: numa0 one pool of ~2 GiB, no NUMA 1 pool, the auto class both pools but a
    # largest volume of one pool. B: one ~4 GiB pool on NUMA 1, nothing on NUMA 0.
    assert 0.97 * 2 * GiB <= a[CLASS_N0][0] <= 2 * GiB, a
    assert a[CLASS_N1][0] == 0, a
    assert a[CLASS_AUTO][0] == 2 * a[CLASS_N0][0] and a[CLASS_AUTO][1] == a[CLASS_N0][1], a
    assert b[CLASS_N0][0] == 0, b
    assert 0.97 * 4 * GiB <= b[CLASS_N1][0] <= 4 * GiB, b
    assert b[CLASS_AUTO] == b[CLASS_N1], b
    assert b[CLASS_AUTO][1] > 3 * GiB > (a[CLASS_AUTO][1] or 0), (a, b)
    for node, c in caps.items():
        EMPTY[node] = c


def test_claim_that_fits_only_on_b_binds_there(release: TwoNodes) -> None:
    """3Gi on the auto class: A has 4 GiB free but no pool holds 3 GiB (its capacity
    objects' maximumVolumeSize is one pool), B's one pool does."""
    k = release
    k.pvc("only-b", CLASS_AUTO, "3Gi")
    k.pod("only-b", "only-b", "write", "seed-only-b")
    res = k.wait_pod_done("only-b", 240)
    assert res["ok"] and res["phase"] == "Succeeded", res
    assert k.node_of("only-b") == k.node_b
    pvc = k.core.read_namespaced_persistent_volume_claim("only-b", NS)
    assert pvc.metadata.annotations["volume.kubernetes.io/selected-node"] == k.node_b
    assert k.claim_node("only-b") == k.node_b
    assert res["meta"]["numa_node"] == 1 and res["meta"]["usable_size"] >= 3 * GiB, res
    after = wait_until("B's capacity objects to shrink by the volume", lambda: (
        (c := k.capacities_on(k.node_b))[CLASS_AUTO][0] < EMPTY[k.node_b][CLASS_AUTO][0]
        and c), 90)
    assert k.capacities_on(k.node) == EMPTY[k.node]
    record("only_b", {"node": k.node_of("only-b"), "capacity_b_after": after[CLASS_AUTO]})
    cleanup(k, ["only-b"], ["only-b"])


def test_claim_that_fits_nowhere_stays_pending_without_driver_errors(
        release: TwoNodes) -> None:
    """5Gi fits neither node: the pod stays Pending with the scheduler's "did not have
    enough free storage" for both nodes; no node is selected, so no provisioner calls
    its driver, and neither driver logs an error (or the claim at all)."""
    k = release
    settled_empty(k)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    k.pvc("nowhere", CLASS_AUTO, "5Gi")
    k.pod("nowhere", "nowhere", "info")

    def failed() -> str | None:
        for msg in k.scheduling_failures("nowhere"):
            if re.search(r"0/2 nodes are available: 2 node\(s\) did not have enough free "
                         r"storage", msg):
                return msg
        return None
    msg = wait_until("FailedScheduling for both nodes", failed, 90)
    record("nowhere_event", msg)
    time.sleep(10)  # a window in which a wrong provisioning attempt would show
    assert k.phase("nowhere") == "Pending"
    pvc = k.core.read_namespaced_persistent_volume_claim("nowhere", NS)
    assert pvc.status.phase == "Pending"
    assert not (pvc.metadata.annotations or {}).get("volume.kubernetes.io/selected-node")
    assert not [e for e in k.events(NS, "nowhere") if e.reason == "ProvisioningFailed"]
    logs = {}
    for node in k.nodes:
        lines = k.log_since(node, since)
        bad = [ln for ln in lines if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", ln)]
        assert not bad, (node, bad[:5])
        # The PV name would be pvc-<claim UID>: no CreateVolume, not even a refused one.
        mentions = [ln for ln in lines if pvc.metadata.uid in ln]
        assert not mentions, (node, mentions[:3])
        # Nor a provisioner error about the claim (klog: E<mmdd> ...).
        prov = [ln for ln in k.log_since(node, since, "csi-provisioner")
                if re.match(r"E\d{4} ", ln) and f"{NS}/nowhere" in ln]
        assert not prov, (node, prov[:3])
        logs[node] = len(lines)
    record("nowhere_driver_log_lines", logs)
    cleanup(k, ["nowhere"], ["nowhere"])


def test_numa_classes_land_on_the_node_that_has_the_pool(release: TwoNodes) -> None:
    """numaNode "1": only B has a NUMA 1 pool (A's capacity object for the class is 0);
    numaNode "0": only A. Neither pod names a node."""
    k = release
    placed = {}
    for cls, numa, node in ((CLASS_N1, 1, k.node_b), (CLASS_N0, 0, k.node)):
        name = f"numa{numa}"
        k.pvc(name, cls, "64Mi")
        k.pod(name, name, "info")
        res = k.wait_pod_done(name)
        assert res["ok"], res
        assert res["meta"]["numa_node"] == numa, res
        assert k.node_of(name) == node and k.claim_node(name) == node
        placed[cls] = k.node_of(name)
    record("numa_class_nodes", placed)
    cleanup(k, ["numa1", "numa0"], ["numa1", "numa0"])


def test_pod_stays_on_its_volumes_node_when_recreated(release: TwoNodes) -> None:
    """A volume made on B (its first pod pinned there); the pod deleted and created
    again twice without any node preference lands on B each time, through the PV's
    node affinity, and reads the data back; one pinned to A stays Pending: A "didn't
    match PersistentVolume's node affinity"."""
    k = release
    k.pvc("pinned", CLASS_AUTO, "64Mi")
    k.pod("pinned-w", "pinned", "write", "seed-P", node_selector=k.pinned(k.node_b))
    res = k.wait_pod_done("pinned-w")
    assert res["ok"] and k.node_of("pinned-w") == k.node_b, res
    assert k.claim_node("pinned") == k.node_b
    k.delete_pod("pinned-w")
    nodes = []
    for i in range(2):
        name = f"pinned-r{i}"
        k.pod(name, "pinned", "read", "seed-P")
        res = k.wait_pod_done(name)
        assert res["ok"] and not res["mismatched_offsets"], res
        nodes.append(k.node_of(name))
        k.delete_pod(name)
    assert nodes == [k.node_b, k.node_b], nodes
    k.pod("pinned-a", "pinned", "read", "seed-P", node_selector=k.pinned(k.node))

    # The scheduler's reason for A (kube-scheduler's volumebinding ErrReasonNodeConflict);
    # B fails the pod's own node selector.
    def conflict() -> str | None:
        msgs = [m for m in k.scheduling_failures("pinned-a")
                if "1 node(s) didn't match PersistentVolume's node affinity" in m]
        return msgs[0] if msgs else None
    try:
        msg = wait_until("FailedScheduling: A does not match the PV's node affinity",
                         conflict, 90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; pod pinned-a {k.phase('pinned-a')} on "
                             f"{k.node_of('pinned-a')}:\n{k.describe('pinned-a')}") from None
    assert k.phase("pinned-a") == "Pending"
    record("pinned", {"recreated_on": nodes, "pinned_to_a_event": msg})
    cleanup(k, ["pinned-a"], ["pinned"])


def test_filling_a_sends_the_next_pods_to_b(release: TwoNodes) -> None:
    """Node A filled (two claims of a whole pool each, their pods pinned to A): once A's
    capacity objects say so, new pods whose claims would fit either empty node all go
    to B."""
    k = release
    settled_empty(k)
    whole = EMPTY[k.node][CLASS_AUTO][1]
    assert whole
    size = f"{whole // Mi}Mi"
    for i in range(2):
        k.pvc(f"fill-a{i}", CLASS_AUTO, size)
        k.pod(f"fill-a{i}", f"fill-a{i}", "info", node_selector=k.pinned(k.node))
        res = k.wait_pod_done(f"fill-a{i}", 240)
        assert res["ok"] and k.node_of(f"fill-a{i}") == k.node, res
    full = wait_until("A's capacity objects to show it full", lambda: (
        (c := k.capacities_on(k.node))[CLASS_AUTO][0] < 256 * Mi and c), 90)
    placed = []
    for i in range(3):
        name = f"next{i}"
        k.pvc(name, CLASS_AUTO, "256Mi")
        k.pod(name, name, "info")
        res = k.wait_pod_done(name, 240)
        assert res["ok"], res
        placed.append(k.node_of(name))
    record("filling_a", {"a_full_capacity": list(full[CLASS_AUTO]), "next_pods_on": placed})
    assert placed == [k.node_b] * 3, placed
    cleanup(k, [f"fill-a{i}" for i in range(2)] + [f"next{i}" for i in range(3)],
            [f"fill-a{i}" for i in range(2)] + [f"next{i}" for i in range(3)])


def test_deleting_node_plugin_on_a_leaves_its_capacity_stale_and_b_working(
        release: TwoNodes) -> None:
    """The node plugin pod on A deleted: A's capacity objects stay (owned by its
    DaemonSet) but nothing maintains them until the new pod is ready (stale); B's
    objects, B's plugin and provisioning on B carry on meanwhile: a claim that fits only
    on B, created right after the deletion, binds and its pod runs. Afterwards A's new
    provisioner maintains the same objects again (a numa0 claim shrinks them)."""
    k = release
    settled_empty(k)
    objs = k.capacity_objects()
    uids = {key: v[0].metadata.uid for key, v in objs.items() if key[0] in k.nodes}
    b_pod, b_restarts = k.driver_pod_on(k.node_b).metadata.name, k.restarts_on(k.node_b)
    old = k.driver_pod_on(k.node).metadata.name
    t0 = time.monotonic()
    k.core.delete_namespaced_pod(old, DRIVER_NS)
    k.pvc("during", CLASS_AUTO, "3Gi")
    k.pod("during", "during", "write", "seed-D")
    samples = []   # (t, every object of both nodes there with its UID, new A pod ready)
    ready_at = None
    while True:
        now = time.monotonic() - t0
        assert now < 180, f"A's node plugin not back after 180 s: {samples[-1:]}"
        cur = {key: [o.metadata.uid for o in v] for key, v in k.capacity_objects().items()}
        kept = all(cur.get(key) == [uid] for key, uid in uids.items())
        pod = k.driver_ready_on(k.node)
        ready = pod is not None and pod.metadata.name != old
        samples.append((now, kept, ready))
        if ready and ready_at is None:
            ready_at = now
        if ready_at is not None and now - ready_at >= 5:
            break
        time.sleep(0.2)
    res = k.wait_pod_done("during", 240)
    assert res["ok"] and k.node_of("during") == k.node_b, res
    assert all(kept for _, kept, _ in samples), [s for s in samples if not s[1]][:3]
    assert k.driver_pod_on(k.node_b).metadata.name == b_pod
    assert k.restarts_on(k.node_b) == b_restarts
    stale = round(ready_at, 2)
    # A maintained again, by the new pod's provisioner, on the same objects.
    k.pvc("after-a", CLASS_N0, "256Mi")
    k.pod("after-a", "after-a", "info")
    res = k.wait_pod_done("after-a")
    assert res["ok"] and k.node_of("after-a") == k.node, res
    wait_until("A's numa0 capacity object refreshed by the new provisioner", lambda:
               k.capacities_on(k.node)[CLASS_N0][0] < EMPTY[k.node][CLASS_N0][0], 90)
    final = {key: [o.metadata.uid for o in v] for key, v in k.capacity_objects().items()}
    assert all(final.get(key) == [uid] for key, uid in uids.items()), (uids, final)
    result = {"stale_seconds_until_new_a_pod_ready": stale, "samples": len(samples),
              "b_claim_node": k.node_of("during")}
    record("node_plugin_on_a_deleted", result)
    print(f"\nnode plugin on A deleted: {json.dumps(result)}")
    cleanup(k, ["during", "after-a"], ["during", "after-a"])


def test_no_leaks_on_either_node(release: TwoNodes) -> None:
    k = release
    wait_until("every PV of the driver deleted", lambda: not [
        pv for pv in k.core.list_persistent_volume().items
        if pv.spec.csi and pv.spec.csi.driver == DRIVER], 120)
    settled_empty(k)
    for node in k.nodes:
        kdir = k.kubelet_dirs[node]
        assert not [m for m in k.mounts_below(kdir + "/pods") if "kubernetes.io~csi" in m]
        assert not k.mounts_below(kdir + "/plugins/kubernetes.io/csi")
    assert not k.our_loop_devices(), k.our_loop_devices()
