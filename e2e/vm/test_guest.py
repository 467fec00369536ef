"""The VM tier: the driver with ``--backend ndctl`` against the real kernel and ndctl.

Runs inside the QEMU guest that e2e/vm/run.sh boots (Debian's kernel, emulated NVDIMMs
on two NUMA nodes, the host's root over 9p). What it proves is what no unit test can:
that libnvdimm, device-dax and ndctl agree with the driver on sizes, placement,
capacity, erase, crash recovery and fd delivery; and for fsdax volumes that the pmem
block device, ext4/xfs with DAX (MAP_SYNC) and BLKZEROOUT behave as the driver assumes.
csi-sanity runs against the same driver process first.

Everything the host needs afterwards goes to ``$E2E_VM_OUT`` (the writable 9p share):
the driver log, csi-sanity's JUnit reports and summaries, ``latency.json``
(client-side wall time of each CSI call, under TCG, which slows guest userspace about
16x) and ``facts.json`` (regions, sizes and counts that the summary prints).
After every test a leak check compares ``ndctl list -N`` with what the test left on
purpose (nothing) and the label slots with those at boot, and looks for state records
and mounts left behind (fsdax file systems and device binds anywhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import math
import mmap
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import statistics
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CONFIG = os.environ.get("E2E_VM_CONFIG", "")
# Only in the guest that run.sh boots (it destroys namespaces): the kernel command line
# carries a marker that no real machine has.
if not CONFIG or "csi_pmem.vm=1" not in Path("/proc/cmdline").read_text().split():
    pytest.skip("runs inside the QEMU guest only: make e2e-vm", allow_module_level=True)

import grpc  # noqa: E402

from csi_pmem.csi import csi_pb2, csi_pb2_grpc  # noqa: E402
from csi_pmem.daxclient import open_volume  # noqa: E402
from csi_pmem.sizes import (  # noqa: E402
    REGION_ALIGN,
    GiB,
    MiB,
    allocation_for,
    devdax_usable,
    round_down,
)
from e2e.vm import weights_guest as wg  # noqa: E402
from tests import cgroups  # noqa: E402
from tests.test_csi_sanity import (  # noqa: E402
    FLAVOURS,
    SANITY_DIR,
    Flavour,
    Results,
    parse_junit,
    sanity_argv,
    summarise,
)

OUT = Path(os.environ.get("E2E_VM_OUT", "/tmp/e2e-vm-out"))
REPO = Path(__file__).resolve().parents[2]
BASE = Path("/run/e2e")  # tmpfs in the guest: short paths for unix sockets
NODE_ID = "vm-node"
METRICS = "127.0.0.1:9670"
START_TIMEOUT = 180.0  # interpreter + grpc import + reconcile, under TCG
CALL_TIMEOUT = 300.0
Code = grpc.StatusCode
Mode = csi_pb2.VolumeCapability.AccessMode
TCG_NOTE = ("guest wall time under QEMU TCG (no KVM): userspace runs about 16x slower "
            "than on the host, ndctl and the erase included")

LATENCY: dict[str, list[float]] = {}
_SESSION: dict[str, Any] = {}
FACTS: dict[str, Any] = {"config": CONFIG}


# ---------------------------------------------------------------------------- ndctl

def run(argv: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LC_ALL": "C"}, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def _as_list(doc: Any) -> list[dict]:
    # ndctl prints a bare object when there is exactly one, nothing when there is none,
    # and {"regions": [...]} for regions with namespaces.
    if doc is None:
        return []
    if isinstance(doc, dict):
        return list(doc["regions"]) if "regions" in doc and "dev" not in doc else [doc]
    return list(doc)


def ndctl_list(*args: str) -> list[dict]:
    out = run(["ndctl", "list", *args]).stdout.strip()
    return _as_list(json.loads(out)) if out else []


def regions() -> list[dict]:
    """``ndctl list -R -N -v``: regions with numa_node and their namespaces."""
    return sorted(ndctl_list("-R", "-N", "-v"), key=lambda r: r["dev"])


def named_namespaces() -> dict[str, tuple[dict, dict]]:
    """alt-name -> (region, namespace) for every configured namespace with a name."""
    found = {}
    for r in regions():
        for ns in _as_list(r.get("namespaces")):
            if ns.get("name"):
                found[ns["name"]] = (r, ns)
    return found


def all_namespaces() -> list[dict]:
    return ndctl_list("-N")


def named_with_idle(name: str) -> list[dict]:
    """Configured namespaces named ``name``, disabled ones included (``ndctl list -N
    -i``). A destroyed namespace stays listed as a seed that may keep the name, with a
    null uuid and no size: that one is gone."""
    return [ns for ns in ndctl_list("-N", "-i") if ns.get("name") == name
            and (ns.get("size") or str(ns.get("uuid", "")).strip("0-"))]


def sysfs(dev: str, attr: str) -> str:
    return Path(f"/sys/bus/nd/devices/{dev}/{attr}").read_text().strip()


def label_slots() -> dict[str, int]:
    base = Path("/sys/bus/nd/devices")
    return {p.name: int((p / "available_slots").read_text())
            for p in sorted(base.glob("nmem*")) if (p / "available_slots").exists()}


def region_start(dev: str) -> int:
    return int(sysfs(dev, "resource"), 0)


# ------------------------------------------------------------------- mounts, fsdax

@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo, with the per-mount and the super-block options
    kept apart (``dax=always`` is a super-block option of ext4 and xfs)."""

    point: str
    root: str
    dev: str
    fstype: str
    source: str
    mount_options: frozenset[str]
    super_options: frozenset[str]


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mountinfo() -> list[Mount]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(" "), right.split(" ")
        if len(f) < 6 or len(r) < 3:
            continue
        found.append(Mount(point=_unescape(f[4]), root=_unescape(f[3]), dev=f[2], fstype=r[0],
                           source=_unescape(r[1]), mount_options=frozenset(f[5].split(",")),
                           super_options=frozenset(r[2].split(","))))
    return found


def mount_at(path: str) -> Mount | None:
    """The top-most mount at ``path`` (the last one listed), or None."""
    found = None
    for m in mountinfo():
        if m.point == path:
            found = m
    return found


def fsdax_mounts() -> list[Mount]:
    return [m for m in mountinfo()
            if m.fstype in ("ext4", "xfs") or m.source.startswith("/dev/pmem")
            or (m.fstype == "devtmpfs" and re.match(r"^/pmem\d", m.root))]


def pmem_loops() -> dict[str, str]:
    """{/dev/loopN: backing device} for loop devices attached to a pmem block device
    (the driver's read-only views of fsdax Block publications)."""
    found = {}
    for p in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            back = p.read_text().strip()
        except OSError:
            continue  # detached meanwhile
        if back.startswith("/dev/pmem"):
            found[f"/dev/{p.parent.parent.name}"] = back
    return found


def dev_of(path: str) -> str:
    """``major:minor`` of the block device at ``path``, as mountinfo prints it."""
    rdev = os.stat(path).st_rdev
    return f"{os.major(rdev)}:{os.minor(rdev)}"


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
STATX_BASIC_STATS = 0x7FF
STATX_ATTR_DAX = 0x00200000  # include/uapi/linux/stat.h (Linux 5.8)
# Python 3.11's mmap module has neither constant; the values are from
# include/uapi/linux/mman.h and asm-generic/mman-common.h (x86-64).
MAP_SHARED_VALIDATE = getattr(mmap, "MAP_SHARED_VALIDATE", 0x03)
MAP_SYNC = getattr(mmap, "MAP_SYNC", 0x80000)
BLKGETSIZE64 = 0x80081272  # _IOR(0x12, 114, size_t)


def statx_dax(path: str) -> tuple[bool, bool]:
    """(the kernel reports STATX_ATTR_DAX for this file system, the file is DAX)."""
    buf = ctypes.create_string_buffer(256)  # struct statx
    if _libc.statx(AT_FDCWD, os.fsencode(path), 0, STATX_BASIC_STATS, buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    attributes = int.from_bytes(buf.raw[8:16], "little")        # stx_attributes
    attributes_mask = int.from_bytes(buf.raw[56:64], "little")  # stx_attributes_mask
    return bool(attributes_mask & STATX_ATTR_DAX), bool(attributes & STATX_ATTR_DAX)


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that starts at ``addr`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    head = f"{addr:08x}-"
    for i, line in enumerate(lines):
        if line.startswith(head):
            for follow in lines[i + 1:]:
                if follow.startswith("VmFlags:"):
                    return follow.split()[1:]
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", follow):
                    break
    return []


def block_size(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, bytes(8)))[0]
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- driver

# How long CreateVolume waits for space that deleted volumes' erases are freeing. Under
# TCG an erase runs at a few hundred MB/s, so csi-sanity's create-right-after-delete
# specs on a small region can outwait the 5 s default (seen: RESOURCE_EXHAUSTED with
# 480Mi still being erased on the CXL region); a real node erases 100x faster.
ERASE_WAIT_SECONDS = "120"


class Driver:
    """``python -m csi_pmem serve --backend ndctl`` with its state under BASE."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sock = base / "csi.sock"
        self.kubelet = base / "kubelet"
        self.state = base / "state"
        self.log = OUT / "driver.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.starts = 0
        self.failpoints = ""
        self.extra: list[str] = []  # more flags for the next start (reset by ``drv``)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.sock}", "--node-id", NODE_ID,
                "--state-dir", str(self.state), "--backend", "ndctl",
                "--kubelet-dir", str(self.kubelet), "--metrics-address", METRICS,
                "--erase-wait-seconds", ERASE_WAIT_SECONDS,
                "--log-level", "debug", *self.extra]

    def start(self, failpoints: str = "") -> float:
        assert self.proc is None or self.proc.poll() is not None, "driver already running"
        self.kubelet.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CSI_PMEM_")}
        if failpoints:
            env["CSI_PMEM_FAILPOINTS"] = failpoints
        self.failpoints = failpoints
        self.starts += 1
        with open(self.log, "ab") as f:
            f.write(f"\n===== e2e: driver start #{self.starts} failpoints={failpoints or '-'} "
                    f"=====\n".encode())
        t = time.monotonic()
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO, env=env, stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_serving()
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        return time.monotonic() - t

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"driver exited {self.proc.returncode} at start:\n{self.log_tail()}")
            if self.sock.exists():
                with socket.socket(socket.AF_UNIX) as s:
                    try:
                        s.connect(str(self.sock))
                        return
                    except OSError:
                        pass
            time.sleep(0.1)
        pytest.fail(f"driver did not serve {self.sock} in {START_TIMEOUT:.0f} s:\n"
                    + self.log_tail())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def stop(self) -> None:
        self._close_channel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def kill(self) -> None:
        self._close_channel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout=timeout)
        self._close_channel()
        return rc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def target(self, name: str) -> str:
        return str(self.kubelet / "pods" / name / "volumes" / "mount")


def timed(op: str, fn: Callable[..., Any], request: Any, timeout: float = CALL_TIMEOUT,
          record: bool = True) -> Any:
    """Call ``fn(request)``; keep the wall time of successful calls under ``op``."""
    t = time.monotonic()
    resp = fn(request, timeout=timeout)
    if record:
        LATENCY.setdefault(op, []).append(time.monotonic() - t)
    return resp


@contextlib.contextmanager
def new_samples(counts: dict[str, int]) -> Iterator[dict[str, list[float]]]:
    """The samples :func:`timed` records inside the block, per operation in ``counts``:
    afterwards there must be exactly that many of each, each the positive, finite wall
    time of a call that returned, and (one call at a time, all inside the block) their
    sum no more than the block's own wall time. What any recording of sequential calls
    satisfies by construction; no speed is asserted."""
    before = {op: len(LATENCY.get(op, [])) for op in counts}
    got: dict[str, list[float]] = {}
    t = time.monotonic()
    yield got
    elapsed = time.monotonic() - t
    for op, n in counts.items():
        got[op] = LATENCY.get(op, [])[before[op]:]
        assert len(got[op]) == n, (op, n, got[op])
        assert all(0 < s < math.inf for s in got[op]), (op, got[op])
    total = sum(sum(v) for v in got.values())
    assert total <= elapsed + 1e-6, (total, elapsed, got)  # 1e-6: float rounding only


def mount_cap(mode: int = Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                    access_mode=Mode(mode=mode))


def block_cap() -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                    access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))


def fs_cap(fs_type: str = "", flags: tuple[str, ...] = (),
           mode: int = Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    """A mount capability with a file system (fsdax volumes: ext4 or xfs)."""
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type, mount_flags=list(flags)),
        access_mode=Mode(mode=mode))


def create(drv: Driver, name: str, size: int, params: dict[str, str] | None = None,
           op: str = "CreateVolume", limit: int = 0,
           caps: list[csi_pb2.VolumeCapability] | None = None) -> csi_pb2.Volume:
    req = csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size, limit_bytes=limit),
        volume_capabilities=caps or [mount_cap()], parameters=params or {})
    return timed(op, drv.controller.CreateVolume, req).volume


def delete(drv: Driver, vid: str, op: str = "DeleteVolume") -> None:
    timed(op, drv.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=vid))


def publish(drv: Driver, vid: str, target: str, readonly: bool = False,
            pod_uid: str | None = None) -> None:
    ctx = {"csi.storage.k8s.io/pod.uid": pod_uid} if pod_uid else {}
    mode = Mode.SINGLE_NODE_READER_ONLY if readonly else Mode.SINGLE_NODE_WRITER
    timed("NodePublishVolume", drv.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
        volume_id=vid, target_path=target, volume_capability=mount_cap(mode),
        readonly=readonly, volume_context=ctx))


def unpublish(drv: Driver, vid: str, target: str, op: str = "NodeUnpublishVolume") -> None:
    timed(op, drv.node.NodeUnpublishVolume,
          csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target))


def stage(drv: Driver, vid: str, path: str, cap: csi_pb2.VolumeCapability,
          op: str = "NodeStageVolume") -> None:
    timed(op, drv.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=path, volume_capability=cap))


def unstage(drv: Driver, vid: str, path: str, op: str = "NodeUnstageVolume") -> None:
    timed(op, drv.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=path))


def publish_cap(drv: Driver, vid: str, target: str, cap: csi_pb2.VolumeCapability,
                staging: str = "", op: str = "NodePublishVolume",
                readonly: bool = False) -> None:
    """NodePublishVolume with an explicit capability (fsdax: block, or a staged fs)."""
    timed(op, drv.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
        volume_id=vid, target_path=target, staging_target_path=staging,
        volume_capability=cap, readonly=readonly))


def capacity(drv: Driver, params: dict[str, str]) -> tuple[int, int]:
    resp = timed("GetCapacity", drv.controller.GetCapacity, csi_pb2.GetCapacityRequest(
        parameters=params, volume_capabilities=[mount_cap()]))
    return resp.available_capacity, resp.maximum_volume_size.value


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def metrics_text() -> str:
    with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=60) as resp:
        return resp.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def wait_erase_idle(timeout: float = 600) -> float:
    """Wait until the driver's erase queue is empty (csi_pmem_erase_queue_length)."""
    t = time.monotonic()
    while True:
        try:
            text = metrics_text()
        except OSError:  # a driver just (re)started serves metrics a moment after gRPC
            assert time.monotonic() - t < timeout, "the driver serves no metrics"
            time.sleep(0.2)
            continue
        jobs = sum(metric_value(text, "csi_pmem_erase_queue_length", kind=k) or 0
                   for k in ("delete", "scrub"))
        if not jobs:
            return time.monotonic() - t
        assert time.monotonic() - t < timeout, f"{jobs} erase jobs still queued"
        time.sleep(0.2)


def region_record(drv: Driver, dev: str) -> dict:
    return json.loads((drv.state / "regions" / f"{dev}.json").read_text())


def map_rw(target: str) -> tuple[dict, mmap.mmap]:
    md, fd = open_volume(os.path.join(target, "dax.sock"))
    try:
        return md, mmap.mmap(fd, md["usable_size"], mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def unique(prefix: str) -> str:
    return f"e2e-{prefix}-{secrets.token_hex(3)}"


# ------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def boot_state() -> dict[str, Any]:
    """What the machine looked like before any test: the leak check's baseline."""
    regs = regions()
    state = {"regions": [{k: r.get(k) for k in ("dev", "size", "align", "available_size",
                                               "max_available_extent", "numa_node")}
                         | {"start": hex(region_start(r["dev"]))} for r in regs],
             "label_slots": label_slots(),
             "namespaces": [ns.get("dev") for ns in all_namespaces()],
             "kernel": os.uname().release,
             "ndctl": run(["ndctl", "--version"]).stdout.strip()}
    FACTS["boot"] = state
    return state


@pytest.fixture(scope="session")
def driver_session(boot_state: dict[str, Any]) -> Iterator[Driver]:
    if BASE.exists():
        shutil.rmtree(BASE)
    BASE.mkdir(parents=True)
    d = Driver(BASE)
    _SESSION["driver"] = d
    FACTS["driver_start_seconds"] = round(d.start(), 2)
    # The regions are first seen: the driver scrubs them in the background. Tests
    # compare capacity with ndctl, so they start once that is done.
    FACTS["first_start_scrub_seconds"] = round(wait_erase_idle(), 2)
    yield d
    d.stop()


@pytest.fixture
def drv(driver_session: Driver) -> Driver:
    """The session's driver, running and without fail points (a failed test may have
    left it stopped or armed)."""
    d = driver_session
    if d.running and (d.failpoints or d.extra):
        d.stop()
    d.extra = []
    if not d.running:
        d.start()
    return d


@pytest.fixture(scope="session", autouse=True)
def results() -> Iterator[None]:
    """Write latency.json and facts.json for the host, however the session ends."""
    yield
    _write_results()


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest, boot_state: dict[str, Any]) -> Iterator[None]:
    """After every test: no namespace, label, state record or mount is left behind."""
    yield
    if request.node.get_closest_marker("no_leak_check"):
        return
    problems = []
    d = _SESSION.get("driver")
    if d is not None and d.running and not d.failpoints:
        wait_erase_idle()  # background erases and scrubs hold namespaces until done
    left = [f"{ns.get('dev')} name={ns.get('name')!r} size={ns.get('size')}"
            for ns in all_namespaces() if ns.get("dev") not in boot_state["namespaces"]]
    if left:
        problems.append("ndctl list -N shows namespaces the test did not expect: "
                        + "; ".join(left))
    if label_slots() != boot_state["label_slots"]:
        problems.append(f"label slots {label_slots()} differ from boot "
                        f"{boot_state['label_slots']}")
    records = sorted(p.name for p in (BASE / "state" / "volumes").glob("*.json"))
    if records:
        problems.append(f"state records left: {records}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if f" {BASE}/kubelet/" in line]
    if mounts:
        problems.append(f"mounts left under the kubelet dir: {mounts}")
    # fsdax leftovers anywhere (a staging path or target outside the kubelet dir, a
    # mount the driver lost track of): any ext4/xfs, any /dev/pmem* file system, any
    # pmem device node bound onto a file. The guest's own root has none of these.
    pmem = fsdax_mounts()
    if pmem:
        problems.append("fsdax mounts left: " + "; ".join(
            f"{m.point} ({m.fstype} {m.source} root={m.root})" for m in pmem))
    loops = pmem_loops()
    if loops:
        problems.append(f"loop devices left on pmem devices: {loops}")
    if problems:
        _clean_up_leftovers(boot_state, mounts + [m.point for m in pmem], list(loops))
        pytest.fail("leak check: " + "\n".join(problems), pytrace=False)


def _clean_up_leftovers(boot_state: dict[str, Any], mounts: list[str],
                        loops: list[str] | None = None) -> None:
    """After a leak was reported: start the next test from a clean machine."""
    d = _SESSION.get("driver")
    if d is not None:
        d.stop()
    for mnt in sorted(set(mounts), key=len, reverse=True):
        run(["umount", "-l", mnt], check=False)
    for loop in loops or []:
        run(["losetup", "--detach", loop], check=False)
    for sub in ("state", "kubelet"):
        shutil.rmtree(BASE / sub, ignore_errors=True)
    for ns in all_namespaces():
        if ns.get("dev") not in boot_state["namespaces"]:
            run(["ndctl", "disable-namespace", ns["dev"]], check=False)
            run(["ndctl", "destroy-namespace", ns["dev"], "--force"], check=False)
    if d is not None:
        d.failpoints, d.extra = "", []
        d.start()
        wait_erase_idle()  # the state is gone: its regions are first seen and scrubbed


def _write_results() -> None:
    lat = {op: {"n": len(v), "min_s": round(min(v), 3), "median_s": round(statistics.median(v), 3),
                "max_s": round(max(v), 3), "samples_s": [round(x, 3) for x in v]}
           for op, v in sorted(LATENCY.items())}
    (OUT / "latency.json").write_text(json.dumps({"note": TCG_NOTE, "operations": lat},
                                                 indent=1) + "\n")
    (OUT / "facts.json").write_text(json.dumps(FACTS, indent=1, default=str) + "\n")


@contextlib.contextmanager
def volume(drv: Driver, name: str, size: int, params: dict[str, str] | None = None,
           op: str = "CreateVolume",
           caps: list[csi_pb2.VolumeCapability] | None = None) -> Iterator[csi_pb2.Volume]:
    vol = create(drv, name, size, params, op=op, caps=caps)
    try:
        yield vol
    finally:
        delete(drv, vol.volume_id)


@contextlib.contextmanager
def published(drv: Driver, vid: str, target: str, readonly: bool = False,
              pod_uid: str | None = None) -> Iterator[str]:
    publish(drv, vid, target, readonly, pod_uid)
    try:
        yield target
    finally:
        unpublish(drv, vid, target)


# ==================================================================== main config

def test_machine_has_two_labelled_aligned_regions(boot_state: dict[str, Any]) -> None:
    regs = regions()
    assert [r.get("numa_node") for r in regs] == [0, 1], regs
    for r in regs:
        assert "iset_id" in r, f"{r['dev']} is label-less: init-labels did not run"
        assert sysfs(r["dev"], "nstype") == "5"  # ND_DEVICE_NAMESPACE_PMEM: labelled
        assert region_start(r["dev"]) % (16 * MiB) == 0
        assert r["size"] == 1008 * MiB  # 1 GiB backend minus label area, 16 MiB aligned
        assert r["available_size"] == r["size"]
    assert boot_state["namespaces"] == [], "the regions must start empty"


def test_probe_and_plugin_info(drv: Driver) -> None:
    resp = timed("Probe", drv.identity.Probe, csi_pb2.ProbeRequest())
    assert resp.ready.value is True
    info = drv.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=60)
    assert info.node_id == NODE_ID
    FACTS["max_volumes_per_node"] = info.max_volumes_per_node
    # ~510 label slots per DIMM (docs/design.md §4); one DIMM per region here.
    assert info.max_volumes_per_node > 100


def _flavour_align(name: str) -> tuple[str, int]:
    text = (SANITY_DIR / name).read_text()
    m = re.search(r"^align:\s*\"?(\w+)\"?", text, re.MULTILINE)
    label = m.group(1) if m else "2Mi"
    return label, {"2Mi": 2 * MiB, "1Gi": GiB}[label]


def vm_flavour(name: str) -> tuple[Flavour, str]:
    """The flavour as make test runs it, and why it cannot run here (empty if it can).

    csi-sanity sends required_bytes == limit_bytes == the test size in several specs.
    A devdax namespace keeps its struct pages on the device, so the namespace offers
    more than a 64 MiB request (80 MiB namespace, 78 MiB usable); the driver then
    advertises the limit (csi_pmem.driver.core.promised_size). Running the same sizes as the
    emulated tier checks that path against the real kernel.
    """
    flavour = FLAVOURS[name]
    if re.search(r"^media:\s*\"?volatile\"?\s*$", (SANITY_DIR / name).read_text(), re.M):
        return flavour, (
            "the class asks for media: volatile and this boot has only NVDIMM (persistent) "
            "pools; it runs on soft-reserved memory in the hmem boot (test_guest_dax.py) "
            "and on the emulated back end on tmpfs in make test")
    label, align = _flavour_align(name)
    raw = allocation_for(flavour.volume_size, align, REGION_ALIGN)[0]
    biggest = max(r["size"] for r in regions())
    if raw > biggest:
        return flavour, (
            f"a {flavour.volume_size >> 20} MiB volume with {label} align needs a "
            f"{raw >> 20} MiB devdax namespace (struct-page metadata plus rounding to the "
            f"align); the VM's regions hold {biggest >> 20} MiB. It runs on the emulated "
            "back end in make test; here the OUT_OF_RANGE answer is checked by "
            "test_usable_size_1gi_align_is_out_of_range")
    return flavour, ""


# By default every flavour whose volumes fit the VM's regions runs (about 55 s each
# under TCG, fsdax-ext4 about 95 s: each volume is erased through the block layer and
# each stage probes, formats and mounts), except those listed here, which repeat
# another flavour on this machine; E2E_VM_SANITY_FLAVOURS=all runs them too. That keeps
# make e2e-vm under 10 minutes on two host cores.
# Flavours not worth their guest time by default (flavour -> why), opt back in with
# E2E_VM_SANITY_FLAVOURS=all. Empty: every flavour that fits the guest's regions runs
# (each costs 40-95 s under TCG; CI has the time).
VM_SANITY_REDUNDANT: dict[str, str] = {
    "devdax-persistent.yaml": "repeats devdax-2mi here (every pool of this boot is a "
                              "persistent NVDIMM); the cxl boot runs it on CXL pmem",
}


def _sanity_binary() -> str:
    path = os.environ.get("CSI_SANITY_BIN", "")
    if path and os.access(path, os.X_OK):
        return path
    msg = (f"csi-sanity not found at {path or '$CSI_SANITY_BIN'}: build it on the host with "
           "scripts/install-csi-sanity.sh")
    if os.environ.get("CSI_SANITY_REQUIRED", "") not in ("", "0"):
        pytest.fail(msg + " (CSI_SANITY_REQUIRED is set)", pytrace=False)
    pytest.skip(msg)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("flavour", sorted(FLAVOURS), ids=lambda n: n.removesuffix(".yaml"))
def test_csi_sanity(drv: Driver, flavour: str) -> None:
    wanted = os.environ.get("E2E_VM_SANITY_FLAVOURS", "")
    if not wanted and flavour in VM_SANITY_REDUNDANT:
        FACTS.setdefault("csi_sanity", {})[flavour] = {"skipped": VM_SANITY_REDUNDANT[flavour]}
        pytest.skip(VM_SANITY_REDUNDANT[flavour])
    if wanted and wanted != "all" and flavour not in wanted.split(","):
        pytest.skip(f"not selected (E2E_VM_SANITY_FLAVOURS={wanted}; 'all' runs every "
                    "flavour, about 55-95 s each under TCG); every flavour runs against the "
                    "emulated back end in make test")
    binary = _sanity_binary()
    vm_fl, why = vm_flavour(flavour)
    if why:
        FACTS.setdefault("csi_sanity", {})[flavour] = {"skipped": why}
        pytest.skip(why)
    res, text = run_sanity(drv, binary, flavour, vm_fl, timeout=1400)
    assert not res.failed, text


def run_sanity(drv: Driver, binary: str, flavour: str, fl: Flavour,
               timeout: float) -> tuple[Results, str]:
    """csi-sanity on the parameter file ``flavour`` against ``drv`` (every guest suite's
    csi-sanity test): its output, JUnit report and summary go to $E2E_VM_OUT, its counts
    to facts.json; returns the parsed report and the summary, for the caller's asserts."""
    work = drv.base  # sanity_argv puts mountdir/stagingdir under <work>/kubelet
    report = work / "junit.xml"
    report.unlink(missing_ok=True)
    argv = sanity_argv(binary, f"unix://{drv.sock}", work, SANITY_DIR / flavour, fl)
    name = flavour.removesuffix(".yaml")
    t = time.monotonic()
    with open(OUT / f"csi-sanity-{name}.out", "wb") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.run(argv, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    seconds = time.monotonic() - t
    assert report.exists(), f"csi-sanity wrote no JUnit report (exit {proc.returncode})"
    shutil.copy(report, OUT / f"csi-sanity-{name}.xml")
    res = parse_junit(report)
    text = summarise(flavour, res)
    (OUT / f"csi-sanity-{name}.txt").write_text(text + "\n")
    print(text)
    FACTS.setdefault("csi_sanity", {})[flavour] = {
        "passed": len(res.passed), "skipped": len(res.skipped), "pending": len(res.pending),
        "failed": len(res.failed), "seconds": round(seconds, 1), "exit": proc.returncode,
        "volume_size": fl.volume_size, "access_type": fl.access_type}
    return res, text


@pytest.mark.parametrize("numa", ["0", "1", "auto"])
def test_placement_lands_in_the_right_region(drv: Driver, numa: str) -> None:
    blocker = None
    if numa == "auto":
        # Fill node 0 a little so "auto" (most free space first) must choose node 1.
        blocker = create(drv, unique("blocker"), 128 * MiB, {"numaNode": "0"})
    try:
        vol = create(drv, unique(f"numa{numa}"), 64 * MiB, {"numaNode": numa})
        try:
            region, ns = named_namespaces()[vol.volume_id]
            want = 1 if numa == "auto" else int(numa)
            assert region["numa_node"] == want, (region["dev"], region["numa_node"])
            assert ns.get("numa_node", want) == want
            assert ns["mode"] == "devdax" and ns["name"] == vol.volume_id
            assert vol.volume_context["numaNode"] == str(want)
            assert vol.volume_context["pool"] == region["dev"]
            dax = ns["daxregion"]["devices"][0]
            assert vol.volume_context["device"] == f"/dev/{dax['chardev']}"
            assert Path(f"/sys/bus/dax/devices/{dax['chardev']}/numa_node").read_text().strip() \
                == str(want)
            assert vol.capacity_bytes == dax["size"] >= 64 * MiB
        finally:
            delete(drv, vol.volume_id)
    finally:
        if blocker is not None:
            delete(drv, blocker.volume_id)


def expected_capacity(params: dict[str, str]) -> tuple[int, int]:
    """GetCapacity computed from ``ndctl list -R`` with the driver's usable-size rule.

    A pool's free bytes are rounded down to the allocation step (lcm of the region
    align and the devdax align), then converted to what a devdax namespace of that raw
    size offers (struct-page metadata on the device, docs/design.md §4). An fsdax namespace
    (map=dev, 2 MiB align) keeps the same metadata: its block device is as large as a
    2Mi devdax device of the same raw size (test_fsdax_usable_size_and_placement).
    """
    align = {"2Mi": 2 * MiB, "1Gi": GiB}[params.get("align", "2Mi")]
    numa = params.get("numaNode", "auto")
    pools = [r for r in regions() if numa == "auto" or r["numa_node"] == int(numa)]

    def usable(nbytes: int, region: dict) -> int:
        step = math.lcm(align, region["align"], REGION_ALIGN)
        return devdax_usable(round_down(nbytes, step), align)

    available = sum(usable(r["available_size"], r) for r in pools)
    largest = max((usable(r["max_available_extent"], r) for r in pools), default=0)
    return available, largest


CAPACITY_PARAMS = [{}, {"numaNode": "0"}, {"numaNode": "1"}, {"numaNode": "7"},
                   {"align": "1Gi"}, {"numaNode": "1", "align": "2Mi"},
                   {"deviceMode": "fsdax", "numaNode": "1"}]


def test_get_capacity_matches_ndctl(drv: Driver) -> None:
    seen = []
    for p in CAPACITY_PARAMS:
        got, want = capacity(drv, p), expected_capacity(p)
        seen.append({"params": p, "empty": got})
        assert got == want, f"GetCapacity{p} = {got}, ndctl says {want}"
    # With volumes in place the regions differ; the answer must still follow ndctl.
    with volume(drv, unique("cap0"), 200 * MiB, {"numaNode": "0"}), \
            volume(drv, unique("cap1"), 100 * MiB, {"numaNode": "1"}):
        for p in CAPACITY_PARAMS:
            got, want = capacity(drv, p), expected_capacity(p)
            assert got == want, f"with volumes: GetCapacity{p} = {got}, ndctl says {want}"
        # The advertised maximum really fits: create exactly that on node 1.
        _, largest = capacity(drv, {"numaNode": "1"})
        with volume(drv, unique("capmax"), largest, {"numaNode": "1"}) as big:
            assert big.capacity_bytes >= largest
            assert capacity(drv, {"numaNode": "1"})[0] == expected_capacity(
                {"numaNode": "1"})[0]
    assert capacity(drv, {"numaNode": "7"}) == (0, 0)
    FACTS["capacity_empty"] = seen


# Small to large, one not a multiple of anything; each is created and erased twice.
USABLE_SIZES_2MI = [2 * MiB, 64 * MiB, 100_000_000, 256 * MiB]


def test_usable_size_at_least_requested_2mi(drv: Driver) -> None:
    rows = []
    for i, size in enumerate(USABLE_SIZES_2MI):
        vol = create(drv, unique(f"size{i}"), size, {"align": "2Mi", "numaNode": str(i % 2)})
        try:
            _region, ns = named_namespaces()[vol.volume_id]
            dax = ns["daxregion"]["devices"][0]
            raw = int(sysfs(ns["dev"], "size"))
            rows.append({"requested": size, "namespace": raw, "usable": vol.capacity_bytes,
                         "kernel_usable": dax["size"], "predicted": devdax_usable(raw, 2 * MiB)})
            assert vol.capacity_bytes >= size
            assert vol.capacity_bytes == dax["size"], "capacity_bytes is not what the kernel offers"
            assert raw == allocation_for(size, 2 * MiB)[0]
            assert dax["size"] == devdax_usable(raw, 2 * MiB), "sizes.devdax_usable is off"
            assert vol.capacity_bytes - size < 16 * MiB + 2 * MiB, "over-allocated"
            assert ns["align"] == 2 * MiB
        finally:
            delete(drv, vol.volume_id)
    FACTS["usable_sizes_2Mi"] = rows


def test_usable_size_1gi_align_is_out_of_range(drv: Driver) -> None:
    """A 1 GiB-aligned volume needs whole GiB plus metadata: more than a 1008 MiB region."""
    for size in (64 * MiB, 1 * GiB):
        err = rpc_error(lambda size=size: create(drv, unique("gib"), size, {"align": "1Gi"}))
        assert err.code() == Code.OUT_OF_RANGE, (err.code(), err.details())
        assert "largest region" in err.details() and "1Gi" in err.details(), err.details()
    assert capacity(drv, {"align": "1Gi"}) == (0, 0)
    FACTS["align_1Gi_error"] = err.details()


def test_erase_on_delete_then_recreate_reads_zeros(drv: Driver) -> None:
    name, size = unique("erase"), 64 * MiB
    pattern = secrets.token_bytes(4096)
    vol = create(drv, name, size, {"numaNode": "0"})
    _region, ns = named_namespaces()[vol.volume_id]
    start_before = sysfs(ns["dev"], "resource")
    target = drv.target("erase-pod")
    with published(drv, vol.volume_id, target):
        md, m = map_rw(target)
        usable = md["usable_size"]
        offsets = [0, usable // 2, usable - len(pattern)]
        for off in offsets:
            m[off:off + len(pattern)] = pattern
        m.close()
    erased_before = metric_value(metrics_text(), "csi_pmem_erase_bytes_total") or 0
    delete(drv, vol.volume_id, op="DeleteVolume (erase)")
    erased = (metric_value(metrics_text(), "csi_pmem_erase_bytes_total") or 0) - erased_before
    assert erased >= usable, f"DeleteVolume zeroed {erased} bytes, the volume has {usable}"

    vol2 = create(drv, name, size, {"numaNode": "0"})
    try:
        _, ns2 = named_namespaces()[vol2.volume_id]
        same_media = sysfs(ns2["dev"], "resource") == start_before
        FACTS["erase_same_media"] = same_media
        with published(drv, vol2.volume_id, target):
            md2, m2 = map_rw(target)
            try:
                for off in offsets:
                    assert m2[off:off + len(pattern)] == bytes(len(pattern)), \
                        f"old data visible at offset {off}"
                assert m2[:].count(0) == md2["usable_size"], "non-zero bytes in a new volume"
            finally:
                m2.close()
    finally:
        delete(drv, vol2.volume_id)


def _connect_refused(sock: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sock)
        except OSError as e:
            return e.errno in (errno.ECONNREFUSED, errno.ENOENT)
    return False


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_restart_serves_published_volumes_again(drv: Driver, how: str) -> None:
    pattern = secrets.token_bytes(512)
    a = create(drv, unique("rsa"), 32 * MiB)
    b = create(drv, unique("rsb"), 32 * MiB)
    ta, tb = drv.target(f"restart-a-{how}"), drv.target(f"restart-b-{how}")
    try:
        publish(drv, a.volume_id, ta)
        publish(drv, b.volume_id, tb, readonly=True)
        _, m = map_rw(ta)
        m[:len(pattern)] = pattern
        m.close()

        drv.kill() if how == "SIGKILL" else drv.stop()
        assert _connect_refused(os.path.join(ta, "dax.sock")), "dax.sock answered while down"
        mounts = Path("/proc/self/mountinfo").read_text()
        assert f" {ta} " in mounts and f" {tb} " in mounts, "the tmpfs mounts must survive"
        seconds = drv.start()
        LATENCY.setdefault(f"driver restart with 2 published ({how})", []).append(seconds)

        md, fd = open_volume(os.path.join(ta, "dax.sock"))
        try:
            with mmap.mmap(fd, md["usable_size"], mmap.MAP_SHARED, mmap.PROT_READ) as m:
                assert m[:len(pattern)] == pattern
        finally:
            os.close(fd)
        mdb, fdb = open_volume(os.path.join(tb, "dax.sock"))
        try:
            assert mdb["readonly"] is True
            assert fcntl.fcntl(fdb, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(PermissionError):
                mmap.mmap(fdb, mdb["usable_size"], mmap.MAP_SHARED,
                          mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fdb)
    finally:
        for vid, t in ((a.volume_id, ta), (b.volume_id, tb)):
            unpublish(drv, vid, t)
            delete(drv, vid)


def _record(drv: Driver, vid: str) -> dict | None:
    p = drv.state / "volumes" / f"{vid}.json"  # csi_pmem.driver.state.StateStore's layout
    return json.loads(p.read_text()) if p.exists() else None


def test_sigkill_between_ndctl_create_and_state_write(drv: Driver) -> None:
    name = unique("crash")
    drv.stop()
    drv.start(failpoints="create-after-namespace")
    err = rpc_error(lambda: create(drv, name, 64 * MiB, {"numaNode": "1"}, op="crash"))
    assert err.code() == Code.UNAVAILABLE, err
    assert drv.wait_exit() == -signal.SIGKILL
    from csi_pmem.driver.core import volume_id_for

    vid = volume_id_for(name)
    left = named_namespaces()
    assert vid in left, "the fail point fired before ndctl created the namespace"
    assert _record(drv, vid)["state"] == "creating"

    drv.start()  # reconcile
    assert vid not in named_namespaces(), "reconcile leaked the namespace"
    assert _record(drv, vid) is None
    assert f"rolled back interrupted creation of {vid}" in drv.log_text()
    with volume(drv, name, 64 * MiB, {"numaNode": "1"}) as vol:
        assert vol.volume_id == vid


def test_sigkill_between_erase_and_destroy_on_delete(drv: Driver) -> None:
    name = unique("crashdel")
    vol = create(drv, name, 64 * MiB)
    drv.stop()
    drv.start(failpoints="delete-after-erase")
    # DeleteVolume waits up to --delete-wait-seconds for its erase, which may take
    # longer under TCG: the fail point kills the driver during the call or after it.
    try:
        delete(drv, vol.volume_id, op="crash")
    except grpc.RpcError as err:
        assert err.code() == Code.UNAVAILABLE, err
    assert drv.wait_exit() == -signal.SIGKILL
    assert vol.volume_id in named_namespaces()
    assert _record(drv, vol.volume_id)["state"] == "deleting"
    drv.start()
    wait_erase_idle()  # the resumed delete erases again in the background, then destroys
    assert vol.volume_id not in named_namespaces(), "reconcile did not finish the delete"
    assert _record(drv, vol.volume_id) is None
    assert f"finished interrupted deletion of {vol.volume_id}" in drv.log_text()


# ------------------------------------------------------------- erase once (issue 17)
def _region_of(numa: str) -> str:
    return next(r["dev"] for r in regions() if str(r.get("numa_node", 0)) == numa)


def _zeroed_on_create(drv: Driver, vid: str) -> bool:
    return any(f"created volume {vid}" in line and "zeroed (dirty region)" in line
               for line in drv.log_text().splitlines())


def _write_pattern(drv: Driver, vid: str, pattern: bytes) -> list[int]:
    target = drv.target(f"fill-{vid[-6:]}")
    with published(drv, vid, target):
        md, m = map_rw(target)
        usable = md["usable_size"]
        offsets = [0, usable // 2, usable - len(pattern)]
        for off in offsets:
            m[off:off + len(pattern)] = pattern
        m.close()
    return offsets


def _reads_zeros(drv: Driver, vid: str) -> bool:
    target = drv.target(f"read-{vid[-6:]}")
    with published(drv, vid, target):
        md, m = map_rw(target)
        try:
            return m[:].count(0) == md["usable_size"]
        finally:
            m.close()


def test_clean_and_dirty_regions_on_real_ndctl(drv: Driver) -> None:
    """Scrubbed at first start: clean. An erased delete keeps it clean and the next
    create writes nothing; a delete without erase makes it dirty until the background
    scrub (raw scratch namespaces over the free space) has cleaned it again."""
    dev = _region_of("0")
    wait_erase_idle()
    rec = region_record(drv, dev)
    assert rec["clean"] and rec["scrub"] == [], rec
    assert metric_value(metrics_text(), "csi_pmem_region_clean", pool=dev) == 1
    with volume(drv, unique("clean"), 64 * MiB, {"numaNode": "0"},
                op="CreateVolume 64Mi (clean region)") as vol:
        assert not _zeroed_on_create(drv, vol.volume_id)
    assert region_record(drv, dev)["clean"], "an erased delete made the region dirty"

    vol = create(drv, unique("noerase"), 64 * MiB, {"numaNode": "0", "eraseOnDelete": "false"})
    delete(drv, vol.volume_id, op="DeleteVolume 64Mi (no erase)")
    rec = region_record(drv, dev)
    assert not rec["clean"] and "eraseOnDelete: false" in rec["reason"], rec
    t = time.monotonic()
    wait_erase_idle()
    FACTS["scrub_after_unerased_delete_seconds"] = round(time.monotonic() - t, 2)
    rec = region_record(drv, dev)
    assert rec["clean"] and rec["scrub"] == [], rec
    assert not [ns for ns in all_namespaces()
                if str(ns.get("name", "")).startswith("csi-pmem-scrub-")], "scratch left"
    assert capacity(drv, {"numaNode": "0"}) == expected_capacity({"numaNode": "0"})
    with volume(drv, unique("clean2"), 64 * MiB, {"numaNode": "0"}) as vol:
        assert not _zeroed_on_create(drv, vol.volume_id)


def test_new_volume_over_unerased_space_reads_zeros(drv: Driver) -> None:
    """eraseOnDelete: false, then a new volume over the same media (scrubs off, so the
    region stays dirty): the driver zeroes it in CreateVolume; it reads all zeros."""
    drv.stop()
    drv.extra = ["--scrub", "off"]
    drv.start()
    size, pattern = 64 * MiB, secrets.token_bytes(4096)
    vol = create(drv, unique("old"), size, {"numaNode": "1", "eraseOnDelete": "false"})
    _, ns = named_namespaces()[vol.volume_id]
    start_before = sysfs(ns["dev"], "resource")
    _write_pattern(drv, vol.volume_id, pattern)
    delete(drv, vol.volume_id, op="DeleteVolume 64Mi (no erase)")
    assert not region_record(drv, _region_of("1"))["clean"]
    vol2 = create(drv, unique("new"), size, {"numaNode": "1"},
                  op="CreateVolume 64Mi (dirty region)")
    try:
        _, ns2 = named_namespaces()[vol2.volume_id]
        FACTS["unerased_same_media"] = sysfs(ns2["dev"], "resource") == start_before
        assert _zeroed_on_create(drv, vol2.volume_id)
        assert _reads_zeros(drv, vol2.volume_id), "the previous tenant's bytes are visible"
    finally:
        delete(drv, vol2.volume_id)
    # Its erase and ndctl destroy may still run in the background; stopping the driver
    # in the middle of the destroy is another test
    # (test_sigterm_during_a_background_ndctl_destroy_leaks_no_label).
    wait_erase_idle()
    drv.stop()
    drv.extra = []
    drv.start()  # scrub auto: the dirty region is cleaned in the background
    wait_erase_idle()
    assert region_record(drv, _region_of("1"))["clean"]


def test_restart_during_background_erase_reports_no_space_early(drv: Driver) -> None:
    """DeleteVolume returns while the erase runs; the space is not free until the
    erase is done, also across a SIGKILL and restart in the middle of it."""
    params = {"numaNode": "1"}
    initial = capacity(drv, params)
    drv.stop()
    drv.extra = ["--delete-wait-seconds", "0"]
    drv.start(failpoints="erase-mid=stall")
    vol = create(drv, unique("bigerase"), 512 * MiB, params)
    _write_pattern(drv, vol.volume_id, secrets.token_bytes(4096))
    with_volume = capacity(drv, params)
    t = time.monotonic()
    delete(drv, vol.volume_id, op="DeleteVolume 512Mi (background erase)")
    FACTS["background_delete_returned_seconds"] = round(time.monotonic() - t, 3)
    deadline = time.monotonic() + 300
    while "failpoint erase-mid stalled" not in drv.log_text():
        assert time.monotonic() < deadline, "the erase never reached its middle"
        time.sleep(0.2)
    listed = drv.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=CALL_TIMEOUT)
    assert vol.volume_id not in [e.volume.volume_id for e in listed.entries]
    assert capacity(drv, params) == with_volume, "space reported free while being erased"
    assert vol.volume_id in named_namespaces(), "destroyed before its erase was done"
    drv.kill()
    assert _record(drv, vol.volume_id)["state"] == "deleting"
    drv.failpoints = ""
    drv.start()  # resumes the erase
    wait_erase_idle()
    assert vol.volume_id not in named_namespaces()
    assert _record(drv, vol.volume_id) is None
    assert capacity(drv, params) == initial
    assert region_record(drv, _region_of("1"))["clean"]
    with volume(drv, unique("after"), 512 * MiB, params) as again:
        assert not _zeroed_on_create(drv, again.volume_id)
        assert _reads_zeros(drv, again.volume_id)


def test_sigterm_during_a_background_ndctl_destroy_leaks_no_label(drv: Driver) -> None:
    """SIGTERM while a background delete is between ndctl's disable-namespace and
    destroy-namespace: the driver exits only once the destroy is done. It used to exit
    as soon as its stop began, leaving a disabled namespace that held a label slot."""
    drv.stop()
    drv.extra = ["--delete-wait-seconds", "0"]
    drv.start(failpoints="destroy-mid=sleep:5")
    vol = create(drv, unique("stopdestroy"), 64 * MiB, {"numaNode": "0"})
    delete(drv, vol.volume_id, op="DeleteVolume 64Mi (background erase)")
    deadline = time.monotonic() + 300
    while "failpoint destroy-mid sleeping" not in drv.log_text():
        assert time.monotonic() < deadline, "the background delete never reached its destroy"
        time.sleep(0.2)
    t = time.monotonic()
    drv.stop()
    FACTS["stop_during_destroy_seconds"] = round(time.monotonic() - t, 2)
    assert drv.proc is not None and drv.proc.returncode == 0, drv.log_tail()
    assert named_with_idle(vol.volume_id) == [], "the driver exited mid-destroy"
    assert _record(drv, vol.volume_id) is None
    drv.failpoints = ""
    drv.start()


def test_sigkill_between_ndctl_disable_and_destroy_resumes_the_destroy(drv: Driver) -> None:
    """A power cut between disable-namespace and destroy-namespace leaves a disabled
    namespace with no device: the record says its erase was verified, so the next start
    destroys it without trying to erase it again."""
    drv.stop()
    drv.extra = ["--delete-wait-seconds", "0"]
    drv.start(failpoints="destroy-mid")
    vid = create(drv, unique("killdestroy"), 64 * MiB, {"numaNode": "1"}).volume_id
    with contextlib.suppress(grpc.RpcError):
        delete(drv, vid, op="crash")
    assert drv.wait_exit(300) == -signal.SIGKILL
    rec = _record(drv, vid)
    assert rec is not None and rec["state"] == "deleting" and rec["erased"] is True, rec
    left = named_with_idle(vid)
    assert left and all(ns.get("state") == "disabled" for ns in left), left
    FACTS["disabled_leftover"] = left  # the kernel lists it as raw: its claim is gone
    drv.failpoints = ""
    drv.extra = []
    drv.start()
    wait_erase_idle()
    assert named_with_idle(vid) == [], "the destroy was not resumed"
    assert _record(drv, vid) is None
    erased = [line for line in drv.log_text().splitlines() if f" erased {vid}:" in line]
    assert len(erased) == 1, erased
    assert region_record(drv, _region_of("1"))["clean"]


def test_ndctl_share_of_create_and_delete(drv: Driver) -> None:
    """Issue 17 item 4: how much of CreateVolume and DeleteVolume is ndctl and how much
    the driver's own work, on real regions (bench_provision.ndctl_share, in-process on
    the session driver's state while that driver is stopped)."""
    import importlib.util

    wait_erase_idle()
    assert region_record(drv, _region_of("0"))["clean"]
    spec = importlib.util.spec_from_file_location(
        "bench_provision", REPO / "benchmarks" / "bench_provision.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    drv.stop()
    try:
        share = bench.ndctl_share(drv.state, 64 * MiB, reps=5, numa="0")
    finally:
        drv.start()
    FACTS["ndctl_share_64Mi"] = share
    print("share of the driver's time in ndctl, 64Mi, guest under TCG:")
    bench.print_share(share, "ndctl")
    assert share["zeroed_creates"] == 0, "the region was dirty: the creates zeroed"
    for op in ("CreateVolume", "DeleteVolume"):
        assert share[op]["execs"] >= 1 and share[op]["backend_ms"] > 0, share


DENIED_CHILD = r"""
import json, mmap, os, sys
from csi_pmem.daxclient import open_volume
args = json.loads(sys.argv[1])
device, pattern = args["device"], bytes.fromhex(args["pattern"])
out = {}

def errno_of(fn):
    try:
        os.close(fn())
    except OSError as e:
        return e.errno
    return 0

out["open_before"] = errno_of(lambda: os.open(device, os.O_RDONLY))
with open(args["procs"], "w") as f:
    f.write(str(os.getpid()))
out["cgroup"] = open("/proc/self/cgroup").read()
out["open_rdwr"] = errno_of(lambda: os.open(device, os.O_RDWR))
out["open_rdonly"] = errno_of(lambda: os.open(device, os.O_RDONLY))
try:
    md, fd = open_volume(args["socket"])
except Exception as e:
    out["open_volume_error"] = str(e)
    print(json.dumps(out))
    sys.exit(0)
out["metadata"] = md
out["reopen_proc_fd"] = errno_of(lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
size = md["usable_size"]
m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
m[:len(pattern)] = pattern
m[size - len(pattern):] = pattern[::-1]
out["readback"] = m[:len(pattern)] == pattern and m[size - len(pattern):] == pattern[::-1]
m.close()
os.close(fd)
print(json.dumps(out))
"""


def _child(code: str, arg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fd_delivered_into_a_cgroup_that_denies_the_device(drv: Driver) -> None:
    hier = cgroups.hierarchies()
    if not hier:
        pytest.fail("no cgroup hierarchy that controls devices in the guest")
    tree = cgroups.CgroupTree(hier[2] if 2 in hier else hier[1])
    pod, other = str(uuid.uuid4()), str(uuid.uuid4())
    pattern = secrets.token_bytes(4096)
    try:
        container = tree.create("kubepods", "burstable", f"pod{pod}", secrets.token_hex(6))
        stranger = tree.create("kubepods", "burstable", f"pod{other}", secrets.token_hex(6))
        with volume(drv, unique("cg"), 32 * MiB) as vol:
            device = vol.volume_context["device"]
            rdev = os.stat(device).st_rdev
            container.deny_device("c", os.major(rdev), os.minor(rdev))
            stranger.deny_device("c", os.major(rdev), os.minor(rdev))
            target = drv.target("cgroup-pod")
            with published(drv, vol.volume_id, target, pod_uid=pod):
                sock = os.path.join(target, "dax.sock")
                out = _child(DENIED_CHILD, {"device": device, "procs": container.procs_file,
                                            "socket": sock, "pattern": pattern.hex()})
                refused = _child(DENIED_CHILD, {"device": device, "procs": stranger.procs_file,
                                                "socket": sock, "pattern": pattern.hex()})
                # The bytes reached the device: map it ourselves (devdax has no read()).
                fd = os.open(device, os.O_RDONLY)
                try:
                    size = out.get("metadata", {}).get("usable_size", 0)
                    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                        on_device = (m[:len(pattern)] == pattern
                                     and m[size - len(pattern):] == pattern[::-1])
                finally:
                    os.close(fd)
    finally:
        tree.cleanup()
    FACTS["cgroup_fd_delivery"] = {"hierarchy": f"v{tree.hierarchy.version}",
                                   **{k: v for k, v in out.items() if k != "metadata"},
                                   "other_pod": refused.get("open_volume_error")}
    assert out["open_before"] == 0
    assert f"pod{pod}" in out["cgroup"]
    assert out["open_rdwr"] == errno.EPERM and out["open_rdonly"] == errno.EPERM
    assert out["reopen_proc_fd"] == errno.EPERM
    assert out["readback"] is True and on_device
    assert out["metadata"]["device"] == device
    # A process of another pod gets no fd.
    assert "open_volume_error" in refused and "metadata" not in refused, refused


def test_block_on_devdax_is_refused(drv: Driver) -> None:
    req = csi_pb2.CreateVolumeRequest(
        name=unique("block"), capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MiB),
        volume_capabilities=[block_cap()])
    err = rpc_error(lambda: drv.controller.CreateVolume(req, timeout=60))
    assert err.code() == Code.INVALID_ARGUMENT
    assert "volumeMode: Block is not possible for a devdax volume" in err.details()
    assert "loop" in err.details() and "Filesystem" in err.details()
    FACTS["block_refusal"] = err.details()
    assert all_namespaces() == [], "a refused CreateVolume must not touch ndctl"
    cap = drv.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        volume_capabilities=[block_cap()]), timeout=60)
    assert cap.available_capacity == 0
    with volume(drv, unique("blockv"), 2 * MiB) as vol:
        resp = drv.controller.ValidateVolumeCapabilities(
            csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id=vol.volume_id, volume_capabilities=[block_cap()]), timeout=60)
        assert not resp.HasField("confirmed")
        assert "volumeMode: Block" in resp.message
        err = rpc_error(lambda: drv.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=vol.volume_id, target_path=drv.target("block-pod"),
            volume_capability=block_cap()), timeout=60))
        assert err.code() == Code.INVALID_ARGUMENT


# ========================================================= fsdax on the real kernel
#
# deviceMode: fsdax volumes are fsdax namespaces (a pfn device with map=dev, 2 MiB
# align) whose block device /dev/pmemX[.Y] the driver publishes raw (volumeMode Block:
# the device node bound onto the target file) or formats with ext4/xfs and mounts with
# -o dax at the staging path, then binds into each pod's target. Everything below goes
# through the driver's gRPC API, as kubelet would.

FSDAX = {"deviceMode": "fsdax"}
# mkfs.xfs refuses file systems below 300 MiB ("Filesystem must be larger than 300MB").
FS_SIZES = {"ext4": 64 * MiB, "xfs": 300 * MiB}
MAP_LEN = 4 * MiB  # two PMDs: the file mapped with MAP_SYNC


def fsdax_params(numa: str | None = None) -> dict[str, str]:
    return {**FSDAX, **({"numaNode": numa} if numa is not None else {})}


def staging_path(drv: Driver, name: str) -> str:
    return str(drv.kubelet / "plugins" / "staging" / name / "globalmount")


def block_target(drv: Driver, name: str) -> str:
    """A block volume's target is a file; kubelet creates its parent directory."""
    parent = drv.kubelet / "pods" / name / "volumeDevices" / "pmem"
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent / "dev")


def fsdax_device(vid: str) -> tuple[dict, dict, str]:
    """(region, namespace, /dev path) of an fsdax volume, from ndctl."""
    region, ns = named_namespaces()[vid]
    assert ns["mode"] == "fsdax", ns
    return region, ns, f"/dev/{ns['blockdev']}"


def check_fsdax_size(vol: csi_pb2.Volume, requested: int) -> dict[str, Any]:
    """The kernel's block device of an fsdax volume is exactly
    ``devdax_usable(namespace size, 2 MiB)`` (nd_pfn_init() keeps the struct pages on the
    device for map=dev, as for devdax), at least what was asked, and what CreateVolume
    reported. Every fsdax test that creates a volume checks it; the rows go to
    facts.json."""
    region, ns, device = fsdax_device(vol.volume_id)
    raw = int(sysfs(ns["dev"], "size"))
    bdev = ns["blockdev"]
    sysfs_bytes = int(Path(f"/sys/block/{bdev}/size").read_text()) * 512
    ioctl_bytes = block_size(device)
    row = {"requested": size_text(requested), "region": region["dev"], "namespace": raw,
           "blockdev": bdev, "kernel_bytes": ioctl_bytes, "ndctl_size": ns["size"],
           "capacity_bytes": vol.capacity_bytes, "predicted": devdax_usable(raw, 2 * MiB)}
    FACTS.setdefault("usable_sizes_fsdax", []).append(row)
    assert ns["map"] == "dev" and ns["align"] == 2 * MiB, ns
    assert raw == allocation_for(requested, 2 * MiB)[0], row
    assert sysfs_bytes == ioctl_bytes == ns["size"], (sysfs_bytes, row)
    assert ioctl_bytes == devdax_usable(raw, 2 * MiB), f"sizes.devdax_usable is off: {row}"
    assert vol.capacity_bytes == ioctl_bytes >= requested, row
    return row


def size_text(n: int) -> str:
    return f"{n >> 20}Mi" if n % MiB == 0 else str(n)


@contextlib.contextmanager
def staged(drv: Driver, vid: str, path: str, cap: csi_pb2.VolumeCapability,
           op: str = "NodeStageVolume") -> Iterator[str]:
    stage(drv, vid, path, cap, op=op)
    try:
        yield path
    finally:
        unstage(drv, vid, path)


@contextlib.contextmanager
def published_as(drv: Driver, vid: str, target: str, cap: csi_pb2.VolumeCapability,
                 staging: str = "", op: str = "NodePublishVolume",
                 readonly: bool = False) -> Iterator[str]:
    publish_cap(drv, vid, target, cap, staging, op=op, readonly=readonly)
    try:
        yield target
    finally:
        unpublish(drv, vid, target)


def direct_io(path: str, writes: dict[int, bytes] | None = None,
              reads: list[tuple[int, int]] | None = None) -> list[bytes]:
    """pwrite ``writes`` with O_DIRECT (then fsync), then pread ``reads`` with O_DIRECT
    through a fresh descriptor: what comes back is on the device, not in a page cache.
    O_DIRECT wants aligned buffers: an anonymous mapping is page aligned."""
    out = []
    if writes:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        try:
            for off, data in writes.items():
                with mmap.mmap(-1, len(data)) as buf:
                    buf[:] = data
                    assert os.pwritev(fd, [buf], off) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        for off, size in reads or []:
            with mmap.mmap(-1, size) as buf:
                assert os.preadv(fd, [buf], off) == size
                out.append(buf[:])
    finally:
        os.close(fd)
    return out


BLKROGET = 0x125E  # _IO(0x12, 94)
LOOP_MAJOR = 7


def write_refusal(path: str) -> str:
    """How the kernel refuses a write to the block device at ``path`` ("" if it wrote):
    open(O_RDWR) may already fail; a read-only block device answers write() with
    EPERM (blkdev_write_iter)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        return f"open: {errno.errorcode.get(e.errno, e.errno)}"
    try:
        with mmap.mmap(-1, 4096) as buf:
            os.pwritev(fd, [buf], 0)
        return ""
    except OSError as e:
        return f"write: {errno.errorcode.get(e.errno, e.errno)}"
    finally:
        os.close(fd)


def check_readonly_view(target: str, device: str) -> dict[str, Any]:
    """A read-only Block publication: the target is a read-only loop device whose
    backing device is the volume's, and writes through it are refused."""
    st = os.stat(target)
    assert stat.S_ISBLK(st.st_mode) and os.major(st.st_rdev) == LOOP_MAJOR, \
        f"{target} is not a loop device ({os.major(st.st_rdev)}:{os.minor(st.st_rdev)})"
    loop = f"loop{os.minor(st.st_rdev)}"
    backing = Path(f"/sys/block/{loop}/loop/backing_file").read_text().strip()
    assert backing == device, f"{loop} is backed by {backing}, not {device}"
    fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ro = struct.unpack("i", fcntl.ioctl(fd, BLKROGET, bytes(4)))[0]
    finally:
        os.close(fd)
    assert ro == 1, f"{loop} is not a read-only block device"
    refusal = write_refusal(target)
    assert refusal in ("write: EPERM", "open: EROFS", "open: EACCES", "open: EPERM"), \
        f"a write through the read-only view was not refused ({refusal or 'it worked'})"
    return {"loop": f"/dev/{loop}", "backing_file": backing, "write": refusal}


def map_sync(path: str, pattern: bytes) -> dict[str, Any]:
    """Create ``path`` (MAP_LEN bytes), map it MAP_SHARED_VALIDATE | MAP_SYNC and store
    ``pattern`` at both ends; what happened, including the errno if the kernel refused."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    out: dict[str, Any] = {}
    try:
        os.posix_fallocate(fd, 0, MAP_LEN)  # real extents: the faults map pmem directly
        out["statx_dax_supported"], out["statx_dax"] = statx_dax(path)
        try:
            m = mmap.mmap(fd, MAP_LEN, flags=MAP_SHARED_VALIDATE | MAP_SYNC,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            # ENOTSUP and EOPNOTSUPP are the same number on Linux; say the mmap(2) name.
            out["errno"] = "EOPNOTSUPP" if e.errno == errno.EOPNOTSUPP \
                else errno.errorcode.get(e.errno, e.errno)
            return out
        try:
            m[:len(pattern)] = pattern
            m[MAP_LEN - len(pattern):] = pattern[::-1]
            anchor = ctypes.c_char.from_buffer(m)
            out["vm_flags"] = vm_flags(ctypes.addressof(anchor))
            del anchor
            m.flush()
        finally:
            m.close()
        # read(2) of a DAX file copies from the media, not from a page cache
        out["readback"] = (os.pread(fd, len(pattern), 0) == pattern
                           and os.pread(fd, len(pattern), MAP_LEN - len(pattern))
                           == pattern[::-1])
    finally:
        os.close(fd)
    return out


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_fsdax_filesystem_is_dax_and_map_sync_works(drv: Driver, fs_type: str) -> None:
    """The driver's ext4/xfs is mounted with DAX: MAP_SYNC is accepted and the file is
    DAX (statx); restaged with mountOptions dax=never, the same file refuses MAP_SYNC
    (EOPNOTSUPP), the control that shows the DAX mount is what makes it work."""
    size, cap = FS_SIZES[fs_type], fs_cap(fs_type)
    name = unique(f"fs{fs_type}")
    staging, target = staging_path(drv, name), drv.target(f"fs-{fs_type}")
    pattern = secrets.token_bytes(4096)
    fact: dict[str, Any] = {"requested": size}
    with volume(drv, name, size, fsdax_params(), op=f"CreateVolume fsdax {size >> 20}Mi",
                caps=[cap]) as vol:
        _region, _ns, device = fsdax_device(vol.volume_id)
        check_fsdax_size(vol, size)
        assert vol.volume_context["deviceMode"] == "fsdax"
        assert vol.volume_context["device"] == device
        fact.update(device=device, usable=vol.capacity_bytes)
        with staged(drv, vol.volume_id, staging, cap,
                    op=f"NodeStageVolume fsdax {fs_type} (mkfs + mount -o dax)"):
            st = mount_at(staging)
            assert st is not None, f"nothing mounted at the staging path {staging}"
            assert (st.fstype, st.source, st.dev) == (fs_type, device, dev_of(device)), st
            assert "dax=always" in st.super_options, st.super_options
            fact["super_options"] = sorted(st.super_options)
            with published_as(drv, vol.volume_id, target, cap, staging,
                              op=f"NodePublishVolume fsdax {fs_type}"):
                pub = mount_at(target)
                assert pub is not None and pub.dev == st.dev and pub.fstype == fs_type, pub
                assert "dax=always" in pub.super_options
                assert "rw" in pub.mount_options
                got = map_sync(os.path.join(target, "map_sync.bin"), pattern)
                fact["dax"] = got
                assert "errno" not in got, f"MAP_SYNC refused on the DAX mount: {got}"
                assert got["statx_dax_supported"] and got["statx_dax"], got
                assert "sf" in got["vm_flags"], f"no synchronous-fault mapping: {got}"
                assert got["readback"], got
                stats = drv.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
                    volume_id=vol.volume_id, volume_path=target), timeout=60)
                used = {u.unit: u.used for u in stats.usage}
                assert used[csi_pb2.VolumeUsage.BYTES] >= MAP_LEN, stats
                assert not stats.volume_condition.abnormal
        assert mount_at(staging) is None and mount_at(target) is None

        # The control: the same file system without DAX.
        nodax = fs_cap(fs_type, ("dax=never",))
        with staged(drv, vol.volume_id, staging, nodax,
                    op=f"NodeStageVolume fsdax {fs_type} (formatted, mount)"):
            st = mount_at(staging)
            assert st is not None and "dax=always" not in st.super_options, st
            with published_as(drv, vol.volume_id, target, nodax, staging):
                path = os.path.join(target, "map_sync.bin")
                with open(path, "rb") as f:
                    assert f.read(len(pattern)) == pattern, \
                        "what was stored through MAP_SYNC did not survive the remount"
                got = map_sync(path, pattern)
                fact["without_dax"] = got
                assert got.get("errno") == "EOPNOTSUPP", got
                assert got["statx_dax_supported"] and not got["statx_dax"], got
    FACTS.setdefault("fsdax_filesystems", {})[fs_type] = fact


def test_fsdax_block_reads_back_then_recreated_reads_zeros(drv: Driver) -> None:
    """Block publish binds /dev/pmemX.Y onto the target file; what is written there with
    O_DIRECT is read back; after DeleteVolume (BLKZEROOUT) the same name and size gets
    the same media back, and it reads zeros."""
    name, size, cap = unique("fsblk"), 64 * MiB, block_cap()
    params = fsdax_params("0")
    pattern = secrets.token_bytes(4096)
    vol = create(drv, name, size, params, op="CreateVolume fsdax 64Mi", caps=[cap])
    _, ns, device = fsdax_device(vol.volume_id)
    check_fsdax_size(vol, size)
    start_before = sysfs(ns["dev"], "resource")
    usable = vol.capacity_bytes
    offsets = [0, usable // 2 // 4096 * 4096, usable - len(pattern)]
    target = block_target(drv, "fsblk-pod")
    with published_as(drv, vol.volume_id, target, cap, op="NodePublishVolume fsdax block"):
        st = os.stat(target)
        assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.stat(device).st_rdev, \
            "the target is not the volume's block device"
        assert mount_at(target) is not None
        assert block_size(target) == usable, "the device is not the size CreateVolume reported"
        got = direct_io(target, writes={off: pattern for off in offsets},
                        reads=[(off, len(pattern)) for off in offsets])
        assert got == [pattern] * len(offsets)
        # A read-only publication of the same volume: a read-only loop view.
        ro_target = block_target(drv, "fsblk-ro-pod")
        with published_as(drv, vol.volume_id, ro_target, cap, readonly=True,
                          op="NodePublishVolume fsdax block read-only (loop view)"):
            FACTS["fsdax_readonly_block"] = check_readonly_view(ro_target, device)
            assert direct_io(ro_target, reads=[(offsets[1], len(pattern))]) == [pattern]
            assert direct_io(target, reads=[(0, len(pattern))]) == [pattern], \
                "the refused write changed the device"
        assert pmem_loops() == {}, "NodeUnpublishVolume left the read-only view attached"
        assert not os.path.lexists(ro_target)
    assert not os.path.lexists(target), "NodeUnpublishVolume left the target file it made"
    erased_before = metric_value(metrics_text(), "csi_pmem_erase_bytes_total") or 0
    delete(drv, vol.volume_id, op="DeleteVolume fsdax 64Mi (erase)")
    erased = (metric_value(metrics_text(), "csi_pmem_erase_bytes_total") or 0) - erased_before
    assert erased >= usable, f"DeleteVolume zeroed {erased} bytes, the volume has {usable}"

    vol2 = create(drv, name, size, params, op="CreateVolume fsdax 64Mi", caps=[cap])
    try:
        _, ns2, _ = fsdax_device(vol2.volume_id)
        FACTS["fsdax_erase_same_media"] = sysfs(ns2["dev"], "resource") == start_before
        with published_as(drv, vol2.volume_id, target, cap):
            chunk = 4 * MiB
            whole = [(off, min(chunk, vol2.capacity_bytes - off))
                     for off in range(0, vol2.capacity_bytes, chunk)]
            got = direct_io(target, reads=[(off, len(pattern)) for off in offsets] + whole)
            for off, data in zip(offsets, got, strict=False):
                assert data == bytes(len(pattern)), f"old data visible at offset {off}"
            assert all(data.count(0) == len(data) for data in got[len(offsets):]), \
                "non-zero bytes in a new volume"
    finally:
        delete(drv, vol2.volume_id)


# Beside the 64 MiB and 300 MiB volumes of the tests above: a size that is no multiple
# of anything, and the smallest volume (one 16 MiB region step).
FSDAX_SIZES = [(100_000_000, "1"), (2 * MiB, "0")]


def test_fsdax_usable_size_and_placement(drv: Driver) -> None:
    """An fsdax volume lands in the region of the requested NUMA node, and its block
    device has the size check_fsdax_size() expects."""
    for i, (size, numa) in enumerate(FSDAX_SIZES):
        vol = create(drv, unique(f"fssize{i}"), size, fsdax_params(numa),
                     caps=[block_cap()], op="CreateVolume fsdax")
        try:
            region, ns, device = fsdax_device(vol.volume_id)
            row = check_fsdax_size(vol, size)
            row["numaNode"] = numa
            assert region["dev"] == f"region{numa}" and region["numa_node"] == int(numa), \
                (region["dev"], region["numa_node"])
            assert ns.get("numa_node", int(numa)) == int(numa)
            assert vol.volume_context["numaNode"] == numa
            assert vol.volume_context["pool"] == region["dev"]
            assert vol.volume_context["device"] == device
        finally:
            delete(drv, vol.volume_id, op="DeleteVolume fsdax")


def test_fsdax_restart_after_sigkill_keeps_mounts(drv: Driver) -> None:
    """SIGKILL with an ext4 volume staged and published and a block volume published
    read-write and read-only (a loop view): the mounts and the view outlive the process,
    the restarted driver keeps its records (repeated stage/publish are no-ops) and
    unpublishes (detaching the view), unstages and deletes as usual."""
    fs, blk = fs_cap("ext4"), block_cap()
    pattern = secrets.token_bytes(4096)
    a = create(drv, unique("fsrsa"), 64 * MiB, fsdax_params(), caps=[fs])
    b = create(drv, unique("fsrsb"), 64 * MiB, fsdax_params(), caps=[blk])
    staging, ta = staging_path(drv, "fsrs-a"), drv.target("fsrs-a")
    tb, tro = block_target(drv, "fsrs-b"), block_target(drv, "fsrs-b-ro")
    paths = (staging, ta, tb, tro)
    with contextlib.ExitStack() as undo:
        undo.callback(delete, drv, b.volume_id)
        undo.callback(delete, drv, a.volume_id)
        stage(drv, a.volume_id, staging, fs, op="NodeStageVolume fsdax ext4 (mkfs + mount -o dax)")
        undo.callback(unstage, drv, a.volume_id, staging)
        publish_cap(drv, a.volume_id, ta, fs, staging, op="NodePublishVolume fsdax ext4")
        undo.callback(unpublish, drv, a.volume_id, ta)
        publish_cap(drv, b.volume_id, tb, blk, op="NodePublishVolume fsdax block")
        undo.callback(unpublish, drv, b.volume_id, tb)
        publish_cap(drv, b.volume_id, tro, blk, readonly=True,
                    op="NodePublishVolume fsdax block read-only (loop view)")
        undo.callback(unpublish, drv, b.volume_id, tro)
        with open(os.path.join(ta, "data"), "wb") as f:
            f.write(pattern)
            os.fsync(f.fileno())
        direct_io(tb, writes={0: pattern})
        before = {p: mount_at(p) for p in paths}
        assert all(before.values()), before
        views = pmem_loops()
        assert len(views) == 1, views

        drv.kill()
        after_kill = {p: mount_at(p) for p in paths}
        assert after_kill == before, "the mounts must survive the driver"
        log_mark = len(drv.log_text())
        seconds = drv.start()
        LATENCY.setdefault("driver restart with fsdax staged+published (SIGKILL)",
                           []).append(seconds)
        new_log = drv.log_text()[log_mark:]
        assert "lost its mount" not in new_log, new_log[-3000:]
        assert {p: mount_at(p) for p in paths} == before
        assert pmem_loops() == views

        # Same requests again: the restarted driver still knows what it did.
        stage(drv, a.volume_id, staging, fs, op="NodeStageVolume fsdax (repeat)")
        publish_cap(drv, a.volume_id, ta, fs, staging, op="NodePublishVolume fsdax (repeat)")
        publish_cap(drv, b.volume_id, tb, blk, op="NodePublishVolume fsdax (repeat)")
        publish_cap(drv, b.volume_id, tro, blk, readonly=True,
                    op="NodePublishVolume fsdax (repeat)")
        assert {p: mount_at(p) for p in paths} == before, "a repeat mounted again"
        assert pmem_loops() == views, "a repeat attached another view"
        with open(os.path.join(ta, "data"), "rb") as f:
            assert f.read() == pattern
        assert direct_io(tb, reads=[(0, len(pattern))]) == [pattern]
        assert direct_io(tro, reads=[(0, len(pattern))]) == [pattern]
        err = rpc_error(lambda: delete(drv, b.volume_id))
        assert err.code() == Code.FAILED_PRECONDITION, err
    # ExitStack ran unpublish, unstage and delete through the restarted driver.
    assert not any(mount_at(p) for p in paths)
    assert not any(os.path.lexists(p) for p in (ta, tb, tro))
    assert pmem_loops() == {}


def test_fsdax_refuses_unsupported_fs_type(drv: Driver) -> None:
    btrfs = fs_cap("btrfs")
    err = rpc_error(lambda: create(drv, unique("btrfs"), 64 * MiB, fsdax_params(),
                                   caps=[btrfs]))
    assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details())
    assert "btrfs" in err.details() and "ext4" in err.details() and "xfs" in err.details()
    FACTS["fsdax_fs_type_refusal"] = err.details()
    assert all_namespaces() == [], "a refused CreateVolume must not touch ndctl"
    err = rpc_error(lambda: create(drv, unique("fsalign"), 64 * MiB,
                                   {**FSDAX, "align": "2Mi"}))
    assert err.code() == Code.INVALID_ARGUMENT and "align" in err.details(), err.details()
    with volume(drv, unique("fsbad"), 2 * MiB, fsdax_params(), caps=[block_cap()]) as vol:
        resp = drv.controller.ValidateVolumeCapabilities(
            csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id=vol.volume_id, volume_capabilities=[btrfs]), timeout=60)
        assert not resp.HasField("confirmed") and "btrfs" in resp.message, resp
        staging = staging_path(drv, "fsbad")
        err = rpc_error(lambda: stage(drv, vol.volume_id, staging, btrfs))
        assert err.code() == Code.INVALID_ARGUMENT and "btrfs" in err.details(), err
        assert mount_at(staging) is None
        _, _, device = fsdax_device(vol.volume_id)
        assert run(["blkid", "-p", device], check=False).returncode == 2, \
            "the refused stage wrote a signature"


def test_latency_samples(drv: Driver) -> None:
    """Three create/publish/unpublish/delete rounds of a 64 MiB volume, for latency.json:
    three samples of each call, each a positive wall time, together within the rounds'."""
    ops = ("CreateVolume 64Mi (incl. erase)", "NodePublishVolume", "NodeUnpublishVolume",
           "DeleteVolume 64Mi (erase)")
    with new_samples(dict.fromkeys(ops, 3)):
        for i in range(3):
            vol = create(drv, unique(f"lat{i}"), 64 * MiB, {"numaNode": str(i % 2)},
                         op=ops[0])
            target = drv.target(f"lat-{i}")
            publish(drv, vol.volume_id, target)
            unpublish(drv, vol.volume_id, target)
            delete(drv, vol.volume_id, op=ops[3])


# ================================================== model weights on the real devices

WEIGHTS_WORK = Path("/tmp/e2e-weights")


def weights_model() -> Path:
    WEIGHTS_WORK.mkdir(parents=True, exist_ok=True)
    return wg.make_model(WEIGHTS_WORK / "model")


def test_weights_on_a_devdax_volume(drv: Driver) -> None:
    """The weights workflow a user runs, on a devdax volume the driver carved and
    published, through its dax.sock: stage, verify, ls, export byte-identical, CPU load
    bit-exact against safetensors, restage without copying, a flipped byte caught by
    verify, the sidecar's first start and warm restart, a read-only publication that
    loads and refuses staging, the loader's bad inputs. Stores are persisted with
    libpmem (msync is EINVAL on device-dax)."""
    model = weights_model()
    with volume(drv, unique("w"), 64 * MiB) as vol, \
            published(drv, vol.volume_id, drv.target("weights-rw")) as target:
        fact = wg.workflow(target, model, WEIGHTS_WORK)
        assert fact["persist"].startswith("libpmem pmem_persist"), fact
        assert "device-dax" in fact["persist"], fact
        fact["bad_inputs"] = wg.bad_inputs(target, WEIGHTS_WORK)
        fact["sidecar"] = wg.sidecar_first_and_warm(target, model)
        with published(drv, vol.volume_id, drv.target("weights-ro"), readonly=True) as ro:
            wg.assert_loads_bit_exact(ro, model, "m")
            refused = wg.cli("stage", model, ro, "--name", "other", rc=None)
            assert refused.returncode != 0 and "published read-only" in refused.stderr
            fact["read_only"] = refused.stderr.strip().splitlines()[0]
    FACTS.setdefault("weights", {})["devdax 2Mi (dax.sock)"] = fact


def test_weights_staging_throughput_on_devdax(drv: Driver) -> None:
    """benchmarks/bench_staging.py on a published devdax volume; run.sh runs the same
    on the host's tmpfs (the emulated back end's volumes) and the summary prints the
    ratio (TCG: only the ratio means anything)."""
    with volume(drv, unique("wb"), 160 * MiB) as vol, \
            published(drv, vol.volume_id, drv.target("weights-bench")) as target:
        proc = run([sys.executable, str(REPO / "benchmarks" / "bench_staging.py"), target,
                    "--size-mib", "48", "--work", str(WEIGHTS_WORK),
                    "--json", str(OUT / "staging-bench.json")], timeout=900)
    result = json.loads((OUT / "staging-bench.json").read_text())
    assert result["persist"].startswith("libpmem pmem_persist"), result
    FACTS["staging_bench"] = result
    print(proc.stdout)


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_weights_on_an_fsdax_filesystem(drv: Driver, fs_type: str) -> None:
    """The same workflow on an fsdax Filesystem volume (ext4/xfs mounted -o dax by the
    driver): the weights live in the image file, mapped MAP_SYNC and persisted with
    libpmem; a read-only publication of the same file system loads."""
    size, cap = FS_SIZES[fs_type], fs_cap(fs_type)
    model = weights_model()
    name = unique(f"wfs{fs_type}")
    staging = staging_path(drv, name)
    with volume(drv, name, size, fsdax_params(), op=f"CreateVolume fsdax {size >> 20}Mi",
                caps=[cap]) as vol, staged(drv, vol.volume_id, staging, cap):
        with published_as(drv, vol.volume_id, drv.target(f"wfs-{fs_type}"), cap,
                          staging) as target:
            fact = wg.workflow(target, model, WEIGHTS_WORK)
            assert "DAX file mapped MAP_SYNC" in fact["persist"], fact
        with published_as(drv, vol.volume_id, drv.target(f"wfs-{fs_type}-ro"), cap,
                          staging, readonly=True) as ro:
            wg.assert_loads_bit_exact(ro, model, "m")
    FACTS.setdefault("weights", {})[f"fsdax {fs_type} -o dax (image file)"] = fact


# ============================================================== misaligned config

@pytest.mark.vmconfig("misaligned")
def test_misaligned_region_is_real() -> None:
    """QEMU put region1 at a start ndctl refuses: the premise of the other tests."""
    regs = regions()
    starts = {r["dev"]: region_start(r["dev"]) for r in regs}
    FACTS["region_starts"] = {k: hex(v) for k, v in starts.items()}
    bad = [d for d, s in starts.items() if s % (16 * MiB)]
    assert bad == ["region1"], starts
    proc = run(["ndctl", "create-namespace", "-r", "region1", "-m", "devdax", "-s", "64M",
                "-a", "2M", "-n", "e2e-premise"], check=False)
    if proc.returncode == 0:  # do not leave it behind, then fail
        for r in regions():
            for ns in _as_list(r.get("namespaces")):
                if ns.get("name") == "e2e-premise":
                    run(["ndctl", "disable-namespace", ns["dev"]], check=False)
                    run(["ndctl", "destroy-namespace", ns["dev"], "--force"], check=False)
    assert proc.returncode != 0
    assert "misaligned to 16M" in proc.stderr, proc.stderr
    FACTS["ndctl_misaligned_error"] = proc.stderr.strip().splitlines()


@pytest.mark.vmconfig("misaligned")
def test_misaligned_region_reported_by_probe_metric_and_log(drv: Driver) -> None:
    resp = drv.identity.Probe(csi_pb2.ProbeRequest(), timeout=60)
    assert resp.ready.value is True, "region0 is usable: the node is ready"
    text = metrics_text()
    usable1 = [line for line in text.splitlines()
               if line.startswith("csi_pmem_pool_usable{") and 'pool="region1"' in line]
    assert len(usable1) == 1 and usable1[0].endswith(" 0.0"), usable1
    assert 'reason="misaligned"' in usable1[0], usable1  # the 16 MiB text is in the log
    assert metric_value(text, "csi_pmem_pool_usable", pool="region0", reason="ok") == 1.0
    FACTS["misaligned_metric"] = usable1[0]
    # The driver names the region in its "serving ..." line, which it logs after the
    # socket accepts calls: give it a moment instead of racing it.
    deadline = time.monotonic() + 30
    while "0x13fe00000" not in drv.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "0x13fe00000" in drv.log_text(), "the driver log does not name the misaligned region"


@pytest.mark.vmconfig("misaligned")
def test_misaligned_create_is_a_clear_error_not_a_crash(drv: Driver) -> None:
    err = rpc_error(lambda: create(drv, unique("mis"), 64 * MiB, {"numaNode": "1"}))
    assert err.code() not in (Code.UNKNOWN, Code.INTERNAL), (err.code(), err.details())
    assert "region1" in err.details() and "16 MiB" in err.details(), err.details()
    FACTS["misaligned_create_error"] = {"code": err.code().name, "message": err.details()}
    assert capacity(drv, {"numaNode": "1"}) == (0, 0)
    assert capacity(drv, {}) == capacity(drv, {"numaNode": "0"}) != (0, 0)
    # The usable region still serves, "auto" picks it, and the driver is alive.
    with volume(drv, unique("ok"), 64 * MiB) as vol:
        region, _ = named_namespaces()[vol.volume_id]
        assert region["dev"] == "region0" and vol.volume_context["numaNode"] == "0"
    assert drv.proc is not None and drv.proc.poll() is None


@pytest.mark.vmconfig("misaligned")
def test_probe_not_ready_when_only_the_misaligned_region_is_left(drv: Driver) -> None:
    run(["ndctl", "disable-region", "region0"])
    try:
        resp = drv.identity.Probe(csi_pb2.ProbeRequest(), timeout=60)
        assert resp.ready.value is False
    finally:
        run(["ndctl", "enable-region", "region0"])
    log = drv.log_text()
    assert re.search(r"not ready: .*region1.*16 MiB", log), drv.log_tail()
    assert drv.identity.Probe(csi_pb2.ProbeRequest(), timeout=60).ready.value is True


# ============================================= memory back end (issue 43), main config

MEMORY_BASE = Path("/run/e2e-memory")
MEMORY_POOL = 256 * MiB
MEMORY_VOLUME = 160 * MiB


class MemoryDriver(Driver):
    """``--backend memory`` (its own state, kubelet dir and log), started pinned to
    ``cpus``: its threads then allocate from a CPU of the other node."""

    def __init__(self, base: Path, fs: str, cpus: str) -> None:
        super().__init__(base)
        self.log = OUT / f"driver-memory-{fs}.log"
        self.cpus = cpus
        self.extra = ["--backend", "memory", "--metrics-address=",
                      "--memory-pools", f"0={MEMORY_POOL},1={MEMORY_POOL}",
                      "--memory-root", str(base / "pools"), "--memory-fs", fs,
                      "--memory-pages", "2M"]

    def argv(self) -> list[str]:
        return ["taskset", "-c", self.cpus, *super().argv()]


@pytest.mark.parametrize("fs", ["tmpfs", "hugetlbfs"])
@pytest.mark.parametrize("order", [(1, 0), (0, 1)], ids=["node1-first", "node0-first"])
def test_memory_pools_bind_pages_to_their_node(fs: str, order: tuple[int, int]) -> None:
    """Each volume's pages lie on its numaNode (>= 99%) although the driver's threads run
    on the other node's CPU, they exist once CreateVolume returns (the node's Shmem or
    free huge pages move before anything maps the volume), and the page size the
    mapping gets is reported."""
    from e2e.vm import memory_guest as mg

    huge_kib = 2048
    if fs == "hugetlbfs":
        want = MEMORY_POOL // (huge_kib * 1024)
        got = {n: mg.reserve_huge_pages(n, want) for n in (0, 1)}
        assert got == {0: want, 1: want}, f"could not reserve 2 MiB pages per node: {got}"
    if MEMORY_BASE.exists():
        shutil.rmtree(MEMORY_BASE)
    MEMORY_BASE.mkdir(parents=True)
    cpus = {n: mg.node_cpus(n) for n in (0, 1)}
    d = MemoryDriver(MEMORY_BASE, fs, cpus[1 - order[0]])
    report: dict[str, Any] = {"fs": fs, "order": list(order), "cpus": cpus, "volumes": []}
    maps: list[mmap.mmap] = []
    vids: list[str] = []
    try:
        d.start()
        assert d.proc is not None
        for numa in order:
            other = 1 - numa
            mg.pin(d.proc.pid, cpus[other])
            assert mg.threads_on(d.proc.pid) == {cpus[other]}
            before = {n: mg.node_meminfo(n) for n in (0, 1)}
            vol = create(d, unique(f"mem{numa}"), MEMORY_VOLUME, {"numaNode": str(numa)})
            after = {n: mg.node_meminfo(n) for n in (0, 1)}
            vids.append(vol.volume_id)
            path = vol.volume_context["device"]
            raw = os.stat(path).st_size
            if fs == "hugetlbfs":
                field, unit = "HugePages_Free", huge_kib * 1024
                grew = {n: (before[n][field] - after[n][field]) * unit for n in (0, 1)}
            else:
                field, unit = "Shmem", 1024
                grew = {n: (after[n][field] - before[n][field]) * unit for n in (0, 1)}
            target = d.target(vol.volume_id)
            publish(d, vol.volume_id, target)
            md, fd = open_volume(os.path.join(target, "dax.sock"))
            try:
                buf = mmap.mmap(fd, md["usable_size"], mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            maps.append(buf)
            untouched = mg.mapping_stats(path)
            mg.populate(buf)
            stats = mg.mapping_stats(path)
            mapped = sum(v for k, v in stats.items() if re.fullmatch(r"N\d+", k))
            on_node = stats.get(f"N{numa}", 0)
            entry = {"numaNode": numa, "driver_cpus": cpus[other], "raw_bytes": raw,
                     "usable_bytes": md["usable_size"],
                     f"{field}_delta_at_create_MiB": {n: round(grew[n] / MiB, 1)
                                                      for n in (0, 1)},
                     "mapped_before_touch_MiB": round(sum(
                         v for k, v in untouched.items() if re.fullmatch(r"N\d+", k)) / MiB, 1),
                     "numa_maps_MiB": {k: round(v / MiB, 1) for k, v in stats.items()
                                       if re.fullmatch(r"N\d+", k)},
                     "on_node_share": round(on_node / mapped, 4) if mapped else 0.0,
                     "page": {k: v for k, v in stats.items() if not re.fullmatch(r"N\d+", k)}}
            report["volumes"].append(entry)
            print(f"memory[{fs}] order={order} volume numaNode={numa} (driver on CPU "
                  f"{cpus[other]}): {json.dumps(entry)}", flush=True)
            assert mapped >= md["usable_size"] * 0.99, entry
            assert on_node >= 0.99 * mapped, f"pages off node {numa}: {entry}"
            # Allocated at CreateVolume: the volume's node gave the pages before any map.
            assert grew[numa] >= 0.99 * raw, f"not allocated at CreateVolume: {entry}"
        FACTS.setdefault("memory_backend", []).append(report)
    finally:
        for buf in maps:
            buf.close()
        if d.running:
            for vid in vids:
                target = d.target(vid)
                if os.path.exists(target):
                    unpublish(d, vid, target)
                delete(d, vid)
        d.stop()
        for n in (0, 1):
            run(["umount", str(MEMORY_BASE / "pools" / f"region{n}")], check=False)
        if fs == "hugetlbfs":
            for n in (0, 1):
                mg.reserve_huge_pages(n, 0)
    (OUT / f"memory-{fs}-{order[0]}{order[1]}.json").write_text(json.dumps(report, indent=1))

