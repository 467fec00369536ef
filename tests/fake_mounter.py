"""An in-memory :class:`csi_pmem.driver.host.mounter.Mounter` for the unit tier: no root, no kernel.

Why: the mounter is everything the node side does to the host. With this fake in its
place, ``Driver`` and the emulated back end run in one unprivileged process, so the node
logic (idempotency, access modes, target checks, reconcile) is tested in milliseconds.
Like aws-ebs-csi-driver's ``pkg/mounter`` fake it keeps a mount table, and like the
kernel it refuses, with the error the real command raises (a ``CommandError`` carrying
util-linux's words, which callers quote and retry on):

- mounting on a missing target or on one of the wrong kind (a file system or tmpfs needs
  a directory; a bind needs a directory for a directory and a file for a file or device);
- a file system mount of a device that holds no such file system, or with an option the
  file system does not know; ext4 with ``dax`` (none of the fake's devices has DAX; xfs
  turns it off instead);
- unmounting or remounting what is not mounted; unmounting a mount with another mount
  below it ("target is busy"); unmounting or sealing (remount read-only) what a test
  marks busy with :meth:`busy`;
- mkfs on a mounted device; a loop device over a missing file; detaching an unknown one.

What it models, and how:

- A mount hides what its target held: the target's entries move to a stash at mount and
  come back at unmount. A tmpfs starts empty and its content is dropped at unmount. A file
  system's content lives with its device: it moves to the device's store at unmount and
  back at the next mount, so a restaged volume finds its files.
- A bind shows the source's mount (type, device, root) at the target and, for a device,
  the device number; files are not mirrored (a test looks at the source).
- Loop devices are symlinks ``<root>/dev/loopN`` to what they are attached to, device
  number 7:N: opening one opens the file, so erase and mkfs write there.
- A file system is a marker at the start of its device (``FAKEFS:<type>``): it survives
  a restart, is gone once the volume is erased, and a new namespace holds none.
- Read-only is recorded in the mount table, not enforced on writes.
- :meth:`reboot` forgets every mount and loop device, as a node restart does.

Used only by tests; ``tests/test_mounter_contract.py`` checks it against the kernel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from csi_pmem.driver.host.mounts import dev_of
from csi_pmem.errors import CommandError, Unavailable
from csi_pmem.mountinfo import MountInfo

FS_MAGIC = b"FAKEFS:"
FS_TYPES = ("ext4", "xfs")
LOOP_MAJOR = 7
# Option names (before any "=") each file system accepts; anything else is refused the
# way the kernel refuses an unknown option.
VFS_OPTIONS = frozenset({
    "ro", "rw", "sync", "async", "atime", "noatime", "relatime", "norelatime",
    "strictatime", "diratime", "nodiratime", "lazytime", "nolazytime", "suid", "nosuid",
    "dev", "nodev", "exec", "noexec", "dirsync", "iversion", "noiversion", "defaults"})
FS_OPTIONS = {
    "ext4": VFS_OPTIONS | {"dax", "discard", "nodiscard", "data", "barrier", "nobarrier",
                           "errors", "user_xattr", "acl", "noacl", "delalloc",
                           "nodelalloc", "commit", "journal_checksum", "noload", "stripe"},
    "xfs": VFS_OPTIONS | {"dax", "discard", "nodiscard", "noquota", "inode32", "inode64",
                          "largeio", "nolargeio", "wsync", "logbufs", "logbsize",
                          "allocsize", "grpid", "nogrpid", "uquota", "gquota", "pquota",
                          "prjquota", "swalloc", "sunit", "swidth", "norecovery"},
}
TMPFS_OPTIONS = frozenset({"rw", "nosuid", "nodev", "noexec", "size=1024k", "mode=755"})


@dataclass
class _Mount:
    info: MountInfo
    kind: str  # tmpfs, fs, bind
    stash: Path  # what the target held before (hidden by the mount)
    rdev: int | None = None  # a device bound onto a file
    store: Path | None = None  # a file system's content, kept with its device


@dataclass
class _Loop:
    back: str
    number: int
    readonly: bool


def _mount_error(target: str, why: str) -> CommandError:
    return CommandError(["mount", target], 32, f"mount: {target}: {why}\n")


class FakeMounter:
    """See the module docstring. ``root`` is a directory of its own (loop devices,
    stashes, file system contents)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.dev_dir = self.root / "dev"
        for sub in ("dev", "stash", "fs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.calls: list[tuple] = []  # what was done to the "host", in order
        self._table: list[_Mount] = []
        self._loops: dict[str, _Loop] = {}
        self._busy: dict[str, int] = {}
        self._anon = 40  # minor numbers of tmpfs mounts (major 0), like the kernel's
        self._stashes = 0
        self._lock = threading.RLock()

    # -- test controls --------------------------------------------------------------
    def busy(self, target: str, times: int = 1) -> None:
        """The next ``times`` umounts or read-only remounts of ``target`` fail as busy
        (what a forked child holding our fds, or a file open for writing, causes)."""
        self._busy[target] = times

    def reboot(self) -> None:
        """Forget every mount and loop device, as a node restart does."""
        with self._lock:
            while self._table:
                self._pop(self._table[-1])
            for device in list(self._loops):
                self._drop_loop(device)
            self.calls.append(("reboot",))

    def mounts(self) -> list[MountInfo]:
        """The mount table, oldest first."""
        with self._lock:
            return [m.info for m in self._table]

    # -- Mounter: queries -------------------------------------------------------------
    def find(self, target: str) -> MountInfo | None:
        top = self._top(target)
        return top.info if top is not None else None

    def device_number(self, path: str) -> int | None:
        with self._lock:
            loop = self._loops.get(path)
            if loop is not None:
                return os.makedev(LOOP_MAJOR, loop.number)
            top = self._top(path)
            if top is not None and top.rdev is not None:
                return top.rdev
        st = os.stat(path)
        return st.st_rdev if stat.S_ISBLK(st.st_mode) else None

    # -- Mounter: mounts --------------------------------------------------------------
    def mount_tmpfs(self, target: str, source: str) -> None:
        with self._lock:
            self._check_dir_target(target)
            self._anon += 1
            info = MountInfo(target, "tmpfs", source, TMPFS_OPTIONS, dev=f"0:{self._anon}")
            self._push(_Mount(info, "tmpfs", self._stash(target)))
            self.calls.append(("mount_tmpfs", target, source))

    def mount(self, device: str, target: str, fstype: str, options: list[str]) -> None:
        with self._lock:
            rdev = self._device(device, target)
            self._check_dir_target(target)
            bad = f"wrong fs type, bad option, bad superblock on {device}, missing " \
                  "codepage or helper program, or other error."
            if self.fs_signature(device) != fstype:
                raise _mount_error(target, bad)
            known = FS_OPTIONS.get(fstype, VFS_OPTIONS)
            if any(o.partition("=")[0] not in known for o in options):
                raise _mount_error(target, bad)
            dax = [o for o in options if o in ("dax", "dax=always")]
            if dax and fstype == "ext4":
                raise _mount_error(target, bad)  # "DAX unsupported by block device."
            store = self._store(device)
            # xfs turns DAX off instead ("DAX unsupported by block device. Turning off DAX.")
            options_set = frozenset(o for o in options if o not in dax) \
                | {"ro" if "ro" in options else "rw"}
            info = MountInfo(target, fstype, device, options_set, dev=dev_of(rdev))
            mount = _Mount(info, "fs", self._stash(target), store=store)
            _move_entries(store, Path(target))
            self._push(mount)
            self.calls.append(("mount", device, target, fstype, tuple(options)))

    def bind(self, source: str, target: str, readonly: bool) -> None:
        with self._lock:
            if not os.path.lexists(target):
                raise _mount_error(target, "mount point does not exist.")
            if not os.path.exists(source):
                raise _mount_error(target, f"special device {source} does not exist.")
            if os.path.isdir(source) and not os.path.isdir(target):
                raise _mount_error(target, "mount point is not a directory.")
            if os.path.isdir(target) and not os.path.isdir(source):
                raise _mount_error(target, "mount(2) system call failed: Not a directory.")
            mode = "ro" if readonly else "rw"
            rdev = self.device_number(source)
            under = self._containing(source)
            if rdev is not None:
                info = MountInfo(target, "devtmpfs", "udev", frozenset({mode}),
                                 dev=dev_of(os.lstat(source).st_dev), root=source)
            elif under is not None:
                rel = os.path.relpath(source, under.info.mount_point)
                root = os.path.normpath(os.path.join(under.info.root, rel))
                info = replace(under.info, mount_point=target, root=root,
                               options=(under.info.options - {"ro", "rw"}) | {mode})
            else:
                info = MountInfo(target, "host", "host", frozenset({mode}),
                                 dev=dev_of(os.stat(source).st_dev), root=source)
            stash = self._stash(target) if os.path.isdir(target) else self._new_stash()
            self._push(_Mount(info, "bind", stash, rdev=rdev))
            self.calls.append(("bind", source, target, readonly))

    def remount(self, target: str, readonly: bool) -> None:
        with self._lock:
            top = self._top(target)
            if top is None:
                raise _mount_error(target, "mount point not mounted or bad option.")
            if readonly and self._take_busy(target):  # files open for writing
                raise _mount_error(target, "mount point is busy.")
            mode = "ro" if readonly else "rw"
            top.info = replace(top.info, options=(top.info.options - {"ro", "rw"}) | {mode})
            self.calls.append(("remount", target, readonly))

    def umount(self, target: str) -> None:
        with self._lock:
            top = self._top(target)
            if top is None:
                raise CommandError(["umount", target], 32, f"umount: {target}: not mounted.\n")
            below = [m for m in self._table
                     if m.info.mount_point.startswith(target.rstrip("/") + "/")]
            if below or self._take_busy(target):
                raise CommandError(["umount", target], 32,
                                   f"umount: {target}: target is busy.\n")
            self._pop(top)
            self.calls.append(("umount", target))

    # -- Mounter: file systems -------------------------------------------------------
    def fs_signature(self, device: str) -> str | None:
        try:
            with open(device, "rb") as f:
                head = f.read(64)
        except FileNotFoundError:
            return None  # blkid -p finds nothing on a missing path either
        if not head.startswith(FS_MAGIC):
            return None
        return head[len(FS_MAGIC):].partition(b"\n")[0].decode()

    def make_fs(self, device: str, fs_type: str) -> None:
        if fs_type not in FS_TYPES:
            raise ValueError(f"the fake knows no file system {fs_type!r}")
        with self._lock:
            if any(m.kind == "fs" and m.info.source == device for m in self._table):
                raise CommandError([f"mkfs.{fs_type}", device], 1,
                                   f"{device} is mounted; will not make a filesystem here!\n")
            with open(device, "r+b") as f:
                f.write(FS_MAGIC + fs_type.encode() + b"\n")
            store = self._store(device)
            shutil.rmtree(store)
            store.mkdir()
            self.calls.append(("make_fs", device, fs_type))

    # -- Mounter: loop devices -------------------------------------------------------
    def loop_devices(self) -> dict[str, str]:
        with self._lock:
            return {device: loop.back for device, loop in self._loops.items()}

    def attach_loop(self, path: str, *, readonly: bool = False,
                    sizelimit: int | None = None) -> str:
        with self._lock:
            if not os.path.exists(path):
                raise Unavailable(
                    f"cannot attach {path} to a loop device (losetup: {path}: failed to set "
                    "up loop device: No such file or directory)")
            used = {loop.number for loop in self._loops.values()}
            number = next(n for n in range(len(used) + 1) if n not in used)
            device = str(self.dev_dir / f"loop{number}")
            os.symlink(os.path.abspath(path), device)
            # losetup reports the path it opened, with directories resolved.
            back = os.path.join(os.path.realpath(os.path.dirname(path)),
                                os.path.basename(path))
            self._loops[device] = _Loop(back, number, readonly)
            self.calls.append(("attach_loop", path, readonly, sizelimit))
            return device

    def detach_loop(self, device: str) -> None:
        with self._lock:
            if device not in self._loops:
                raise CommandError(["losetup", "--detach", device], 1,
                                   f"losetup: {device}: detach failed: No such device or "
                                   "address\n")
            self._drop_loop(device)
            self.calls.append(("detach_loop", device))

    # -- helpers ------------------------------------------------------------------------
    def _top(self, target: str) -> _Mount | None:
        with self._lock:
            for m in reversed(self._table):
                if m.info.mount_point == target:
                    return m
        return None

    def _containing(self, path: str) -> _Mount | None:
        """The mount ``path`` lies in (the deepest, then the newest), if any."""
        best = None
        for m in self._table:
            point = m.info.mount_point
            if path == point or path.startswith(point.rstrip("/") + "/"):
                if best is None or len(point) >= len(best.info.mount_point):
                    best = m
        return best

    def _device(self, device: str, target: str) -> int:
        try:
            rdev = self.device_number(device)
        except FileNotFoundError:
            raise _mount_error(target, f"special device {device} does not exist.") from None
        if rdev is None:
            raise _mount_error(target, f"{device} is not a block device.")
        return rdev

    @staticmethod
    def _check_dir_target(target: str) -> None:
        if not os.path.lexists(target):
            raise _mount_error(target, "mount point does not exist.")
        if not os.path.isdir(target):
            raise _mount_error(target, "mount point is not a directory.")

    def _take_busy(self, target: str) -> bool:
        left = self._busy.get(target, 0)
        if left <= 0:
            return False
        self._busy[target] = left - 1
        return True

    def _new_stash(self) -> Path:
        self._stashes += 1
        stash = self.root / "stash" / str(self._stashes)
        stash.mkdir()
        return stash

    def _stash(self, target: str) -> Path:
        stash = self._new_stash()
        _move_entries(Path(target), stash)
        return stash

    def _store(self, device: str) -> Path:
        key = hashlib.sha256(os.path.realpath(device).encode()).hexdigest()[:16]
        store = self.root / "fs" / key
        store.mkdir(exist_ok=True)
        return store

    def _push(self, mount: _Mount) -> None:
        self._table.append(mount)

    def _pop(self, mount: _Mount) -> None:
        self._table.remove(mount)
        target = Path(mount.info.mount_point)
        if target.is_dir() and mount.kind != "bind":
            if mount.kind == "fs" and mount.store is not None:
                _move_entries(target, mount.store)
            else:
                _clear(target)
        if target.is_dir():
            _move_entries(mount.stash, target)
        shutil.rmtree(mount.stash, ignore_errors=True)

    def _drop_loop(self, device: str) -> None:
        del self._loops[device]
        Path(device).unlink(missing_ok=True)


def _move_entries(src: Path, dst: Path) -> None:
    if not src.is_dir():
        return
    for entry in list(src.iterdir()):
        shutil.move(str(entry), str(dst / entry.name))


def _clear(path: Path) -> None:
    for entry in list(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


__all__ = ["FakeMounter"]
