"""Node side of devdax volumes: a per-target tmpfs holding volume.json and dax.sock.

Why this shape (docs/design.md §2): a devdax character device cannot be a
``volumeMode: Block`` volume and a pod's device cgroup would refuse to open it, so the
volume reaches the pod as a directory: NodePublishVolume mounts a small tmpfs at the
target, writes ``volume.json``, serves ``dax.sock`` (the node plugin opens the device
and hands the fd to an authenticated peer, :mod:`csi_pmem.driver.daxsock`) and, with the GPU
copy service, ``gpu.sock``; then it remounts the tmpfs read-only (sealed). Each
publication is self-contained, so NodeStageVolume has nothing to do.

The same intent-then-act discipline as every publisher: the record says ``publishing``
before anything is mounted, and :meth:`DevdaxNode.reconcile` finishes, re-serves or drops
what a restart or crash left, trusting the mount table. The caller (the driver) holds the
volume's in-flight slot and has applied the shared policy (target paths, access modes).
Mounts go through the :class:`~csi_pmem.driver.host.mounter.Mounter` it is given (a fake in unit
tests).

With ``device_node`` on (``--device-node on``, the chart's ``nri.enabled``),
volume.json also names the volume's device node (``device_node``: the path inside the
container, its type and number) for the NRI plugin (``nri/``), which adds that node to
each container that mounts this target, so unmodified programs can open
``/dev/daxX.Y``. The plugin trusts the file because the tmpfs is sealed before
NodePublishVolume returns and only the driver mounts tmpfs with a ``csi-pmem:`` source;
dax.sock stays the portable path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat

from csi_pmem import failpoints
from csi_pmem.driver.backends.base import Backend, Namespace
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.host import mounts
from csi_pmem.driver.host.filesystems import Usage
from csi_pmem.driver.host.mounter import Mounter
from csi_pmem.driver.node.access import Access, PublishRequest
from csi_pmem.driver.node.busy import umount, while_busy
from csi_pmem.driver.state import (
    PUBLISHED,
    PUBLISHING,
    UNPUBLISHING,
    Publication,
    StateStore,
    VolumeRecord,
)
from csi_pmem.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    from_os_error,
)
from csi_pmem.fdpass import SocketInUse
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.mountinfo import MountInfo

log = logging.getLogger(__name__)

METADATA_FILE = "volume.json"
SOCKET_FILE = "dax.sock"
GPU_SOCKET_FILE = "gpu.sock"
# Where a device node goes inside the container: a devdax device keeps its name (what
# PMDK and daxctl-style tools expect); any other node (the emulated back end's loop
# device) goes to /dev/csi-pmem/<volume id>, a name that cannot collide with the
# container's own devices. The NRI plugin accepts only these two forms.
DAX_NAME = re.compile(r"dax[0-9]+\.[0-9]+")
CONTAINER_DEVICE_DIR = "/dev/csi-pmem"


class DevdaxNode:
    def __init__(self, backend: Backend, store: StateStore, dax: DaxSocketServer,
                 driver_name: str, mounter: Mounter,
                 gpu_copy: ServiceLink | None = None, device_node: bool = False) -> None:
        self.backend = backend
        # volume.json names the device node for the NRI plugin (module docstring).
        self.device_node = device_node
        self.mounter = mounter
        self.store = store
        self.dax = dax
        self.driver_name = driver_name
        # The node's GPU copy service (csi_pmem.gpucopy), or None: publications then
        # also serve gpu.sock, forwarded to it after the dax.sock checks.
        self.gpu_copy = gpu_copy

    # ------------------------------------------------------------------ stage
    def stage(self, rec: VolumeRecord, path: str, access: Access) -> None:
        """Nothing to stage: each publication is self-contained."""

    def unstage(self, rec: VolumeRecord, path: str) -> None:
        """Nothing was staged."""

    # ------------------------------------------------------------------ publish
    def publish(self, rec: VolumeRecord, request: PublishRequest) -> None:
        """A tmpfs at the target with volume.json and dax.sock. ``request.access`` does
        not change it (the servicer refuses block access to a devdax volume, and a tmpfs
        takes no file system options) and nothing was staged, so neither is read."""
        target, readonly, pod_uid = request.target, request.readonly, request.pod_uid
        mount_group = request.mount_group
        pub = rec.publications.get(target)
        current = self.mounter.find(target)
        if pub is not None and pub.state == PUBLISHED and current is not None \
                and current.source == mounts.source_for(rec.id):
            if pub.readonly != readonly or pub.mount_group != mount_group:
                raise AlreadyExists(
                    f"volume {rec.id} is already published at {target} with readonly="
                    f"{pub.readonly}; unpublish it before publishing with other options")
            self._serve(rec, pub)  # idempotent; also heals a socket that went away
            return
        self._check_target_free(rec.id, target, current)
        pub = Publication(target=target, readonly=readonly, state=PUBLISHING,
                          pod_uid=pod_uid, mount_group=mount_group,
                          access_mode=request.access_mode)
        rec.publications[target] = pub
        self.store.put(rec)
        failpoints.hit(failpoints.PUBLISH_AFTER_RECORD)
        try:
            mounts.make_dir_target(target, rec.id)
            if current is None:
                self.mounter.mount_tmpfs(target, mounts.source_for(rec.id))
            failpoints.hit(failpoints.PUBLISH_AFTER_MOUNT)
            self._populate(rec, pub)
        except BaseException:
            self._undo_publish(rec, target)
            raise
        failpoints.hit(failpoints.PUBLISH_AFTER_SOCKET)
        pub.state = PUBLISHED
        self.store.put(rec)
        log.info("published %s at %s (readonly=%s, pod %s)", rec.id, target, readonly,
                 pod_uid or "-")
        if not pod_uid:
            log.warning("%s is published without a pod UID: any process that can reach "
                        "%s gets the device (set podInfoOnMount: true on the CSIDriver)",
                        rec.id, target)

    def _check_target_free(self, vid: str, target: str, current: MountInfo | None) -> None:
        if current is not None:
            if current.source == mounts.source_for(vid):
                return  # our own half-finished publish: reuse the mount
            if current.source.startswith(mounts.SOURCE_PREFIX):
                raise AlreadyExists(
                    f"target {target} already holds another volume "
                    f"({current.source[len(mounts.SOURCE_PREFIX):]})")
            raise FailedPrecondition(
                f"target {target} is already a mount point ({current.fstype} from "
                f"{current.source}); refusing to mount over it")
        mounts.check_dir_target(target)

    def _metadata(self, rec: VolumeRecord, pub: Publication) -> dict:
        meta = {"volume_id": rec.id, "device": rec.device, "numa_node": rec.numa_node,
                "size": rec.size, "usable_size": rec.usable_size, "align": rec.align,
                "readonly": pub.readonly, "driver": self.driver_name,
                "socket": SOCKET_FILE}
        if self.device_node:
            node = self._device_node(rec)
            if node is not None:
                meta["device_node"] = node
        return meta

    def _device_node(self, rec: VolumeRecord) -> dict | None:
        """volume.json's ``device_node``, or None when the volume's device is no device
        node (the emulated back end with ``--emulated-device file``)."""
        ns = self.backend.get(rec.id)
        device = ns.device if ns is not None else rec.device
        try:
            st = os.stat(device)
        except OSError as exc:
            log.warning("volume %s: cannot stat its device %s for volume.json's "
                        "device_node: %s", rec.id, device, exc.strerror)
            return None
        if stat.S_ISCHR(st.st_mode):
            kind = "c"
        elif stat.S_ISBLK(st.st_mode):
            kind = "b"
        else:
            log.warning("volume %s: its device %s is not a device node (the emulated back "
                        "end hands out files unless --emulated-device loop): no device_node "
                        "in volume.json, pods use dax.sock", rec.id, device)
            return None
        name = os.path.basename(device)
        if kind == "c" and DAX_NAME.fullmatch(name):
            path = f"/dev/{name}"
        else:
            path = f"{CONTAINER_DEVICE_DIR}/{rec.id}"
        return {"path": path, "type": kind, "major": os.major(st.st_rdev),
                "minor": os.minor(st.st_rdev)}

    def _populate(self, rec: VolumeRecord, pub: Publication) -> None:
        """Write volume.json and serve dax.sock in the target's tmpfs, then seal it."""
        target = pub.target
        current = self.mounter.find(target)
        if current is not None and current.readonly:
            self.mounter.remount(target, readonly=False)
        meta_path = os.path.join(target, METADATA_FILE)
        try:
            with open(meta_path, "w") as f:
                json.dump(self._metadata(rec, pub), f, indent=1)
                f.write("\n")
            os.chmod(meta_path, 0o644)
            os.chmod(target, 0o755)
        except OSError as exc:
            raise from_os_error(exc, f"cannot write {meta_path} for volume {rec.id}",
                                needs=f"the target's own {mounts.TMPFS_SIZE} tmpfs holds "
                                "volume.json and dax.sock") from exc
        self._serve(rec, pub)
        self._seal(target)

    def _serve(self, rec: VolumeRecord, pub: Publication) -> None:
        ns = self.backend.get(rec.id)
        if ns is None:
            raise FailedPrecondition(f"the device of volume {rec.id} has disappeared")
        readonly = pub.readonly
        sock = os.path.join(pub.target, SOCKET_FILE)
        if sock in self.dax.paths() and self.mounter.find(pub.target) is not None \
                and os.path.exists(sock):
            return
        current = self.mounter.find(pub.target)
        sealed = current is not None and current.readonly
        if sealed:
            self.mounter.remount(pub.target, readonly=False)
        mode, gid = (0o660, pub.mount_group) if pub.mount_group is not None else (0o666, None)
        meta = self._metadata(rec, pub)
        try:
            self.dax.serve(sock, meta, lambda: self.backend.open_device(ns, readonly),
                           pod_uid=pub.pod_uid, mode=mode, gid=gid)
            if self.gpu_copy is not None:
                link = self.gpu_copy
                self.dax.serve(os.path.join(pub.target, GPU_SOCKET_FILE), meta,
                               lambda: self.backend.open_device(ns, True),
                               pod_uid=pub.pod_uid, mode=mode, gid=gid,
                               forward=lambda conn, fd: link.forward(meta, conn, fd))
        except SocketInUse as exc:
            raise FailedPrecondition(
                f"{exc.filename}: another process serves this socket (a second driver on "
                "this node?); it is left alone: stop that process and retry") from exc
        except FileExistsError as exc:
            raise FailedPrecondition(
                f"{exc.filename or sock} exists and is not a socket; refusing to replace "
                "it") from exc
        except ValueError as exc:
            raise InvalidArgument(f"cannot serve {sock}: {exc}") from exc
        except OSError as exc:
            raise from_os_error(exc, f"cannot serve {sock} for volume {rec.id}") from exc
        if sealed:
            self._seal(pub.target)
        if self.gpu_copy is not None:
            self._prepare_gpu_copy(self.gpu_copy, rec, ns, meta)

    def _prepare_gpu_copy(self, link: ServiceLink, rec: VolumeRecord, ns: Namespace,
                          meta: dict) -> None:
        """Have the copy service map and register the volume now, at publish, so that
        the pod's first load only copies (best effort: it logs when it cannot)."""
        try:
            fd = self.backend.open_device(ns, True)
        except OSError as exc:
            log.warning("volume %s: cannot open its device for the GPU copy service: %s",
                        rec.id, exc)
            return
        try:
            link.prepare(meta, fd)
        finally:
            os.close(fd)

    def _stop_and_umount(self, vid: str, target: str) -> None:
        current = self.mounter.find(target)
        ours = current is not None and current.source == mounts.source_for(vid)
        if ours and current is not None and current.readonly:
            self.mounter.remount(target, readonly=False)  # so the socket file can be removed
        self.dax.stop(os.path.join(target, SOCKET_FILE))
        self.dax.stop(os.path.join(target, GPU_SOCKET_FILE))
        if ours:
            self._umount(target)

    def _umount(self, target: str) -> None:
        umount(self.mounter, target)

    def _seal(self, target: str) -> None:
        """Remount the target's tmpfs read-only (see while_busy for the retries)."""
        while_busy(lambda: self.mounter.remount(target, readonly=True), f"sealing {target}")

    def _undo_publish(self, rec: VolumeRecord, target: str) -> None:
        self._stop_and_umount(rec.id, target)
        try:
            os.rmdir(target)
        except OSError:
            pass
        rec.publications.pop(target, None)
        self.store.put(rec)

    # ------------------------------------------------------------------ unpublish
    def owns(self, rec: VolumeRecord, target: str) -> bool:
        """Whether ``target`` is a publication of ``rec`` (recorded, or our mount)."""
        if target in rec.publications:
            return True
        current = self.mounter.find(target) if os.path.isabs(target) else None
        return current is not None and current.source == mounts.source_for(rec.id)

    def unpublish(self, rec: VolumeRecord, target: str) -> None:
        self._finish_unpublish(rec, target)

    def _finish_unpublish(self, rec: VolumeRecord, target: str) -> None:
        self._stop_and_umount(rec.id, target)
        failpoints.hit(failpoints.UNPUBLISH_AFTER_UMOUNT)
        mounts.remove_target(target)
        rec.publications.pop(target, None)
        self.store.put(rec)
        if self.gpu_copy is not None and not rec.publications:
            self.gpu_copy.release(rec.id)  # the last pod using it on this node went away
        log.info("unpublished %s from %s", rec.id, target)

    def usage(self, rec: VolumeRecord, path: str) -> Usage | None:
        """A raw device: no file system usage to report (the caller reports it whole)."""
        pub = rec.publications.get(path)
        if pub is None or pub.state != PUBLISHED:
            raise NotFound(f"volume {rec.id} is not published at {path!r} on this node")
        return None

    # ------------------------------------------------------------------ start-up
    def reconcile(self, rec: VolumeRecord) -> None:
        self._reconcile_publications(rec)

    def _reconcile_publications(self, rec: VolumeRecord) -> None:
        for target, pub in list(rec.publications.items()):
            current = self.mounter.find(target)
            ours = current is not None and current.source == mounts.source_for(rec.id)
            if pub.state == UNPUBLISHING or (pub.state == PUBLISHING and not ours):
                self._finish_unpublish(rec, target)
            elif not ours:
                log.warning("publication of %s at %s lost its mount (node reboot?); "
                            "dropped, kubelet publishes again", rec.id, target)
                rec.publications.pop(target)
                self.store.put(rec)
            else:
                self._populate(rec, pub) if pub.state == PUBLISHING else self._serve(rec, pub)
                if pub.state == PUBLISHING:
                    pub.state = PUBLISHED
                    self.store.put(rec)
                log.info("serving %s again at %s", rec.id, target)

