"""Open a weight volume as one shared mapping, whichever way it reaches this process.

Why: a devdax volume has no file the usual loaders can open (st_size is 0, no
read()/write(); docs/design.md §3), and inside a pod it is not even a device node: the fd
arrives over the published directory's ``dax.sock``. Everything else in the loader
works on one ``MAP_SHARED`` mapping from offset 0, so this module is the one place that
knows the sources: a published volume directory (or its socket), a devdax character
device (node plugin, tests on real hardware), a plain file (emulated volumes, tmpfs or
hugetlbfs stand-ins, tests, or a file on an fsdax file system mounted ``-o dax``), a
block device (an fsdax ``volumeMode: Block`` volume, ``/dev/pmemX.Y``), and a directory
without ``dax.sock`` (an fsdax ``Filesystem`` volume's mount, or any directory), whose
volume is by convention the one image file :data:`IMAGE_NAME` inside it. Read-only
volumes are mapped PROT_READ, so a stray store faults instead of corrupting staged
weights.

An image file is the one volume that can grow (:meth:`Volume.grow`; :mod:`.image`).
Once per open it also decides, with :mod:`.mapping`'s probes, whether the mapping may
ever be registered with CUDA (``registration_refused_reason``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import stat
from typing import Any

from csi_pmem import daxclient
from csi_pmem.sizes import MiB, describe_size, round_up
from csi_pmem.weights import persist as persistence
from csi_pmem.weights.errors import AlignmentError, ReadOnlyVolumeError, VolumeError
from csi_pmem.weights.image import IMAGE_NAME, reserve, volume_image
from csi_pmem.weights.mapping import (
    _refusal,
    buffer_address,
    dax_file_reason,
    large_pages,
    libc,
    mapping_kind,
    private_refusal,
)

log = logging.getLogger(__name__)

DEFAULT_ALIGN = 2 * MiB
PAGE = mmap.PAGESIZE
# Linux 5.14+; Python 3.11's mmap module has no names for them.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
# include/uapi/linux/mman.h (x86-64); Python 3.11's mmap module has neither.
MAP_SHARED_VALIDATE = getattr(mmap, "MAP_SHARED_VALIDATE", 0x03)
MAP_SYNC = getattr(mmap, "MAP_SYNC", 0x80000)


class Volume:
    """One MAP_SHARED mapping of a whole volume plus what we know about it.

    ``size`` is the mapped length (a multiple of ``align``), ``numa_node`` is None when
    unknown, ``registration_refused_reason`` says why the mapping must not be registered
    with CUDA (fsdax files, block devices) or is None. ``image`` is the path of a
    directory volume's image file (:data:`IMAGE_NAME`), else None; a writable one keeps
    its fd, so that it can :meth:`grow` and :meth:`sync`. Views handed out (numpy
    arrays, torch tensors) keep the mapping alive after :meth:`close`; it is unmapped
    when the last of them is freed.
    """

    def __init__(self, mapping: mmap.mmap, *, size: int, align: int, numa_node: int | None,
                 writable: bool, source: str, metadata: dict[str, Any] | None = None,
                 registration_refused_reason: str | None = None,
                 image: str | None = None, fd: int | None = None,
                 persistence: persistence.Persistence = persistence.NONE,
                 map_sync: bool = False, large_pages: bool = False,
                 read_fd: int | None = None, private_fd: int | None = None,
                 private_refused_reason: str | None = "not opened for private mapping"):
        self.mapping: mmap.mmap | None = mapping
        self.size = size
        self.align = align
        self.numa_node = numa_node
        self.writable = writable
        self.source = source
        self.metadata = dict(metadata or {})
        self._view: memoryview | None = memoryview(mapping)
        self._address: int | None = None
        # Why this mapping must never be registered with CUDA (None: it may be); see
        # registration_refusal(). The GPU loader then always uses bounce buffers.
        self.registration_refused_reason = registration_refused_reason
        self.image = image
        self._fd = fd
        # How stores become durable (persist.py); logged once per writable open.
        self.persistence = persistence
        self._map_sync = map_sync
        # Backed by 2 MiB or larger pages (devdax, hugetlbfs, huge tmpfs): see
        # large_pages(); the GPU loader picks its first-load path by it.
        self.large_pages = large_pages
        # A read-only 4 KiB-page file keeps its fd for pread() (see read_fd()).
        self._read_fd = read_fd
        # Why private_mapping() cannot be had (None: it can), and the fd it maps.
        self.private_refused_reason = private_refused_reason
        self._private_fd = private_fd
        self._private: mmap.mmap | None = None

    def read_fd(self) -> int | None:
        """An fd that pread() can read the volume through, or None: kept for regular
        files on 4 KiB pages only.

        Why: a fresh mapping of such a file faults its pages in one by one (or one
        fault-around window at a time) inside the copies that first touch them; reading
        the file copies the same bytes without building page tables. A devdax device has
        no read(), and a 2 MiB-page mapping faults 512 times less often.
        """
        if self.large_pages:
            return None
        return self._fd if self._fd is not None else self._read_fd

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return (f"Volume({self.source!r}, {describe_size(self.size)}, align={self.align}, "
                f"numa_node={self.numa_node}, {mode})")

    @property
    def buffer(self) -> memoryview:
        if self._view is None:
            raise VolumeError(f"volume {self.source} is closed")
        return self._view

    @property
    def mapped(self) -> mmap.mmap:
        """The mapping itself (numpy and torch take it as a buffer); raises once closed."""
        if self.mapping is None:
            raise VolumeError(f"volume {self.source} is closed")
        return self.mapping

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise VolumeError(f"range [{offset}, {offset + length}) is outside the volume "
                              f"{self.source} of {self.size} bytes")
        return self.buffer[offset:offset + length]

    def private_mapping(self) -> mmap.mmap:
        """A second, copy-on-write mapping of the whole volume (``MAP_PRIVATE``,
        readable and writable), made on first use and kept until :meth:`close`.

        Why: CPU tensors are ordinary tensors to the code that gets them, and ordinary
        code writes into them. Through this mapping a write copies the page it touches
        into this process's own memory; the volume, and every other reader of it, keep
        the staged bytes. Pages never written stay the volume's own (no copy, no extra
        memory). ``MAP_NORESERVE``: the kernel does not charge the whole length against
        the overcommit limit up front, only the pages actually copied. Raises
        :class:`VolumeError` saying why on volumes that cannot have one
        (:attr:`private_refused_reason`: devdax, hugetlbfs, writable opens).
        """
        if self._private is not None:
            return self._private
        if self.private_refused_reason is not None or self._private_fd is None:
            raise VolumeError(f"{self.source} cannot be mapped copy-on-write: "
                              f"{self.private_refused_reason or 'its fd is not kept'}")
        if self.mapping is None:
            raise VolumeError(f"volume {self.source} is closed")
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0x4000)
        try:
            self._private = mmap.mmap(self._private_fd, self.size, flags=flags,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise VolumeError(f"copy-on-write mapping of {describe_size(self.size)} of "
                              f"{self.source} failed: {exc}") from exc
        return self._private

    @property
    def address(self) -> int:
        if self._address is None:
            self._address = buffer_address(self.mapping)
        return self._address

    def prefault(self, offset: int = 0, length: int | None = None) -> str:
        """Populate page tables for a range now, so copies do not fault page by page.

        Returns the method used. MADV_POPULATE_* (Linux 5.14) does it in the kernel in one
        call; older kernels get MADV_WILLNEED plus touching one byte per page.
        """
        length = self.size - offset if length is None else length
        start = offset - offset % PAGE
        length += offset - start
        if length <= 0 or self.mapping is None:
            return "none"
        err = self._madvise_populate(start, length)
        if err == 0:
            return "madv_populate"
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise VolumeError(f"prefault of {self.source} failed: {os.strerror(err)}")
        log.info("MADV_POPULATE not supported here; prefaulting %s by touching pages",
                 self.source)
        self.mapping.madvise(mmap.MADV_WILLNEED, start, length)
        # Slicing with a step makes CPython read one byte per page in C.
        bytes(self.buffer[start:start + length:PAGE])
        return "touch"

    def populate(self, offset: int, length: int) -> bool:
        """Fill the page tables of a range (MADV_POPULATE_*) without holding the GIL.

        Why: registering a range with CUDA pins its pages; on a fresh mapping each page
        is first faulted in, one by one, under the driver's lock. Populating slices of
        the range from several threads first (the kernel does it in parallel, ctypes
        releases the GIL) leaves registration only the pinning. False where the kernel
        has no MADV_POPULATE (before 5.14) or the mapping is closed.
        """
        if self.mapping is None or length <= 0:
            return False
        start = offset - offset % PAGE
        return self._madvise_populate(start, length + offset - start) == 0

    def _madvise_populate(self, start: int, length: int) -> int:
        """madvise(MADV_POPULATE_READ/WRITE) on a page-aligned range through libc (the
        GIL is released); 0 or the errno."""
        lib = libc()
        advice = MADV_POPULATE_WRITE if self.writable else MADV_POPULATE_READ
        rc = lib.madvise(ctypes.c_void_p(self.address + start), ctypes.c_size_t(length),
                          ctypes.c_int(advice))
        return 0 if rc == 0 else ctypes.get_errno()

    def persist(self, offset: int = 0, length: int | None = None) -> None:
        """Make a written range durable with this mapping's primitive
        (:attr:`persistence`: cache flush + fence on device-dax and MAP_SYNC DAX files,
        msync on page-cache mappings); a no-op for read-only mappings."""
        if not self.writable or self.mapping is None:
            return
        length = self.size - offset if length is None else length
        if offset < 0 or offset + length > self.size:
            raise VolumeError(f"persist range [{offset}, {offset + length}) is outside the "
                              f"volume {self.source} of {self.size} bytes")
        self.persistence.persist(self.mapping, self.address, offset, length)

    @property
    def growable(self) -> bool:
        """Whether :meth:`grow` can make room: a writable image file."""
        return self._fd is not None and self.writable

    def grow(self, size: int) -> bool:
        """Make a writable image file at least ``size`` bytes (rounded up to the align)
        and map all of it; False when it already is. Never shrinks.

        The new bytes are allocated (``posix_fallocate``), so a full file system raises
        :class:`VolumeTooSmallError` here, naming the bytes needed and free, instead of
        a store into the mapping dying of SIGBUS later. The mapping moves: addresses and
        views taken before stay valid for the old range only (staging grows before it
        takes any).
        """
        size = round_up(size, self.align)
        if size <= self.size:
            return False
        if not self.growable or self._fd is None:
            raise VolumeError(f"{self.source} is not a writable image file; it cannot grow "
                              f"to {describe_size(size)}")
        reserve(self._fd, size, self.image or self.source)
        self._remap(size)
        log.info("%s: grew to %s", self.source, describe_size(size))
        return True

    def refresh(self) -> bool:
        """Map what another process grew the image file to since it was opened (the
        sidecar calls it once it holds the staging lock); False when nothing changed."""
        if self._fd is None:
            return False
        size = os.fstat(self._fd).st_size
        size -= size % self.align
        if size <= self.size:
            return False
        self._remap(size)
        return True

    def _remap(self, size: int) -> None:
        assert self._fd is not None
        mapping, _, _ = _map(self._fd, size, self.writable, False, self.source,
                             sync=self._map_sync)
        self._unmap()
        self.mapping, self._view = mapping, memoryview(mapping)
        self.size, self._address = size, None
        self.metadata["usable_size"] = size

    def sync(self) -> None:
        """fsync a writable image file: every page stored through the mapping, its size
        and its allocation (staging msyncs each range it writes; on a file system that
        is not the whole story). A no-op for other volumes."""
        if self._fd is not None and self.writable:
            os.fsync(self._fd)

    def _unmap(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:
                # Tensors or arrays still point into it; it is unmapped when they go.
                log.debug("%s: mapping outlives close() (views still exported)", self.source)
            self.mapping = None

    def close(self) -> None:
        self._unmap()
        if self._private is not None:
            try:
                self._private.close()
            except BufferError:
                log.debug("%s: private mapping outlives close() (tensors still hold it)",
                          self.source)
            self._private = None
        for fd in {self._fd, self._read_fd, self._private_fd} - {None}:
            os.close(fd)  # type: ignore[arg-type]
        self._fd = self._read_fd = self._private_fd = None

    def __enter__(self) -> Volume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_geometry(source: str, size: int, align: int) -> None:
    if align < PAGE or align & (align - 1):
        raise AlignmentError(f"{source}: align {align} is not a power of two >= {PAGE}")
    if size <= 0:
        raise VolumeError(f"{source}: the volume is empty (size {size}); nothing to map")
    if size % align:
        raise AlignmentError(
            f"{source}: size {size} is not a multiple of the volume align "
            f"{describe_size(align)}; devdax mappings must start, end and be offset on that "
            "alignment (for a plain file, resize it to a multiple, e.g. with truncate -s)")


def _sysfs_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (OSError, ValueError):
        return None


def _volume_json(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, daxclient.METADATA_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _map(fd: int, size: int, writable: bool, prefault: bool, source: str, *,
         sync: bool = False) -> tuple[mmap.mmap, bool, bool]:
    """Map ``fd``; the flags say whether MAP_POPULATE already prefaulted it and whether
    the mapping is MAP_SYNC (asked with ``sync``, for writable DAX files: the file
    system then keeps the metadata for every written page durable at fault time, so a
    CPU cache flush persists the data; a file system that refuses falls back to a plain
    shared mapping, persisted with msync)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED
    populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
    if sync:
        try:
            return (mmap.mmap(fd, size, flags=MAP_SHARED_VALIDATE | MAP_SYNC | populate,
                              prot=prot), bool(populate), True)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise VolumeError(f"mmap of {describe_size(size)} of {source} failed: "
                                  f"{exc}") from exc
            log.warning("%s: MAP_SYNC refused (%s); mapping it without, stores are "
                        "persisted with msync", source, exc)
    try:
        return mmap.mmap(fd, size, flags=flags | populate, prot=prot), bool(populate), False
    except OSError as exc:
        if populate and exc.errno == errno.EINVAL:
            log.warning("%s: MAP_POPULATE refused (%s); mapping without it and prefaulting "
                        "with madvise", source, exc)
            return mmap.mmap(fd, size, flags=flags, prot=prot), False, False
        hint = ""
        if exc.errno == errno.EINVAL:
            hint = " (devdax needs MAP_SHARED and a length on the namespace alignment)"
        raise VolumeError(f"mmap of {describe_size(size)} of {source} failed: {exc}{hint}") \
            from exc


def _from_socket(path: str, writable: bool, timeout: float) -> tuple[int, dict[str, Any]]:
    try:
        metadata, fd = daxclient.open_volume(path, timeout=timeout)
    except daxclient.DaxSocketError as exc:
        raise VolumeError(str(exc)) from exc
    if writable and metadata.get("readonly"):
        os.close(fd)
        raise ReadOnlyVolumeError(
            f"volume {metadata.get('volume_id', '?')} at {path} is published read-only; "
            "staging writes to it: give the staging container a read-write mount of the "
            "claim (readOnly: false) and keep the serving container read-only")
    return fd, metadata


def _from_path(path: str, writable: bool) -> tuple[int, dict[str, Any]]:
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except PermissionError as exc:
        if writable:
            raise ReadOnlyVolumeError(
                f"{path} cannot be opened for writing ({exc.strerror}); staging needs a "
                "writable volume") from exc
        raise VolumeError(f"cannot open {path}: {exc.strerror}") from exc
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise ReadOnlyVolumeError(
                f"{path} is on a read-only file system; staging needs a writable volume") \
                from exc
        raise VolumeError(f"cannot open {path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    meta: dict[str, Any] = {"device": path, "readonly": not writable}
    if stat.S_ISCHR(st.st_mode):
        # devdax: st_size is 0; the device's sysfs directory has size, align, node.
        sysdir = f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        for key, name in (("usable_size", "size"), ("align", "align"),
                          ("numa_node", "numa_node")):
            value = _sysfs_int(os.path.join(sysdir, name))
            if value is not None:
                meta[key] = value
    elif stat.S_ISREG(st.st_mode):
        meta["usable_size"] = st.st_size
    elif stat.S_ISBLK(st.st_mode):
        # An fsdax namespace (/dev/pmemX.Y), a loop device: st_size is 0; the size is
        # where the end is. The namespace's NUMA node is on its device (a partition's
        # on its disk's).
        meta["usable_size"] = os.lseek(fd, 0, os.SEEK_END)
        meta["block_device"] = True
        sysdir = f"/sys/dev/block/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        for device in ("device", "../device"):
            node = _sysfs_int(os.path.join(sysdir, device, "numa_node"))
            if node is not None:
                meta["numa_node"] = node
                break
    else:
        os.close(fd)
        raise VolumeError(f"{path} is neither a regular file, a block device, a devdax "
                          "device nor a published volume directory")
    return fd, meta


def open_volume(path: str | os.PathLike[str], *, writable: bool = False,
                prefault: bool = False, align: int | None = None,
                numa_node: int | None = None, timeout: float = 10) -> Volume:
    """Map a volume: a published volume directory, its ``dax.sock``, or a plain path.

    ``writable=False`` maps PROT_READ (what loaders want); ``writable=True`` raises
    :class:`ReadOnlyVolumeError` for read-only publishes and files. ``prefault`` asks
    for MAP_POPULATE (all page tables filled at map time; on a sparse tmpfs file that
    also allocates its holes). ``align`` and ``numa_node`` override what the volume
    reports; plain files default to 2 MiB and an unknown node. A block device (fsdax
    ``volumeMode: Block``) cannot be resized, so it is mapped up to the last whole
    ``align`` rather than refused for an odd size. A directory without ``dax.sock``
    (an fsdax ``Filesystem`` volume) maps its image file :data:`IMAGE_NAME`, which
    staging creates (:func:`csi_pmem.loader.staging.open_for_staging`); without one it
    is refused with a message saying so.
    """
    path = os.fspath(path)
    opened_by_path = False
    image = volume_image(path)
    if image is not None:
        if not os.path.lexists(image):
            raise VolumeError(
                f"{path} holds neither {daxclient.SOCKET_NAME} (a published devdax volume) "
                f"nor {IMAGE_NAME} (the weights image of an fsdax file system volume): "
                f"stage a model first (csi-pmem-weights stage SRC_DIR {path}, or the "
                "sidecar), which creates the image")
        if not os.path.isfile(image):
            raise VolumeError(f"{image} is not a regular file; remove it and stage again")
        fd, meta = _from_path(image, writable)
        meta["image"] = image
        opened_by_path = True
    elif os.path.isdir(path):
        fd, meta = _from_socket(os.path.join(path, daxclient.SOCKET_NAME), writable, timeout)
        if meta.get("numa_node") is None:
            meta["numa_node"] = _volume_json(path).get("numa_node")
    elif os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        fd, meta = _from_socket(path, writable, timeout)
    elif os.path.exists(path):
        fd, meta = _from_path(path, writable)
        opened_by_path = True
    else:
        raise VolumeError(f"{path} does not exist")
    keep_fd = image is not None and writable  # to grow and fsync the image
    try:
        try:
            size = int(meta["usable_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise VolumeError(f"{path}: cannot tell the volume's size ({meta!r})") from exc
        align = int(align or meta.get("align") or DEFAULT_ALIGN)
        if meta.get("block_device") and 0 < size < align:
            raise VolumeError(f"{path}: the block device ({describe_size(size)}) is smaller "
                              f"than one volume align ({describe_size(align)})")
        if meta.get("block_device") and size % align:
            log.info("%s: mapping %s of the %s block device (whole multiples of the "
                     "%s align)", path, describe_size(size - size % align), describe_size(size),
                     describe_size(align))
            size -= size % align
        _check_geometry(image or path, size, align)
        # A socket's fd may come from another mount namespace: no path to trust there.
        trusted_path = (image or path) if opened_by_path else None
        dax = dax_file_reason(fd, trusted_path)  # one mountinfo read for both uses
        refused = _refusal(fd, trusted_path, dax)
        kind = mapping_kind(fd, dax)
        huge = large_pages(fd, trusted_path)
        node = numa_node if numa_node is not None else meta.get("numa_node")
        node = int(node) if node is not None and int(node) >= 0 else None
        mapping, populated, synced = _map(fd, size, writable, prefault, image or path,
                                          sync=writable and kind == persistence.KIND_DAX_FILE)
        if kind == persistence.KIND_DAX_FILE and not synced:
            kind = persistence.KIND_PAGE_CACHE
        try:
            durable = persistence.for_mapping(kind, writable)
        except BaseException:
            mapping.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    # A read-only 4 KiB-page file keeps its fd for pread() (Volume.read_fd), and a
    # read-only volume that can be mapped copy-on-write keeps it for
    # Volume.private_mapping().
    keep_read_fd = not keep_fd and not huge and stat.S_ISREG(os.fstat(fd).st_mode)
    private = ("opened writable (for staging)" if writable
               else private_refusal(fd, trusted_path))
    keep_private_fd = not keep_fd and private is None
    if not keep_fd and not keep_read_fd and not keep_private_fd:
        os.close(fd)
    volume = Volume(mapping, size=size, align=align, numa_node=node, writable=writable,
                    source=image or path, metadata=meta, registration_refused_reason=refused,
                    image=image, fd=fd if keep_fd else None, persistence=durable,
                    map_sync=synced, large_pages=huge,
                    read_fd=fd if keep_read_fd else None,
                    private_fd=fd if keep_private_fd else None,
                    private_refused_reason=private)
    if prefault and not populated:
        volume.prefault()
    if writable:
        log.info("%s: stores persisted with %s", volume.source, durable.detail)
    log.debug("opened %r", volume)
    return volume
