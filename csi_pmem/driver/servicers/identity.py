"""CSI Identity service: who we are, what we offer, whether the back end is usable."""

from __future__ import annotations

import logging

from google.protobuf import wrappers_pb2

from csi_pmem import __version__
from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver.servicers.rpc import rpc

log = logging.getLogger(__name__)
Cap = csi_pb2.PluginCapability


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, driver_name: str, probe) -> None:
        self.driver_name = driver_name
        self._probe = probe
        self._last_problem: str | None = None

    @rpc
    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=self.driver_name, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request, context):
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[
            Cap(service=Cap.Service(type=Cap.Service.CONTROLLER_SERVICE)),
            Cap(service=Cap.Service(type=Cap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS)),
        ])

    @rpc
    def Probe(self, request, context):
        ok, reason = self._probe()
        # Log transitions only: Probe is called every few seconds and must stay quiet.
        problem = None if ok else reason
        if problem != self._last_problem:
            if problem:
                log.error("not ready: %s", problem)
            else:
                log.info("ready")
            self._last_problem = problem
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=ok))
