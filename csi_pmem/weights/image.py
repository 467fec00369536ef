"""The image file of a directory volume: fsdax file system volumes hold the weights in it.

Why: a directory without ``dax.sock`` (an fsdax ``Filesystem`` volume's mount, or any
directory) has no device to map, so its volume is by convention the one image file
:data:`IMAGE_NAME` inside it. An image file is the one volume that can grow: staging
sizes it for the model (:func:`prepare_image`, :meth:`Volume.grow
<csi_pmem.weights.volume.Volume.grow>`, with ``posix_fallocate`` so a full file system
is an error at stage time, not a SIGBUS in the middle of a copy) and never shrinks it
(pods may map it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

from csi_pmem import daxclient
from csi_pmem.durable import fsync_dir
from csi_pmem.sizes import describe_size
from csi_pmem.weights.errors import ReadOnlyVolumeError, VolumeError, VolumeTooSmallError

log = logging.getLogger(__name__)


# The volume of a directory without dax.sock (an fsdax Filesystem volume's mount, or any
# directory): this one file in it, created and grown by staging.
IMAGE_NAME = "csi-pmem-weights.img"


def volume_image(path: str | os.PathLike[str]) -> str | None:
    """The image file of a directory volume, whether it exists yet or not; None for
    every other kind of volume path.

    A directory volume is a directory with neither ``dax.sock`` nor ``volume.json``: an
    fsdax file system volume's mount, or any directory. A devdax publish directory keeps
    ``volume.json`` while its socket is briefly gone (node plugin restarting), so it is
    never mistaken for one and never gets an image written into it.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    for name in (daxclient.SOCKET_NAME, daxclient.METADATA_FILE):
        if os.path.lexists(os.path.join(path, name)):
            return None
    return os.path.join(path, IMAGE_NAME)


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def reserve(fd: int, size: int, path: str) -> None:
    """Make the regular file ``fd`` (at ``path``) at least ``size`` bytes long with all
    of them allocated (``posix_fallocate``: ENOSPC now, not a SIGBUS when a store into
    a MAP_SHARED mapping of a hole meets a full file system). On failure the file keeps
    its old size. Never shrinks."""
    old = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, 0, max(size, old))
    except OSError as exc:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size > old:
                os.ftruncate(fd, old)  # give back a partial allocation past the old end
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            allocated = os.fstat(fd).st_blocks * 512
            needed = max(size - allocated, size - old, 0)
            free = _free_bytes(os.path.dirname(os.path.abspath(path)))
            quota = " (or the quota)" if exc.errno == errno.EDQUOT else ""
            raise VolumeTooSmallError(
                f"no space for {path}: it must be {describe_size(size)}, "
                f"{describe_size(needed)} more than is allocated now, but its file "
                f"system{quota} has only {describe_size(free)} free. Free space on that "
                "file system, stage with --replace (discards the models in the image and "
                "reuses its space) or use a larger volume", needed=needed,
                available=free) from exc
        raise VolumeError(f"cannot allocate {describe_size(size)} for {path}: "
                          f"{exc.strerror}") from exc
    if os.fstat(fd).st_size < size:  # posix_fallocate extends the file; be sure of it
        os.ftruncate(fd, size)


def prepare_image(image: str, size: int) -> bool:
    """Make the image file ``image`` exist with at least ``size`` bytes, allocated
    (:func:`reserve`); True when this call created it.

    A new image appears complete or not at all: it is allocated under a temporary name
    and linked into place, so a reader never maps a half-made one, and two stagers
    creating it at once both end up with the same file. An existing image only grows
    (and gets its holes allocated, should it have been made sparse by hand).
    """
    directory = os.path.dirname(image) or "."

    def refused(exc: OSError) -> VolumeError:
        if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            return ReadOnlyVolumeError(
                f"cannot write {image} ({exc.strerror}): staging into a directory volume "
                "creates and grows that file, so it needs a writable mount of the volume")
        return VolumeError(f"cannot prepare {image}: {exc.strerror or exc}")

    if os.path.lexists(image):
        if not os.path.isfile(image):
            raise VolumeError(f"{image} is not a regular file; remove it and stage again")
        st = os.stat(image)
        if st.st_size >= size and st.st_blocks * 512 >= st.st_size:
            return False  # large enough and allocated (not a sparse file made by hand)
        try:
            fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise refused(exc) from exc
        try:
            reserve(fd, size, image)
            os.fsync(fd)
        finally:
            os.close(fd)
        return False
    # Random, not just the pid: stagers in two pods may have the same pid.
    tmp = os.path.join(directory, f".{IMAGE_NAME}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o664)
    except OSError as exc:
        raise refused(exc) from exc
    try:
        try:
            reserve(fd, size, image)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, image)
            created = True
        except FileExistsError:  # another stager was quicker: use its image
            created = False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(directory)
    if not created:
        return prepare_image(image, size)
    log.info("created %s (%s)", image, describe_size(size))
    return True
