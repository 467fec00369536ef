"""CSI Node service: devdax volumes as a tmpfs with volume.json and dax.sock, fsdax
volumes as a block device or an ext4/xfs file system mounted with -o dax.

NodeStageVolume matters only for fsdax file systems (one mount per node, bound into
each pod). devdax volumes need no stage: a per-target tmpfs shares nothing, so their
NodeStageVolume only validates, which keeps a devdax publish self-contained.
"""

from __future__ import annotations

from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver.core import Driver
from csi_pmem.driver.node import Access, PublishRequest
from csi_pmem.driver.params import FSDAX
from csi_pmem.driver.servicers.capabilities import (
    READ_ONLY_MODES,
    mode_name,
    require_valid,
)
from csi_pmem.driver.servicers.rpc import require, rpc
from csi_pmem.driver.state import BLOCK, MOUNT
from csi_pmem.errors import InvalidArgument

NCap = csi_pb2.NodeServiceCapability.RPC
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    @rpc
    def NodeGetInfo(self, request, context):
        cfg = self.driver.config
        return csi_pb2.NodeGetInfoResponse(
            node_id=cfg.node_id, max_volumes_per_node=self.driver.backend.max_volumes(),
            accessible_topology=csi_pb2.Topology(
                segments={f"{cfg.driver_name}/node": cfg.node_id}))

    @rpc
    def NodeGetCapabilities(self, request, context):
        caps = [NCap.STAGE_UNSTAGE_VOLUME, NCap.GET_VOLUME_STATS, NCap.VOLUME_CONDITION,
                NCap.VOLUME_MOUNT_GROUP]
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=NCap(type=t)) for t in caps])

    def _access(self, volume_id: str, cap) -> Access:
        """Validate ``cap`` against the volume's device mode; what it asks for."""
        device_mode = self.driver.device_mode(volume_id)
        require_valid([cap], device_mode)
        if cap.WhichOneof("access_type") == "block":
            return Access(kind=BLOCK)
        if device_mode != FSDAX:
            return Access(kind=MOUNT)  # a devdax tmpfs takes no file system options
        flags = tuple(cap.mount.mount_flags)
        bad = [f for f in flags if not f or "," in f or "\x00" in f]
        if bad:
            raise InvalidArgument(
                f"invalid mount flag(s) {bad!r}: give one option per entry, without commas")
        return Access(kind=MOUNT, mount_flags=flags,
                      fs_type=self.driver.fs_type(volume_id, cap.mount.fs_type))

    @rpc
    def NodeStageVolume(self, request, context):
        require(request, "volume_id", "staging_target_path", "volume_capability")
        access = self._access(request.volume_id, request.volume_capability)
        self.driver.stage(request.volume_id, request.staging_target_path, access)
        return csi_pb2.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, request, context):
        require(request, "volume_id", "staging_target_path")
        self.driver.unstage(request.volume_id, request.staging_target_path)
        return csi_pb2.NodeUnstageVolumeResponse()

    def _publish_request(self, request) -> PublishRequest:
        """Validate a NodePublishVolumeRequest once; what it asks, for every level below.

        Why here: the CSI message is read in one place, so the core and the publishers
        see only checked values (a numeric group, a pod UID without "/") and the
        VolumeCapability already turned into an :class:`Access`."""
        access = self._access(request.volume_id, request.volume_capability)
        cap = request.volume_capability
        group = cap.mount.volume_mount_group
        # A gid_t, and not (gid_t)-1, which chown() reads as "leave the group alone".
        if group and not (group.isascii() and group.isdecimal() and len(group) <= 10
                          and int(group) < 2**32 - 1):
            raise InvalidArgument(
                f"volume_mount_group {group!r} must be a numeric group id (0 to 4294967294)")
        pod_uid = request.volume_context.get(POD_UID_KEY) or None
        if pod_uid is not None and "/" in pod_uid:
            # Checked here, not only when the socket is first served, so that a repeated
            # publish gets the same answer as the first one.
            raise InvalidArgument(f"{POD_UID_KEY} {pod_uid!r} is not a pod UID")
        return PublishRequest(
            target=request.target_path,
            readonly=request.readonly or cap.access_mode.mode in READ_ONLY_MODES,
            access=access, staging=request.staging_target_path,
            mount_group=int(group) if group else None, pod_uid=pod_uid,
            access_mode=mode_name(cap))

    @rpc
    def NodePublishVolume(self, request, context):
        require(request, "volume_id", "target_path", "volume_capability")
        self.driver.publish(request.volume_id, self._publish_request(request))
        return csi_pb2.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, request, context):
        require(request, "volume_id", "target_path")
        self.driver.unpublish(request.volume_id, request.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @rpc
    def NodeGetVolumeStats(self, request, context):
        require(request, "volume_id", "volume_path")
        rec, fs = self.driver.usage(request.volume_id, request.volume_path)
        cond = self.driver.condition(rec)
        if fs is None:
            # The driver cannot see inside a raw device: report it whole and free, so
            # "volume filling up" alerts do not fire on every devdax or block volume.
            usage = [csi_pb2.VolumeUsage(unit=csi_pb2.VolumeUsage.BYTES, total=rec.usable_size,
                                         available=rec.usable_size, used=0)]
        else:
            usage = [
                csi_pb2.VolumeUsage(unit=csi_pb2.VolumeUsage.BYTES, total=fs.total_bytes,
                                    available=fs.available_bytes, used=fs.used_bytes),
                csi_pb2.VolumeUsage(unit=csi_pb2.VolumeUsage.INODES, total=fs.total_inodes,
                                    available=fs.available_inodes, used=fs.used_inodes)]
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=usage,
            volume_condition=csi_pb2.VolumeCondition(abnormal=cond.abnormal,
                                                     message=cond.message))
