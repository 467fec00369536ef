"""The cluster tier with the NRI plugin: devdax volumes as device nodes in the pod.

Why: whether a container gets the node, owned so that a restricted pod can open it,
with the device cgroup saying rw or r, is decided by the real runtime (containerd 2.x
with NRI, e2e/cluster/up.sh E2E_NRI=1), runc and kubelet's mounts; none of them runs in
the host tier, where nri/'s go tests check the plugin's decision.

Which device: the emulated back end has no devdax character device. With
backend.emulated.device=loop it hands out a loop block device over the volume's file,
the same device dax.sock passes; the plugin injects it at /dev/csi-pmem/<volume id>,
type "b". Node creation, ownership, the device-cgroup rule (rw, or r with "deny w") and
the keying on the kubelet mount source are the same code for a char /dev/daxX.Y (type
"c"; the decision is covered by the go tests, the publisher's naming by the unit tier):
no tier here runs a real devdax char device under Kubernetes.

Runs after test_cluster.py (run.sh E2E_NRI=1), with a release of its own: nri.enabled,
the loop device; at the end the plugin is turned off again (helm upgrade) and the
same claim behaves as without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="pip install -e '.[e2e]'")
from test_cluster import (  # noqa: E402  (the same test bed helpers)
    DRIVER,
    DRIVER_NS,
    ENV_FILE,
    HERE,
    REPO,
    Cluster,
    _env,
    record,
    wait_until,
)

NRI_NS = "csi-pmem-nri-e2e"   # Pod Security "restricted"
RELEASE = "csi-pmem-nri"
CLASS = "csi-pmem"            # the chart's devdax class (numaNode auto)
pytestmark = [
    pytest.mark.skipif(not ENV_FILE or _env().get("NRI") != "1",
                       reason="needs the NRI test bed: E2E_NRI=1 make e2e-cluster"),
    pytest.mark.timeout(600),
]


class NriCluster(Cluster):
    def pod2(self, name: str, claim: str | None, main: list[str],
             side: list[str] | None = None, readonly: bool = False,
             env: dict[str, str] | None = None) -> None:
        """A restricted pod: container "w" runs nri_workload.py ``main`` with the claim
        at /data; with ``side``, a second container "side" without the claim."""
        sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "readOnlyRootFilesystem": True}

        def container(cname: str, args: list[str], with_claim: bool) -> dict[str, Any]:
            mounts = [{"name": "script", "mountPath": "/e2e", "readOnly": True},
                      {"name": "tmp", "mountPath": "/tmp"}]
            if with_claim:
                mounts.append({"name": "data", "mountPath": "/data", "readOnly": readonly})
            return {"name": cname, "image": self.env["WORKLOAD_IMAGE"],
                    "imagePullPolicy": "Never",
                    "command": ["python3", "/e2e/nri_workload.py", *args],
                    "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                    "securityContext": sc, "volumeMounts": mounts}

        containers = [container("w", main, claim is not None)]
        if side is not None:
            containers.append(container("side", side, False))
        volumes: list[dict[str, Any]] = [
            {"name": "script", "configMap": {"name": "e2e-nri-workload"}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
        if claim is not None:
            volumes.append({"name": "data", "persistentVolumeClaim": {
                "claimName": claim, "readOnly": readonly}})
        self.core.create_namespaced_pod(NRI_NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "csi-pmem-nri-e2e"}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "runAsGroup": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": containers, "volumes": volumes}})

    def claim(self, name: str, size: str = "64Mi") -> None:
        self.core.create_namespaced_persistent_volume_claim(NRI_NS, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"storageClassName": CLASS, "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": size}}}})

    def phase_in(self, name: str) -> str:
        return self.core.read_namespaced_pod(name, NRI_NS).status.phase

    def clog(self, name: str, container: str = "w") -> str:
        return self.core.read_namespaced_pod_log(name, NRI_NS, container=container,
                                                 _preload_content=False).data.decode()

    def done(self, name: str, containers: tuple[str, ...] = ("w",),
             timeout: float = 180) -> dict[str, dict[str, Any]]:
        phase = wait_until(f"pod {name} to finish", lambda: self.phase_in(name) in (
            "Succeeded", "Failed") and self.phase_in(name), timeout)
        out = {}
        for c in containers:
            logs = self.clog(name, c)
            lines = [ln for ln in logs.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"{name}/{c} ({phase}) printed no RESULT:\n{logs}"
            out[c] = json.loads(lines[-1][len("RESULT "):])
        out["phase"] = {"phase": phase}
        return out

    def remove_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, NRI_NS, grace_period_seconds=1)
        wait_until(f"pod {name} gone", lambda: not self._exists(
            self.core.read_namespaced_pod, name, NRI_NS), 120)

    def nri_log(self) -> str:
        pod = self.driver_pod().metadata.name
        return self.run("kubectl", "-n", DRIVER_NS, "logs", pod, "-c", "nri").stdout

    def nri_status(self) -> Any:
        return next(c for c in self.driver_pod().status.container_statuses if c.name == "nri")


@pytest.fixture(scope="module")
def nk() -> NriCluster:
    return NriCluster()


def helm_values(k: NriCluster, nri: bool) -> list[str]:
    env = k.env

    def image(prefix: str, ref: str) -> list[str]:
        repo, tag = ref.rsplit(":", 1)
        return ["--set", f"{prefix}.image.repository={repo}", "--set",
                f"{prefix}.image.tag={tag}", "--set", f"{prefix}.image.pullPolicy=Never"]

    return ["--namespace", DRIVER_NS,
            "-f", str(REPO / "charts" / "csi-pmem" / "ci" / "emulated-values.yaml"),
            "--set", f"kubeletDir={k.kubelet_dir}", "--set", f"stateDir={env['STATE_DIR']}",
            "--set", "driver.logFormat=text", "--set", "backend.emulated.device=loop",
            "--set", f"nri.enabled={str(nri).lower()}",
            "--set", f"nri.socket={env['NRI_SOCKET']}",
            *image("driver", env["DRIVER_IMAGE"]), *image("provisioner", env["PROVISIONER_IMAGE"]),
            *image("registrar", env["REGISTRAR_IMAGE"]),
            *image("livenessProbe", env["LIVENESSPROBE_IMAGE"]), *image("nri", env["NRI_IMAGE"]),
            "--wait", "--timeout", "5m"]


@pytest.fixture(scope="module")
def nri_release(nk: NriCluster):
    k = nk
    t0 = time.monotonic()
    k.run("helm", "install", RELEASE, str(REPO / "charts" / "csi-pmem"), "--create-namespace",
          *helm_values(k, True))
    wait_until("driver pod ready", k.driver_ready, 180)
    record("nri_helm_install_to_ready_seconds", round(time.monotonic() - t0, 1))
    k.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": NRI_NS, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                   "pod-security.kubernetes.io/enforce-version": "latest"}}})
    k.core.create_namespaced_config_map(NRI_NS, {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "e2e-nri-workload"},
        "data": {"workload.py": (HERE / "workload.py").read_text(),
                 "nri_workload.py": (HERE / "nri_workload.py").read_text()}})
    wait_until("service account default", lambda: k.core.read_namespaced_service_account(
        "default", NRI_NS), 60)
    yield k
    k.save_driver_logs("nri-final")
    k.core.delete_collection_namespaced_pod(NRI_NS, grace_period_seconds=1)
    wait_until("NRI test pods gone", lambda: not k.core.list_namespaced_pod(NRI_NS).items, 120)
    k.core.delete_collection_namespaced_persistent_volume_claim(NRI_NS)
    wait_until("NRI test PVs gone", lambda: not [
        pv for pv in k.core.list_persistent_volume().items
        if pv.spec.csi and pv.spec.csi.driver == DRIVER], 180)
    k.core.delete_namespace(NRI_NS)
    k.run("helm", "uninstall", RELEASE, "--namespace", DRIVER_NS, "--wait", "--timeout", "2m",
          check=False)


STATE: dict[str, Any] = {}


def test_plugin_connected(nri_release: NriCluster) -> None:
    k = nri_release
    log = wait_until("the plugin's Synchronize", lambda: "synchronized" in k.nri_log()
                     and k.nri_log(), 60)
    assert "connection to the runtime closed" not in log, log
    record("nri_containerd_version", k.env.get("CONTAINERD_VERSION"))


def test_restricted_pod_opens_the_device_rw_and_a_later_pod_reads_it_back(
        nri_release: NriCluster) -> None:
    k = nri_release
    k.claim("dev")
    k.pod2("dev-writer", "dev", ["devwrite", "nri-A"], side=["nodev"])
    res = k.done("dev-writer", ("w", "side"))
    w, side = res["w"], res["side"]
    assert w["ok"] and res["phase"]["phase"] == "Succeeded", res
    node = w["meta"]["device_node"]
    vid = w["meta"]["volume_id"]
    # The emulated loop device, at the path volume.json names, owned by the pod's user.
    assert node["path"] == f"/dev/csi-pmem/{vid}" and node["type"] == "b", node
    assert w["device"] == {"type": "b", "uid": 1000, "gid": 1000, "mode": "0o660",
                           "rdev": f"{node['major']}:{node['minor']}"}, w["device"]
    assert w["uid"] == 1000
    # The host's device is that number (the driver's loop device of the volume).
    host_dev = w["meta"]["device"]
    st = os.stat(host_dev)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (node["major"], node["minor"]), \
        (host_dev, node)
    # The second container of the same pod does not mount the claim: no node.
    assert side["ok"] and side["found"] == [], side
    STATE["node"] = node
    STATE["vid"] = vid
    log = k.nri_log()
    assert "device injected" in log and vid in log and "access=rw" in log, log
    record("nri_injected", [ln for ln in log.splitlines() if "device injected" in ln])
    k.remove_pod("dev-writer")

    k.pod2("dev-reader", "dev", ["devread", "nri-A"])
    r = k.done("dev-reader")["w"]
    assert r["ok"] and r["same_bytes"], r
    assert r["meta"]["device_node"] == node
    k.remove_pod("dev-reader")


def test_read_only_claim_gets_the_device_read_only(nri_release: NriCluster) -> None:
    k = nri_release
    k.pod2("dev-ro", "dev", ["devro", "nri-A"], readonly=True)
    r = k.done("dev-ro")["w"]
    assert r["meta"]["readonly"] is True
    assert r["open_rdonly"] == "allowed", r
    # The device cgroup allows r only: EPERM, as for kubelet's read-only Block volumes.
    assert (r["open_rdwr"], r["open_wronly"]) == ("EPERM", "EPERM"), r
    assert r["ok"], r
    assert "access=r " in k.nri_log() or "access=r\n" in k.nri_log()
    k.remove_pod("dev-ro")


def test_a_pod_without_the_claim_cannot_open_the_device(nri_release: NriCluster) -> None:
    k = nri_release
    node = STATE["node"]
    k.pod2("no-claim", None, ["nodev", node["type"], str(node["major"]), str(node["minor"])])
    r = k.done("no-claim")["w"]
    # No node, and no way to make one (no CAP_MKNOD; the device cgroup would refuse too).
    assert r["ok"] and r["found"] == [] and r["mknod"] == "EPERM", r
    k.remove_pod("no-claim")


def test_plugin_restart_leaves_running_containers_alone(nri_release: NriCluster) -> None:
    k = nri_release
    k.pod2("dev-hold", "dev", ["devhold", "nri-B", "25"])
    wait_until("holder mapped", lambda: k.phase_in("dev-hold") == "Running"
               and "HOLDING" in k.clog("dev-hold"), 120)
    before = k.nri_status()
    restarts = before.restart_count
    cid = before.container_id.split("://", 1)[1]
    # Stop the plugin's process through our containerd; kubelet restarts the container.
    subprocess.run(["ctr", "--address", k.env["CONTAINERD_SOCK"], "-n", "k8s.io", "tasks",
                    "kill", "-s", "SIGKILL", cid], check=True, capture_output=True, timeout=30)
    wait_until("the plugin restarted", lambda: (s := k.nri_status()).restart_count > restarts
               and s.ready, 120)
    wait_until("the new plugin's Synchronize", lambda: "synchronized" in k.nri_log(), 60)
    log = k.nri_log()
    record("nri_after_restart", [ln for ln in log.splitlines() if "synchronized" in ln])
    # It reports the holder (created with its node) as fine: nothing without a node.
    assert "without_node=0" in log, log
    r = k.done("dev-hold", timeout=120)["w"]
    assert r["ok"] and r["ticks"] > 50 and r["failures"] == [], r
    record("nri_plugin_restart", {"holder_ticks": r["ticks"], "failures": len(r["failures"])})
    k.remove_pod("dev-hold")
    # And the restarted plugin injects again.
    k.pod2("dev-after", "dev", ["devread", "nri-B"])
    assert k.done("dev-after")["w"]["ok"]
    k.remove_pod("dev-after")


def test_after_unpublish_nothing_is_left(nri_release: NriCluster) -> None:
    k = nri_release
    pods_dir = str(Path(k.kubelet_dir) / "pods")
    # Kubelet unpublishes a deleted pod's volumes after the pod object is gone (its
    # volume manager runs on its own loop), so the last pod's mount may still be there.
    wait_until("no CSI mount left below kubelet's pods directory", lambda: not [
        m for m in k.mounts_below(pods_dir) if "kubernetes.io~csi" in m], 60)
    vid = STATE["vid"]
    k.core.delete_namespaced_persistent_volume_claim("dev", NRI_NS)
    wait_until("the volume deleted", lambda: vid not in json.dumps(k.driver_json("list")), 180)
    wait_until("no loop device of the test bed", lambda: not k.our_loop_devices(), 60)


def test_plugin_disabled_is_todays_behaviour(nri_release: NriCluster) -> None:
    k = nri_release
    k.save_driver_logs("nri-enabled")  # the plugin's log, before it goes
    old = k.driver_pod().metadata.uid
    k.run("helm", "upgrade", RELEASE, str(REPO / "charts" / "csi-pmem"), *helm_values(k, False))
    wait_until("the new driver pod without the plugin", lambda: (p := k.driver_ready())
               and p.metadata.uid != old and "nri" not in {
                   c.name for c in p.spec.containers}, 180)
    env = {e.name: e.value for e in next(c for c in k.driver_pod().spec.containers
                                         if c.name == "driver").env or []}
    assert "CSI_PMEM_DEVICE_NODE" not in env
    k.claim("plain")
    k.pod2("plain", "plain", ["nodev"])
    r = k.done("plain")["w"]
    assert r["ok"] and r["found"] == [], r
    # volume.json as today: no device_node; dax.sock works.
    k.pod2("plain-write", "plain", ["devwrite", "x"])
    w = k.done("plain-write")["w"]
    assert not w["ok"] and "device_node" not in w["meta"], w
    assert w["error"] == "volume.json has no device_node"
    k.pod2("plain-sock", "plain", ["write", "x"])
    assert k.done("plain-sock")["w"]["ok"]
    for name in ("plain", "plain-write", "plain-sock"):
        k.remove_pod(name)
