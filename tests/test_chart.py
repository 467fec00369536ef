"""The Helm chart, the manifests rendered from it and the Dockerfile, checked without a cluster.

Why: the cluster tier (``make e2e-cluster``) installs the chart on a real kubelet, but it
takes many minutes and cannot say which of the chart's promises broke. These tests
render the chart with ``helm template`` and hold it to the facts the design rests on
(docs/design.md §2 and §5): the CSIDriver fields kubelet and the scheduler read,
hostPID for the dax.sock peer check, Bidirectional propagation on the kubelet
directory, external-provisioner in node-deployment mode with capacity tracking, RBAC
that covers exactly what that mode needs, StorageClasses that point at the driver.
They also check that the schema rejects bad values, that deploy/ is what the chart
renders, and that the cluster test bed runs the image the Dockerfile builds.

helm v3 comes from ``scripts/install-helm.sh`` (built from the Go module proxy, cached
outside the repo; ``HELM`` points at another binary). The tests skip only when the
proxy cannot provide helm (the script's exit status 3), with its reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from csi_pmem import DEFAULT_DRIVER_NAME
from csi_pmem.driver.config import DEFAULTS, env_name

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "csi-pmem"
EMULATED_VALUES = CHART / "ci" / "emulated-values.yaml"
MEMORY_VALUES = CHART / "ci" / "memory-values.yaml"
INSTALL_HELM = REPO / "scripts" / "install-helm.sh"
RENDER_DEPLOY = REPO / "scripts" / "render-deploy.sh"
DOCKERFILE = REPO / "Dockerfile"
CLUSTER_DIR = REPO / "e2e" / "cluster"
NAMESPACE = "csi-pmem"

# A cold helm build takes minutes on 2 cores; it happens inside the first test's setup.
pytestmark = pytest.mark.timeout(1800)


# --------------------------------------------------------------------------- helm


@pytest.fixture(scope="session")
def helm() -> str:
    given = os.environ.get("HELM")
    if given:
        return given
    proc = subprocess.run(["bash", str(INSTALL_HELM)], capture_output=True, text=True,
                          timeout=1700)
    if proc.returncode == 3:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        pytest.skip(f"the Go module proxy cannot provide helm: {tail}")
    assert proc.returncode == 0, f"scripts/install-helm.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def run_helm(helm: str, command: str, *args: str,
             chart: Path = CHART) -> subprocess.CompletedProcess:
    release = ["csi-pmem"] if command == "template" else []
    return subprocess.run([helm, command, *release, str(chart), *args], capture_output=True,
                          text=True, timeout=120)


def render(helm: str, *args: str, chart: Path = CHART) -> list[dict[str, Any]]:
    """``helm template`` into the csi-pmem namespace; the parsed documents."""
    proc = run_helm(helm, "template", "--namespace", NAMESPACE, *args, chart=chart)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


class Manifests:
    """Rendered objects, looked up by kind (and name)."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"want one {kind} {name or ''}, got {len(found)}"
        return found[0]

    @property
    def pod(self) -> dict[str, Any]:
        return self.one("DaemonSet")["spec"]["template"]["spec"]

    def container(self, name: str) -> dict[str, Any]:
        found = [c for c in self.pod["containers"] if c["name"] == name]
        assert len(found) == 1, [c["name"] for c in self.pod["containers"]]
        return found[0]

    def env(self, container: str) -> dict[str, Any]:
        return {e["name"]: e.get("value", e.get("valueFrom"))
                for e in self.container(container).get("env", [])}

    def host_path(self, volume: str) -> str:
        vols = {v["name"]: v for v in self.pod["volumes"]}
        return vols[volume]["hostPath"]["path"]

    def mounts(self, container: str) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.container(container).get("volumeMounts", [])}


@pytest.fixture(scope="session")
def default(helm: str) -> Manifests:
    return Manifests(render(helm))


@pytest.fixture(scope="session")
def emulated(helm: str) -> Manifests:
    return Manifests(render(helm, "-f", str(EMULATED_VALUES)))


GPU_COPY_ON = ("--set", "gpuCopy.enabled=true", "--set", "gpuCopy.runtimeClassName=nvidia")


@pytest.fixture(scope="session")
def gpu_copy(helm: str) -> Manifests:
    return Manifests(render(helm, *GPU_COPY_ON))


# --------------------------------------------------------------------------- lint


@pytest.mark.parametrize("args", [(), ("-f", str(EMULATED_VALUES)), GPU_COPY_ON,
                                  ("-f", str(MEMORY_VALUES)),
                                  ("-f", str(MEMORY_VALUES), "--set",
                                   "backend.memory.fs=hugetlbfs,backend.memory.pages=1G")],
                         ids=["default", "emulated", "gpu-copy", "memory", "memory-1G"])
def test_helm_lint_strict_is_clean(helm: str, args: tuple[str, ...]) -> None:
    proc = run_helm(helm, "lint", "--strict", *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out
    assert "1 chart(s) linted, 0 chart(s) failed" in out


# --------------------------------------------------------------------------- CSIDriver


def test_csidriver_fields(default: Manifests) -> None:
    spec = default.one("CSIDriver", DEFAULT_DRIVER_NAME)["spec"]
    assert spec["attachRequired"] is False          # node-local: no ControllerPublish
    assert spec["podInfoOnMount"] is True           # pod.uid for the dax.sock peer check
    assert spec["storageCapacity"] is True          # the scheduler reads CSIStorageCapacity
    # kubelet never chowns: the devdax tmpfs is sealed read-only; fsGroup reaches the
    # driver as volume_mount_group anyway (VOLUME_MOUNT_GROUP), which applies it.
    assert spec["fsGroupPolicy"] == "None"
    assert spec["volumeLifecycleModes"] == ["Persistent"]


def test_driver_has_volume_mount_group_so_fsgroup_needs_no_policy() -> None:
    """fsGroupPolicy None is only right because kubelet delegates fsGroup to drivers
    with VOLUME_MOUNT_GROUP whatever the policy (pkg/volume/csi/csi_mounter.go SetUpAt):
    without the capability fsdax Filesystem volumes would ignore the pod's fsGroup."""
    from csi_pmem.csi import csi_pb2
    from csi_pmem.driver.servicers.node import NodeServicer

    caps = NodeServicer(None).NodeGetCapabilities(  # type: ignore[arg-type]
        csi_pb2.NodeGetCapabilitiesRequest(), None).capabilities
    types = {c.rpc.type for c in caps}
    rpc = csi_pb2.NodeServiceCapability.RPC
    assert rpc.VOLUME_MOUNT_GROUP in types
    assert rpc.STAGE_UNSTAGE_VOLUME in types  # fsdax file systems are staged


# --------------------------------------------------------------------------- DaemonSet


def test_node_plugin_pod(default: Manifests) -> None:
    pod = default.pod
    assert pod["hostPID"] is True, "SO_PEERCRED pids must resolve in /proc (docs/design.md §2)"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == default.one("ServiceAccount")["metadata"]["name"]
    assert {c["name"] for c in pod["containers"]} == {
        "driver", "csi-provisioner", "node-driver-registrar", "liveness-probe"}
    assert pod["nodeSelector"]["kubernetes.io/os"] == "linux"
    ds = default.one("DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_driver_container(default: Manifests) -> None:
    driver = default.container("driver")
    assert driver["securityContext"]["privileged"] is True
    assert driver["command"] == ["csi-pmem", "serve"]
    env = default.env("driver")
    assert env["CSI_PMEM_NODE_ID"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["CSI_PMEM_ENDPOINT"] == "unix:///csi/csi.sock"
    assert env["CSI_PMEM_DRIVER_NAME"] == DEFAULT_DRIVER_NAME
    assert env["CSI_PMEM_KUBELET_DIR"] == "/var/lib/kubelet"
    assert env["CSI_PMEM_STATE_DIR"] == "/var/lib/csi-pmem"
    assert env["CSI_PMEM_BACKEND"] == "ndctl"
    assert env["CSI_PMEM_LOG_FORMAT"] == "json"
    assert env["CSI_PMEM_METRICS_ADDRESS"] == ":9670"
    assert "CSI_PMEM_EMULATED_REGIONS" not in env


@pytest.mark.parametrize("which", ["default", "emulated", "gpu_copy", "memory"])
def test_driver_env_names_are_real_flags(which: str, request: pytest.FixtureRequest) -> None:
    """Every CSI_PMEM_* variable the chart sets is one `csi-pmem serve` reads."""
    m: Manifests = request.getfixturevalue(which)
    known = {env_name(k) for k in DEFAULTS}
    names = {n for n in m.env("driver") if n.startswith("CSI_PMEM_")}
    assert names <= known, f"unknown driver variables: {sorted(names - known)}"


ERASE_FLAGS = {  # values.yaml key: (driver variable, default, an override)
    "eraseWorkers": ("CSI_PMEM_ERASE_WORKERS", "2", "3"),
    "eraseVerify": ("CSI_PMEM_ERASE_VERIFY", "sampled", "full"),
    "eraseWaitSeconds": ("CSI_PMEM_ERASE_WAIT_SECONDS", "5", "7"),
    "deleteWaitSeconds": ("CSI_PMEM_DELETE_WAIT_SECONDS", "30", "0"),
    "scrub": ("CSI_PMEM_SCRUB", "auto", "off"),
}


def serve_config_from(env: dict[str, Any]) -> Any:
    """What `csi-pmem serve` makes of the rendered CSI_PMEM_* variables (its own parser,
    so a value the chart renders but the driver refuses fails here)."""
    import argparse
    import unittest.mock

    from csi_pmem.driver import config

    plain = {k: v for k, v in env.items() if k.startswith("CSI_PMEM_") and isinstance(v, str)}
    with unittest.mock.patch.dict(os.environ, plain, clear=True):
        parser = argparse.ArgumentParser()
        config.add_serve_flags(parser)
        return config.from_args(parser.parse_args([]))


def test_erase_flags_render_as_the_driver_reads_them(helm: str, default: Manifests) -> None:
    env = default.env("driver")
    for key, (name, want, _) in ERASE_FLAGS.items():
        assert env[name] == want, key
    cfg = serve_config_from(env)
    assert (cfg.erase_workers, cfg.erase_verify, cfg.erase_wait_seconds,
            cfg.delete_wait_seconds, cfg.scrub) == (2, "sampled", 5.0, 30.0, "auto")
    sets = ",".join(f"driver.{key}={over}" for key, (_, _, over) in ERASE_FLAGS.items())
    env = Manifests(render(helm, "--set", sets)).env("driver")
    for key, (name, _, over) in ERASE_FLAGS.items():
        assert env[name] == over, key
    cfg = serve_config_from(env)
    assert (cfg.erase_workers, cfg.erase_verify, cfg.erase_wait_seconds,
            cfg.delete_wait_seconds, cfg.scrub) == (3, "full", 7.0, 0.0, "off")


def test_driver_mounts(default: Manifests) -> None:
    mounts = default.mounts("driver")
    kubelet = mounts["kubelet-dir"]
    assert kubelet["mountPath"] == "/var/lib/kubelet"
    assert kubelet["mountPropagation"] == "Bidirectional"
    assert default.host_path("kubelet-dir") == "/var/lib/kubelet"
    assert mounts["plugin-dir"]["mountPath"] == "/csi"
    assert default.host_path("plugin-dir") == f"/var/lib/kubelet/plugins/{DEFAULT_DRIVER_NAME}"
    assert mounts["dev"]["mountPath"] == "/dev" and default.host_path("dev") == "/dev"
    assert mounts["sys"]["mountPath"] == "/sys" and default.host_path("sys") == "/sys"
    assert mounts["state-dir"]["mountPath"] == "/var/lib/csi-pmem"
    assert default.host_path("state-dir") == "/var/lib/csi-pmem"
    # Only the privileged driver may propagate mounts to the host.
    for c in default.pod["containers"]:
        if c["name"] != "driver":
            assert all("mountPropagation" not in m for m in c.get("volumeMounts", [])), c["name"]
            assert c["securityContext"].get("privileged") is not True, c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]


def test_driver_reaches_fsdax_staging_and_block_paths(default: Manifests) -> None:
    """fsdax needs the driver to mount at kubelet's staging paths
    (<kubeletDir>/plugins/kubernetes.io/csi/<driver>/<hash>/globalmount), bind device
    nodes at the Block publish paths (<kubeletDir>/plugins/kubernetes.io/csi/
    volumeDevices/publish/<pv>/<pod uid>) and attach loop devices: one Bidirectional
    mount of the whole kubelet directory covers both (no other mount may shadow a part
    of it), and the host's /dev with a privileged container gives loop-control and new
    device nodes."""
    driver = default.container("driver")
    assert driver["securityContext"]["privileged"] is True
    mounts = default.mounts("driver")
    kubelet = "/var/lib/kubelet"
    for path in (f"{kubelet}/plugins/kubernetes.io/csi/{DEFAULT_DRIVER_NAME}/abc/globalmount",
                 f"{kubelet}/plugins/kubernetes.io/csi/volumeDevices/publish/pv/uid",
                 f"{kubelet}/plugins/kubernetes.io/csi/volumeDevices/staging/pv"):
        covering = [m for m in mounts.values()
                    if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
        deepest = max(covering, key=lambda m: len(m["mountPath"]))
        assert deepest["name"] == "kubelet-dir", (path, deepest)
        assert deepest["mountPropagation"] == "Bidirectional"
        assert not deepest.get("readOnly")
    assert default.host_path("kubelet-dir") == kubelet
    assert mounts["dev"]["mountPath"] == "/dev" and default.host_path("dev") == "/dev"
    assert not mounts["dev"].get("readOnly")


def test_liveness_goes_through_the_livenessprobe_sidecar(default: Manifests) -> None:
    driver = default.container("driver")
    probe = driver["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in driver["ports"]}
    port = ports[probe["port"]]  # a named port resolves in the probed container
    args = default.container("liveness-probe")["args"]
    assert f"--http-endpoint=:{port}" in args
    assert "--csi-address=/csi/csi.sock" in args


def test_registrar(default: Manifests) -> None:
    args = default.container("node-driver-registrar")["args"]
    assert "--csi-address=/csi/csi.sock" in args
    assert (f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DEFAULT_DRIVER_NAME}"
            "/csi.sock") in args
    assert default.mounts("node-driver-registrar")["registration-dir"]["mountPath"] == \
        "/registration"
    assert default.host_path("registration-dir") == "/var/lib/kubelet/plugins_registry"


def test_provisioner_node_deployment_with_capacity(default: Manifests) -> None:
    prov = default.container("csi-provisioner")
    assert re.search(r"/csi-provisioner:v6\.\d+\.\d+$", prov["image"]), prov["image"]
    args = prov["args"]
    for flag in ("--csi-address=/csi/csi.sock", "--node-deployment=true", "--strict-topology",
                 "--enable-capacity", "--extra-create-metadata"):
        assert flag in args, flag
    # The DaemonSet owns the capacity objects (external-provisioner's README for node
    # deployment), so a node-pod restart does not garbage-collect them.
    assert [a for a in args if a.startswith("--capacity-ownerref-level")] == \
        ["--capacity-ownerref-level=1"]
    # Topology is GA in external-provisioner v6 (on by default): no feature gate.
    assert not any(a.startswith("--feature-gates") for a in args), args
    assert not any(a.startswith("--leader-election") for a in args)
    env = default.env("csi-provisioner")
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}


CONTAINER_VALUES = {"driver": "driver", "csi-provisioner": "provisioner",
                    "node-driver-registrar": "registrar", "liveness-probe": "livenessProbe",
                    "gpu-copy": "gpuCopy", "nri": "nri"}


def test_security_contexts_default_and_override(helm: str) -> None:
    """Each container's securityContext is its value, the defaults are the ones the
    design needs (only the driver privileged), and a user's value overrides them."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    m = Manifests(render(helm, "--set", "gpuCopy.enabled=true", "--set", "nri.enabled=true"))
    assert {c["name"] for c in m.pod["containers"]} == set(CONTAINER_VALUES)
    for container, key in CONTAINER_VALUES.items():
        assert m.container(container)["securityContext"] == values[key]["securityContext"]
    assert m.container("driver")["securityContext"] == {"privileged": True}
    for container in ("csi-provisioner", "node-driver-registrar", "liveness-probe"):
        assert m.container(container)["securityContext"] == {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}, container
    # Helm merges a value into the default key by key; null drops a default key.
    restricted = {"runAsNonRoot": True, "runAsUser": 65532,
                  "seccompProfile": {"type": "RuntimeDefault"}}
    sets = [a for key in ("provisioner", "registrar", "livenessProbe") for a in (
        "--set-json", f"{key}.securityContext={json.dumps(restricted)}")]
    o = Manifests(render(helm, *sets, "--set-json",
                         'driver.securityContext={"seLinuxOptions": {"type": "spc_t"}}',
                         "--set-json", "registrar.securityContext.readOnlyRootFilesystem=null"))
    for container in ("csi-provisioner", "node-driver-registrar", "liveness-probe"):
        want = {**values[CONTAINER_VALUES[container]]["securityContext"], **restricted}
        if container == "node-driver-registrar":
            del want["readOnlyRootFilesystem"]
        assert o.container(container)["securityContext"] == want, container
    assert o.container("driver")["securityContext"] == {
        "privileged": True, "seLinuxOptions": {"type": "spc_t"}}


def test_kubelet_dir_is_one_value(helm: str) -> None:
    """k0s: every path below the kubelet directory follows the value, none is left over."""
    k0s = "/var/lib/k0s/kubelet"
    m = Manifests(render(helm, "--set", f"kubeletDir={k0s}/"))
    assert m.mounts("driver")["kubelet-dir"]["mountPath"] == k0s
    assert m.host_path("kubelet-dir") == k0s
    assert m.host_path("plugin-dir") == f"{k0s}/plugins/{DEFAULT_DRIVER_NAME}"
    assert m.host_path("registration-dir") == f"{k0s}/plugins_registry"
    assert m.env("driver")["CSI_PMEM_KUBELET_DIR"] == k0s
    assert "/var/lib/kubelet" not in yaml.safe_dump(m.one("DaemonSet"))


# --------------------------------------------------------------------------- NRI plugin


NRI_MAIN = REPO / "nri" / "cmd" / "csi-pmem-nri" / "main.go"


def test_nri_is_off_by_default(default: Manifests, emulated: Manifests) -> None:
    for m in (default, emulated):
        assert "nri" not in {c["name"] for c in m.pod["containers"]}
        assert "CSI_PMEM_DEVICE_NODE" not in m.env("driver")
        assert "nri-socket-dir" not in {v["name"] for v in m.pod["volumes"]}


def test_nri_container(helm: str) -> None:
    m = Manifests(render(helm, "-f", str(EMULATED_VALUES), "--set", "nri.enabled=true",
                         "--set", "kubeletDir=/var/lib/k0s/kubelet",
                         "--set", "nri.socket=/run/containerd/nri/nri.sock",
                         "--set-string", "nri.pluginIndex=10"))
    nri = m.container("nri")
    assert nri["image"].startswith("example.com/csi-pmem/csi-pmem-nri:")
    assert m.env("driver")["CSI_PMEM_DEVICE_NODE"] == "on"
    args = dict(a.split("=", 1) for a in nri["args"])
    assert args == {"--nri-socket": "/var/run/nri/nri.sock", "--idx": "10",
                    "--kubelet-dir": "/var/lib/k0s/kubelet", "--driver-name": DEFAULT_DRIVER_NAME}
    # Every flag the chart passes is one the plugin defines.
    flags = set(re.findall(r'flag\.String\("([a-z-]+)"', NRI_MAIN.read_text()))
    assert {a[2:] for a in args} <= flags, (args, flags)
    assert m.host_path("nri-socket-dir") == "/run/containerd/nri"
    mounts = m.mounts("nri")
    assert set(mounts) == {"nri-socket-dir", "kubelet-dir"}
    assert mounts["nri-socket-dir"]["mountPath"] == "/var/run/nri"
    # The publications at their host paths, the driver's tmpfs mounts propagated in;
    # read-only: the plugin writes nothing there.
    kd = mounts["kubelet-dir"]
    assert (kd["mountPath"], kd["mountPropagation"], kd["readOnly"]) == (
        "/var/lib/k0s/kubelet", "HostToContainer", True)
    sc = nri["securityContext"]
    assert sc.get("privileged") is not True and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True


# --------------------------------------------------------------------------- GPU copy


GPU_COPY_MAIN = REPO / "csi_pmem" / "gpucopy" / "main.py"


def gpu_copy_env_names() -> set[str]:
    """The variables `csi-pmem gpu-copy` reads: ENV + "..." and literal CSI_PMEM_* names."""
    text = GPU_COPY_MAIN.read_text()
    prefix = re.search(r'^ENV = "(CSI_PMEM_[A-Z_]+)"$', text, re.M)
    assert prefix, "csi_pmem/gpucopy/main.py no longer defines ENV"
    names = {prefix.group(1) + m for m in re.findall(r'ENV \+ "([A-Z_]+)"', text)}
    names |= set(re.findall(r'env\("(CSI_PMEM_[A-Z_]+)"', text))
    assert "CSI_PMEM_GPU_COPY_SOCKET" in names, names  # the pattern still finds them
    return names


def test_gpu_copy_is_off_by_default(helm: str, default: Manifests) -> None:
    assert "gpu-copy" not in {c["name"] for c in default.pod["containers"]}
    assert "CSI_PMEM_GPU_COPY_SOCKET" not in default.env("driver")
    assert "runtimeClassName" not in default.pod
    # A runtime class alone changes nothing: it belongs to the service.
    m = Manifests(render(helm, "--set", "gpuCopy.runtimeClassName=nvidia"))
    assert "runtimeClassName" not in m.pod
    assert "gpu-copy" not in {c["name"] for c in m.pod["containers"]}
    # Enabled without a runtime class: the node's default runtime (no field).
    m = Manifests(render(helm, "--set", "gpuCopy.enabled=true"))
    assert "runtimeClassName" not in m.pod
    assert m.container("gpu-copy")


def test_gpu_copy_container(gpu_copy: Manifests) -> None:
    pod = gpu_copy.pod
    assert pod["runtimeClassName"] == "nvidia"
    assert {c["name"] for c in pod["containers"]} == {
        "driver", "gpu-copy", "csi-provisioner", "node-driver-registrar", "liveness-probe"}
    svc = gpu_copy.container("gpu-copy")
    driver = gpu_copy.container("driver")
    # The same binary as the driver, run the same way (command, not the entrypoint).
    assert driver["command"] == ["csi-pmem", "serve"]
    assert svc["command"] == ["csi-pmem", "gpu-copy"]
    assert "args" not in svc
    env = gpu_copy.env("gpu-copy")
    socket_path = gpu_copy.env("driver")["CSI_PMEM_GPU_COPY_SOCKET"]
    assert env["CSI_PMEM_GPU_COPY_SOCKET"] == socket_path
    # The socket lies in the plugin directory, mounted at the same path in both.
    plugin = gpu_copy.mounts("driver")["plugin-dir"]["mountPath"]
    assert gpu_copy.mounts("gpu-copy")["plugin-dir"]["mountPath"] == plugin
    assert socket_path.startswith(plugin.rstrip("/") + "/")
    assert set(gpu_copy.mounts("gpu-copy")) == {"plugin-dir"}  # no hostPath of its own
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["CSI_PMEM_GPU_COPY_POLL_SECONDS"] == "2"
    assert env["CSI_PMEM_LOG_LEVEL"] == gpu_copy.env("driver")["CSI_PMEM_LOG_LEVEL"]
    assert env["CSI_PMEM_LOG_FORMAT"] == gpu_copy.env("driver")["CSI_PMEM_LOG_FORMAT"]
    # Asking for nvidia.com/gpu would take GPUs away from the inference pods.
    resources = svc["resources"]
    assert resources["requests"] == {"cpu": "50m", "memory": "128Mi"}
    assert "limits" not in resources
    assert not any(k.startswith("nvidia.com/") for part in resources.values() for k in part)
    sc = svc["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc.get("privileged") is not True
    assert sc["runAsUser"] == 0  # its socket is 0600 in the root-owned plugin directory
    assert all("mountPropagation" not in m for m in svc["volumeMounts"])
    # No other container sees the GPUs through the pod's runtime class.
    for c in pod["containers"]:
        if c["name"] != "gpu-copy":
            assert not any(e["name"].startswith("NVIDIA_") for e in c.get("env", [])), c["name"]


def test_gpu_copy_values(helm: str) -> None:
    m = Manifests(render(helm, *GPU_COPY_ON, "--set", "gpuCopy.logLevel=debug",
                         "--set-json", "gpuCopy.pollSeconds=0.5",  # --set: a string
                         "--set", "gpuCopy.maxClients=8",
                         "--set", "gpuCopy.visibleDevices=",
                         "--set", "gpuCopy.driverCapabilities=compute",
                         "--set-json",
                         'gpuCopy.extraEnv=[{"name": "CSI_PMEM_GPU_COPY_COPIER", '
                         '"value": "fake"}]'))
    env = m.env("gpu-copy")
    assert env["CSI_PMEM_LOG_LEVEL"] == "debug"
    assert m.env("driver")["CSI_PMEM_LOG_LEVEL"] == "info"
    assert env["CSI_PMEM_GPU_COPY_POLL_SECONDS"] == "0.5"
    assert env["CSI_PMEM_GPU_COPY_MAX_CLIENTS"] == "8"
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute"
    assert env["CSI_PMEM_GPU_COPY_COPIER"] == "fake"


def test_gpu_copy_image_defaults_to_the_driver_image(helm: str, gpu_copy: Manifests) -> None:
    driver, svc = gpu_copy.container("driver"), gpu_copy.container("gpu-copy")
    assert svc["image"] == driver["image"]
    assert svc["imagePullPolicy"] == driver["imagePullPolicy"]
    m = Manifests(render(helm, *GPU_COPY_ON, "--set", "driver.image.tag=dev",
                         "--set", "driver.image.pullPolicy=Always"))
    assert m.container("gpu-copy")["image"] == m.container("driver")["image"]
    assert m.container("driver")["image"].endswith(":dev")
    assert m.container("gpu-copy")["imagePullPolicy"] == "Always"
    m = Manifests(render(helm, *GPU_COPY_ON,
                         "--set", "gpuCopy.image.repository=registry.example/gpu-copy",
                         "--set", "gpuCopy.image.tag=1.2.3",
                         "--set", "gpuCopy.image.pullPolicy=Never"))
    assert m.container("gpu-copy")["image"] == "registry.example/gpu-copy:1.2.3"
    assert m.container("gpu-copy")["imagePullPolicy"] == "Never"
    assert m.container("driver")["image"] == driver["image"]
    # Its own repository without a tag: the chart's appVersion, like the driver's.
    m = Manifests(render(helm, *GPU_COPY_ON,
                         "--set", "gpuCopy.image.repository=registry.example/gpu-copy"))
    tag = driver["image"].rpartition(":")[2]
    assert m.container("gpu-copy")["image"] == f"registry.example/gpu-copy:{tag}"


def test_gpu_copy_env_names_are_real_flags(helm: str, gpu_copy: Manifests) -> None:
    """Every CSI_PMEM_* variable the chart sets on gpu-copy is one `csi-pmem gpu-copy`
    reads (the copier is chosen through extraEnv, so it counts too)."""
    known = gpu_copy_env_names()
    assert {"CSI_PMEM_GPU_COPY_SOCKET", "CSI_PMEM_GPU_COPY_COPIER",
            "CSI_PMEM_GPU_COPY_POLL_SECONDS", "CSI_PMEM_LOG_LEVEL",
            "CSI_PMEM_LOG_FORMAT"} <= known, known
    names = {n for n in gpu_copy.env("gpu-copy") if n.startswith("CSI_PMEM_")}
    assert names <= known, f"unknown gpu-copy variables: {sorted(names - known)}"
    # The socket variable is one name for both sides: the driver's flag reads it too.
    assert env_name("gpu_copy_socket") == "CSI_PMEM_GPU_COPY_SOCKET"


# --------------------------------------------------------------------------- back ends


def test_emulated_backend(emulated: Manifests) -> None:
    env = emulated.env("driver")
    assert env["CSI_PMEM_BACKEND"] == "emulated"
    assert env["CSI_PMEM_EMULATED_REGIONS"] == "0=2Gi,1=2Gi"
    assert env["CSI_PMEM_EMULATED_ROOT"] == "/var/lib/csi-pmem/emulated"  # on state-dir
    assert "CSI_PMEM_NDCTL" not in env


def test_emulated_root_elsewhere_is_mounted(helm: str) -> None:
    m = Manifests(render(helm, "-f", str(EMULATED_VALUES),
                         "--set", "backend.emulated.root=/dev/hugepages/csi-pmem"))
    assert m.env("driver")["CSI_PMEM_EMULATED_ROOT"] == "/dev/hugepages/csi-pmem"
    assert m.mounts("driver")["emulated-root"]["mountPath"] == "/dev/hugepages/csi-pmem"
    assert m.host_path("emulated-root") == "/dev/hugepages/csi-pmem"


# --------------------------------------------------------------------------- memory back end
# DRAM pools (issue 43, item 2): the driver's flags, the memory root on a Bidirectional
# hostPath, and requests derived from the pools so the scheduler sees their memory.

KUBE_UNITS = {"": 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def kube_bytes(quantity: str) -> int:
    """A rendered request ("8320Mi", "6Gi") as bytes; only binary suffixes are expected."""
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, f"not a whole binary quantity: {quantity!r}"
    return int(m.group(1)) * KUBE_UNITS[m.group(2) or ""]


def pools_json(pools: dict[int, str]) -> str:
    return "backend.memory.pools=" + json.dumps(
        [{"numaNode": n, "size": size} for n, size in pools.items()])


def render_memory(helm: str, *args: str) -> Manifests:
    return Manifests(render(helm, "-f", str(MEMORY_VALUES), *args))


@pytest.fixture(scope="session")
def memory(helm: str) -> Manifests:
    return render_memory(helm)


def test_memory_backend_renders_the_driver_flags(memory: Manifests) -> None:
    from csi_pmem.driver.backends.memory_sizing import parse_pools

    env = memory.env("driver")
    assert env["CSI_PMEM_BACKEND"] == "memory"
    assert env["CSI_PMEM_MEMORY_POOLS"] == "0=4Gi,1=4Gi"
    assert env["CSI_PMEM_MEMORY_ROOT"] == "/var/lib/csi-pmem/memory"
    assert env["CSI_PMEM_MEMORY_FS"] == "tmpfs"
    assert env["CSI_PMEM_MEMORY_PAGES"] == "2M"
    assert not {n for n in env if n.startswith(("CSI_PMEM_EMULATED_", "CSI_PMEM_NDCTL",
                                                "CSI_PMEM_DAXCTL"))}, sorted(env)
    # What `csi-pmem serve` makes of them, through its own parser.
    cfg = serve_config_from(env)
    assert cfg.backends == ("memory",)
    assert (cfg.memory_root, cfg.memory_fs, cfg.memory_pages) == (
        "/var/lib/csi-pmem/memory", "tmpfs", "2M")
    assert parse_pools(cfg.memory_pools) == {0: 4 * 1024**3, 1: 4 * 1024**3}


@pytest.mark.parametrize("fs,pages", [("tmpfs", "4k"), ("hugetlbfs", "2M"),
                                      ("hugetlbfs", "1G")])
def test_memory_file_system_and_pages_reach_the_driver(helm: str, fs: str, pages: str) -> None:
    m = render_memory(helm, "--set", f"backend.memory.fs={fs},backend.memory.pages={pages}",
                      "--set-json", pools_json({0: "2Gi", 1: "8Gi"}),
                      "--set", "backend.memory.root=/mnt/csi-pmem-pools/")
    cfg = serve_config_from(m.env("driver"))
    assert (cfg.memory_fs, cfg.memory_pages, cfg.memory_pools, cfg.memory_root) == (
        fs, pages, "0=2Gi,1=8Gi", "/mnt/csi-pmem-pools")


def covering_mount(m: Manifests, path: str) -> dict[str, Any]:
    """The driver's volume mount that a path inside the container lies on."""
    covering = [v for v in m.mounts("driver").values()
                if path == v["mountPath"] or path.startswith(v["mountPath"].rstrip("/") + "/")]
    return max(covering, key=lambda v: len(v["mountPath"]))


@pytest.mark.parametrize("root", ["", "/mnt/csi-pmem-pools"])
def test_memory_root_is_a_bidirectional_host_path(helm: str, root: str) -> None:
    """The pools' mounts must reach the host's mount table, so that they, and the
    volumes in them, outlive the driver container: the memory root is a hostPath of its
    own at the same path, Bidirectional (only a privileged container may have that), and
    no other mount of the driver shadows the pools' directories."""
    m = render_memory(helm, "--set", f"backend.memory.root={root}")
    want = root or "/var/lib/csi-pmem/memory"
    assert m.env("driver")["CSI_PMEM_MEMORY_ROOT"] == want
    mount = m.mounts("driver")["memory-root"]
    assert mount["mountPath"] == want
    assert mount["mountPropagation"] == "Bidirectional"
    assert not mount.get("readOnly")
    vols = {v["name"]: v for v in m.pod["volumes"]}
    assert vols["memory-root"]["hostPath"] == {"path": want, "type": "DirectoryOrCreate"}
    for node in (0, 1):
        assert covering_mount(m, f"{want}/region{node}")["name"] == "memory-root"
    assert m.container("driver")["securityContext"]["privileged"] is True
    # The state directory stays a mount of its own (the records must stay on disk).
    assert m.mounts("driver")["state-dir"]["mountPath"] == "/var/lib/csi-pmem"
    assert "mountPropagation" not in m.mounts("driver")["state-dir"]
    # Only the driver propagates mounts.
    for c in m.pod["containers"]:
        if c["name"] != "driver":
            assert all("mountPropagation" not in v for v in c.get("volumeMounts", [])), \
                c["name"]


@pytest.mark.parametrize("root", ["/var/lib/csi-pmem", "/var/lib", "/var/lib/kubelet",
                                  "/var/lib/kubelet/pools", "/var"])
def test_memory_root_must_be_a_directory_of_its_own(helm: str, root: str) -> None:
    proc = run_helm(helm, "template", "-f", str(MEMORY_VALUES),
                    "--set", f"backend.memory.root={root}")
    assert proc.returncode != 0, f"root {root} was accepted"
    assert f"backend.memory.root {root}: the pools are mounted there with Bidirectional " \
           "propagation" in proc.stderr, proc.stderr


GiB, MiB = 1024**3, 1024**2
DRIVER_OWN = 128 * MiB  # values.yaml driver.resources.requests.memory


@pytest.mark.parametrize("fs,pages,pools", [
    ("tmpfs", "2M", {0: "4Gi", 1: "4Gi"}),
    ("tmpfs", "4k", {0: "1000Mi", 1: "3Gi"}),  # 1000Mi: 992Mi, as the driver rounds
    ("tmpfs", "2M", {0: "1Ti", 1: "16777216"}),
    ("tmpfs", "2M", {1: "20480Ki"}),  # one pool, on node 1 only: 16Mi
    ("hugetlbfs", "2M", {0: "4Gi", 1: "2Gi"}),
    ("hugetlbfs", "2M", {0: "1000Mi"}),
    ("hugetlbfs", "1G", {0: "64Gi", 1: "1Ti"}),
])
def test_memory_requests_are_the_sum_of_the_pools(helm: str, fs: str, pages: str,
                                                  pools: dict[int, str]) -> None:
    """hugetlbfs pools: hugepages-<size> requests and limits equal to the pools (kubelet
    removes reserved huge pages from allocatable memory and sets the pod's hugetlb
    limit to its request); tmpfs pools: the memory request is the driver's own plus the
    pools. Each pool counts as the driver sizes it (rounded down to 16Mi); the sums are
    computed here from the pools, independently of the chart."""
    from csi_pmem.driver.backends.memory_sizing import parse_pools
    from csi_pmem.sizes import REGION_ALIGN, round_down

    spec = ",".join(f"{n}={s}" for n, s in pools.items())
    want = sum(round_down(b, REGION_ALIGN) for b in parse_pools(spec).values())
    m = render_memory(helm, "--set", f"backend.memory.fs={fs},backend.memory.pages={pages}",
                      "--set-json", pools_json(pools))
    res = m.container("driver")["resources"]
    assert m.env("driver")["CSI_PMEM_MEMORY_POOLS"] == spec
    assert res["requests"]["cpu"] == "50m"
    if fs == "hugetlbfs":
        key = {"2M": "hugepages-2Mi", "1G": "hugepages-1Gi"}[pages]
        assert kube_bytes(res["requests"][key]) == want
        assert kube_bytes(res["limits"][key]) == want
        assert kube_bytes(res["requests"]["memory"]) == DRIVER_OWN
        assert set(res["requests"]) == {"cpu", "memory", key}
        assert set(res["limits"]) == {key}
    else:
        assert kube_bytes(res["requests"]["memory"]) == DRIVER_OWN + want
        assert not [k for k in res["requests"] if k.startswith("hugepages-")]
        assert "limits" not in res  # no memory limit by default, pools or not


def test_memory_requests_render_readably(helm: str, memory: Manifests) -> None:
    assert memory.container("driver")["resources"] == {
        "requests": {"cpu": "50m", "memory": "8320Mi"}}
    m = render_memory(helm, "--set", "backend.memory.fs=hugetlbfs,backend.memory.pages=1G")
    assert m.container("driver")["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi", "hugepages-1Gi": "8Gi"},
        "limits": {"hugepages-1Gi": "8Gi"}}


def test_memory_pools_are_added_to_the_drivers_own_resources(helm: str) -> None:
    """The driver's own request (and a memory limit, when one is set) stay, with the
    tmpfs pools on top; other resources pass through."""
    m = render_memory(helm, "--set", "driver.resources.requests.memory=1Gi",
                      "--set", "driver.resources.limits.memory=2Gi",
                      "--set", "driver.resources.limits.cpu=2",
                      "--set-json", pools_json({0: "3Gi", 1: "5Gi"}))
    res = m.container("driver")["resources"]
    assert kube_bytes(res["requests"]["memory"]) == 9 * GiB
    assert kube_bytes(res["limits"]["memory"]) == 10 * GiB
    assert str(res["limits"]["cpu"]) == "2"
    # Without a request of its own the driver requests the pools alone.
    m = render_memory(helm, "--set", "driver.resources.requests.memory=null")
    assert kube_bytes(m.container("driver")["resources"]["requests"]["memory"]) == 8 * GiB


@pytest.mark.parametrize("args,message", [
    # A share: the chart cannot know the node's memory.
    (("--set", "backend.type=memory"),
     "backend.memory.pools: 0=50%,1=50% is a share of a NUMA node's memory, which the "
     "chart cannot know"),
    (("-f", "MEMORY", "--set-json", pools_json({0: "64Gi", 1: "25.5%"})),
     "backend.memory.pools: 1=25.5% is a share of a NUMA node's memory"),
    # poolsTotal next to sizes would be a second value to keep in step.
    (("-f", "MEMORY", "--set", "backend.memory.poolsTotal=8Gi"),
     "backend.memory.poolsTotal: set to 8Gi, but every pool has a size, and the chart "
     "requests their sum itself (8Gi); remove poolsTotal"),
    (("-f", "MEMORY", "--set-json", pools_json({0: "8Mi"})),
     "backend.memory.pools: NUMA node 0: a pool of 8Mi is smaller than 16Mi"),
    (("-f", "MEMORY", "--set", "backend.memory.fs=hugetlbfs,backend.memory.pages=1G",
      "--set-json", pools_json({0: "1536Mi"})),
     "backend.memory.pools: NUMA node 0: a pool of 1536Mi is not a whole number of 1G "
     "huge pages"),
    (("-f", "MEMORY", "--set", "backend.memory.fs=hugetlbfs",
      "--set", "driver.resources.limits.hugepages-2Mi=1Gi"),
     "driver.resources: hugepages-2Mi is the sum of backend.memory.pools, set by the chart"),
    (("-f", "MEMORY", "--set", "driver.resources.requests.memory=0.5Gi"),
     'driver.resources.requests.memory: "0.5Gi" is not a size in bytes, Ki, Mi, Gi or Ti'),
    (("--set", "backend.type=memory,backend.memory.fs=hugetlbfs,backend.memory.pages=1G",
      "--set", "backend.memory.poolsTotal=1536Mi"),
     "backend.memory.poolsTotal: 1536Mi is not a whole number of 1G huge pages"),
    (("-f", "MEMORY", "--set-json",
      'backend.memory.pools=[{"numaNode": 0, "size": "1Gi"}, '
      '{"numaNode": 0, "size": "2Gi"}]'),
     "backend.memory.pools: NUMA node 0 has two pools (1Gi and 2Gi)"),
    (("-f", "MEMORY", "--set", "backend.memory.fs=hugetlbfs",
      "--set-json", "driver.resources=null"),
     "driver.resources: the driver requests hugepages-2Mi for its hugetlbfs pools, and "
     "Kubernetes refuses a container that requests huge pages without a cpu or memory "
     "request"),
], ids=["shares", "one-share", "total-with-sizes", "tiny", "1G-not-whole", "hugepages-given",
        "own-request-unparsed", "total-not-whole-pages", "node-twice", "hugepages-alone"])
def test_memory_values_the_chart_cannot_request_fail_the_render(
        helm: str, args: tuple[str, ...], message: str) -> None:
    args = tuple(str(MEMORY_VALUES) if a == "MEMORY" else a for a in args)
    proc = run_helm(helm, "template", *args)
    assert proc.returncode != 0, "rendered"
    assert message in proc.stderr, proc.stderr
    if "share" in message:
        assert "give each pool as a size (for example 64Gi), or set " \
               "backend.memory.poolsTotal" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fs,key", [("tmpfs", "memory"), ("hugetlbfs", "hugepages-2Mi")])
def test_memory_share_with_pools_total_requests_it(helm: str, fs: str, key: str) -> None:
    m = Manifests(render(helm, "--set", f"backend.type=memory,backend.memory.fs={fs}",
                         "--set", "backend.memory.poolsTotal=256Gi"))
    res = m.container("driver")["resources"]
    assert m.env("driver")["CSI_PMEM_MEMORY_POOLS"] == "0=50%,1=50%"
    own = DRIVER_OWN if key == "memory" else 0
    assert kube_bytes(res["requests"][key]) == 256 * GiB + own
    if key.startswith("hugepages-"):
        assert kube_bytes(res["limits"][key]) == 256 * GiB


@pytest.mark.parametrize("setting,path", [
    ("backend.memory.fs=ramfs", "/backend/memory/fs"),
    ("backend.memory.pages=2Mi", "/backend/memory/pages"),
    ("backend.memory.pages=1G", "/backend/memory/pages"),  # tmpfs has no 1G pages
    ("backend.memory.fs=hugetlbfs,backend.memory.pages=4k", "/backend/memory/pages"),
    ("backend.memory.poolsTotal=1.5Ti", "/backend/memory/poolsTotal"),
    ("backend.memory.root=pools", "/backend/memory/root"),
    ("backend.memory.size=4Gi", "size"),  # a typo is an error
])
def test_schema_rejects_bad_memory_values(helm: str, setting: str, path: str) -> None:
    proc = run_helm(helm, "template", "-f", str(MEMORY_VALUES), "--set", setting)
    assert proc.returncode != 0, f"{setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert path in proc.stderr, proc.stderr


@pytest.mark.parametrize("size", ["4GB", "150%", "0.5Gi", "-1Gi", "50 %", "0%", "0.0%",
                                  "100.5%", "00%"])
def test_schema_rejects_bad_memory_pool_sizes(helm: str, size: str) -> None:
    proc = run_helm(helm, "template", "-f", str(MEMORY_VALUES),
                    "--set-json", pools_json({0: size}))
    assert proc.returncode != 0, f"{size} was accepted"
    assert "/backend/memory/pools/0/size" in proc.stderr, proc.stderr


@pytest.mark.parametrize("variant", ["default", "emulated"])
def test_other_back_ends_render_as_before(helm: str, variant: str) -> None:
    """Without backend.type memory nothing of it renders: no memory variables, no
    memory root, the driver's resources are driver.resources as given, and the render
    is the one deploy/ holds, rendered before the memory back end existed (also
    checked byte for byte by test_deploy_manifests_are_in_sync)."""
    m = Manifests(render(helm, "-f", str(CHART / "ci" / f"{variant}-values.yaml")))
    assert not [n for n in m.env("driver") if n.startswith("CSI_PMEM_MEMORY_")]
    assert "memory-root" not in m.mounts("driver")
    assert "memory-root" not in {v["name"] for v in m.pod["volumes"]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert m.container("driver")["resources"] == values["driver"]["resources"]
    deploy = {"default": "csi-pmem.yaml", "emulated": "csi-pmem-emulated.yaml"}[variant]
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / deploy).read_text())
            if d and d["kind"] != "Namespace"]
    assert m.docs == docs


def test_memory_values_of_another_back_end_change_nothing(helm: str,
                                                          emulated: Manifests) -> None:
    m = Manifests(render(helm, "-f", str(EMULATED_VALUES),
                         "--set-json", pools_json({0: "50%"}),
                         "--set", "backend.memory.fs=hugetlbfs"))
    assert m.docs == emulated.docs


# --------------------------------------------------------------------------- classes


FSTYPE = "csi.storage.k8s.io/fstype"


def check_class(sc: dict[str, Any], driver_name: str, numa: str, mode: str = "devdax",
                fs_type: str | None = None) -> None:
    assert sc["provisioner"] == driver_name
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert sc["allowVolumeExpansion"] is False
    assert sc["parameters"]["numaNode"] == numa
    assert sc["parameters"]["deviceMode"] == mode
    assert all(isinstance(v, str) for v in sc["parameters"].values()), sc["parameters"]
    if mode == "fsdax":
        assert "align" not in sc["parameters"]  # the driver refuses align for fsdax
        assert sc["parameters"].get(FSTYPE) == fs_type
    else:
        assert FSTYPE not in sc["parameters"] and "mountOptions" not in sc


def test_default_storage_classes(default: Manifests) -> None:
    driver_name = default.one("CSIDriver")["metadata"]["name"]
    classes = default.all("StorageClass")
    assert [c["metadata"]["name"] for c in classes] == ["csi-pmem", "csi-pmem-fsdax"]
    check_class(classes[0], driver_name, "auto")
    check_class(classes[1], driver_name, "auto", "fsdax", "ext4")
    for c in classes:  # not the cluster default unasked
        assert "annotations" not in c["metadata"]
    assert "mountOptions" not in classes[1]


def test_per_numa_storage_classes(emulated: Manifests) -> None:
    driver_name = emulated.one("CSIDriver")["metadata"]["name"]
    classes = {c["metadata"]["name"]: c for c in emulated.all("StorageClass")}
    assert set(classes) == {"csi-pmem", "csi-pmem-numa0", "csi-pmem-numa1", "csi-pmem-fsdax"}
    check_class(classes["csi-pmem"], driver_name, "auto")
    check_class(classes["csi-pmem-numa0"], driver_name, "0")
    check_class(classes["csi-pmem-numa1"], driver_name, "1")
    check_class(classes["csi-pmem-fsdax"], driver_name, "auto", "fsdax", "ext4")


def test_fsdax_storage_classes(helm: str) -> None:
    m = Manifests(render(helm, "--set-json", "storageClasses.fsdax.perNuma=[0,1]",
                         "--set", "storageClasses.fsdax.fsType=xfs",
                         "--set-json", 'storageClasses.fsdax.mountOptions=["noatime"]',
                         "--set", "storageClasses.eraseOnDelete=false",
                         "--set", "storageClasses.reclaimPolicy=Retain"))
    driver_name = m.one("CSIDriver")["metadata"]["name"]
    classes = {c["metadata"]["name"]: c for c in m.all("StorageClass")}
    assert set(classes) == {"csi-pmem", "csi-pmem-fsdax", "csi-pmem-fsdax-numa0",
                            "csi-pmem-fsdax-numa1"}
    for name, numa in (("csi-pmem-fsdax", "auto"), ("csi-pmem-fsdax-numa0", "0"),
                       ("csi-pmem-fsdax-numa1", "1")):
        sc = classes[name]
        check_class(sc, driver_name, numa, "fsdax", "xfs")
        assert sc["mountOptions"] == ["noatime"]
        assert sc["parameters"]["eraseOnDelete"] == "false"
        assert sc["reclaimPolicy"] == "Retain"
    assert classes["csi-pmem"]["parameters"]["eraseOnDelete"] == "false"
    assert "mountOptions" not in classes["csi-pmem"]

    # fsType "": no fstype parameter at all (the driver then makes ext4).
    m = Manifests(render(helm, "--set", "storageClasses.fsdax.fsType="))
    check_class(m.one("StorageClass", "csi-pmem-fsdax"), driver_name, "auto", "fsdax", None)
    # Off; only the per-NUMA ones; a custom name as the cluster default.
    m = Manifests(render(helm, "--set", "storageClasses.fsdax.create=false"))
    assert [c["metadata"]["name"] for c in m.all("StorageClass")] == ["csi-pmem"]
    m = Manifests(render(helm, "--set", "storageClasses.fsdax.create=false",
                         "--set", "storageClasses.default.create=false",
                         "--set-json", "storageClasses.fsdax.perNuma=[2]",
                         "--set", "storageClasses.fsdax.perNumaNamePrefix=pmem-fs-"))
    check_class(m.one("StorageClass"), driver_name, "2", "fsdax", "ext4")
    assert m.one("StorageClass")["metadata"]["name"] == "pmem-fs-2"
    m = Manifests(render(helm, "--set", "storageClasses.fsdax.name=pmem-files",
                         "--set", "storageClasses.fsdax.isDefaultClass=true"))
    sc = m.one("StorageClass", "pmem-files")
    assert sc["metadata"]["annotations"] == {"storageclass.kubernetes.io/is-default-class": "true"}
    assert "annotations" not in m.one("StorageClass", "csi-pmem")["metadata"]


@pytest.mark.parametrize("settings, message", [
    (["storageClasses.default.isDefaultClass=true", "storageClasses.fsdax.isDefaultClass=true"],
     "one default StorageClass"),
    (["storageClasses.fsdax.name=csi-pmem"], "two StorageClasses of this chart are named csi-pmem"),
    (["storageClasses.perNuma={0}", "storageClasses.fsdax.perNumaNamePrefix=csi-pmem-numa",
      "storageClasses.fsdax.perNuma={0}"], "named csi-pmem-numa0"),
])
def test_conflicting_classes_fail_the_render(helm: str, settings: list[str],
                                             message: str) -> None:
    proc = run_helm(helm, "template", *[a for s in settings for a in ("--set", s)])
    assert proc.returncode != 0, settings
    assert message in proc.stderr, proc.stderr


def test_fsdax_classes_take_block_and_their_file_system(helm: str) -> None:
    """What external-provisioner and kubelet send for an fsdax class passes the driver's
    checks: the parameters (fstype included: a csi.storage.k8s.io/ key), a Block
    capability, and a mount capability with the class's fstype (which the provisioner
    moves into the PV's fsType)."""
    from csi_pmem.csi import csi_pb2
    from csi_pmem.driver.params import FSDAX, parse
    from csi_pmem.driver.servicers.capabilities import problem

    mode = csi_pb2.VolumeCapability.AccessMode(
        mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
    for fs in ("ext4", "xfs", ""):
        m = Manifests(render(helm, "--set", f"storageClasses.fsdax.fsType={fs}"))
        params = m.one("StorageClass", "csi-pmem-fsdax")["parameters"]
        assert parse(params).device_mode == FSDAX
        block = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                         access_mode=mode)
        mount = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=params.get(FSTYPE, "")),
            access_mode=mode)
        assert problem(block, FSDAX) is None
        assert problem(mount, FSDAX) is None, (fs, problem(mount, FSDAX))


def test_class_parameters_are_ones_the_driver_accepts(helm: str) -> None:
    from csi_pmem.driver.params import parse

    m = Manifests(render(helm, "--set", "storageClasses.perNuma={3}", "--set",
                         "storageClasses.align=1Gi", "--set", "storageClasses.eraseOnDelete=false"))
    for sc in m.all("StorageClass"):
        parse(sc["parameters"])  # raises InvalidArgument on an unknown key/value
    numa3 = m.one("StorageClass", "csi-pmem-numa3")["parameters"]
    assert numa3 == {"deviceMode": "devdax", "numaNode": "3", "align": "1Gi",
                     "eraseOnDelete": "false"}
    # align is devdax-only: the fsdax class does not inherit storageClasses.align.
    assert m.one("StorageClass", "csi-pmem-fsdax")["parameters"] == {
        "deviceMode": "fsdax", "numaNode": "auto", "eraseOnDelete": "false", FSTYPE: "ext4"}


def test_driver_name_flows_everywhere(helm: str) -> None:
    m = Manifests(render(helm, "--set", "driverName=pmem.example.com",
                         "--set", "storageClasses.perNuma={0}"))
    assert m.one("CSIDriver")["metadata"]["name"] == "pmem.example.com"
    assert {sc["provisioner"] for sc in m.all("StorageClass")} == {"pmem.example.com"}
    assert m.env("driver")["CSI_PMEM_DRIVER_NAME"] == "pmem.example.com"
    assert m.host_path("plugin-dir") == "/var/lib/kubelet/plugins/pmem.example.com"


# --------------------------------------------------------------------------- RBAC


def rules_of(m: Manifests, kind: str) -> list[dict[str, Any]]:
    return [r for obj in m.all(kind) for r in obj["rules"]]


def granted(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for r in rules:
        if group in r["apiGroups"] and resource in r["resources"]:
            verbs |= set(r["verbs"])
    return verbs


def test_rbac_covers_node_deployment_and_capacity(default: Manifests) -> None:
    cluster = rules_of(default, "ClusterRole")
    ns = rules_of(default, "Role")
    assert {"create", "delete", "get", "list", "watch", "patch"} <= granted(
        cluster, "", "persistentvolumes")
    assert {"get", "list", "watch", "update"} <= granted(cluster, "", "persistentvolumeclaims")
    assert {"get", "list", "watch"} <= granted(cluster, "storage.k8s.io", "storageclasses")
    assert {"create", "patch"} <= granted(cluster, "", "events")
    # Capacity objects are namespaced: the Role grants them, in the release namespace.
    assert {"get", "list", "watch", "create", "update", "patch", "delete"} <= granted(
        ns, "storage.k8s.io", "csistoragecapacities")
    # Owner lookup at level 1: the provisioner gets its own Pod and takes the DaemonSet's
    # reference from it (external-provisioner pkg/owner: the parent is only read from
    # level 2 on), so nothing of apps/ is needed.
    assert granted(ns, "", "pods") == {"get"}
    assert not [r for r in ns + cluster if "apps" in r["apiGroups"]], ns + cluster
    role = default.one("Role")
    assert role["metadata"]["namespace"] == NAMESPACE


def test_rbac_is_least_privilege(default: Manifests) -> None:
    rules = rules_of(default, "ClusterRole") + rules_of(default, "Role")
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"], r
    resources = {res for r in rules for res in r["resources"]}
    # No leader election (node deployment), no secrets, no attachments (attachRequired
    # false), no Node/CSINode watch (node deployment builds them from NodeGetInfo).
    assert not resources & {"leases", "secrets", "volumeattachments", "nodes", "csinodes"}
    assert granted(rules, "", "pods") == {"get"}


def test_bindings_name_the_pods_service_account(default: Manifests) -> None:
    sa = default.one("ServiceAccount")["metadata"]
    assert sa["namespace"] == NAMESPACE
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        b = default.one(kind)
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                                  "namespace": NAMESPACE}]
        assert b["roleRef"]["kind"] == role_kind
        assert b["roleRef"]["name"] == default.one(role_kind)["metadata"]["name"]


# --------------------------------------------------------------------------- metrics


def test_metrics_service_and_optional_servicemonitor(helm: str, default: Manifests) -> None:
    svc = default.one("Service")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"metrics", "prov-metrics"}
    pod_ports = {p["name"] for c in default.pod["containers"] for p in c.get("ports", [])}
    assert {"metrics", "prov-metrics"} <= pod_ports
    assert svc["spec"]["selector"].items() <= \
        default.one("DaemonSet")["spec"]["template"]["metadata"]["labels"].items()
    assert default.all("ServiceMonitor") == []

    on = Manifests(render(helm, "--set", "metrics.serviceMonitor.enabled=true",
                          "--set", "metrics.serviceMonitor.labels.release=prometheus"))
    sm = on.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= \
        on.one("Service")["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {"metrics", "prov-metrics"}

    off = Manifests(render(helm, "--set", "metrics.enabled=false",
                           "--set", "metrics.serviceMonitor.enabled=true"))
    assert off.all("Service") == [] and off.all("ServiceMonitor") == []
    assert off.env("driver")["CSI_PMEM_METRICS_ADDRESS"] == ""
    assert not any(a.startswith("--http-endpoint")
                   for a in off.container("csi-provisioner")["args"])


def test_optional_prometheusrule_and_dashboard_ship_the_tested_files(helm: str,
                                                                     default: Manifests) -> None:
    """Off by default; when on, the PrometheusRule's groups are monitoring/alerts.yaml
    (what tests/test_alerts.py runs promtool on) and the ConfigMap holds the dashboard
    JSON (what tests/unit/test_monitoring.py checks), both unchanged."""
    assert default.all("PrometheusRule") == [] and default.all("ConfigMap") == []
    on = Manifests(render(helm, "--set", "metrics.prometheusRule.enabled=true",
                          "--set", "metrics.prometheusRule.labels.release=prometheus",
                          "--set", "metrics.grafanaDashboard.enabled=true"))
    rule = on.one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load((CHART / "monitoring" / "alerts.yaml").read_text())
    dash = on.one("ConfigMap")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["csi-pmem.json"]) == \
        json.loads((CHART / "dashboards" / "csi-pmem.json").read_text())
    off = Manifests(render(helm, "--set", "metrics.enabled=false",
                           "--set", "metrics.prometheusRule.enabled=true",
                           "--set", "metrics.grafanaDashboard.enabled=true"))
    assert off.all("PrometheusRule") == [] and off.all("ConfigMap") == []


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize("setting, path", [
    ("backend.type=foo", "/backend/type"),
    ("kubeletDir=var/lib/kubelet", "/kubeletDir"),
    ("storageClasses.align=4Ki", "/storageClasses/align"),
    ("storageClasses.perNuma={zero}", "/storageClasses/perNuma/0"),
    ("driver.logFormat=xml", "/driver/logFormat"),
    ("driver.eraseWorkers=0", "/driver/eraseWorkers"),
    ("driver.eraseVerify=some", "/driver/eraseVerify"),
    ("driver.eraseWaitSeconds=-1", "/driver/eraseWaitSeconds"),
    ("driver.scrub=on", "/driver/scrub"),
    ("provisioner.timeout=2 minutes", "/provisioner/timeout"),
    ("metrics.port=70000", "/metrics/port"),
    ("drivr.logLevel=debug", "drivr"),  # a typo is an error, not a silent no-op
    ("storageClasses.fsdax.fsType=btrfs", "/storageClasses/fsdax/fsType"),
    ("storageClasses.fsdax.perNuma={x}", "/storageClasses/fsdax/perNuma/0"),
    ("storageClasses.fsdax.mountOptions={a\\,b}", "/storageClasses/fsdax/mountOptions/0"),
    ("storageClasses.fsdax.name=Pmem", "/storageClasses/fsdax/name"),
    ("storageClasses.fsdax.align=2Mi", "/storageClasses/fsdax"),
    ("gpuCopy.enabled=yes", "/gpuCopy/enabled"),
    ("gpuCopy.pollSeconds=0", "/gpuCopy/pollSeconds"),
    ("gpuCopy.maxClients=0", "/gpuCopy/maxClients"),
    ("gpuCopy.logLevel=verbose", "/gpuCopy/logLevel"),
    ("gpuCopy.runtimeClassName=NVIDIA", "/gpuCopy/runtimeClassName"),
    ("gpuCopy.image.pullPolicy=Sometimes", "/gpuCopy/image/pullPolicy"),
    ("gpuCopy.gpus=1", "gpus"),  # a typo (or a GPU request) is an error
    ("driver.securityContext.privileged=yes", "/driver/securityContext/privileged"),
    ("registrar.securityContext.runAsUsr=1000", "runAsUsr"),  # a typo is an error
    ("livenessProbe.securityContext.runAsUser=-1", "/livenessProbe/securityContext/runAsUser"),
    ("provisioner.securityContext.seccompProfile.type=Default",
     "/provisioner/securityContext/seccompProfile/type"),
])
def test_schema_rejects_bad_values(helm: str, setting: str, path: str) -> None:
    proc = run_helm(helm, "template", "--set", setting)
    assert proc.returncode != 0, f"{setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert path in proc.stderr, proc.stderr


def test_schema_rejects_bad_emulated_region(helm: str) -> None:
    proc = run_helm(helm, "template", "--set-json",
                    'backend.emulated.regions=[{"numaNode": 0, "size": "2GB"}]')
    assert proc.returncode != 0
    assert "/backend/emulated/regions/0/size" in proc.stderr, proc.stderr


def walk_values(values: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys of values.yaml that the schema does not describe."""
    missing = []
    if isinstance(values, dict) and schema.get("type") == "object" and "properties" in schema:
        for key, val in values.items():
            sub = schema["properties"].get(key)
            if sub is None:
                missing.append(f"{path}.{key}")
            else:
                missing += walk_values(val, sub, f"{path}.{key}")
    return missing


def test_schema_describes_every_value() -> None:
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert walk_values(values, schema) == []


# Kubernetes objects the chart passes through as given: one README row each, not one
# per field inside.
PASSED_THROUGH = {"resources", "securityContext", "updateStrategy"}


def value_keys(values: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Every key of values.yaml, top-level and nested, as dotted paths with its default
    (the chart's own structure; the Kubernetes objects above are leaves)."""
    out: dict[str, Any] = {}
    for key, val in values.items():
        dotted = f"{path}.{key}" if path else key
        out[dotted] = val
        if isinstance(val, dict) and val and key not in PASSED_THROUGH:
            out.update(value_keys(val, dotted))
    return out


def readme_rows() -> dict[str, str]:
    """{key: default cell} of the values table in charts/csi-pmem/README.md."""
    text = (CHART / "README.md").read_text()
    table = text.split("\n## Values\n", 1)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"README lists {m.group(1)} twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_chart_readme_lists_every_value_with_its_default() -> None:
    values = value_keys(yaml.safe_load((CHART / "values.yaml").read_text()))
    rows = readme_rows()
    # A key whose value is a map of the chart's own keys is listed through its children.
    leaves = {k: v for k, v in values.items()
              if not (isinstance(v, dict) and v and k.rsplit(".", 1)[-1] not in PASSED_THROUGH)}
    assert sorted(set(leaves) - set(rows)) == [], "values.yaml keys missing from the README"
    assert sorted(set(rows) - set(leaves)) == [], "README rows that are no value"
    for key, val in leaves.items():
        if isinstance(val, bool):
            want = f"`{str(val).lower()}`"
        elif isinstance(val, int | float | str):
            want = f"`{val}`" if val != "" else '`""`'
        else:  # lists and maps: the row shows them in YAML flow style
            flow = yaml.safe_load(rows[key].strip("`"))
            assert flow == val, (key, rows[key], val)
            continue
        assert rows[key] == want, (key, rows[key], want)


def sh_commands(markdown: str) -> list[str]:
    """The commands of every ```sh block, continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [" ".join(line.split()) for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return out


def test_every_install_example_makes_the_namespace_and_sets_the_image_as_readme() -> None:
    """The install commands of the chart's README and docs/install.md are README.md's:
    the namespace made and labelled enforce=privileged first (the node plugin is a
    privileged pod, which a baseline namespace rejects), then helm install with the
    image override (there is no public image). Issue 45: the chart README used
    --create-namespace without the label, and no image for the emulated example."""
    readme = (REPO / "README.md").read_text().split("\n## Installing on Kubernetes\n", 1)[1]
    commands = sh_commands(readme.split("\n## ", 1)[0])
    setup = [c for c in commands if c.startswith(("kubectl create namespace",
                                                  "kubectl label namespace"))]
    assert setup == [f"kubectl create namespace {NAMESPACE}",
                     f"kubectl label namespace {NAMESPACE} "
                     "pod-security.kubernetes.io/enforce=privileged"], commands
    install = next(c for c in commands if c.startswith("helm install"))
    wanted = shlex.split(install)
    assert "--create-namespace" not in wanted
    for doc in (CHART / "README.md", REPO / "docs" / "install.md"):
        cmds = sh_commands(doc.read_text())
        helms = [i for i, c in enumerate(cmds) if c.startswith("helm install")]
        assert helms, f"{doc.name}: no helm install example"
        first = helms[0]
        assert cmds[first - 2:first] == setup, (doc.name, cmds[:first])
        for i in helms:
            argv = shlex.split(cmds[i])
            assert "--create-namespace" not in argv, (doc.name, cmds[i])
            ns = [argv[j + 1] for j, a in enumerate(argv) if a in ("-n", "--namespace")]
            assert ns == [NAMESPACE], (doc.name, cmds[i])
            image = [a for a in argv if a.startswith("driver.image.repository=")]
            assert image == [a for a in wanted if a.startswith("driver.image.repository=")], \
                (doc.name, cmds[i])
    assert sh_commands((CHART / "README.md").read_text())[2] == install


def test_notes_render_with_next_steps(helm: str, tmp_path: Path) -> None:
    """NOTES.txt renders only on install; render it through a copy of the chart."""
    chart = tmp_path / "csi-pmem"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.tpl")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
        '{{ tpl (.Files.Get "notes.tpl") . | indent 4 }}\n')
    docs = render(helm, "-f", str(EMULATED_VALUES), "--show-only", "templates/zz-notes.yaml",
                  chart=chart)
    notes = docs[0]["data"]["notes"]
    for text in ("csistoragecapacities", "storageClassName: csi-pmem",
                 "csi-pmem-numa0", "csi-pmem-numa1", "PersistentVolumeClaim",
                 "fsdax classes: csi-pmem-fsdax", "device_ownership_from_security_context",
                 "deploy/examples/fsdax/",
                 "map_volume", "pod-security.kubernetes.io/enforce=privileged",
                 "rollout status daemonset/csi-pmem-node"):
        assert text in notes, text


# --------------------------------------------------------------------------- deploy/


def test_deploy_manifests_are_in_sync(helm: str) -> None:
    proc = subprocess.run(["bash", str(RENDER_DEPLOY), "--check"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HELM": helm})
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_deploy_manifests_create_their_namespace() -> None:
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        ns = [d for d in docs if d["kind"] == "Namespace"]
        assert [n["metadata"]["name"] for n in ns] == [NAMESPACE], path.name
        assert ns[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        assert docs[0]["kind"] == "Namespace", f"{path.name}: the namespace must come first"
        namespaced = [d for d in docs if "namespace" in d["metadata"]]
        assert {d["metadata"]["namespace"] for d in namespaced} == {NAMESPACE}, path.name


def test_fsdax_examples_use_the_charts_class_and_pass_restricted(default: Manifests) -> None:
    """deploy/examples/fsdax/: a Block claim and a Filesystem claim on the chart's fsdax
    class, each with a pod that passes Pod Security "restricted" (the model-weight
    examples one level up are checked by tests/test_sidecar.py)."""
    fsdax = {c["metadata"]["name"] for c in default.all("StorageClass")
             if c["parameters"]["deviceMode"] == "fsdax"}
    seen_modes = set()
    files = sorted((REPO / "deploy" / "examples" / "fsdax").glob("*.yaml"))
    assert [f.name for f in files] == ["block.yaml", "filesystem.yaml"]
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
        pods = [d for d in docs if d["kind"] == "Pod"]
        assert claims and pods, path.name
        for claim in claims.values():
            assert claim["spec"]["storageClassName"] in fsdax, path.name
            seen_modes.add(claim["spec"].get("volumeMode", "Filesystem"))
        for pod in pods:
            spec = pod["spec"]
            where = f"{path.name}/{pod['metadata']['name']}"
            psc = spec.get("securityContext", {})
            assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, where
            assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            assert not spec.get("hostNetwork") and not spec.get("hostPID"), where
            assert all(set(v) - {"name"} == {"persistentVolumeClaim"}
                       for v in spec["volumes"]), where
            for c in spec["containers"]:
                csc = c["securityContext"]
                assert csc.get("allowPrivilegeEscalation") is False, where
                assert csc.get("capabilities", {}).get("drop") == ["ALL"], where
                assert not csc.get("privileged") and not csc.get("capabilities", {}).get("add")
                for dev in c.get("volumeDevices", []):
                    claim = next(v["persistentVolumeClaim"]["claimName"]
                                 for v in spec["volumes"] if v["name"] == dev["name"])
                    assert claims[claim]["spec"]["volumeMode"] == "Block", where
    assert seen_modes == {"Block", "Filesystem"}


# --------------------------------------------------------------------------- image


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines()
        if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            instr, _, rest = line.strip().partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def runtime_packages() -> list[str]:
    args = [rest for instr, rest in dockerfile_instructions()
            if instr == "ARG" and rest.startswith("RUNTIME_PACKAGES=")]
    assert len(args) == 1, "the runtime apt packages are listed in one ARG RUNTIME_PACKAGES"
    return shlex.split(args[0].partition("=")[2])[0].split()


def test_dockerfile_structure() -> None:
    ins = dockerfile_instructions()
    froms = [rest for instr, rest in ins if instr == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS builder"), froms
    base = dict(shlex.split(rest)[0].split("=", 1) for instr, rest in ins
                if instr == "ARG" and rest.startswith("DEBIAN_IMAGE="))["DEBIAN_IMAGE"]
    assert re.fullmatch(r"(debian:12-slim|debian:bookworm-slim|python:3\.11-slim-bookworm)",
                        base), base
    # The builder makes the wheel with pip wheel; the runtime stage has no compiler.
    runs = [rest for instr, rest in ins if instr == "RUN"]
    assert any("pip wheel" in r for r in runs), runs
    pkgs = runtime_packages()
    # util-linux: blkid; mount: mount, losetup; e2fsprogs/xfsprogs: mkfs of fsdax volumes.
    for needed in ("ndctl", "daxctl", "util-linux", "mount", "python3", "e2fsprogs",
                   "xfsprogs"):
        assert needed in pkgs, needed
    installs = [r for r in runs if "apt-get install" in r and "${RUNTIME_PACKAGES}" in r]
    assert len(installs) == 1, "the runtime stage installs exactly RUNTIME_PACKAGES"
    entry = [rest for instr, rest in ins if instr == "ENTRYPOINT"]
    assert entry == ['["csi-pmem", "serve"]'], entry
    labels = " ".join(rest for instr, rest in ins if instr == "LABEL")
    assert "org.opencontainers.image.title" in labels


BUILD_IMAGE = REPO / "scripts" / "build-image.sh"


def test_dockerignore_admits_exactly_what_the_dockerfile_copies() -> None:
    """The context is the repository root: .dockerignore ignores everything (a .venv,
    build/, .git and caches would otherwise be sent and could reach a layer) and
    re-admits exactly the COPY sources, so a new COPY without its line fails here first.
    """
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert patterns[0] == "*", patterns
    admitted = {p[1:].strip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for instr, rest in dockerfile_instructions():
        if instr == "COPY" and "--from" not in rest:
            *sources, _dest = shlex.split(rest)
            copied.update(src.removeprefix("./").strip("/") for src in sources)
    assert copied and admitted == copied, (admitted, copied)
    for path in (".venv", "build", ".git", ".pytest_cache", "e2e", "tests"):
        assert path not in admitted, path


def test_labels_record_the_build_and_come_last() -> None:
    """make image passes the source revision, source and build time as build args into
    OCI labels; they come after every RUN so a new commit rebuilds no layer.
    """
    ins = dockerfile_instructions()
    declared = {rest.split("=", 1)[0] for instr, rest in ins if instr == "ARG"}
    passed = set(re.findall(r'--build-arg "([A-Z_]+)=', BUILD_IMAGE.read_text()))
    assert {"DEBIAN_IMAGE", "VERSION", "REVISION", "SOURCE", "CREATED"} <= passed, passed
    assert passed <= declared, f"build args the Dockerfile does not declare: {passed - declared}"
    labels = " ".join(rest for instr, rest in ins if instr == "LABEL")
    for name, arg in (("revision", "REVISION"), ("source", "SOURCE"),
                      ("created", "CREATED"), ("version", "VERSION"),
                      ("base.name", "DEBIAN_IMAGE")):
        assert f'org.opencontainers.image.{name}="${{{arg}}}"' in labels, name
    last_run = max(i for i, (instr, _) in enumerate(ins) if instr == "RUN")
    for i, (instr, rest) in enumerate(ins):
        if instr == "ARG" and rest.split("=", 1)[0] in ("REVISION", "CREATED"):
            assert i > last_run, f"ARG {rest} before a RUN invalidates its layer per commit"


def test_cluster_tier_runs_the_dockerfiles_image() -> None:
    """The cluster tier's driver image is the archive make image writes (built from the
    Dockerfile), not a second build: images.sh takes IMAGE and ARCHIVE from
    scripts/build-image.sh, and neither it nor anything else in e2e/cluster installs the
    project or runs debootstrap.
    """
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^image:.*\n\t.*scripts/build-image\.sh", makefile, re.M), "make image"
    images = (CLUSTER_DIR / "images.sh").read_text()
    assert 'bash "${repo}/scripts/build-image.sh"' in images
    assert 'DRIVER_IMAGE=${IMAGE}' in images and 'DRIVER_IMAGE_ARCHIVE=${ARCHIVE}' in images
    assert '--from "${ARCHIVE}"' in images, "the workload image reuses the driver's layers"
    for path in sorted(CLUSTER_DIR.rglob("*")):
        if path.is_file() and path.suffix in ("", ".sh", ".py"):
            text = path.read_text(errors="replace")
            for word in ("debootstrap --", "--find-links", "pip wheel", "python3 -m venv"):
                assert word not in text, (
                    f"{path.relative_to(REPO)} builds a driver image of its own ({word!r})")
    build = BUILD_IMAGE.read_text()
    assert "buildah" in build and "bud" in build and "docker-archive:" in build
    assert "docker.io/library/debian:12-slim" in build, "the base is tagged as FROM names it"


def shell_vars(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Z_][A-Z0-9_]*)=([^\s#]*)", line)
        if m:
            found[m.group(1)] = m.group(2).strip("\"'")
    return found


def test_versions_match_cluster_testbed() -> None:
    """Chart image tags and the helm pin equal the test bed's pins.

    The test bed builds external-provisioner at its pin (and stand-ins for the registrar
    and livenessprobe, with the same flags) and installs the chart with them: the
    versions the chart ships by default are then the ones the cluster tier ran. A pin
    missing from e2e/cluster/versions.sh fails here too: the tier would then run
    something the chart does not ship.
    """
    pins = shell_vars(CLUSTER_DIR / "versions.sh")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pairs = {"PROVISIONER_VERSION": values["provisioner"]["image"]["tag"],
             "REGISTRAR_TAG": values["registrar"]["image"]["tag"],
             "LIVENESSPROBE_TAG": values["livenessProbe"]["image"]["tag"],
             "HELM_VERSION": shell_vars(INSTALL_HELM)["HELM_PINNED"]}
    assert {k: pins.get(k) for k in pairs} == pairs, "versions.sh against the chart"
