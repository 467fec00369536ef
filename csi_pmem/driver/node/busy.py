"""Mount operations that retry for a moment while the kernel says the target is busy."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from csi_pmem.driver.host.mounter import Mounter
from csi_pmem.errors import CommandError

log = logging.getLogger(__name__)

# How long a mount operation is retried while the kernel reports the target busy.
UMOUNT_BUSY_SECONDS = 5.0


def while_busy(action: Callable[[], None], what: str) -> None:
    """Run a mount operation, retrying for a moment while the kernel says it is busy.

    Why: every mount/umount this process runs for another volume forks, and until the
    child execs it holds a copy of all our fds: a dax.sock listener that stop() just
    closed (its bound path pins the tmpfs, so umount fails with EBUSY) or the volume.json
    just written (a file open for writing, so remount,ro fails with EBUSY). Concurrent
    publishes and unpublishes hit this for a few milliseconds; a target that stays busy
    still fails.
    """
    deadline = time.monotonic() + UMOUNT_BUSY_SECONDS
    delay = 0.005
    while True:
        try:
            action()
            return
        except CommandError as exc:
            if "busy" not in exc.stderr or time.monotonic() + delay > deadline:
                raise
            log.debug("%s: busy; trying again in %.3f s", what, delay)
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def umount(mounter: Mounter, target: str) -> None:
    while_busy(lambda: mounter.umount(target), f"unmounting {target}")
