"""Flags of ``csi-pmem serve``; every flag is also an environment variable.

Why both: a DaemonSet sets env from values and the downward API (NODE_NAME), a
developer types flags. ``--some-flag`` reads ``CSI_PMEM_SOME_FLAG`` when not given on
the command line. Defaults work out of the box on a laptop: the emulated back end with
two 2 GiB NUMA pools under the state directory.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from csi_pmem import DEFAULT_DRIVER_NAME
from csi_pmem.errors import InvalidArgument

DEFAULTS = {
    "endpoint": "unix:///run/csi-pmem/csi.sock",
    "node_id": "",
    "driver_name": DEFAULT_DRIVER_NAME,
    "state_dir": "/var/lib/csi-pmem",
    "backend": "emulated",
    "metrics_address": "",
    "log_format": "text",
    "log_level": "info",
    "emulated_regions": "0=2Gi,1=2Gi",
    "emulated_root": "",
    "emulated_device": "file",
    "emulated_free_space": "fresh",
    "kubelet_dir": "/var/lib/kubelet",
    "erase_threads": "0",
    "erase_workers": "2",
    "erase_verify": "sampled",
    "erase_wait_seconds": "5",
    "delete_wait_seconds": "1",
    "scrub": "auto",
    "grpc_workers": "0",
    "ndctl": "ndctl",
    "device_poll_seconds": "30",
    "gpu_copy_socket": "",
    "device_node": "off",
}
HELP = {
    "endpoint": "gRPC endpoint: unix:///path/csi.sock or tcp://127.0.0.1:PORT",
    "node_id": "node id reported to the CO (default: the host name)",
    "driver_name": "CSI driver name; also the topology key prefix (<name>/node)",
    "state_dir": "directory for per-volume state records",
    "backend": "ndctl (real NVDIMM regions) or emulated (file-backed pools)",
    "metrics_address": "host:port to serve Prometheus /metrics on (empty: off)",
    "log_format": "text or json",
    "log_level": "debug, info, warning or error",
    "emulated_regions": "emulated pools as NUMA=SIZE pairs, e.g. 0=2Gi,1=2Gi (SIZE a "
                        "Kubernetes quantity, rounded down to 16Mi)",
    "emulated_root": "directory for emulated backing files (tmpfs or hugetlbfs; "
                     "default: <state-dir>/emulated)",
    "emulated_device": "file (hand out the backing file) or loop (hand out a loop device)",
    "emulated_free_space": "fresh (every namespace is a new zeroed file) or reuse (a "
                           "destroyed namespace's bytes are handed out again, as on real "
                           "persistent memory)",
    "kubelet_dir": "publish targets must lie below this directory",
    "erase_threads": "threads used to zero a namespace (0: one per CPU)",
    "erase_workers": "erase jobs (deleted volumes, scrubs) run at the same time",
    "erase_verify": "read-back after an erase: sampled (the first 64 KiB of every MiB), "
                    "full or off",
    "erase_wait_seconds": "how long CreateVolume waits for space still being erased "
                          "before it answers RESOURCE_EXHAUSTED",
    "delete_wait_seconds": "how long DeleteVolume waits for its erase before it returns "
                           "and lets the erase finish in the background",
    "scrub": "auto (zero the free space of dirty regions in the background) or off",
    "grpc_workers": "gRPC worker threads (0: sized for the node)",
    "ndctl": "path of the ndctl binary",
    "device_poll_seconds": "interval of the device re-scan when udev events are unavailable",
    "gpu_copy_socket": "control socket of this node's GPU copy service (csi-pmem gpu-copy); "
                       "devdax publications then also serve gpu.sock (empty: off)",
    "device_node": "on: devdax publications name the volume's device node in volume.json "
                   "(device_node), so the NRI plugin (csi-pmem-nri) adds it to the pod's "
                   "containers that mount the volume; off: dax.sock only",
}
CHOICES = {"backend": ("ndctl", "emulated"), "log_format": ("text", "json"),
           "emulated_device": ("file", "loop"), "emulated_free_space": ("fresh", "reuse"),
           "erase_verify": ("sampled", "full", "off"), "scrub": ("auto", "off"),
           "log_level": ("debug", "info", "warning", "error"), "device_node": ("off", "on")}


@dataclass(frozen=True)
class ServeConfig:
    endpoint: str
    node_id: str
    driver_name: str
    state_dir: str
    backend: str
    metrics_address: str
    log_format: str
    log_level: str
    emulated_regions: str
    emulated_root: str
    emulated_device: str
    kubelet_dir: str
    erase_threads: int
    grpc_workers: int
    ndctl: str
    device_poll_seconds: float
    gpu_copy_socket: str = ""
    emulated_free_space: str = "fresh"
    erase_workers: int = 2
    erase_verify: str = "sampled"
    erase_wait_seconds: float = 5.0
    delete_wait_seconds: float = 1.0
    scrub: str = "auto"
    device_node: str = "off"


def env_name(key: str) -> str:
    return "CSI_PMEM_" + key.upper()


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for key, default in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), dest=key,
                            default=os.environ.get(env_name(key), default),
                            choices=CHOICES.get(key),
                            help=f"{HELP[key]} [env {env_name(key)}, default {default!r}]")


def from_args(ns: argparse.Namespace) -> ServeConfig:
    values = {k: getattr(ns, k) for k in DEFAULTS}
    for key in ("erase_threads", "grpc_workers", "erase_workers"):
        if not str(values[key]).isdecimal():
            raise InvalidArgument(f"--{key.replace('_', '-')} must be a non-negative integer")
        values[key] = int(values[key])
    if values["erase_workers"] < 1:
        raise InvalidArgument("--erase-workers must be at least 1")
    for key in ("device_poll_seconds", "erase_wait_seconds", "delete_wait_seconds"):
        try:
            values[key] = float(values[key])
        except ValueError:
            raise InvalidArgument(f"--{key.replace('_', '-')} must be a number") from None
        if not values[key] >= 0:
            raise InvalidArgument(f"--{key.replace('_', '-')} must not be negative")
    for key, choices in CHOICES.items():
        if values[key] not in choices:
            raise InvalidArgument(f"--{key.replace('_', '-')} must be one of {', '.join(choices)}")
    values["node_id"] = values["node_id"] or socket.gethostname()
    values["emulated_root"] = values["emulated_root"] or os.path.join(values["state_dir"],
                                                                      "emulated")
    return ServeConfig(**values)


def grpc_address(endpoint: str) -> tuple[str, str | None]:
    """(address for grpc, unix socket path or None) from a CSI endpoint URL."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://"):]
        if not path.startswith("/"):
            raise InvalidArgument(f"endpoint {endpoint!r}: use unix:///absolute/path.sock")
        return f"unix://{path}", path
    if endpoint.startswith("tcp://"):
        return endpoint[len("tcp://"):], None
    raise InvalidArgument(f"endpoint {endpoint!r}: use unix:///path.sock or tcp://host:port")
