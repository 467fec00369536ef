"""What a mapping of a volume is: DAX or page cache, large pages or not, and whether it
may ever be registered with CUDA.

Why a module of its own: these probes look at an open fd (fstat, statx, the mount
table) and map nothing, and the GPU loader and the node's copy service use them
(:func:`buffer_address`, :func:`libc`) on mappings they already hold. :func:`open_volume
<csi_pmem.weights.volume.open_volume>` asks them once per open.

:func:`registration_refusal` decides whether the mapping may ever be registered with
CUDA: the kernel refuses the long-term pins ``cudaHostRegister`` needs on fsdax files,
and a block device's mapping is page cache (docs/design.md §1, §3). Such volumes carry
``registration_refused_reason`` and the GPU loader goes straight to bounce buffers
instead of trying and failing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import struct
from collections.abc import Iterable
from typing import Any

from csi_pmem.mountinfo import MountInfo, mountinfo
from csi_pmem.weights import persist as persistence
from csi_pmem.weights.errors import VolumeError

log = logging.getLogger(__name__)

# statx(2) (glibc 2.28, Linux 5.8 for the DAX bit); Python 3.11's os has no statx.
AT_EMPTY_PATH = 0x1000
STATX_ATTR_DAX = 0x00200000
_STATX_ATTRIBUTES = 8  # offsets of stx_attributes and stx_attributes_mask (u64)
_STATX_ATTRIBUTES_MASK = 56
MOUNTINFO = "/proc/self/mountinfo"
# Mount options that make every file of the file system DAX (ext2/ext4 print "dax" or
# "dax=always", xfs "dax=always"). "dax=inode" leaves it to each file: statx tells.
DAX_MOUNT_OPTIONS = frozenset({"dax", "dax=always"})


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


def buffer_address(obj: Any) -> int:
    """Address of a buffer's first byte, also for read-only buffers.

    ``ctypes.c_char.from_buffer`` refuses read-only buffers (a PROT_READ mapping), and
    numpy is optional, so ask the buffer protocol directly. The address stays valid as
    long as the object does (a mapping does not move).
    """
    view = _PyBuffer()
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    if get(obj, ctypes.byref(view), 0) != 0:  # pragma: no cover - raises in ctypes first
        raise VolumeError("object does not expose a buffer")
    try:
        return int(view.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def statx_dax(fd: int) -> bool | None:
    """Whether an open file is DAX (``STATX_ATTR_DAX``), or None where statx cannot tell
    (no statx in libc, a kernel before 5.8, a file system that does not report it)."""
    statx = getattr(libc(), "statx", None)
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx
    if statx(fd, b"", AT_EMPTY_PATH, 0, buf) != 0:
        return None
    (attributes,) = struct.unpack_from("<Q", buf.raw, _STATX_ATTRIBUTES)
    (mask,) = struct.unpack_from("<Q", buf.raw, _STATX_ATTRIBUTES_MASK)
    if not mask & STATX_ATTR_DAX:
        return None
    return bool(attributes & STATX_ATTR_DAX)


_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """libc through ctypes, errno kept; calls through it release the GIL."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def mount_of(path: str | None, mounts: Iterable[MountInfo], dev: str = "") -> MountInfo | None:
    """The mount holding ``path`` (already resolved): the deepest mount point above it;
    among mounts on the same point the last listed, the one on top.

    ``dev`` (the file's ``st_dev`` as "major:minor") keeps only mounts of that file
    system, which guards against a path that was mounted over after the file was
    opened; with no ``path``, or none of those mounts above it, any mount of that file
    system answers (the DAX options belong to the file system, not to one mount of it).
    """
    found, depth, same_fs = None, -1, None
    for m in mounts:
        if dev and m.dev:
            if m.dev != dev:
                continue
            same_fs = m
        if path is None:
            continue
        point = m.mount_point.rstrip("/") or "/"
        inside = point == "/" or path == point or path.startswith(point + "/")
        if inside and len(point) >= depth:
            found, depth = m, len(point)
    return found or same_fs


def dax_file_reason(fd: int, path: str | None = None, *,
                    mounts: Iterable[MountInfo] | None = None) -> str | None:
    """Why the regular file ``fd`` is DAX (its mapping is the persistent memory itself),
    or None for a page-cache file or anything that is not a regular file.

    A file is DAX when statx says so, or when the mount holding it (``mounts``, default
    the process's mountinfo; found by ``path`` and by the file's device, so an fd
    received over a socket without a path still finds its file system when it is
    mounted here) has ``dax`` or ``dax=always``.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return None
    if statx_dax(fd):
        return "a DAX file (statx STATX_ATTR_DAX)"
    if mounts is None:
        try:
            mounts = mountinfo(MOUNTINFO)
        except OSError as exc:
            log.debug("cannot read %s (%s); assuming %s is not on a DAX mount",
                      MOUNTINFO, exc, path or f"fd {fd}")
            return None
    mount = mount_of(os.path.realpath(path) if path else None, mounts,
                     f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    dax = sorted(DAX_MOUNT_OPTIONS & mount.options) if mount is not None else []
    if mount is None or not dax:
        return None
    return (f"on a DAX file system ({mount.fstype} {mount.source} at "
            f"{mount.mount_point}, mounted with {dax[0]})")


def registration_refusal(fd: int, path: str | None = None, *,
                         mounts: Iterable[MountInfo] | None = None) -> str | None:
    """Why a mapping of the open ``fd`` must never be registered with CUDA, or None.

    Block devices (their mapping is page cache) and DAX files (the kernel refuses the
    long-term pins cudaHostRegister needs on fsdax pages) are refused; devdax character
    devices, tmpfs, hugetlbfs and other files keep the registered path.
    """
    return _refusal(fd, path, dax_file_reason(fd, path, mounts=mounts))


def _refusal(fd: int, path: str | None, dax: str | None) -> str | None:
    name = path or f"fd {fd}"
    if stat.S_ISBLK(os.fstat(fd).st_mode):
        return (f"{name} is a block device: its mapping is page cache, not DAX memory, "
                "and pinning it for CUDA does not pay for a one-shot copy")
    if dax is None:
        return None
    return (f"{name} is {dax}: the kernel refuses the long-term pins cudaHostRegister "
            "needs on fsdax files")


# tmpfs mounted with these serves files from 2 MiB pages (transparent huge pages).
HUGE_TMPFS_OPTIONS = frozenset({"huge=always", "huge=within_size"})


def large_pages(fd: int, path: str | None = None, *,
                mounts: Iterable[MountInfo] | None = None) -> bool:
    """Whether a mapping of ``fd`` is backed by 2 MiB (or larger) pages: a devdax
    device, or a file on hugetlbfs or on tmpfs mounted ``huge=always|within_size``.

    Why it matters: the GPU loader's first load of such a mapping registers it piece by
    piece (the driver pins large pages quickly), while a 4 KiB-page mapping pins so
    slowly that bounce buffers move it faster.
    """
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):
        return True
    if not stat.S_ISREG(st.st_mode):
        return False
    mount = _file_mount(st, path, mounts)
    if mount is None:
        return False
    return mount.fstype == "hugetlbfs" or (
        mount.fstype == "tmpfs" and bool(HUGE_TMPFS_OPTIONS & mount.options))


def _file_mount(st: os.stat_result, path: str | None,
                mounts: Iterable[MountInfo] | None) -> MountInfo | None:
    """The mount holding the file ``st`` describes (at ``path``, when known), or None
    when the mount table cannot be read or names none."""
    if mounts is None:
        try:
            mounts = mountinfo(MOUNTINFO)
        except OSError:
            return None
    return mount_of(os.path.realpath(path) if path else None, mounts,
                    f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")


def private_refusal(fd: int, path: str | None = None, *,
                    mounts: Iterable[MountInfo] | None = None) -> str | None:
    """Why ``fd`` cannot back a private (copy-on-write) mapping that is safe to write,
    or None when it can.

    Why: CPU tensors handed to a user's process are written by ordinary code
    (``mul_``, ``nn.init``, fine-tuning). A private mapping turns such a write into a
    page of the process's own memory; the volume never sees it. A devdax device only
    allows shared mappings (the kernel refuses ``MAP_PRIVATE``), and on hugetlbfs the
    private copy of a page needs a free huge page, without which the write dies of
    SIGBUS.
    """
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):
        return "a devdax device allows only shared mappings"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        return "not a file or block device"
    if stat.S_ISBLK(st.st_mode):
        return None
    mount = _file_mount(st, path, mounts)
    if mount is not None and mount.fstype == "hugetlbfs":
        return ("a hugetlbfs file: a private copy of a page needs a free huge page, "
                "and a write without one dies of SIGBUS")
    return None


def mapping_kind(fd: int, dax_reason: str | None) -> str:
    """What a mapping of ``fd`` is, for :mod:`~csi_pmem.weights.persist`."""
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):
        return persistence.KIND_DEVDAX
    if stat.S_ISREG(st.st_mode) and dax_reason is not None:
        return persistence.KIND_DAX_FILE
    return persistence.KIND_PAGE_CACHE
