"""CSI Controller service, node-local: external-provisioner runs beside us on each node.

Validates requests, delegates to :class:`csi_pmem.driver.core.Driver`, translates results.
Topology is one segment per node (``<driver-name>/node``); NUMA placement is a pool
chosen by the ``numaNode`` StorageClass parameter (docs/design.md §5).
"""

from __future__ import annotations

from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver import params as sc_params
from csi_pmem.driver.core import Driver, is_volume_id
from csi_pmem.driver.host import filesystems
from csi_pmem.driver.servicers.capabilities import (
    fs_type,
    named_fs_type,
    problem,
    require_valid,
)
from csi_pmem.driver.servicers.rpc import require, rpc
from csi_pmem.driver.state import VolumeRecord
from csi_pmem.errors import Aborted, InvalidArgument, ResourceExhausted
from csi_pmem.sizes import format_bytes

CCap = csi_pb2.ControllerServiceCapability.RPC
MAX_PAGE = 1000


def describe(rec: VolumeRecord) -> dict[str, str]:
    """The volume_context handed to the CO (and back to NodePublishVolume): the wire
    shape of a volume record, so it lives with the servicers."""
    ctx = {"deviceMode": rec.params.get("deviceMode", "devdax"),
           "numaNode": str(rec.numa_node), "align": format_bytes(rec.align),
           "usableSize": str(rec.usable_size), "device": rec.device, "pool": rec.pool}
    if rec.fs_type:  # fsdax: the file system CreateVolume named, which a stage makes
        ctx["fsType"] = rec.fs_type
    return ctx


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.topology_key = f"{driver.config.driver_name}/node"

    def _topology(self) -> csi_pb2.Topology:
        return csi_pb2.Topology(segments={self.topology_key: self.driver.config.node_id})

    def _on_this_node(self, topologies) -> bool:
        return any(t.segments.get(self.topology_key) == self.driver.config.node_id
                   for t in topologies)

    def _volume(self, rec) -> csi_pb2.Volume:
        return csi_pb2.Volume(volume_id=rec.id, capacity_bytes=rec.usable_size,
                              volume_context=describe(rec),
                              accessible_topology=[self._topology()])

    @rpc
    def CreateVolume(self, request, context):
        require(request, "name", "volume_capabilities")
        if request.HasField("volume_content_source"):
            raise InvalidArgument("volume content sources (snapshots, clones) are not supported")
        params = sc_params.parse(request.parameters)
        require_valid(request.volume_capabilities, params.device_mode)
        requisite = request.accessibility_requirements.requisite
        if requisite and not self._on_this_node(requisite):
            raise ResourceExhausted(
                f"the requested topology does not include this node "
                f"({self.topology_key}={self.driver.config.node_id}); volumes are node-local")
        rng = request.capacity_range
        named = ""
        if params.device_mode == sc_params.FSDAX:
            named = named_fs_type(list(request.volume_capabilities))
            # mkfs runs only at NodeStageVolume; a size its file system refuses is the
            # request's fault, so say it now rather than fail the pod's start.
            asked = rng.required_bytes or rng.limit_bytes
            for cap in request.volume_capabilities:
                why = cap.HasField("mount") and asked and filesystems.too_small(
                    fs_type(cap), asked)
                if why:
                    raise InvalidArgument(f"volume_capabilities: {why}")
        rec = self.driver.create_volume(request.name, rng.required_bytes, rng.limit_bytes,
                                        params, fs_type=named)
        return csi_pb2.CreateVolumeResponse(volume=self._volume(rec))

    @rpc
    def DeleteVolume(self, request, context):
        require(request, "volume_id")
        self.driver.delete_volume(request.volume_id)
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    def ValidateVolumeCapabilities(self, request, context):
        require(request, "volume_id", "volume_capabilities")
        rec = self.driver.get(request.volume_id)
        mode = rec.params.get(sc_params.DEVICE_MODE, sc_params.DEVDAX)
        reasons = [p for p in (problem(c, mode) for c in request.volume_capabilities) if p]
        if request.parameters:
            try:
                wanted = sc_params.parse(request.parameters)
            except InvalidArgument as exc:
                reasons.append(str(exc))
            else:
                reasons += [f"parameter {p}" for p in
                            wanted.compatible_with(rec.params, rec.numa_node)]
        if reasons:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message="; ".join(reasons))
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=request.volume_context,
                volume_capabilities=request.volume_capabilities,
                parameters=request.parameters))

    @rpc
    def ListVolumes(self, request, context):
        if request.max_entries < 0:
            raise InvalidArgument("max_entries must not be negative")
        records = sorted(self.driver.list_volumes(), key=lambda r: r.id)
        start = 0
        if request.starting_token:
            if not is_volume_id(request.starting_token):
                raise Aborted(f"starting_token {request.starting_token!r} is not valid; "
                              "restart the listing without a token")
            start = next((i for i, r in enumerate(records) if r.id >= request.starting_token),
                         len(records))
        count = min(request.max_entries or MAX_PAGE, MAX_PAGE)
        page = records[start:start + count]
        following = records[start + count:start + count + 1]
        entries = []
        for rec in page:
            cond = self.driver.condition(rec)
            status = csi_pb2.ListVolumesResponse.VolumeStatus(
                published_node_ids=[self.driver.config.node_id] if rec.publications else [],
                volume_condition=csi_pb2.VolumeCondition(abnormal=cond.abnormal,
                                                         message=cond.message))
            entries.append(csi_pb2.ListVolumesResponse.Entry(volume=self._volume(rec),
                                                             status=status))
        return csi_pb2.ListVolumesResponse(
            entries=entries, next_token=following[0].id if following else "")

    @rpc
    def GetCapacity(self, request, context):
        params = sc_params.parse(request.parameters)  # a bad class is an error, not 0
        for cap in request.volume_capabilities:
            if problem(cap, params.device_mode):
                return csi_pb2.GetCapacityResponse(available_capacity=0)
        if request.HasField("accessible_topology") and \
                not self._on_this_node([request.accessible_topology]):
            return csi_pb2.GetCapacityResponse(available_capacity=0)
        cap = self.driver.capacity(params)
        return csi_pb2.GetCapacityResponse(
            available_capacity=cap.available,
            maximum_volume_size={"value": cap.maximum_volume_size})

    @rpc
    def ControllerGetCapabilities(self, request, context):
        caps = [CCap.CREATE_DELETE_VOLUME, CCap.GET_CAPACITY, CCap.LIST_VOLUMES,
                CCap.LIST_VOLUMES_PUBLISHED_NODES, CCap.VOLUME_CONDITION, CCap.GET_VOLUME]
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[
            csi_pb2.ControllerServiceCapability(rpc=CCap(type=t)) for t in caps])

    @rpc
    def ControllerGetVolume(self, request, context):
        require(request, "volume_id")
        rec = self.driver.get(request.volume_id)
        cond = self.driver.condition(rec)
        return csi_pb2.ControllerGetVolumeResponse(
            volume=self._volume(rec),
            status=csi_pb2.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=[self.driver.config.node_id] if rec.publications else [],
                volume_condition=csi_pb2.VolumeCondition(abnormal=cond.abnormal,
                                                         message=cond.message)))


