"""Sizes of the memory back end's pools: absolute, or a share of a NUMA node's memory.

Why its own module: a pool of DRAM is carved from the very memory the node runs on, so
a typo (``0=20Gi`` for ``0=2Gi``) or a configuration copied to a smaller node can take
a node's RAM. The operator states pools as a share of each NUMA node (``0=50%,1=50%``,
or ``*=50%`` for every node the host has: the default, so that one configuration fits
one-socket and two-socket nodes alike) or as a size (``0=64Gi``); the driver reads
each node's ``MemTotal`` from ``/sys/devices/system/node/node<N>/meminfo`` and refuses
at start, in one line naming the node, what it has and what was asked, a pool on a
node that does not exist or one bigger than its node. Parsing (the grammar, checked
with the other flags) and fitting (against this node's memory, only when ``--backend
memory`` is chosen) are two steps, so a bad value is a usage error whatever the node,
and a good one is checked against the node that runs it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import REGION_ALIGN, describe_size, format_bytes, parse_quantity, round_down

SYSFS_NODES = "/sys/devices/system/node"
_MEMTOTAL = re.compile(r"^Node\s+(\d+)\s+MemTotal:\s+(\d+)\s+kB\s*$", re.MULTILINE)
_SHARE = re.compile(r"^(\d+(?:\.\d+)?)%$")

# A pool's requested size: bytes (int) or a share of its node's MemTotal (Fraction).
Request = int | Fraction
# The key of ``*=SIZE``: every NUMA node the host has that no entry names itself.
EVERY_NODE = -1


def parse_pools(spec: str) -> dict[int, Request]:
    """``"0=50%,1=64Gi"`` into {NUMA node: bytes or share}; ``*`` (every node no other
    entry names) is :data:`EVERY_NODE`. The grammar only."""
    pools: dict[int, Request] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        node, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not (node.isdecimal() or node == "*"):
            raise InvalidArgument(f"invalid memory pool {item!r}: use NUMA=SIZE or "
                                  "NUMA=PERCENT% (NUMA a node number, or * for every "
                                  "node), for example *=50% or 0=50%,1=64Gi")
        n = EVERY_NODE if node == "*" else int(node)
        if n in pools:
            raise InvalidArgument(f"memory pool for NUMA node {node} given twice")
        share = _SHARE.fullmatch(size)
        if share:
            value = Fraction(share.group(1)) / 100
            if not 0 < value <= 1:
                raise InvalidArgument(f"memory pool {item!r}: a share is more than 0% "
                                      "and at most 100% of the NUMA node's memory")
            pools[n] = value
        else:
            nbytes = parse_quantity(size)
            if round_down(nbytes, REGION_ALIGN) <= 0:
                raise InvalidArgument(f"memory pool {item!r} is smaller than 16Mi")
            pools[n] = nbytes
    if not pools:
        raise InvalidArgument("no memory pools configured (for example *=50%)")
    return pools


def node_memory(root: str | None = None) -> dict[int, int]:
    """{NUMA node: MemTotal in bytes} from each node's ``meminfo`` under ``root``
    (default :data:`SYSFS_NODES`)."""
    found: dict[int, int] = {}
    for meminfo in sorted(Path(root or SYSFS_NODES).glob("node[0-9]*/meminfo")):
        m = _MEMTOTAL.search(meminfo.read_text())
        if m:
            found[int(m.group(1))] = int(m.group(2)) * 1024
    return found


def describe_request(request: Request) -> str:
    if isinstance(request, Fraction):
        return f"{float(request * 100):g}%"
    return format_bytes(request)


def fit_pools(pools: dict[int, Request], memory: dict[int, int]) -> dict[int, int]:
    """{NUMA node: pool bytes, rounded down to 16 MiB}, or :class:`InvalidArgument` in
    one line for the first pool this node cannot hold. ``*`` gives its request to every
    NUMA node of ``memory`` that no entry names."""
    pools = dict(pools)
    every = pools.pop(EVERY_NODE, None)
    if every is not None:
        pools.update({n: every for n in memory if n not in pools})
        if not pools:
            raise InvalidArgument(f"memory pools of {describe_request(every)} on every NUMA "
                                  f"node were asked, and this host lists none under "
                                  f"{SYSFS_NODES}")
    sized: dict[int, int] = {}
    for node, request in sorted(pools.items()):
        asked = describe_request(request)
        if node not in memory:
            have = ", ".join(map(str, sorted(memory))) or "none"
            raise InvalidArgument(f"NUMA node {node} does not exist on this node (its NUMA "
                                  f"nodes: {have}), and a memory pool of {asked} was asked "
                                  "there")
        total = memory[node]
        nbytes = int(total * request) if isinstance(request, Fraction) else request
        if nbytes > total:
            raise InvalidArgument(f"NUMA node {node} has {describe_size(total)} of memory "
                                  f"(MemTotal), and its memory pool asks {asked}")
        nbytes = round_down(nbytes, REGION_ALIGN)
        if nbytes <= 0:
            raise InvalidArgument(f"NUMA node {node} has {describe_size(total)} of memory, "
                                  f"and {asked} of it is less than 16Mi")
        sized[node] = nbytes
    return sized


def check_huge_pages(sized: dict[int, int], page_size: int, root: str | None = None) -> None:
    """hugetlbfs pools: each node's reserved huge pages of ``page_size`` (its
    ``nr_hugepages``, used ones included, so a restart with volumes passes) must cover
    its pool; else :class:`InvalidArgument` in one line, saying where to reserve more."""
    kib = page_size // 1024
    for node, nbytes in sorted(sized.items()):
        path = Path(root or SYSFS_NODES) / f"node{node}" / "hugepages" / \
            f"hugepages-{kib}kB" / "nr_hugepages"
        try:
            count = int(path.read_text())
        except (OSError, ValueError):
            count = 0
        if count * page_size < nbytes:
            raise InvalidArgument(
                f"NUMA node {node} has {count} huge pages of {format_bytes(page_size)} "
                f"reserved ({format_bytes(count * page_size)}), and its memory pool asks "
                f"{format_bytes(nbytes)}; reserve {-(-nbytes // page_size)} in {path}")
