"""Shared fixtures: a real driver process on a real unix socket, and CSI stubs.

Why a subprocess and not an in-process server: crash-safety tests SIGKILL it, the
dax sockets must be served by another process than the client that maps the fd, and
a real start-up path (flags, reconcile) is what users run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from csi_pmem.csi import csi_pb2, csi_pb2_grpc
from csi_pmem.driver.host import mounts

ROOT = Path(__file__).resolve().parent.parent

# tests/torch_cpu runs in .venv-torch (`make torch-test`, which sets CSI_PMEM_TORCH_TESTS=1
# and stops conftest lookup there): this venv has no torch by design. Not even visited
# here, so that its conftest never takes the name `conftest` from this one, which the
# tests import helpers from.
collect_ignore = [] if os.environ.get("CSI_PMEM_TORCH_TESTS") == "1" else ["torch_cpu"]
Mode = csi_pb2.VolumeCapability.AccessMode
MiB = 1 << 20
GiB = 1 << 30


def mount_cap(mode=Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                    access_mode=Mode(mode=mode))


def block_cap(mode=Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                    access_mode=Mode(mode=mode))


@dataclass
class DriverProcess:
    """A `csi-pmem serve` child with its own state dir, pools and kubelet dir."""

    base: Path
    regions: str = "0=1Gi,1=1Gi"
    device: str = "file"
    env: dict = field(default_factory=dict)
    extra: list = field(default_factory=list)
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.base / "csi.sock"

    @property
    def kubelet(self) -> Path:
        return self.base / "kubelet"

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def log(self) -> Path:
        return self.base / "driver.log"

    def target(self, name: str) -> str:
        return str(self.kubelet / "pods" / name / "volumes" / "mount")

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.socket}", "--node-id", "test-node",
                "--state-dir", str(self.state), "--kubelet-dir", str(self.kubelet),
                "--backend", "emulated", "--emulated-regions", self.regions,
                "--emulated-root", str(self.base / "pools"),
                "--emulated-device", self.device, "--log-level", "debug", *self.extra]

    def start(self, failpoints: str = "") -> DriverProcess:
        self.kubelet.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.env)
        env["CSI_PMEM_FAILPOINTS"] = failpoints
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        while True:
            try:
                grpc.channel_ready_future(self.channel).result(timeout=0.5)
                csi_pb2_grpc.IdentityStub(self.channel).Probe(csi_pb2.ProbeRequest(), timeout=5)
                return self
            except (grpc.FutureTimeoutError, grpc.RpcError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"driver did not start:\n{self.log.read_text()}") from None

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_channel()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._close_channel()

    def restart(self, failpoints: str = "") -> DriverProcess:
        self.stop()
        return self.start(failpoints)

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    # Convenience wrappers with sensible defaults.
    def create(self, name: str, size: int = 64 * MiB, limit: int = 0, params=None,
               caps=None, **kw) -> csi_pb2.CreateVolumeResponse:
        return self.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size,
                                                            limit_bytes=limit),
            volume_capabilities=caps or [mount_cap()], parameters=params or {}, **kw),
            timeout=60)

    def delete(self, volume_id: str) -> None:
        self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id),
                                     timeout=120)

    def publish(self, volume_id: str, target: str, readonly: bool = False, context=None,
                cap=None, staging: str = "") -> None:
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=target, readonly=readonly,
            volume_capability=cap or mount_cap(), volume_context=context or {},
            staging_target_path=staging), timeout=60)

    def stage(self, volume_id: str, path: str, cap=None, context=None) -> None:
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=path, volume_capability=cap or mount_cap(),
            volume_context=context or {}), timeout=120)

    def unstage(self, volume_id: str, path: str) -> None:
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=path), timeout=60)

    def staging(self, name: str) -> str:
        return str(self.kubelet / "plugins" / "staging" / name / "globalmount")

    def unpublish(self, volume_id: str, target: str) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=target), timeout=60)

    def capacity(self, params=None) -> csi_pb2.GetCapacityResponse:
        return self.controller.GetCapacity(csi_pb2.GetCapacityRequest(
            parameters=params or {}, volume_capabilities=[mount_cap()]), timeout=30)

    def list_ids(self) -> list[str]:
        ids, token = [], ""
        while True:
            resp = self.controller.ListVolumes(
                csi_pb2.ListVolumesRequest(starting_token=token), timeout=30)
            ids += [e.volume.volume_id for e in resp.entries]
            token = resp.next_token
            if not token:
                return ids

    def pool_files(self) -> list[Path]:
        pools = self.base / "pools"
        return sorted([*pools.glob("region*/*.dax"), *pools.glob("region*/*.fsdax")])

    def cleanup_mounts(self) -> None:
        """Unmount whatever is still mounted below our base dir (tests that failed)."""
        for m in reversed(mounts_below(self)):
            subprocess.run(["umount", "-l", m.mount_point], check=False)


def eventually(check, what: str, timeout: float = 60.0, interval: float = 0.02):
    """Wait until ``check()`` is truthy and return it; fail naming ``what`` otherwise.

    For what the driver finishes in the background: a deleted volume's space comes
    back only once its erase is done (docs/design.md §6.9).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)


# ------------------------------------------------------------------ state inspection
def backing_ids(d: DriverProcess) -> list[str]:
    """Volume ids of the backing files in the pools (``<id>~<align>.dax`` or ``.fsdax``),
    duplicates kept."""
    return sorted(p.name.partition("~")[0] for p in d.pool_files())


def records(d: DriverProcess) -> dict[str, dict]:
    """Every state record as raw JSON; any other file in the store fails the test."""
    out = {}
    for p in sorted((d.state / "volumes").iterdir()):
        assert p.suffix == ".json" and not p.name.startswith("."), \
            f"stray file in the state store: {p.name}"
        rec = json.loads(p.read_text())
        assert p.name == f"{rec['id']}.json"
        out[rec["id"]] = rec
    return out


def record_state(d: DriverProcess, vid: str) -> str | None:
    """One record's state, read while the driver may be writing (it renames atomically)."""
    try:
        return json.loads((d.state / "volumes" / f"{vid}.json").read_text())["state"]
    except FileNotFoundError:
        return None


def mounts_below(d: DriverProcess) -> list[mounts.MountInfo]:
    return [m for m in mounts.mountinfo() if m.mount_point.startswith(str(d.base) + "/")]


def needs_root():
    return pytest.mark.skipif(os.geteuid() != 0, reason="needs root for tmpfs mounts")


@pytest.fixture
def driver_factory():
    """Make DriverProcess objects; everything is stopped and unmounted afterwards."""
    made: list[DriverProcess] = []
    bases: list[str] = []

    def make(**kw) -> DriverProcess:
        base = tempfile.mkdtemp(prefix="csi-pmem-test-")
        bases.append(base)
        d = DriverProcess(base=Path(base), **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()
        d.cleanup_mounts()
        if d.device == "loop" or any(f.suffix == ".fsdax" for f in d.pool_files()):
            for f in d.pool_files():
                out = subprocess.run(["losetup", "-j", str(f)], capture_output=True, text=True)
                for line in out.stdout.splitlines():
                    subprocess.run(["losetup", "-d", line.split(":")[0]], check=False)
    for b in bases:
        shutil.rmtree(b, ignore_errors=True)


@pytest.fixture
def driver(driver_factory) -> DriverProcess:
    """A started driver with two 1 GiB emulated NUMA pools."""
    return driver_factory().start()
