"""The cluster tier: a model shipped as an OCI image, mounted as a Kubernetes image
volume, staged by the sidecar onto a csi-pmem claim and loaded bit-exact.

Why here: image volumes (``volumes[].image``; GA in Kubernetes 1.36, no feature gate)
are mounted by the kubelet and the container runtime (containerd 2.1 or later), so only
a real kubelet and containerd show what the sidecar gets as its source: a read-only
directory of files owned by root, with the image's links as they were built. The NRI
test bed runs containerd 2.4.2 (up.sh E2E_NRI=1); Debian's 1.6 of the default bed has
no image volumes.

The image (images.sh, model_image.py) holds a small safetensors model in the ModelCar
layout (below /models, a shard that is a relative link into /blobs, a hidden file),
and nothing else: no entry point, no shell. A restricted pod (Pod Security
"restricted", uid 1000) mounts it read-only into the sidecar, as
deploy/examples/sources/image-volume.yaml does; the sidecar (a native sidecar, the
startupProbe on /readyz) stages it into a csi-pmem claim; the pod's container then loads
it through csi_pmem.loader (image_workload.py) and prints the SHA-256 of every tensor,
which must equal the bytes model_image.py defines. A second pod on the same claim finds
it staged and copies nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="pip install -e '.[e2e]'")
from test_cluster import (  # noqa: E402  (the same test bed helpers)
    DRIVER,
    DRIVER_NS,
    ENV_FILE,
    HERE,
    REPO,
    RESULTS,
    RESULTS_DIR,
    Cluster,
    _env,
    record,
    wait_until,
)

sys.path.insert(0, str(HERE))
import model_image  # noqa: E402

IV_NS = "csi-pmem-iv-e2e"     # Pod Security "restricted"
RELEASE = "csi-pmem-iv"
CLASS = "csi-pmem"            # the chart's devdax class
CLAIM = "model"
SOURCE = f"/source/{model_image.SOURCE}"
pytestmark = [
    pytest.mark.skipif(not ENV_FILE or not _env().get("MODEL_IMAGE"),
                       reason="needs the NRI test bed (containerd 2.x, the model image): "
                              "E2E_NRI=1 make e2e-cluster"),
    pytest.mark.timeout(600),
]


class IvCluster(Cluster):
    def model_pod(self, name: str) -> None:
        """The example's pod (deploy/examples/sources/image-volume.yaml) cut down to the
        test: the sidecar stages from the image volume, "load" checks the staged model."""
        sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "readOnlyRootFilesystem": True}
        sidecar = {
            "name": "weights", "image": self.env["WORKLOAD_IMAGE"],
            "imagePullPolicy": "Never", "restartPolicy": "Always",
            "command": ["csi-pmem-weights"],
            "args": ["sidecar", "--volume=/models", f"--source={SOURCE}",
                     f"--name={model_image.MODEL}", "--listen=:8081"],
            "ports": [{"name": "weights-http", "containerPort": 8081}],
            "startupProbe": {"httpGet": {"path": "/readyz", "port": 8081},
                             "periodSeconds": 1, "failureThreshold": 120},
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081},
                               "periodSeconds": 5},
            "securityContext": sc,
            "volumeMounts": [{"name": "weights", "mountPath": "/models"},
                             {"name": "model", "mountPath": "/source", "readOnly": True}]}
        load = {
            "name": "load", "image": self.env["WORKLOAD_IMAGE"], "imagePullPolicy": "Never",
            "command": ["python3", "/e2e/image_workload.py", "load"],
            "env": [{"name": "E2E_VOLUME", "value": "/models"},
                    {"name": "E2E_SOURCE", "value": SOURCE},
                    {"name": "E2E_MODEL", "value": model_image.MODEL}],
            "securityContext": sc,
            "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True},
                             {"name": "model", "mountPath": "/source", "readOnly": True},
                             {"name": "script", "mountPath": "/e2e", "readOnly": True},
                             {"name": "tmp", "mountPath": "/tmp"}]}
        self.core.create_namespaced_pod(IV_NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "csi-pmem-iv-e2e"}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                     "nodeSelector": {"kubernetes.io/hostname": self.node},
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "runAsGroup": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "initContainers": [sidecar], "containers": [load],
                     "volumes": [
                         {"name": "weights", "persistentVolumeClaim": {"claimName": CLAIM}},
                         {"name": "model", "image": {"reference": self.env["MODEL_IMAGE"],
                                                     "pullPolicy": "Never"}},
                         {"name": "script", "configMap": {"name": "e2e-iv-workload"}},
                         {"name": "tmp", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": "1Mi"}}]}})

    def iv_phase(self, name: str) -> str:
        return self.core.read_namespaced_pod(name, IV_NS).status.phase

    def iv_log(self, name: str, container: str) -> str:
        return self.core.read_namespaced_pod_log(name, IV_NS, container=container,
                                                 _preload_content=False).data.decode()

    def iv_events(self, name: str) -> str:
        return "\n".join(f"  {e.type} {e.reason}: {e.message}"
                         for e in self.events(IV_NS, name))

    def finished(self, name: str, timeout: float = 240) -> dict[str, Any]:
        """Wait for the pod to end; the load container's RESULT, the sidecar's events
        (its JSON log lines by message) and the seconds from create to the end."""
        t0 = time.monotonic()
        try:
            phase = wait_until(f"pod {name} to finish", lambda: self.iv_phase(name) in (
                "Succeeded", "Failed") and self.iv_phase(name), timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.iv_events(name)}") from None
        seconds = time.monotonic() - t0
        logs = self.iv_log(name, "load")
        lines = [ln for ln in logs.splitlines() if ln.startswith("RESULT ")]
        side = self.iv_log(name, "weights")
        assert lines, (f"{name} ({phase}) printed no RESULT:\n{logs}\n--- sidecar:\n{side}"
                       f"\n{self.iv_events(name)}")
        events: dict[str, dict[str, Any]] = {}
        for ln in side.splitlines():
            try:
                ev = json.loads(ln)
            except ValueError:
                continue
            if isinstance(ev, dict) and "msg" in ev:
                events.setdefault(ev["msg"], ev)
        run = {"phase": phase, "seconds": round(seconds, 1),
               "result": json.loads(lines[-1][len("RESULT "):]), "sidecar": events,
               "sidecar_log": side}
        # Everything the pod printed, beside results.json (kubelet deletes the logs).
        RUNS[name] = run
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / "image-volume-pods.json").write_text(
            json.dumps(RUNS, indent=2, sort_keys=True) + "\n")
        return run

    def remove(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, IV_NS, grace_period_seconds=1)
        wait_until(f"pod {name} gone", lambda: not self._exists(
            self.core.read_namespaced_pod, name, IV_NS), 120)


@pytest.fixture(scope="module")
def iv() -> IvCluster:
    return IvCluster()


@pytest.fixture(scope="module")
def iv_release(iv: IvCluster):
    k = iv
    env = k.env

    def image(prefix: str, ref: str) -> list[str]:
        repo, tag = ref.rsplit(":", 1)
        return ["--set", f"{prefix}.image.repository={repo}", "--set",
                f"{prefix}.image.tag={tag}", "--set", f"{prefix}.image.pullPolicy=Never"]

    k.run("helm", "install", RELEASE, str(REPO / "charts" / "csi-pmem"),
          "--namespace", DRIVER_NS, "--create-namespace",
          "-f", str(REPO / "charts" / "csi-pmem" / "ci" / "emulated-values.yaml"),
          "--set", f"kubeletDir={k.kubelet_dir}", "--set", f"stateDir={env['STATE_DIR']}",
          "--set", "driver.logFormat=text",
          "--set-json", "nodeSelector=" + json.dumps({"kubernetes.io/hostname": k.node}),
          *image("driver", env["DRIVER_IMAGE"]), *image("provisioner", env["PROVISIONER_IMAGE"]),
          *image("registrar", env["REGISTRAR_IMAGE"]),
          *image("livenessProbe", env["LIVENESSPROBE_IMAGE"]),
          "--wait", "--timeout", "5m")
    wait_until("driver pod ready", k.driver_ready, 180)
    k.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": IV_NS, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                  "pod-security.kubernetes.io/enforce-version": "latest"}}})
    k.core.create_namespaced_config_map(IV_NS, {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "e2e-iv-workload"},
        "data": {"image_workload.py": (HERE / "image_workload.py").read_text()}})
    wait_until("service account default", lambda: k.core.read_namespaced_service_account(
        "default", IV_NS), 60)
    k.core.create_namespaced_persistent_volume_claim(IV_NS, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
        "spec": {"storageClassName": CLASS, "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "64Mi"}}}})
    yield k
    k.save_driver_logs("image-volume-final")
    k.core.delete_collection_namespaced_pod(IV_NS, grace_period_seconds=1)
    wait_until("image-volume pods gone", lambda: not k.core.list_namespaced_pod(IV_NS).items,
               120)
    k.core.delete_collection_namespaced_persistent_volume_claim(IV_NS)
    wait_until("image-volume PVs gone", lambda: not [
        pv for pv in k.core.list_persistent_volume().items
        if pv.spec.csi and pv.spec.csi.driver == DRIVER], 180)
    k.core.delete_namespace(IV_NS)
    k.run("helm", "uninstall", RELEASE, "--namespace", DRIVER_NS, "--wait", "--timeout", "2m",
          check=False)


EXPECTED = model_image.expected()
STAGED_BYTES = sum(len(b) for b in model_image.files().values())
RUNS: dict[str, dict[str, Any]] = {}


def image_digest(k: IvCluster) -> str:
    """The model image's manifest digest in the node's containerd (what a user would
    pin in the pod spec, and pass as --revision)."""
    p = subprocess.run(["ctr", "--address", k.env["CONTAINERD_SOCK"], "-n", "k8s.io",
                        "images", "ls", f"name=={k.env['MODEL_IMAGE']}"],
                       capture_output=True, text=True, timeout=30, check=True)
    rows = [ln.split() for ln in p.stdout.splitlines()[1:] if ln.strip()]
    assert len(rows) == 1, p.stdout
    return rows[0][2]


def check_loaded(run: dict[str, Any]) -> dict[str, Any]:
    """What every pod's load must show: the model's bytes, exactly."""
    r = run["result"]
    assert "error" not in r, r["error"]
    # Every tensor: dtype, shape and bytes as model_image.py defines them.
    assert set(r["tensors"]) == set(EXPECTED["tensors"]), sorted(r["tensors"])
    wrong = {n: (r["tensors"][n], want) for n, want in EXPECTED["tensors"].items()
             if r["tensors"][n] != want}
    assert not wrong, f"tensors loaded with other dtype, shape or bytes: {wrong}"
    # The same bytes as the image's files hold, read in the pod without the loader.
    assert r["source_tensors"] == {n: t["sha256"] for n, t in EXPECTED["tensors"].items()}
    # The auxiliary files, staged whole and verified (read_aux), and nothing else: the
    # hidden file is skipped, the linked shard is staged under its own name.
    want_files = EXPECTED["files"]
    assert r["staged_files"] == sorted(want_files), r["staged_files"]
    assert r["aux"] == {n: h for n, h in want_files.items()
                        if not n.endswith(".safetensors")}, r["aux"]
    assert r["state"] == "committed"
    assert r["verify"]["rc"] == 0 and '"ok": true' in r["verify"]["out"], r["verify"]
    assert r["same_as_source"] and r["ok"], r
    assert run["phase"] == "Succeeded", run
    return r


def test_image_volume_is_staged_by_the_sidecar_and_loads_bit_exact(
        iv_release: IvCluster) -> None:
    k = iv_release
    k.model_pod("iv-first")
    run = k.finished("iv-first")
    r = check_loaded(run)
    # The source as the kubelet and containerd mounted it: read-only, owned by root,
    # the ModelCar layout with its relative link and its hidden file.
    assert r["uid"] == 1000 and r["gid"] == 1000
    assert r["source_write"] == "EROFS", r["source_write"]
    assert r["source_mount"]["options"].split(",")[0] == "ro", r["source_mount"]
    tree = r["source_tree"]
    link = f"{model_image.SOURCE}/{model_image.SHARDS[2]}"
    assert tree[link]["link"].startswith("../blobs/"), tree[link]
    assert f"{model_image.SOURCE}/.gitattributes" in tree
    assert all(e["uid"] == 0 and e["gid"] == 0 for e in tree.values()), tree
    assert {p.split("/")[0] for p in tree} == {"blobs", model_image.SOURCE}, sorted(tree)
    for fname, digest in EXPECTED["files"].items():
        entry = tree[f"{model_image.SOURCE}/{fname}"]
        if "link" in entry:
            entry = tree[os.path.normpath(f"{model_image.SOURCE}/{entry['link']}")]
        assert (entry["sha256"], entry["mode"]) == (digest, "0o644"), (fname, entry)
    # The sidecar copied the whole model once, from the image volume.
    ready = run["sidecar"].get("model ready")
    assert ready, run["sidecar_log"][-3000:]
    assert (ready["action"], ready["copied"], ready["reused"]) == (
        "staged", STAGED_BYTES, 0), ready
    startup = run["sidecar"].get("ready", {}).get("startup_seconds")
    record("image_volume", {
        "containerd": k.env.get("CONTAINERD_VERSION"), "image": k.env["MODEL_IMAGE"],
        "image_digest": image_digest(k), "source_mount": r["source_mount"],
        "model_bytes": STAGED_BYTES, "tensors": len(r["tensors"]),
        "files_staged": r["staged_files"], "revision": r["revision"],
        "first_pod": {"action": ready["action"], "copied": ready["copied"],
                      "sidecar_startup_seconds": startup,
                      "create_to_succeeded_seconds": run["seconds"]},
        "bit_exact": True})
    k.remove("iv-first")


def test_a_second_pod_finds_the_model_staged(iv_release: IvCluster) -> None:
    k = iv_release
    assert "iv-first" in RUNS, "needs the first pod's run"
    k.model_pod("iv-second")
    run = k.finished("iv-second")
    r = check_loaded(run)
    ready = run["sidecar"].get("model ready")
    assert ready, run["sidecar_log"][-3000:]
    assert (ready["action"], ready["copied"]) == ("already-staged", 0), ready
    assert r["revision"] == RUNS["iv-first"]["result"]["revision"]
    res = dict(RESULTS.get("image_volume", {}))
    res["second_pod"] = {"action": ready["action"], "copied": ready["copied"],
                         "sidecar_startup_seconds":
                             run["sidecar"].get("ready", {}).get("startup_seconds"),
                         "create_to_succeeded_seconds": run["seconds"]}
    record("image_volume", res)
    k.remove("iv-second")
