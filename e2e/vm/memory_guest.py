"""What the memory back end's guest test measures: where a volume's pages are, their
size, and when they were allocated.

Why its own module: the placement claim of ``--backend memory`` (issue 43) is about the
kernel, not the driver: per-node memory counters before and after CreateVolume (did
the pages exist before anything touched them, and on which node), and the test's own
mapping of the volume (``/proc/self/numa_maps`` per node, ``smaps`` for huge page
mappings). These read the guest's /proc and /sys only, and never allocate.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

NODES = Path("/sys/devices/system/node")
MADV_POPULATE_READ = 22  # include/uapi/asm-generic/mman-common.h (Linux 5.14)


def node_cpus(node: int) -> str:
    """The CPU list of ``node`` as taskset takes it (``"1"``, ``"0-3"``)."""
    return (NODES / f"node{node}" / "cpulist").read_text().strip()


def node_meminfo(node: int) -> dict[str, int]:
    """``nodeN/meminfo`` as {field: value}: kB for sizes, a count for HugePages_*."""
    out = {}
    for line in (NODES / f"node{node}" / "meminfo").read_text().splitlines():
        m = re.match(r"Node\s+\d+\s+(\S+):\s+(\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def huge_pages_free(node: int, kib: int = 2048) -> int:
    return int((NODES / f"node{node}" / "hugepages" / f"hugepages-{kib}kB" /
                "free_hugepages").read_text())


def reserve_huge_pages(node: int, count: int, kib: int = 2048) -> int:
    """Set ``node``'s pool of huge pages to ``count``; the count the kernel reached."""
    path = NODES / f"node{node}" / "hugepages" / f"hugepages-{kib}kB" / "nr_hugepages"
    path.write_text(f"{count}\n")
    return int(path.read_text())


def pin(pid: int, cpus: str) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads made later inherit it)."""
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True,
                   capture_output=True, timeout=60)


def threads_on(pid: int) -> set[str]:
    """The ``Cpus_allowed_list`` of every thread of ``pid``."""
    found = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue  # the thread ended meanwhile
        m = re.search(r"^Cpus_allowed_list:\s+(\S+)", text, re.MULTILINE)
        if m:
            found.add(m.group(1))
    return found


def mapping_stats(path: str) -> dict[str, int]:
    """This process's mapping of the file ``path``: bytes per node from numa_maps
    (``N0``, ``N1`` ... times ``kernelpagesize_kB``) and its smaps page-size fields."""
    stats: dict[str, int] = {}
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        words = dict(w.partition("=")[::2] for w in line.split()[1:])
        if words.get("file") == path:
            page_kib = int(words.get("kernelpagesize_kB", "4"))
            stats["kernelpagesize_kB"] = page_kib
            for key, value in words.items():
                if re.fullmatch(r"N\d+", key):
                    stats[key] = int(value) * page_kib * 1024
            break
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line) and line.endswith(" " + path):
            for follow in lines[i + 1:]:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", follow):
                    break
                key, _, value = follow.partition(":")
                if key in ("Rss", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb",
                           "Private_Hugetlb", "KernelPageSize", "MMUPageSize"):
                    stats[key + "_kB"] = int(value.split()[0])
            break
    return stats


def populate(buf: object) -> None:
    """Map every page of an mmap without writing (MADV_POPULATE_READ); allocates nothing
    that the file does not hold already."""
    buf.madvise(MADV_POPULATE_READ)  # type: ignore[attr-defined]


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512
