"""File systems on fsdax volumes: probe, create once, mount with DAX, report usage.

Why a module: NodeStageVolume must never format a device that already holds data (a
restaged volume keeps its files), must make a file system that can be mounted with
``-o dax``, and must say clearly when the volume holds something else. These rules
are the same for ext4 and xfs and for the ndctl and emulated back ends.

- Probing uses ``blkid -p`` (low-level superblock probing, no cache): exit 2 means no
  signature at all, the only state in which the driver formats.
- ext4 is made with 4 KiB blocks (DAX needs the block size to equal the page size, and
  mke2fs picks 1 KiB blocks for small "floppy"/"small" file systems) and no root
  reserve (``-m 0``: the default 5% is for root only, and a pod's user could not use
  it). xfs is made without reflink, which older kernels refuse to combine with DAX.
  Neither discards: a new volume was zeroed already, and discarding an emulated loop
  device would punch holes in its reserved backing file.
- xfs needs a device of at least 300 MiB (:data:`MIN_BYTES`; ``mkfs.xfs`` refuses
  smaller ones): :func:`make` says so before running it, and a mkfs that fails for any
  other reason is FAILED_PRECONDITION with mkfs's own words, never an INTERNAL error
  with a traceback in the driver log.
- ``-o dax`` (the legacy spelling of ``dax=always``, accepted by both file systems on
  every kernel with fsdax) is added when the back end says the device supports DAX.

The commands (probe, mkfs) take the runner to use; the node side reaches them through
:class:`csi_pmem.driver.host.mounter.HostMounter` (a fake in unit tests).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import CommandError, FailedPrecondition, InvalidArgument, from_os_error
from csi_pmem.sizes import MiB, describe_size

MKFS_TIMEOUT = 600.0
PROBE_TIMEOUT = 30.0
DAX_OPTION = "dax"
_MKFS = {
    "ext4": ["mkfs.ext4", "-F", "-q", "-b", "4096", "-m", "0", "-E", "nodiscard"],
    "xfs": ["mkfs.xfs", "-f", "-q", "-K", "-m", "reflink=0"],
}
_PACKAGE = {"ext4": "e2fsprogs", "xfs": "xfsprogs"}
# The smallest device each mkfs accepts (xfsprogs 5.19 and later: "Filesystem must be
# larger than 300MB", which is 300 MiB; ext4 has no minimum that a volume reaches).
DEFAULT_FS_TYPE = "ext4"  # an fsdax mount that names no file system, here or at create
MIN_BYTES = {"xfs": 300 * MiB}


class MkfsFailed(FailedPrecondition, CommandError):
    """mkfs exited non-zero: FAILED_PRECONDITION (the status table finds
    :class:`FailedPrecondition` first in the MRO) with mkfs's own first words, and still
    the :class:`CommandError` (argv, status, stderr) every Mounter raises for a refusal."""

    def __init__(self, exc: CommandError, message: str) -> None:
        CommandError.__init__(self, exc.argv, exc.returncode, exc.stderr)
        self.args = (message,)


@dataclass(frozen=True)
class Usage:
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int
    available_inodes: int
    used_inodes: int


def probe(runner: Runner, device: str) -> dict[str, str]:
    """The signatures ``blkid -p`` finds on ``device`` ({} when it holds none)."""
    try:
        res = runner.run(["blkid", "-p", "-o", "export", device], timeout=PROBE_TIMEOUT)
    except CommandError as exc:
        if exc.returncode == 2:  # nothing found
            return {}
        raise
    found = {}
    for line in res.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key] = value
    return found


def signature(runner: Runner, device: str) -> str | None:
    """What ``device`` holds: a file system or partition table type, "unknown" for an
    unnamed signature, None when blkid finds nothing at all."""
    found = probe(runner, device)
    if not found:
        return None
    return found.get("TYPE") or found.get("PTTYPE") or "unknown"


def refuse_other(volume: str, device: str, have: str, fs_type: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"volume {volume} already holds {have} on {device}, not {fs_type}: it is not "
        f"formatted again (that would destroy its data); use fsType {have} for it, or a "
        "new volume")


def too_small(fs_type: str, nbytes: int) -> str | None:
    """Why ``fs_type`` cannot be made on ``nbytes``, or None when it can."""
    least = MIN_BYTES.get(fs_type, 0)
    if nbytes >= least:
        return None
    return (f"{fs_type} needs a volume of at least {describe_size(least)} (mkfs.{fs_type} "
            f"refuses smaller ones), and this one is {describe_size(nbytes)}: use ext4 for "
            f"it, or a volume of at least {least // MiB}Mi for {fs_type}")


def device_size(device: str) -> int:
    """The bytes of a block device (or of a file standing in for one)."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def make(runner: Runner, device: str, fs_type: str) -> None:
    """mkfs (forced: the caller decided the device holds nothing worth keeping).

    A device too small for ``fs_type`` is INVALID_ARGUMENT before mkfs runs; a mkfs that
    fails is FAILED_PRECONDITION with its first words (mkfs.xfs ends its message with
    its usage text, whose last line says nothing about the failure)."""
    try:
        why = too_small(fs_type, device_size(device))
    except OSError as exc:
        raise from_os_error(exc, f"cannot read the size of {device} before mkfs.{fs_type}",
                            fs=device) from exc
    if why:
        raise InvalidArgument(f"cannot make {fs_type} on {device}: {why}")
    try:
        runner.run([*_MKFS[fs_type], device], timeout=MKFS_TIMEOUT)
    except CommandError as exc:
        if exc.returncode == 127:
            raise FailedPrecondition(
                f"{_MKFS[fs_type][0]} is not installed where the driver runs: install "
                f"{_PACKAGE[fs_type]} (the csi-pmem image has it)") from exc
        lines = [ln.strip() for ln in exc.stderr.splitlines() if ln.strip()]
        said = lines[0] if lines else ("timed out" if exc.returncode is None
                                       else f"exit status {exc.returncode}")
        raise MkfsFailed(exc, (
            f"mkfs.{fs_type} on {device} failed: {said}; nothing was mounted, and the "
            "next NodeStageVolume formats again (the kernel log, dmesg, may say more)")
            ) from exc


def mount_options(dax: bool, mount_flags: list[str]) -> list[str]:
    """The -o list: DAX first (when the device has it), then the user's flags."""
    user = [f for f in mount_flags if f]
    explicit = any(f == DAX_OPTION or f.startswith(DAX_OPTION + "=") for f in user)
    return ([DAX_OPTION] if dax and not explicit else []) + user


def usage(path: str) -> Usage:
    st = os.statvfs(path)
    return Usage(total_bytes=st.f_blocks * st.f_frsize,
                 available_bytes=st.f_bavail * st.f_frsize,
                 used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
                 total_inodes=st.f_files, available_inodes=st.f_favail,
                 used_inodes=st.f_files - st.f_ffree)


def apply_group(root: str, gid: int) -> None:
    """Give group ``gid`` access to the file system at ``root``, as kubelet would.

    With the VOLUME_MOUNT_GROUP capability kubelet delegates fsGroup to the driver
    instead of changing ownership itself. This does what kubelet's SetVolumeOwnership
    does (group ownership, group read/write, setgid on directories so new files
    inherit the group), and like fsGroupChangePolicy OnRootMismatch it walks the tree
    only when the root does not have the group yet.

    The tree belongs to pods that may be running: every entry is opened relative to
    its directory's fd with O_PATH|O_NOFOLLOW and changed through that fd, so a symlink
    swapped in mid-walk is never followed out of the volume.
    """
    try:
        st = os.lstat(root)
        if st.st_gid == gid and st.st_mode & stat.S_ISGID:
            return
        for _, dirnames, filenames, dir_fd in os.fwalk(root, follow_symlinks=False):
            for name in [*dirnames, *filenames]:
                _group_one(name, gid, dir_fd)
        _group_one(root, gid, None)
    except OSError as exc:
        raise from_os_error(exc, f"cannot give group {gid} (the pod's fsGroup) access to the "
                            f"file system at {root}", fs=root) from exc


def _group_one(name: str, gid: int, dir_fd: int | None) -> None:
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return  # removed by the pod meanwhile
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            return
        # chown/chmod through the fd's magic link act on the opened inode itself.
        proc = f"/proc/self/fd/{fd}"
        os.chown(proc, -1, gid)
        mode = stat.S_IMODE(st.st_mode) | stat.S_IRGRP | stat.S_IWGRP
        if stat.S_ISDIR(st.st_mode):
            mode |= stat.S_IXGRP | stat.S_ISGID
        os.chmod(proc, mode)
    finally:
        os.close(fd)
