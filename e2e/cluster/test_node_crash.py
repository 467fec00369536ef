"""The two-node tier's last scenario: node B dies with a pod of ours running on it, and
the test bed's tear-down still leaves nothing behind.

Why: a kubelet and containerd that die (OOM-killed, a crashed node) leave the pod's
containers running under their shims, and the driver's publish mounts and the pod's
volume in place; nothing in Kubernetes unpublishes them any more. down.sh finds what is
left by what it is, not by asking the dead daemons: the shims by the socket on their
command line, the processes in the test bed's cgroups or naming E2E_ROOT, the mounts
below E2E_ROOT, the loop devices backed by files there. It fails the run when any of
them is left. The first run of this module found two shims of the dead node that
down.sh left running: it looked for shim.pid files, which containerd 1.x does not
write for a pod's grouped shim. This module hands it
exactly that state: it kills node B's kubelet and containerd with SIGKILL while a pod
holds a devdax volume of ours there, checks that the pod and its mounts outlived them,
and cleans nothing up. So the check of this scenario is run.sh's tear-down, which
follows at once: run.sh runs this module last, after every other one (B stays dead).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="pip install -e '.[e2e]'")
from test_cluster import wait_until
from test_two_nodes import (
    CLASS_AUTO,
    ENV_FILE,
    POOLS_B,
    TwoNodes,
    _two_nodes,
    helm_install,
)

pytestmark = [
    pytest.mark.skipif(not ENV_FILE, reason="needs a running test bed: make e2e-cluster"),
    pytest.mark.skipif(ENV_FILE and not _two_nodes(),
                       reason="needs the two-node test bed (E2E_NODES=2)"),
    pytest.mark.timeout(600),
]

RELEASE = "csi-pmem-crash"


def alive(pid: int) -> bool:
    """Running, not a zombie (a daemon killed here is reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_node_b_dies_with_a_pod_holding_a_volume() -> None:
    k = TwoNodes()
    # test_two_nodes.py's releases are gone: this one, on B alone, brings the CSIDriver
    # object and the classes with it.
    install = helm_install(k, RELEASE, k.node_b, POOLS_B)
    out = install.communicate(timeout=400)[0]
    assert install.returncode == 0, f"helm install {RELEASE} failed:\n{out[-3000:]}"
    wait_until(f"driver pod on {k.node_b} ready", lambda: k.driver_ready_on(k.node_b), 180)
    k.workload_namespace()
    k.pvc("crash", CLASS_AUTO, "1Gi")
    k.pod("crash", "crash", "hold", "seed-crash", node_selector=k.pinned(k.node_b))
    wait_until("the pod on B holding its volume's mapping",
               lambda: k.phase("crash") == "Running" and '"hold-start"' in k.logs("crash"),
               240)
    assert k.node_of("crash") == k.node_b
    kdir = k.kubelet_dirs[k.node_b]
    published = [m for m in k.mounts_below(kdir + "/pods") if "kubernetes.io~csi" in m]
    assert published, "the pod's volume is not published below B's kubelet dir"

    root = Path(k.env["E2E_ROOT"])
    daemons = {name: int((root / "pids" / f"{name}.pid").read_text())
               for name in ("kubelet-b", "containerd-b")}
    assert all(alive(pid) for pid in daemons.values()), daemons
    for pid in daemons.values():
        os.kill(pid, signal.SIGKILL)
    wait_until("node B's kubelet and containerd dead",
               lambda: not any(alive(pid) for pid in daemons.values()), 30)

    # What a crash leaves: the pods' shims (orphans now) with their containers, the
    # mounts. A shim names its containerd's socket on its command line.
    sock = f"-address {root}/node-b/containerd/containerd.sock"
    shims = [pid for pid in pids() if sock in cmdline(pid)]
    assert shims and all(alive(pid) for pid in shims), shims
    assert set(published) <= set(k.mounts_below(kdir + "/pods"))
    print(f"\nnode B crashed with {len(shims)} shim(s) and {len(published)} publish "
          f"mount(s) left for down.sh")
