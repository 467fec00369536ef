"""The driver in this process, as an ordinary user: servicers, Driver, the emulated back
end and the fake mounter, with the helpers of ``conftest.DriverProcess``.

Why in-process: the node logic (idempotency, access modes, targets, reconcile) is the
driver's own, and the kernel's part is what :class:`fake_mounter.FakeMounter` stands in
for (``tests/test_mounter_contract.py`` holds it to the kernel). Calls go through the
real servicers with a context whose ``abort`` raises an :class:`grpc.RpcError`, so a test
sees the status code and message a CO would. A restart is a new Driver over the same
state, pools and "kernel" (the fake keeps its mounts, as the host does); a reboot also
forgets the mounts and loop devices.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.daxclient import map_volume
from csi_pmem.driver.backends.base import Backend
from csi_pmem.driver.backends.emulated import EmulatedBackend
from csi_pmem.driver.config import DriverConfig
from csi_pmem.driver.core import Driver
from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.driver.servicers.controller import ControllerServicer
from csi_pmem.driver.servicers.identity import IdentityServicer
from csi_pmem.driver.servicers.node import POD_UID_KEY, NodeServicer
from csi_pmem.driver.state import StateStore

from conftest import MiB, mount_cap
from fake_mounter import FakeMounter

DRIVER_NAME = "pmem-csi.example.com"
NODE_ID = "unit-node"
PATTERN = bytes(range(256)) * 4096  # 1 MiB: what write_pattern writes at a volume's start


class Aborted(grpc.RpcError):
    """What ``context.abort`` raises, shaped like the error a gRPC client gets."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)


class _Stub:
    """servicer.Method(request, timeout=...) -> the response, or Aborted."""

    def __init__(self, servicer) -> None:
        self._servicer = servicer

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        return lambda request, timeout=None: method(request, _Context())


class InProcessNode:
    """One node: the base directory holds kubelet/, state/, pools/ and the fake's host/."""

    def __init__(self, regions: dict[int, int] | None = None, *,
                 device_node: bool = False, media: str = "auto",
                 free_space: str = "fresh") -> None:
        # Short: dax.sock paths below the kubelet dir must fit a unix socket address.
        self.base = Path(tempfile.mkdtemp(prefix="csiu-"))
        self.kubelet = self.base / "kubelet"
        self.kubelet.mkdir()
        self.state = self.base / "state"
        self.regions = regions or {0: 512 * MiB, 1: 512 * MiB}
        self.device_node = device_node  # the driver's --device-node on
        self.media, self.free_space = media, free_space  # --emulated-media, -free-space
        self.recreated: list[str] = []  # pools of volumes carved again (the metric's calls)
        self.fake = FakeMounter(self.base / "host")
        # The dax.sock server reads a peer's /proc/<pid>/cgroup here (see pod()).
        self.proc = self.base / "proc"
        self.proc.mkdir()
        self.driver: Driver | None = None
        self.start()

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> InProcessNode:
        """A driver process: the back end, dax.sock, the Driver over the state and the
        fake mounter, reconciled, and the servicers (a subclass changes the back end
        only, in :meth:`make_backend`)."""
        self.backend = self.make_backend()
        self.dax = DaxSocketServer(proc_root=str(self.proc))
        self.driver = Driver(DriverConfig(driver_name=DRIVER_NAME, node_id=NODE_ID,
                                          kubelet_dir=str(self.kubelet),
                                          device_node=self.device_node),
                             self.backend, StateStore(str(self.state)), self.dax,
                             mounter=self.fake, on_recreate=self.recreated.append)
        self.driver.reconcile()
        self.controller = _Stub(ControllerServicer(self.driver))
        self.node = _Stub(NodeServicer(self.driver))
        self.identity = _Stub(IdentityServicer(DRIVER_NAME, self.backend.probe))
        return self

    def make_backend(self) -> Backend:
        """The emulated back end over ``pools/`` (called at each start)."""
        return EmulatedBackend(self.base / "pools", self.regions, loops=self.fake,
                               media=self.media, free_space=self.free_space)

    def stop(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def restart(self) -> InProcessNode:
        """A new driver process: state, pools and mounts stay."""
        self.stop()
        return self.start()

    def reboot(self) -> InProcessNode:
        """The node restarts: mounts and loop devices are gone too."""
        self.stop()
        self.fake.reboot()
        return self.start()

    def pod(self, uid: str) -> None:
        """Make this process look like a container of pod ``uid`` to dax.sock."""
        mine = self.proc / str(os.getpid())
        mine.mkdir(exist_ok=True)
        (mine / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/container\n")

    # -- paths ------------------------------------------------------------------------
    def target(self, name: str) -> str:
        return str(self.kubelet / "pods" / name / "mount")

    def staging(self, name: str) -> str:
        return str(self.kubelet / "staging" / name / "globalmount")

    def block_target(self, pod: str) -> str:
        """Like kubelet: the parent exists, the driver creates the file."""
        parent = self.kubelet / "devices" / pod
        parent.mkdir(parents=True, exist_ok=True)
        return str(parent / "dev")

    # -- RPCs, with the defaults of conftest.DriverProcess ------------------------------
    def create(self, name: str, size: int = 64 * MiB, limit: int = 0, params=None,
               caps=None) -> csi_pb2.CreateVolumeResponse:
        return self.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size,
                                                            limit_bytes=limit),
            volume_capabilities=caps or [mount_cap()], parameters=params or {}))

    def delete(self, volume_id: str) -> None:
        self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id))

    def stage(self, volume_id: str, path: str, cap=None) -> None:
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=path,
            volume_capability=cap or mount_cap()))

    def unstage(self, volume_id: str, path: str) -> None:
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=path))

    def publish(self, volume_id: str, target: str, readonly: bool = False, cap=None,
                staging: str = "", pod_uid: str = "") -> None:
        context = {POD_UID_KEY: pod_uid} if pod_uid else {}
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=target, readonly=readonly,
            volume_capability=cap or mount_cap(), volume_context=context,
            staging_target_path=staging))

    def unpublish(self, volume_id: str, target: str) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=target))

    def stats(self, volume_id: str, path: str) -> csi_pb2.NodeGetVolumeStatsResponse:
        return self.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=volume_id, volume_path=path))

    def record(self, volume_id: str):
        assert self.driver is not None
        return self.driver.store.get(volume_id)


def code_of(call, *args, **kw) -> grpc.StatusCode:
    """The status code ``call`` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value.code()


def made_nodes(cls: type[InProcessNode] = InProcessNode):
    """The body of a ``nodes`` fixture: ``make(**kw)`` builds a node of ``cls``; every
    node made is closed afterwards (``yield from made_nodes(...)``)."""
    made: list[InProcessNode] = []

    def make(**kw) -> InProcessNode:
        made.append(cls(**kw))
        return made[-1]

    yield make
    for n in made:
        n.close()


def write_pattern(target: str) -> None:
    """PATTERN at the start of the volume published at ``target``, through dax.sock."""
    _, m = map_volume(target, writable=True)
    with m:
        m[:len(PATTERN)] = PATTERN


def read_head(target: str) -> bytes:
    """The first len(PATTERN) bytes of the volume published at ``target``."""
    _, m = map_volume(target, writable=False)
    with m:
        return m[:len(PATTERN)]


@pytest.fixture(name="node")
def node_fixture():
    """A fresh in-process node (driver, servicers, fake mounter), closed afterwards."""
    n = InProcessNode()
    yield n
    n.close()


@pytest.fixture(name="served")
def served_fixture():
    """An in-process node whose servicers answer on a unix socket, as `make run`'s do
    (``node.endpoint`` is the address for the command line)."""
    node = InProcessNode()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    csi_pb2_grpc.add_IdentityServicer_to_server(
        IdentityServicer(DRIVER_NAME, node.backend.probe), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(node.driver), server)
    csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node.driver), server)
    sock = node.base / "csi.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    node.endpoint = f"unix://{sock}"
    yield node
    server.stop(None)
    node.close()
