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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from csi_pmem import DEFAULT_DRIVER_NAME
from csi_pmem.cmdline import (
    UsageError,
    from_env,
    non_negative_int,
    non_negative_seconds,
    one_of,
    positive_int,
)
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
    "emulated_media": "auto",
    "daxctl": "daxctl",
    "cxl": "cxl",
    "dax_setup": "off",
    "memory_pools": "*=50%",
    "memory_root": "",
    "memory_fs": "tmpfs",
    "memory_pages": "2M",
}
HELP = {
    "endpoint": "gRPC endpoint: unix:///path/csi.sock or tcp://127.0.0.1:PORT",
    "node_id": "node id reported to the CO (default: the host name)",
    "driver_name": "CSI driver name; also the topology key prefix (<name>/node)",
    "state_dir": "directory for per-volume state records",
    "backend": "ndctl (NVDIMM and CXL persistent memory regions), daxctl (dynamic dax "
               "regions: soft-reserved and CXL volatile memory), both as ndctl,daxctl, "
               "memory (DRAM pools per NUMA node, each a file system the driver mounts "
               "bound to its node) or emulated (file-backed pools, for tests)",
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
    "emulated_media": "what a node restart does to the emulated pools: volatile (their "
                      "files are lost: a volume found gone is carved again, empty and "
                      "zeroed, under the same id, and its condition says its contents were "
                      "lost), persistent (they survive: a volume found gone stays abnormal, "
                      "never recreated) or auto (volatile when the emulated root is on "
                      "tmpfs, ramfs or hugetlbfs, persistent otherwise)",
    "daxctl": "path of the daxctl binary (daxctl back end)",
    "cxl": "path of the cxl binary: says why a CXL node has no dax region, and makes "
           "CXL regions under --dax-setup=reconfigure",
    "dax_setup": "off: dax regions onlined as system RAM or held by the kernel's boot-time "
                 "device, and CXL memory devices without a region, are only reported; "
                 "reconfigure: the driver creates a region for each CXL memory device "
                 "that has none (cxl create-region, ram and pmem), hands the boot-time "
                 "device (daxN.0) back to device-dax, offlining its memory, and shrinks "
                 "it so the region can be carved",
    "memory_pools": "memory back end: a pool per NUMA node as NUMA=SIZE or NUMA=PERCENT% "
                    "of that node's MemTotal (NUMA * for every node the host has), e.g. "
                    "*=50%, 0=50%,1=50% or 0=64Gi,1=64Gi "
                    "(rounded down to 16Mi); a node the host lacks, or a pool bigger than "
                    "its node, stops the driver at start",
    "memory_root": "memory back end: the directory under which each pool's file system "
                   "is mounted as region<N> (default: <state-dir>/memory)",
    "memory_fs": "memory back end: tmpfs (a tmpfs per pool mounted mpol=bind:N, pages "
                 "4k or transparent 2M) or hugetlbfs (the node's reserved huge pages, "
                 "2M or 1G, allocated with the driver's thread bound to the node)",
    "memory_pages": "memory back end: the page size of the pools: 2M (the default), 4k "
                    "(tmpfs only) or 1G (hugetlbfs only)",
}
# Several kinds of pool on one node: ndctl and daxctl together (composite back end).
BACKENDS = ("ndctl", "daxctl", "ndctl,daxctl", "memory", "emulated")
CHOICES = {"backend": BACKENDS, "log_format": ("text", "json"),
           "emulated_device": ("file", "loop"), "emulated_free_space": ("fresh", "reuse"),
           "erase_verify": ("sampled", "full", "off"), "scrub": ("auto", "off"),
           "log_level": ("debug", "info", "warning", "error"), "device_node": ("off", "on"),
           "emulated_media": ("auto", "persistent", "volatile"),
           "dax_setup": ("off", "reconfigure"), "memory_fs": ("tmpfs", "hugetlbfs"),
           "memory_pages": ("4k", "2M", "1G")}


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
    emulated_media: str = "auto"
    daxctl: str = "daxctl"
    cxl: str = "cxl"
    dax_setup: str = "off"
    memory_pools: str = "*=50%"
    memory_root: str = ""
    memory_fs: str = "tmpfs"
    memory_pages: str = "2M"

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.backend.split(","))

    def driver_config(self) -> DriverConfig:
        """What the core is told: the flags it reads, under its own names and types."""
        return DriverConfig(
            driver_name=self.driver_name, node_id=self.node_id, kubelet_dir=self.kubelet_dir,
            erase_threads=self.erase_threads or None,  # 0: one per CPU
            erase_verify=self.erase_verify, erase_workers=self.erase_workers,
            scrub=self.scrub == "auto", erase_wait=self.erase_wait_seconds,
            delete_wait=self.delete_wait_seconds, device_node=self.device_node == "on")


@dataclass(frozen=True)
class DriverConfig:
    """What the core (:class:`csi_pmem.driver.core.Driver`) is told: made from the flags
    by :meth:`ServeConfig.driver_config`; tests and benchmarks make it directly."""

    driver_name: str
    node_id: str
    kubelet_dir: str
    erase_threads: int | None = None
    erase_verify: str = "sampled"  # csi_pmem.driver.erasing.erase: full, sampled or off
    erase_workers: int = 2       # background erase jobs at a time
    scrub: bool = True           # scrub dirty regions in the background
    erase_wait: float = 5.0      # how long CreateVolume waits for space being erased
    delete_wait: float = 1.0     # how long DeleteVolume waits for its background erase
    device_node: bool = False    # volume.json names the device node (the NRI plugin's)



def env_name(key: str) -> str:
    return "CSI_PMEM_" + key.upper()


def endpoint(text: str) -> str:
    """An argparse type: a CSI endpoint :func:`grpc_address` can use."""
    try:
        grpc_address(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text



# How a value's text is read, for the command line (argparse) and for the environment
# and the defaults (from_args) alike; a key without an entry is text, checked against
# CHOICES when it has some.
TYPES: dict[str, Callable[[str], Any]] = {
    "endpoint": endpoint,
    "erase_threads": non_negative_int, "grpc_workers": non_negative_int,
    "erase_workers": positive_int,
    "device_poll_seconds": non_negative_seconds, "erase_wait_seconds": non_negative_seconds,
    "delete_wait_seconds": non_negative_seconds,
}



def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every key of DEFAULTS as a flag. A flag not given is None here: :func:`from_args`
    reads the environment then, so a bad variable is reported under its own name, and
    only by ``serve`` (the client commands never read these)."""
    for key, default in DEFAULTS.items():
        parser.add_argument(flag(key), dest=key, default=None, type=TYPES.get(key, str),
                            choices=CHOICES.get(key),
                            help=f"{HELP[key]} [env {env_name(key)}, default {default!r}]"
                            .replace("%", "%%"))  # argparse %-formats help texts


def _check(key: str) -> Callable[[str], Any]:
    if key in TYPES:
        return TYPES[key]
    return one_of(CHOICES[key]) if key in CHOICES else str


def from_args(ns: argparse.Namespace,
              checks: Mapping[str, Callable[[Any], object]] | None = None) -> ServeConfig:
    """The configuration from the flags given, else the CSI_PMEM_* environment, else
    DEFAULTS. A bad value raises :class:`csi_pmem.cmdline.UsageError` naming the
    variable (``CSI_PMEM_LOG_LEVEL``) or the flag it came from. ``checks`` are further
    validators by key (the caller's, e.g. the emulated back end's region grammar, which
    this layer cannot import); they raise InvalidArgument or ValueError."""
    values = {k: from_env(getattr(ns, k, None), env_name(k), DEFAULTS[k], _check(k))
              for k in DEFAULTS}
    for key, check in (checks or {}).items():
        check_value(ns, key, values[key], check)
    values["node_id"] = values["node_id"] or socket.gethostname()
    values["emulated_root"] = values["emulated_root"] or os.path.join(values["state_dir"],
                                                                      "emulated")
    values["memory_root"] = values["memory_root"] or os.path.join(values["state_dir"],
                                                                  "memory")
    return ServeConfig(**values)


def check_value(ns: argparse.Namespace, key: str, value: Any,
                check: Callable[[Any], object]) -> Any:
    """``check(value)``; its InvalidArgument or ValueError becomes a
    :class:`~csi_pmem.cmdline.UsageError` naming the flag or the variable the value
    came from. Also for checks that need the node (the memory pools' fit), made once
    the back end is known."""
    try:
        return check(value)
    except (InvalidArgument, ValueError) as exc:
        given = getattr(ns, key, None) is not None or env_name(key) not in os.environ
        where = flag(key) if given else f"environment variable {env_name(key)}"
        raise UsageError(f"{where}: {exc}") from None


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
