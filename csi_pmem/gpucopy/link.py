"""The node plugin's half of the GPU copy service: prepare, release, hand over a pod.

Why the node plugin forwards pods instead of the service listening in each volume
directory: authenticating the peer (SO_PEERCRED, then its cgroup must name the pod the
volume was published to) already lives in :mod:`csi_pmem.driver.daxsock`, and only the node
plugin can create sockets inside kubelet's publish targets. So ``gpu.sock`` is served
by the same selector loop as ``dax.sock``; after the same checks, the connection and
the volume's fd travel to the service, which talks to the pod from then on.

Every call is bounded by a short timeout and never raises into publishing: without
the service, pods load in-pod (the forward answers the pod with an error it reports
as one warning).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from csi_pmem.fdpass import unix_address
from csi_pmem.gpucopy import protocol

log = logging.getLogger(__name__)


class ServiceUnavailable(Exception):
    pass


class ServiceLink:
    def __init__(self, control_socket: str, timeout: float = 5.0):
        self.control_socket = control_socket
        self.timeout = timeout

    def _call(self, doc: dict[str, Any], fds: list[int]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            try:
                with unix_address(self.control_socket) as address:
                    sock.connect(address)
                protocol.send(sock, doc, fds)
                reply = protocol.Reader(sock).read()
            except (OSError, protocol.ProtocolError) as exc:
                raise ServiceUnavailable(
                    f"the GPU copy service on this node ({self.control_socket}) is not "
                    f"reachable: {exc}") from exc
            if reply is None or not reply.get("ok"):
                why = (reply or {}).get("error", "no reply")
                raise ServiceUnavailable(f"the GPU copy service refused: {why}")
        finally:
            sock.close()

    def prepare(self, meta: dict[str, Any], fd: int) -> bool:
        """Ask the service to map and register a published volume (best effort)."""
        try:
            self._call({"op": protocol.OP_PREPARE, **meta}, [fd])
            return True
        except ServiceUnavailable as exc:
            log.warning("volume %s: %s; pods load it in-pod", meta.get("volume_id"), exc)
            return False

    def release(self, volume_id: str) -> bool:
        """Unregister and unmap a volume in the service; before its namespace goes."""
        try:
            self._call({"op": protocol.OP_RELEASE, "volume_id": volume_id}, [])
            return True
        except ServiceUnavailable as exc:
            log.info("volume %s: release in the GPU copy service: %s", volume_id, exc)
            return False

    def forward(self, meta: dict[str, Any], conn: socket.socket, fd: int) -> None:
        """Hand an authenticated pod's connection and the volume's fd to the service;
        raises ServiceUnavailable (the caller tells the pod)."""
        self._call({"op": protocol.OP_CLIENT, **meta}, [fd, conn.fileno()])
