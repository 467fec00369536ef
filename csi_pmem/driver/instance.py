"""One driver per state directory: an flock held for the life of the process.

Why: everything a driver does assumes it is alone with its state. A second instance on
the same state dir (a second ``make run``, a node plugin started by hand beside the
DaemonSet's, a rollout that surges) would reconcile the same records, destroy the
namespaces the first one is creating and take over the sockets every pod is connected
to, while the first keeps running unreachable. So the process takes an exclusive flock
on ``<state dir>/driver.lock`` before it reads any state, and a second one stops there,
with one line that names the holder.

Why flock: the kernel drops it when the holder dies, however it dies (SIGKILL, OOM,
power cut), so a crashed driver never leaves a lock to clean up by hand, and a
restarted one takes it at once. The file keeps the holder's PID and host for the
message only; the lock itself is the truth.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket

from csi_pmem.errors import CsiPmemError

LOCK_FILE = "driver.lock"


class AlreadyRunning(CsiPmemError):
    """Another process holds what this one needs to start: the state dir's lock, the
    gRPC socket or the metrics port. The command line exits 2 with the message."""


class StateDirLock:
    """The exclusive flock on ``<state_dir>/driver.lock``; :meth:`release` or process
    exit gives it up."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.path = os.path.join(self.state_dir, LOCK_FILE)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise AlreadyRunning(
                f"another csi-pmem driver ({holder}) holds the state dir {self.state_dir} "
                f"(lock {self.path}); stop it first, or give this one its own "
                "--state-dir") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        """Give the lock up (the file stays: unlinking it would let a third process lock
        a new file while a second still waits on the old one)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError as exc:
        text = f"unknown: {errno.errorcode.get(exc.errno or 0, exc)}"
    return text or "PID unknown"
