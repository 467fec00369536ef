"""The volume's staging lock: two sidecars on one node never stage into one volume at once.

Why flock on the device's fd: it is node-wide whichever pod or publish the fd came
through; crash safety itself comes from the staging code (plan first, commit last).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator

from csi_pmem import daxclient
from csi_pmem.loader.sidecar.events import event
from csi_pmem.weights.errors import VolumeError
from csi_pmem.weights.image import volume_image


def _lock_fd(path: str) -> int:
    """An fd of the volume's device (or file): flock on it is node-wide, whichever pod
    or publish the fd came through, because all of them share the device's inode. A
    directory volume's is its image file's (the directory's until there is one)."""
    image = volume_image(path)
    if image is not None:
        target = image if os.path.exists(image) else path
        return os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    is_socket = os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode)
    if os.path.isdir(path) or is_socket:
        try:
            _, fd = daxclient.open_volume(path)
        except daxclient.DaxSocketError as exc:
            raise VolumeError(str(exc)) from exc
        return fd
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


@contextlib.contextmanager
def volume_lock(path: str) -> Iterator[float]:
    """Hold the volume's staging lock; yields the seconds spent waiting for it."""
    fd = _lock_fd(path)
    started = time.monotonic()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            event("another process is staging into this volume; waiting for it",
                   logging.WARNING, volume=path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - started
    finally:
        os.close(fd)
