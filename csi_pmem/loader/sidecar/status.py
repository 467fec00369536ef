"""What ``/status`` shows, the failure kinds, and staging progress.

Why one object behind a lock: the worker thread updates it while the HTTP threads read
it, and every probe must see a consistent snapshot.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from typing import Any

from csi_pmem import daxclient, failpoints
from csi_pmem.loader.sidecar.events import SourceError, event
from csi_pmem.loader.sources import SourceUnreachableError
from csi_pmem.weights.errors import (
    ChecksumError,
    LayoutError,
    LoaderError,
    ReadOnlyVolumeError,
    SafetensorsFormatError,
    VolumeError,
    VolumeTooSmallError,
)

# Kill the sidecar (SIGKILL) once staging has copied half the model: the
# interrupted-staging test needs a kill that lands mid-copy every time.
FP_STAGE_HALF = "sidecar-stage-half"
PROGRESS_INTERVAL = 2.0


def classify(exc: BaseException) -> str:
    """A short, stable name for the kind of failure (``/status`` ``error_kind``)."""
    if isinstance(exc, SourceUnreachableError):
        return "source-unreachable"
    if isinstance(exc, SourceError | SafetensorsFormatError):
        return "source"
    if isinstance(exc, ReadOnlyVolumeError):
        return "read-only"
    if isinstance(exc, VolumeTooSmallError):
        return "too-small"
    if isinstance(exc, VolumeError):
        return "dax-socket" if isinstance(exc.__cause__, daxclient.DaxSocketError) else "volume"
    if isinstance(exc, ChecksumError):
        return "checksum"
    if isinstance(exc, LayoutError):
        return "layout"
    return "error" if isinstance(exc, LoaderError | OSError) else "internal"


class Status:
    """What ``/status`` shows; updated by the worker, read by the HTTP threads."""

    def __init__(self, **initial: Any):
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {
            "state": "starting", "ready": False, "healthy": True, "model": None,
            "revision": None, "revision_from": None, "bytes": None, "bytes_done": 0,
            "bytes_copied": 0, "bytes_reused": 0, "action": None, "released": [],
            "space": "", "last_error": None, "error_kind": None, "attempts": 0,
            "startup_seconds": None, "phases": {}, "last_verified": None,
            "verify_mode": None, "needed": None, "available": None, "retry_in": None,
            # Totals over the process's life, for /metrics' counters.
            "copied_total": 0, "reused_total": 0, "verified_total": 0,
            "verifications": {},  # {mode: {result: count}}; results ok, damaged, error
            "pid": os.getpid(), **initial}

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._data.update(fields)

    def phase(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data["phases"][name] = round(seconds, 4)

    def add(self, **amounts: int) -> None:
        """Add to the totals (``copied_total=...``)."""
        with self._lock:
            for key, n in amounts.items():
                self._data[key] += n

    def verified(self, mode: str, result: str, nbytes: int = 0) -> None:
        """Count one verification: ``mode`` sample/full, ``result`` ok/damaged/error."""
        with self._lock:
            by_result = self._data["verifications"].setdefault(mode, {})
            by_result[result] = by_result.get(result, 0) + 1
            self._data["verified_total"] += nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._data)

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data.get(key)


def process_age() -> float | None:
    """Seconds since this process started (interpreter start-up included)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class Progress:
    """Staging progress into /status and, throttled, into the log."""

    def __init__(self, status: Status, interval: float = PROGRESS_INTERVAL):
        self.status, self.interval = status, interval
        self.started = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        self.status.update(state="staging", bytes_done=done, bytes=total)
        if total > done and 2 * done >= total:
            failpoints.hit(FP_STAGE_HALF)
        now = time.monotonic()
        if now - self.last < self.interval and done < total:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9) / 1e9
        event("progress", bytes_done=done, bytes_total=total,
               percent=round(100 * done / total, 1) if total else 100.0,
               gbps=round(rate, 3), file=what)
