"""Node side of fsdax volumes: a raw block device, or ext4/xfs mounted with -o dax.

Why separate from devdax publishing: an fsdax namespace is a block device
(``/dev/pmemX.Y``), so it is published the way every block-storage CSI driver does it,
not through dax.sock (docs/design.md §6.1):

- ``volumeMode: Block``: NodePublishVolume creates the target file and binds the device
  node onto it; kubelet then loop-attaches it and gives the container the device with
  ``rw`` or, for a read-only claim, ``r`` device-cgroup permissions. A read-only
  publication binds a read-only loop device over the namespace instead (its ``view``):
  a read-only bind mount of a device node does not stop writes to the device, a
  read-only block device does (EPERM). NodeStageVolume has nothing to do.
- ``volumeMode: Filesystem``: NodeStageVolume makes the file system once (never over
  existing data, see :mod:`csi_pmem.driver.host.filesystems`) and mounts it at the staging path with
  ``-o dax`` where the device supports DAX; NodePublishVolume binds the staging mount
  onto each pod's target (read-only when asked) and applies the pod's fsGroup, which
  kubelet delegates to drivers with VOLUME_MOUNT_GROUP.

The same intent-then-act discipline as every publisher (:mod:`csi_pmem.driver.node`): the
record says ``staging``/``publishing`` before anything is mounted, and
:meth:`FsdaxNode.reconcile` finishes or drops what a crash interrupted, trusting
the mount table for what is mounted. The caller holds the volume's in-flight slot.
Everything done to the host (mounts, loop devices, mkfs, device numbers) goes through
the :class:`~csi_pmem.driver.host.mounter.Mounter` it is given (a fake in unit tests).
"""

from __future__ import annotations

import logging
import os

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace
from csi_pmem.driver.host import filesystems, mounts
from csi_pmem.driver.host.mounter import Mounter
from csi_pmem.driver.node.access import Access, PublishRequest
from csi_pmem.driver.node.busy import umount
from csi_pmem.driver.state import (
    BLOCK,
    MOUNT,
    PUBLISHED,
    PUBLISHING,
    STAGED,
    STAGING,
    UNPUBLISHING,
    Publication,
    Stage,
    StateStore,
    VolumeRecord,
)
from csi_pmem.errors import (
    AlreadyExists,
    CommandError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from csi_pmem.mountinfo import MountInfo

log = logging.getLogger(__name__)
PENDING_VIEW = "pending"  # recorded before a read-only view is attached


class FsdaxNode:
    def __init__(self, backend: Backend, store: StateStore, mounter: Mounter) -> None:
        self.backend = backend
        self.store = store
        self.mounter = mounter

    # ------------------------------------------------------------------ helpers
    def _namespace(self, rec: VolumeRecord) -> Namespace:
        ns = self.backend.get(rec.id)
        if ns is None or not ns.device:
            raise FailedPrecondition(f"the block device of volume {rec.id} has disappeared")
        return ns

    def _umount(self, path: str) -> None:
        umount(self.mounter, path)  # retries while busy

    def _rdev(self, device: str) -> int:
        try:
            rdev = self.mounter.device_number(device)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"device {device} does not exist; is /dev the host's "
                                     "/dev in this container?") from exc
        if rdev is None:
            raise FailedPrecondition(f"{device} is not a block device")
        return rdev

    def _fs_mounted(self, path: str, rdev: int) -> MountInfo | None:
        """The mount at ``path`` if it is a file system on device ``rdev``."""
        current = self.mounter.find(path)
        if current is not None and current.dev == mounts.dev_of(rdev):
            return current
        return None

    def _device_bound(self, path: str, rdev: int) -> MountInfo | None:
        """The mount at ``path`` if it is device ``rdev`` bound onto a file."""
        current = self.mounter.find(path)
        if current is None:
            return None
        try:
            bound = self.mounter.device_number(path)
        except OSError:
            return None
        return current if bound == rdev else None

    def _ours(self, pub: Publication, rdev: int) -> MountInfo | None:
        if pub.kind == BLOCK:
            if pub.view:
                view = self._view_rdev(pub.view)
                return self._device_bound(pub.target, view) if view is not None else None
            return self._device_bound(pub.target, rdev)
        return self._fs_mounted(pub.target, rdev)

    def _view_rdev(self, view: str) -> int | None:
        try:
            return self.mounter.device_number(view)
        except OSError:
            return None

    def _detach_view(self, rec: VolumeRecord, pub: Publication, device: str) -> None:
        """Detach a read-only view, after checking it still sits on our device.

        A ``pending`` view (the process died between attaching it and recording which
        loop device it got) is found as a loop device on our device that no other
        publication of this volume names: nothing else puts loop devices on ours.
        """
        attached = self.mounter.loop_devices()
        if pub.view == PENDING_VIEW:
            named = {p.view for p in rec.publications.values()}
            for name, back in attached.items():
                if back == device and name not in named:
                    self.mounter.detach_loop(name)
        elif pub.view and attached.get(pub.view) == device:
            self.mounter.detach_loop(pub.view)

    def _refuse_blind(self, rec: VolumeRecord, path: str, recorded: bool) -> None:
        """Without the device the driver cannot tell whether a mount at ``path`` is the
        volume's: it must neither drop the record of a mount that may be live (a later
        DeleteVolume would erase under it) nor unmount what may be someone else's."""
        if recorded and self.mounter.find(path) is not None:
            raise Unavailable(
                f"the device of volume {rec.id} cannot be found (namespace disabled, or "
                f"/dev not the host's?), so the mount at {path} cannot be checked; try "
                "again once the device is back")

    def _current_rdev(self, rec: VolumeRecord) -> int | None:
        ns = self.backend.get(rec.id)
        if ns is None or not ns.device:
            return None
        try:
            return self._rdev(ns.device)
        except FailedPrecondition:
            return None

    # ------------------------------------------------------------------ stage
    def stage(self, rec: VolumeRecord, path: str, access: Access) -> None:
        if access.kind == BLOCK:
            return  # the device is bound per pod at publish; nothing to share
        blocks = sorted(t for t, p in rec.publications.items() if p.kind == BLOCK)
        if blocks:
            raise FailedPrecondition(
                f"volume {rec.id} is published as a raw block device at {blocks[0]}; it "
                "cannot be mounted as a file system at the same time")
        ns = self._namespace(rec)
        rdev = self._rdev(ns.device)
        # One staging path per volume and node (the CO ensures it, CSI NodeStageVolume):
        # a second one would be a second mount of the same file system. A record whose
        # mount is gone stages nothing and is no reason to refuse.
        elsewhere = sorted(p for p in rec.stages
                           if p != path and self._fs_mounted(p, rdev) is not None)
        if elsewhere:
            raise AlreadyExists(
                f"volume {rec.id} is already staged at {elsewhere[0]}, not {path}: a volume "
                "has one staging path per node; unstage it there before staging it "
                "elsewhere")
        staged = rec.stages.get(path)
        if self._fs_mounted(path, rdev) is not None:
            if staged is not None and staged.state == STAGED:
                if staged.fs_type != access.fs_type \
                        or staged.mount_flags != list(access.mount_flags):
                    raise AlreadyExists(
                        f"volume {rec.id} is already staged at {path} as {staged.fs_type} "
                        f"with mount options {staged.mount_flags or 'none'}; unstage it "
                        "before staging with other settings")
                return
        else:
            current = self.mounter.find(path)
            if current is not None:
                raise FailedPrecondition(
                    f"staging path {path} is already a mount point ({current.fstype} from "
                    f"{current.source}); refusing to mount over it")
            if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path)):
                raise FailedPrecondition(f"staging path {path} exists and is not a directory")
        stage = Stage(path=path, fs_type=access.fs_type, mount_flags=list(access.mount_flags),
                      state=STAGING, dax=ns.fs_dax)
        rec.stages[path] = stage
        self.store.put(rec)
        try:
            if self._fs_mounted(path, rdev) is None:
                self._format_and_mount(rec, ns, path, access)
        except BaseException:
            rec.stages.pop(path, None)
            self.store.put(rec)
            raise
        stage.state = STAGED
        self.store.put(rec)
        log.info("staged %s at %s (%s%s)", rec.id, path, access.fs_type,
                 ", dax" if ns.fs_dax else ", without dax: the device does not support it")

    def _format_and_mount(self, rec: VolumeRecord, ns: Namespace, path: str,
                          access: Access) -> None:
        """Format only a device that holds nothing (or whose own mkfs was cut short),
        then mount. ``rec.formatting`` is the intent: set before mkfs, cleared after
        the first successful mount, so a retry after a crash or timeout formats again
        instead of tripping over a half-written signature."""
        mounts.make_dir_target(path, rec.id)
        have = self.mounter.fs_signature(ns.device)
        if rec.formatting or have is None:
            if rec.block_used and not rec.formatting:
                raise FailedPrecondition(
                    f"volume {rec.id} was used as a raw block device and holds no file "
                    "system; it is not formatted (its data would be lost): use it with "
                    "volumeMode: Block, or make a file system on it yourself")
            rec.formatting = True
            self.store.put(rec)
            self.mounter.make_fs(ns.device, access.fs_type)
            log.info("made %s on %s for volume %s", access.fs_type, ns.device, rec.id)
            failpoints.hit(failpoints.STAGE_AFTER_MKFS)
        elif have != access.fs_type:
            raise filesystems.refuse_other(rec.id, ns.device, have, access.fs_type)
        self._mount(rec, ns, path, access)
        if rec.formatting:
            rec.formatting = False
            self.store.put(rec)

    def _mount(self, rec: VolumeRecord, ns: Namespace, path: str, access: Access) -> None:
        options = filesystems.mount_options(ns.fs_dax, list(access.mount_flags))
        try:
            self.mounter.mount(ns.device, path, access.fs_type, options)
            return
        except CommandError as exc:
            failure = exc
        if access.mount_flags:
            # Blame the class's mountOptions only if the mount works without them.
            try:
                self.mounter.mount(ns.device, path, access.fs_type,
                                   filesystems.mount_options(ns.fs_dax, []))
            except CommandError:
                pass
            else:
                self._umount(path)
                raise InvalidArgument(
                    f"mounting {access.fs_type} of volume {rec.id} with options "
                    f"{','.join(options)} failed: {failure.stderr.strip() or failure}; "
                    "check the StorageClass mountOptions") from failure
        raise FailedPrecondition(
            f"mounting {access.fs_type} of volume {rec.id} from {ns.device} at {path} "
            f"failed: {failure.stderr.strip() or failure}; the kernel log (dmesg) says "
            "why") from failure

    def unstage(self, rec: VolumeRecord, path: str) -> None:
        # Unmounting the stage would leave each of these with a bind of nothing (CSI:
        # every NodeUnpublishVolume comes before NodeUnstageVolume).
        users = sorted(t for t, p in rec.publications.items()
                       if p.kind == MOUNT and p.staging == path)
        if users:
            raise FailedPrecondition(
                f"volume {rec.id} is still published from staging path {path} at "
                f"{', '.join(users)}; unpublish it there (NodeUnpublishVolume) before "
                "unstaging it")
        rdev = self._current_rdev(rec)
        if rdev is None:
            self._refuse_blind(rec, path, path in rec.stages)
        elif self._fs_mounted(path, rdev) is not None:
            self._umount(path)
        if rec.stages.pop(path, None) is not None:
            self.store.put(rec)
            log.info("unstaged %s from %s", rec.id, path)

    # ------------------------------------------------------------------ publish
    def publish(self, rec: VolumeRecord, request: PublishRequest) -> None:
        """Bind the device (block) or the staged file system (mount) onto the target;
        ``request.access`` says which, and a file system needs ``request.staging``."""
        target, readonly, access = request.target, request.readonly, request.access
        staging, mount_group = request.staging, request.mount_group
        ns = self._namespace(rec)
        rdev = self._rdev(ns.device)
        pub = rec.publications.get(target)
        if pub is not None and pub.state == PUBLISHED:
            current = self._ours(pub, rdev)
            if current is not None:
                if pub.kind != access.kind or pub.readonly != readonly \
                        or pub.mount_group != mount_group:
                    raise AlreadyExists(
                        f"volume {rec.id} is already published at {target} as {pub.kind} "
                        f"with readonly={pub.readonly}; unpublish it before publishing with "
                        "other options")
                return
        if access.kind == MOUNT:
            source = self._staged_source(rec, staging, rdev)
            self._check_dir_target(target)
        else:
            source = ns.device
            self._check_file_target(target)
        pub = Publication(target=target, readonly=readonly, state=PUBLISHING,
                          pod_uid=request.pod_uid, mount_group=mount_group,
                          access_mode=request.access_mode, kind=access.kind,
                          staging=staging if access.kind == MOUNT else "")
        rec.publications[target] = pub
        self.store.put(rec)
        failpoints.hit(failpoints.PUBLISH_AFTER_RECORD)
        created = not os.path.lexists(target)
        try:
            if access.kind == MOUNT:
                mounts.make_dir_target(target, rec.id)
                if mount_group is not None and not readonly:
                    filesystems.apply_group(source, mount_group)
            else:
                if created:
                    mounts.make_file_target(target, rec.id)
                rec.block_used = True
                if readonly:
                    pub.view = PENDING_VIEW
                    self.store.put(rec)
                    pub.view = source = self.mounter.attach_loop(ns.device, readonly=True)
                self.store.put(rec)
            self.mounter.bind(source, target, readonly)
        except BaseException:
            if created:
                mounts.remove_target(target)
            self._detach_view(rec, pub, ns.device)
            rec.publications.pop(target, None)
            self.store.put(rec)
            raise
        failpoints.hit(failpoints.PUBLISH_AFTER_MOUNT)
        pub.state = PUBLISHED
        self.store.put(rec)
        log.info("published %s at %s as %s (readonly=%s, pod %s)", rec.id, target,
                 "a block device" if access.kind == BLOCK else f"{access.fs_type} from "
                 f"{staging}", readonly, request.pod_uid or "-")

    def _staged_source(self, rec: VolumeRecord, staging: str, rdev: int) -> str:
        if not staging:
            raise InvalidArgument(
                "staging_target_path is required to publish an fsdax file system volume "
                "(the driver has the STAGE_UNSTAGE_VOLUME capability)")
        stage = rec.stages.get(staging)
        if stage is None or stage.state != STAGED or self._fs_mounted(staging, rdev) is None:
            raise FailedPrecondition(
                f"volume {rec.id} is not staged at {staging}; call NodeStageVolume first")
        return staging

    def _refuse_mount_point(self, target: str) -> None:
        current = self.mounter.find(target)
        if current is not None:
            raise FailedPrecondition(
                f"target {target} is already a mount point ({current.fstype} from "
                f"{current.source}); refusing to mount over it")

    def _check_dir_target(self, target: str) -> None:
        self._refuse_mount_point(target)
        mounts.check_dir_target(target)

    def _check_file_target(self, target: str) -> None:
        self._refuse_mount_point(target)
        if os.path.lexists(target):
            if os.path.islink(target) or not os.path.isfile(target):
                raise FailedPrecondition(
                    f"target {target} exists and is not a regular file: a block volume is "
                    "published as a device bound onto a file")
            if os.path.getsize(target):
                raise FailedPrecondition(
                    f"target {target} is a non-empty file; binding a device over it would "
                    "hide its contents")
        elif not os.path.isdir(os.path.dirname(target)):
            raise FailedPrecondition(
                f"the parent directory of target {target} does not exist (the CO creates "
                "it for block volumes)")

    # ------------------------------------------------------------------ unpublish
    def unpublish(self, rec: VolumeRecord, target: str) -> None:
        pub = rec.publications.get(target)
        rdev = self._current_rdev(rec)
        if rdev is None:
            self._refuse_blind(rec, target, pub is not None)
        else:
            probes = [pub] if pub is not None else [
                Publication(target=target, readonly=False, kind=k) for k in (BLOCK, MOUNT)]
            if any(self._ours(p, rdev) is not None for p in probes):
                self._umount(target)
        failpoints.hit(failpoints.UNPUBLISH_AFTER_UMOUNT)
        if pub is not None and pub.view:
            ns = self.backend.get(rec.id)
            if ns is not None:
                self._detach_view(rec, pub, ns.device)
        if self.mounter.find(target) is None:
            mounts.remove_target(target)
        rec.publications.pop(target, None)
        self.store.put(rec)
        log.info("unpublished %s from %s", rec.id, target)

    def owns(self, rec: VolumeRecord, target: str) -> bool:
        """Whether ``target`` is a publication of ``rec`` (recorded, or found mounted)."""
        return target in rec.publications or (os.path.isabs(target)
                                               and self.mounted_here(rec, target))

    def mounted_here(self, rec: VolumeRecord, target: str) -> bool:
        """Whether ``target`` holds this volume even though no record says so (a
        read-only view without a record is not recognised: its record came first)."""
        rdev = self._current_rdev(rec)
        return rdev is not None and (self._device_bound(target, rdev) is not None
                                     or self._fs_mounted(target, rdev) is not None)

    # ------------------------------------------------------------------ stats
    def usage(self, rec: VolumeRecord, path: str) -> filesystems.Usage | None:
        """File system usage at ``path``, None for a block device path of this volume.

        kubelet asks about block volumes with its own per-pod device file, not the
        publish target, so any path that is this volume's block device is accepted.
        """
        rdev = self._current_rdev(rec)
        if rdev is None:
            if path in rec.publications or path in rec.stages:
                return None  # the raw figures; the volume condition says what is wrong
            raise NotFound(f"the block device of volume {rec.id} has disappeared")
        try:
            here = self.mounter.device_number(path)
        except FileNotFoundError as exc:
            raise NotFound(f"volume path {path} does not exist") from exc
        views = {self._view_rdev(p.view) for p in rec.publications.values() if p.view}
        if here is not None and (here == rdev or here in views):
            return None
        if self._fs_mounted(path, rdev) is not None:
            return filesystems.usage(path)
        raise NotFound(f"volume {rec.id} is not published or staged at {path!r} on this node")

    # ------------------------------------------------------------------ start-up
    def reconcile(self, rec: VolumeRecord) -> None:
        rdev = self._current_rdev(rec)
        if rdev is None and (rec.stages or rec.publications):
            log.error("the device of fsdax volume %s cannot be found: its stages and "
                      "publications are kept as they are until it is back", rec.id)
            return
        for path, stage in list(rec.stages.items()):
            mounted = rdev is not None and self._fs_mounted(path, rdev) is not None
            if mounted and stage.state != STAGED:
                stage.state = STAGED
                self.store.put(rec)
            elif not mounted:
                log.warning("stage of %s at %s lost its mount (node reboot or interrupted "
                            "stage); dropped, kubelet stages again", rec.id, path)
                rec.stages.pop(path)
                self.store.put(rec)
        for target, pub in list(rec.publications.items()):
            ours = rdev is not None and self._ours(pub, rdev) is not None
            if pub.state == UNPUBLISHING or not ours:
                if not ours and pub.state == PUBLISHED:
                    log.warning("publication of %s at %s lost its mount (node reboot?); "
                                "dropped, kubelet publishes again", rec.id, target)
                self.unpublish(rec, target)
            elif pub.state == PUBLISHING:
                pub.state = PUBLISHED
                self.store.put(rec)
