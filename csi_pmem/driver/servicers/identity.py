"""CSI Identity service: who we are, what we offer, whether the back end is usable.

GetPluginInfo's ``manifest`` (CSI's opaque map for the plugin's own facts) also says
what each pool is: ``pool.<name>`` -> ``numa=0 size=... pages=2Mi placement=bind
media=volatile``, which ``csi-pmem volume info`` prints. Why there: it is the one answer
about the plugin itself that CSI lets carry free-form data, so the pools' node, page
size and placement reach the CLI with no change to the protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from google.protobuf import wrappers_pb2

from csi_pmem import __version__
from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver.backends.base import Pool
from csi_pmem.driver.servicers.rpc import rpc
from csi_pmem.sizes import format_bytes

log = logging.getLogger(__name__)
Cap = csi_pb2.PluginCapability


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, driver_name: str, probe,
                 pools: Callable[[], list[Pool]] | None = None) -> None:
        self.driver_name = driver_name
        self._probe = probe
        self._pools = pools
        self._last_problem: str | None = None

    @rpc
    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=self.driver_name, vendor_version=__version__,
                                             manifest=self._manifest())

    def _manifest(self) -> dict[str, str]:
        """``pool.<name>`` per pool; none when the listing fails: the sidecars call
        GetPluginInfo at start, and a back end that cannot list must not stop them
        (Probe says what is wrong)."""
        if self._pools is None:
            return {}
        try:
            pools = self._pools()
        except Exception as exc:  # any listing failure: no manifest
            log.debug("GetPluginInfo without pools: %s", exc)
            return {}
        return {f"pool.{p.name}": pool_manifest(p) for p in pools}

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


def pool_manifest(p: Pool) -> str:
    """One pool as ``key=value`` words (the manifest's value for ``pool.<name>``)."""
    words = [f"numa={p.numa_node}", f"size={format_bytes(p.size)}",
             f"free={format_bytes(p.free)}",
             f"pages={format_bytes(p.page_size) if p.page_size else '-'}",
             f"placement={p.placement or '-'}", f"media={p.media}"]
    if p.problem:
        words.append("usable=no")
    return " ".join(words)
