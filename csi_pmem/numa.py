"""Which CPUs sit on a NUMA node, and pinning the calling thread to them.

Why: the memcpy threads of the GPU path read the volume and write pinned buffers; both
live on the volume's NUMA node (the driver places the namespace there and publishes the
node), and a copy that crosses the socket interconnect runs at a fraction of local
bandwidth. Pinning is best effort: a pod's cpuset may exclude the node's CPUs, and then
we say so once instead of failing the load.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

SYSFS_NODE = "/sys/devices/system/node"
# What was said about a node, by (sysfs, node, what): each is said once per process, at
# WARNING, and at DEBUG after that. Every erase and every load asks again (a walkthrough
# on a one-node host asked about the emulated default's NUMA-1 pool 9 times), and the
# answer does not change while the process runs.
_said: set[tuple[str, int, str]] = set()
_said_lock = threading.Lock()


def _warn_once(key: tuple[str, int, str], msg: str, *args: object) -> None:
    with _said_lock:
        first = key not in _said
        _said.add(key)
    log.log(logging.WARNING if first else logging.DEBUG, msg, *args)


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's cpulist format ("0-3,8,10-11") into a sorted list."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                # "0-15:4" (stride) is valid cpulist syntax since Linux 4.x
                hi, _, stride = hi.partition(":")
                cpus.update(range(int(lo), int(hi) + 1, int(stride or 1)))
            else:
                cpus.add(int(lo))
        except ValueError as exc:
            raise ValueError(f"malformed cpulist {text!r}") from exc
    return sorted(cpus)


def node_cpus(node: int | None, sysfs: str = SYSFS_NODE) -> list[int]:
    """CPUs of ``node`` that this process may run on; all allowed CPUs when unknown.

    The intersection with ``sched_getaffinity`` matters in containers: the cgroup cpuset
    decides, and pinning to a CPU outside it fails with EINVAL.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if node is None or node < 0:
        return allowed
    try:
        with open(os.path.join(sysfs, f"node{node}", "cpulist")) as f:
            local = parse_cpulist(f.read())
    except OSError as exc:
        _warn_once((sysfs, node, "cpulist"), "NUMA node %d: cannot read its cpulist (%s); "
                   "memcpy threads run unpinned (said once per process)", node, exc)
        return allowed
    usable = [c for c in local if c in set(allowed)]
    if not usable:
        _warn_once((sysfs, node, "off-node"),
                   "NUMA node %d has CPUs %s but this process may only use %s: memcpy "
                   "threads run off-node and copies cross the socket interconnect; give "
                   "the pod CPUs on node %d", node, local, allowed, node)
        return allowed
    return usable


def pin_current_thread(cpus: list[int]) -> bool:
    """Pin the calling thread (pid 0 means the thread on Linux) to ``cpus``."""
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except OSError as exc:
        log.warning("cannot pin memcpy thread to CPUs %s: %s", cpus, exc)
        return False
