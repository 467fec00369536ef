"""The node side of a published devdax volume on a host without Kubernetes.

Why: a pod meets the GPU copy service through the node plugin: a published directory
with ``dax.sock`` (the volume's fd) and ``gpu.sock`` (forwarded to the service after the
peer checks). This runs exactly those parts, the node plugin's socket server
(:class:`csi_pmem.driver.daxsock.DaxSocketServer`) in this process and the service as its own
process (``csi-pmem gpu-copy``), over a volume (a devdax device, or a file standing in
for one). Fresh processes then load from the directory as a pod would: the benchmarks
and the GPU tests use it, and so can anyone trying the service on one machine. No
cgroup check: every local process may connect.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.gpucopy.protocol import SOCKET_NAME

ROOT = Path(__file__).resolve().parent.parent.parent

MiB = 1 << 20


@contextlib.contextmanager
def published(volume: str, directory: str, *, copier: str = "cuda",
              numa_node: int | None = None, wait_s: float = 120,
              size: int | None = None) -> Iterator[str]:
    """Serve ``directory`` as a published volume over ``volume``, with the copy
    service; yields the directory once the service registered the staged model."""
    os.makedirs(directory, exist_ok=True)
    size = size or os.path.getsize(volume)
    meta = {"volume_id": "csi-bench", "device": volume, "numa_node": numa_node,
            "size": size, "usable_size": size, "align": 2 * MiB, "readonly": True,
            "driver": "bench", "socket": "dax.sock"}
    with open(os.path.join(directory, "volume.json"), "w") as f:
        json.dump(meta, f)
    control = os.path.join(directory, ".gpu-copy-control.sock")
    log_path = os.path.join(directory, ".gpu-copy.log")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "wb") as log:
        service = subprocess.Popen([sys.executable, "-m", "csi_pmem", "gpu-copy", "--socket",
                                    control, "--copier", copier], env=env, stderr=log)
    dax = DaxSocketServer()
    try:
        deadline = time.monotonic() + wait_s
        while not os.path.exists(control):
            if service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the copy service did not start:\n"
                                   f"{Path(log_path).read_text()}")
            time.sleep(0.05)
        link = ServiceLink(control)

        def opener() -> int:
            return os.open(volume, os.O_RDONLY | os.O_CLOEXEC)

        dax.serve(os.path.join(directory, "dax.sock"), meta, opener, pod_uid=None)
        dax.serve(os.path.join(directory, SOCKET_NAME), meta, opener, pod_uid=None,
                  forward=lambda conn, fd: link.forward(meta, conn, fd))
        fd = opener()
        try:
            link.prepare(meta, fd)
        finally:
            os.close(fd)
        while "registered" not in Path(log_path).read_text():
            if service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the copy service registered nothing:\n"
                                   f"{Path(log_path).read_text()}")
            time.sleep(0.05)
        print(Path(log_path).read_text().strip().splitlines()[-1], file=sys.stderr)
        yield directory
    finally:
        dax.close()
        service.terminate()
        try:
            code = service.wait(30)
        except subprocess.TimeoutExpired:
            service.kill()
            code = service.wait(10)
        print(f"copy service exited with {code}; its log:\n{Path(log_path).read_text()}",
              file=sys.stderr)
