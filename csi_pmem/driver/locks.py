"""Per-volume in-flight set and the node-wide back-end lock.

Why: the CO retries aggressively. A second call for a volume that is still being
worked on must fail fast with ABORTED (the CO retries later) instead of queueing a
thread behind a long erase. Separately, concurrent ndctl writes have corrupted labels
and oopsed kernels (pmem/ndctl#91, #96), so every create/destroy on the node runs
under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from csi_pmem.errors import Aborted


class InFlight:
    """A set of keys with an operation in progress; entering a busy key raises Aborted."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, key: str, operation: str) -> Iterator[None]:
        with self._lock:
            busy = self._keys.get(key)
            if busy is not None:
                raise Aborted(f"an operation ({busy}) on {key} is already in progress; retry later")
            self._keys[key] = operation
        try:
            yield
        finally:
            with self._lock:
                self._keys.pop(key, None)

    def busy(self) -> dict[str, str]:
        with self._lock:
            return dict(self._keys)
