"""What the node side does to the host, behind one interface: mounts, loops, file systems.

Why an interface: publishing a volume mounts a tmpfs, binds devices and file systems,
attaches loop devices and runs mkfs, and recognising its own work after a restart reads
the mount table. Those need root and a real kernel; the policy around them (idempotency,
access modes, target checks, reconcile) does not. With the host behind :class:`Mounter`
the driver, the emulated back end and an in-memory fake (``tests/fake_mounter.py``, like
aws-ebs-csi-driver's ``pkg/mounter``) run in one unprivileged process, which is what the
unit tier (``tests/unit``) does; :class:`HostMounter` is the real thing, everywhere else.

What stays outside: plain file operations in directories the driver owns (creating a
target, writing ``volume.json``, handing a file system to the pod's fsGroup, statvfs).
They need no privilege and act the same on a fake mount, whose target is an ordinary
directory.

Errors are part of the contract: a refused mount or umount raises
:class:`csi_pmem.errors.CommandError` with the kernel's words in ``stderr`` (callers
retry on "busy" and quote the rest), and a loop device that cannot be made raises
:class:`csi_pmem.errors.Unavailable`.
"""

from __future__ import annotations

import os
import stat
from typing import Protocol, runtime_checkable

from csi_pmem.driver.host import filesystems, loops, mounts
from csi_pmem.driver.host.runner import Runner, default_runner
from csi_pmem.mountinfo import MOUNTINFO, MountInfo, find


@runtime_checkable
class LoopDevices(Protocol):
    """Loop devices: what the emulated back end needs from the host (fsdax namespaces
    are loop devices over backing files)."""

    def loop_devices(self) -> dict[str, str]:
        """{loop device: the file or device it is attached to} for every attached loop."""
        ...

    def attach_loop(self, path: str, *, readonly: bool = False,
                    sizelimit: int | None = None) -> str:
        """Attach ``path`` to a free loop device and return the device."""
        ...

    def detach_loop(self, device: str) -> None: ...


@runtime_checkable
class Mounter(LoopDevices, Protocol):
    """Everything the node publishers (:mod:`csi_pmem.driver.node`) do to the host."""

    def find(self, target: str) -> MountInfo | None:
        """The top-most mount at ``target``, or None."""
        ...

    def mount_tmpfs(self, target: str, source: str) -> None:
        """Mount a small tmpfs named ``source`` on the directory ``target``."""
        ...

    def mount(self, device: str, target: str, fstype: str, options: list[str]) -> None:
        """Mount the file system on ``device`` at the directory ``target``."""
        ...

    def bind(self, source: str, target: str, readonly: bool) -> None:
        """Bind ``source`` (a directory, or a device node onto a file) onto ``target``."""
        ...

    def remount(self, target: str, readonly: bool) -> None: ...

    def umount(self, target: str) -> None: ...

    def device_number(self, path: str) -> int | None:
        """``st_rdev`` of the block device at ``path`` (also through a device bound onto
        it), None when ``path`` is no block device; FileNotFoundError when missing."""
        ...

    def fs_signature(self, device: str) -> str | None:
        """What ``device`` holds (a file system or partition table type, "unknown"), or
        None when it holds no signature at all: the only state in which to format."""
        ...

    def make_fs(self, device: str, fs_type: str) -> None:
        """Make an ``fs_type`` file system on ``device`` (forced: the caller checked)."""
        ...


class HostMounter:
    """The host's kernel, through the project's :class:`~csi_pmem.driver.host.runner.Runner`
    (argv lists, timeouts, ``LC_ALL=C``) and ``/proc/self/mountinfo``."""

    def __init__(self, runner: Runner | None = None, mountinfo_path: str = MOUNTINFO) -> None:
        self.runner = runner or default_runner()
        self.mountinfo_path = mountinfo_path

    # -- mounts -------------------------------------------------------------------
    def find(self, target: str) -> MountInfo | None:
        return find(target, self.mountinfo_path)

    def mount_tmpfs(self, target: str, source: str) -> None:
        mounts.mount_tmpfs(self.runner, target, source)

    def mount(self, device: str, target: str, fstype: str, options: list[str]) -> None:
        mounts.mount(self.runner, device, target, fstype, options)

    def bind(self, source: str, target: str, readonly: bool) -> None:
        mounts.bind(self.runner, source, target, readonly)

    def remount(self, target: str, readonly: bool) -> None:
        mounts.remount(self.runner, target, readonly)

    def umount(self, target: str) -> None:
        mounts.umount(self.runner, target)

    # -- devices and file systems -------------------------------------------------
    def device_number(self, path: str) -> int | None:
        st = os.stat(path)
        return st.st_rdev if stat.S_ISBLK(st.st_mode) else None

    def fs_signature(self, device: str) -> str | None:
        return filesystems.signature(self.runner, device)

    def make_fs(self, device: str, fs_type: str) -> None:
        filesystems.make(self.runner, device, fs_type)

    # -- loop devices -------------------------------------------------------------
    def loop_devices(self) -> dict[str, str]:
        return loops.devices(self.runner)

    def attach_loop(self, path: str, *, readonly: bool = False,
                    sizelimit: int | None = None) -> str:
        return loops.attach(self.runner, path, readonly=readonly, sizelimit=sizelimit)

    def detach_loop(self, device: str) -> None:
        loops.detach(self.runner, device)


__all__ = ["HostMounter", "LoopDevices", "Mounter"]
