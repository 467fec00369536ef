"""The erase of one namespace through its back end: a deleted volume's, a new one carved
from a dirty region, one carved again after volatile memory lost it, a scrub's scratch
namespace.

Why one object: four callers (the core's create, :mod:`csi_pmem.driver.deletion`,
:mod:`csi_pmem.driver.recovery` and the scrubber) must erase alike: the device opened
exclusively (never under a live mount), the whole backing file of the emulated back end,
the configured threads and read-back, the threads pinned to the namespace's NUMA node,
and every erase counted, its bytes and time or its failure (the metrics' hooks). The
zeroing itself is :func:`csi_pmem.driver.erasing.erase.zero_fd`.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable

from csi_pmem.driver.backends.base import Backend, Namespace
from csi_pmem.driver.erasing.erase import EraseCancelled, zero_fd
from csi_pmem.numa import node_cpus
from csi_pmem.sizes import format_bytes

log = logging.getLogger(__name__)


class NamespaceEraser:
    """Zero and verify a namespace; see the module docstring."""

    def __init__(self, backend: Backend, *, threads: int | None = None,
                 verify: str = "sampled",
                 on_erase: Callable[[int, float], None] | None = None,
                 on_erase_error: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.threads = threads
        self.verify = verify
        # Called with the bytes and seconds of each erase done (metrics count them).
        self.on_erase = on_erase or (lambda nbytes, seconds: None)
        # Called when zeroing a namespace fails (the delete then fails and is retried):
        # metrics count it, since data that outlives its volume is what erase prevents.
        self.on_erase_error = on_erase_error or (lambda: None)

    def erase(self, ns: Namespace, cancel: threading.Event | None = None) -> None:
        """Zero ``ns`` and verify it; :class:`EraseCancelled` when ``cancel`` is set."""
        try:
            fd = self.backend.open_device(ns, readonly=False, exclusive=True)
            try:
                st = os.fstat(fd)
                # A regular file (the emulated back end) is handed to the pod whole, so
                # all of it is erased, not just the usable size.
                length = st.st_size if stat.S_ISREG(st.st_mode) else ns.usable_size
                result = zero_fd(fd, length, threads=self.threads, verify=self.verify,
                                 cpus=node_cpus(ns.numa_node), cancel=cancel)
            finally:
                os.close(fd)
        except EraseCancelled:
            raise  # a scrub or erase given up on purpose, not a failure
        except Exception:
            self.on_erase_error()
            raise
        self.on_erase(result.bytes, result.seconds)
        log.info("erased %s: %s in %.3f s (%.2f GB/s, %d threads, %s, verify %s%s)",
                 ns.name, format_bytes(result.bytes), result.seconds,
                 result.bytes / max(result.seconds, 1e-9) / 1e9, result.threads,
                 result.method, result.verify, ", persisted" if result.persisted else "")
