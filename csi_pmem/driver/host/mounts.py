"""The mounts the driver makes (devdax tmpfs, fsdax binds) and reading mountinfo.

Why: a devdax character device cannot be a Block volume (docs/design.md §1), so a
published volume is a tiny tmpfs at the pod's target path holding ``volume.json`` and
``dax.sock``. The mount source is ``csi-pmem:<volume id>``, which is how the driver
recognises its own mounts after a restart (mountinfo is the truth about mounts, the
state record only says what was intended). The tmpfs is remounted read-only once
populated so nothing in the pod can replace the socket or the metadata.

fsdax volumes are recognised by device instead: a file system mount by its
``major:minor`` in mountinfo, a block device bound onto a target file by the ``st_rdev``
the target then stats with.

The commands run through the runner they are given:
:class:`csi_pmem.driver.host.mounter.HostMounter` is their one caller, and the node
side reaches them through it (a fake in unit tests).
"""

from __future__ import annotations

import logging
import os

from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import FailedPrecondition, from_os_error
from csi_pmem.mountinfo import MountInfo, find, mountinfo

__all__ = ["MountInfo", "find", "mountinfo"]  # re-exported: tests and tools read them here

log = logging.getLogger(__name__)

SOURCE_PREFIX = "csi-pmem:"
TMPFS_SIZE = "1m"
TIMEOUT = 30


def source_for(volume_id: str) -> str:
    return f"{SOURCE_PREFIX}{volume_id}"


def mount_tmpfs(runner: Runner, target: str, source: str) -> None:
    """A tmpfs named ``source`` (:func:`source_for`), just big enough for the metadata."""
    runner.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755,nosuid,nodev,noexec",
                source, target], timeout=TIMEOUT)


def remount(runner: Runner, target: str, readonly: bool) -> None:
    mode = "ro" if readonly else "rw"
    runner.run(["mount", "-o", f"remount,{mode}", target], timeout=TIMEOUT)


def umount(runner: Runner, target: str) -> None:
    runner.run(["umount", target], timeout=TIMEOUT)


def mount(runner: Runner, device: str, target: str, fstype: str, options: list[str],
          timeout: float = TIMEOUT) -> None:
    argv = ["mount", "-t", fstype]
    if options:
        argv += ["-o", ",".join(options)]
    runner.run([*argv, device, target], timeout=timeout)


def bind(runner: Runner, source: str, target: str, readonly: bool) -> None:
    """Bind ``source`` (a directory or a device node) onto ``target``.

    A read-only bind needs a second step: the kernel ignores ``ro`` on the bind itself
    and applies it only on ``remount,bind``.
    """
    runner.run(["mount", "--bind", source, target], timeout=TIMEOUT)
    if readonly:
        try:
            runner.run(["mount", "-o", "remount,bind,ro", target], timeout=TIMEOUT)
        except BaseException:
            runner.run(["umount", target], timeout=TIMEOUT)
            raise


def dev_of(rdev: int) -> str:
    """The ``major:minor`` text mountinfo uses for a device number."""
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def check_dir_target(target: str) -> None:
    """A mount target must be an empty directory, or creatable below a directory.

    Mounting over a non-empty directory would hide its contents from whoever owns them.
    Raises FailedPrecondition naming what is in the way.
    """
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise FailedPrecondition(f"target {target} exists and is not a directory")
        if not is_dir_empty(target):
            raise FailedPrecondition(
                f"target {target} is a non-empty directory; mounting over it would hide "
                "its contents")
        return
    ancestor = os.path.dirname(target)  # it will be created: the nearest existing
    while not os.path.lexists(ancestor):  # ancestor must be a directory
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise FailedPrecondition(
            f"target {target} cannot be created: {ancestor} is not a directory")


# What a target needs, said when the file system holding it refuses.
TARGET_NEEDS = ("the driver creates the target kubelet names (an empty directory or "
                "file) below its --kubelet-dir before it mounts there")


def make_dir_target(target: str, volume_id: str) -> None:
    """Create the directory ``target`` (and its parents), or say what it needs."""
    try:
        os.makedirs(target, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise from_os_error(exc, f"cannot create target directory {target} for volume "
                            f"{volume_id}", needs=TARGET_NEEDS) from exc


def make_file_target(target: str, volume_id: str) -> None:
    """Create the empty file ``target`` a device is bound onto, or say what it needs."""
    try:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        raise from_os_error(exc, f"cannot create target file {target} for volume "
                            f"{volume_id}", needs=TARGET_NEEDS) from exc


def remove_target(target: str) -> None:
    """Remove a target the driver made (a directory for a mount, a file for a bound
    device) once nothing is mounted there. Gone already is fine; one that cannot be
    removed (not empty, say) is left in place with a warning: the unpublish stands."""
    try:
        if os.path.isdir(target) and not os.path.islink(target):
            os.rmdir(target)
        else:
            os.unlink(target)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("left target %s in place: %s", target, exc.strerror)


def is_dir_empty(path: str) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None
