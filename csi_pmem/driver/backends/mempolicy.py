"""The calling thread's NUMA memory policy, bound to one node for a block of code.

Why: hugetlbfs has no shared (per-file) memory policy and no ``mpol`` mount option, so
a huge page it allocates comes from the node the *allocating task's* policy names
(``huge_node()``), by default the node of the CPU the thread happens to run on. The
memory back end's hugetlbfs pools therefore allocate a volume's pages (fallocate) with
the thread's policy set to ``MPOL_BIND`` on the pool's node and put the old policy
back afterwards: the pages are then taken from that node's huge page pool whichever
CPU the driver's thread runs on, and a node whose pool is short fails the fallocate
(ENOSPC/ENOMEM) rather than spilling to the other node. The policy is per thread, so
the gRPC worker's other calls are untouched; it is set and restored around one
allocation only, under the driver's node-wide lock. tmpfs pools need none of this:
their mount's ``mpol=bind:N`` becomes each file's shared policy (see
:mod:`csi_pmem.driver.backends.memory`).

glibc has no wrapper for these system calls (libnuma has), so they are made through
``syscall(2)`` with the numbers of the two architectures the driver ships for.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

MPOL_DEFAULT = 0
MPOL_BIND = 2
MAX_NODES = 1024  # bits in the node masks passed to the kernel
_WORDS = MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
# (set_mempolicy, get_mempolicy) per architecture: arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h (arm64).
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}


class MemPolicyError(OSError):
    """The kernel refused the policy (no such node, or no NUMA support)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _numbers() -> tuple[int, int]:
    try:
        return _SYSCALLS[platform.machine()]
    except KeyError:
        raise MemPolicyError(0, f"set_mempolicy: no system call number known for "
                                f"{platform.machine()}") from None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise MemPolicyError(err, f"{what}: {os.strerror(err)}")


def current() -> tuple[int, list[int]]:
    """(mode, nodes) of the calling thread's policy."""
    _, get_nr = _numbers()
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * _WORDS)()
    _check(_libc().syscall(get_nr, ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES),
                           ctypes.c_void_p(0), ctypes.c_ulong(0)), "get_mempolicy")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    return mode.value, [n for n in range(MAX_NODES) if mask[n // bits] >> (n % bits) & 1]


def set_policy(mode: int, nodes: list[int]) -> None:
    set_nr, _ = _numbers()
    mask = (ctypes.c_ulong * _WORDS)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    _check(_libc().syscall(set_nr, ctypes.c_int(mode), mask if nodes else None,
                           ctypes.c_ulong(MAX_NODES if nodes else 0)),
           f"set_mempolicy({mode}, {nodes})")


@contextlib.contextmanager
def bound_to(node: int) -> Iterator[None]:
    """The calling thread allocates only from ``node`` inside the block."""
    mode, nodes = current()
    set_policy(MPOL_BIND, [node])
    try:
        yield
    finally:
        set_policy(mode, nodes if mode != MPOL_DEFAULT else [])
