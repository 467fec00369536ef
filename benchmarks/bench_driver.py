#!/usr/bin/env python3
"""Latency, start-up time and memory of a real ``csi-pmem serve`` process.

Why: provisioning and publishing sit on the pod start path (external-provisioner waits
for CreateVolume, kubelet for NodePublishVolume), a restarted node plugin must be back
before kubelet gives up on its probes, and the node plugin runs on every node of the
fleet, so its resident memory is paid many times. This script measures all of that in
one run against the driver as users run it: a separate process, the emulated back end,
gRPC on a unix socket, real tmpfs mounts and a real dax.sock.

What is measured (client-side wall time, so gRPC and protobuf costs are included):
  CreateVolume / DeleteVolume / the pair, eraseOnDelete "false" and "true" interleaved
  NodePublishVolume / NodeUnpublishVolume (tmpfs mount, volume.json, dax.sock, seal)
  daxclient.open_volume on a published volume (connect, metadata + fd over SCM_RIGHTS)
  GetCapacity with no volumes and with --volumes volumes
  start-up: process spawn to the first Probe answering ready, empty state and with
            --volumes published volumes to reconcile (median of --starts starts)
  VmRSS of the driver: idle, after --volumes volumes + publications, and after a restart
            that re-serves them

Needs root (tmpfs mounts). Everything it creates (volumes, mounts, the driver process,
temporary directories) is removed at the end, also after an error or Ctrl-C.

Usage: benchmarks/bench_driver.py [--iterations 200] [--erase-iterations N] [--starts 5]
                                  [--volumes 50] [--size 64Mi] [--pool-dir /dev/shm]
                                  [--json] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from csi_pmem import daxclient  # noqa: E402
from csi_pmem.csi import csi_pb2, csi_pb2_grpc  # noqa: E402
from csi_pmem.driver.host import mounts  # noqa: E402
from csi_pmem.sizes import format_bytes, parse_quantity  # noqa: E402

Mode = csi_pb2.VolumeCapability.AccessMode
MOUNT_CAP = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                     access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))
# Short reconnect back-off: the default (1 s initial) would quantise start-up times.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 2),
                   ("grpc.min_reconnect_backoff_ms", 2),
                   ("grpc.max_reconnect_backoff_ms", 10),
                   ("grpc.use_local_subchannel_pool", 1)]
ERASE_OFF = {"eraseOnDelete": "false"}
ERASE_ON = {"eraseOnDelete": "true"}
PCTS = (50, 90, 99)


def log(msg: str) -> None:
    print(f"[bench_driver] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- driver
class DriverProcess:
    """A ``csi-pmem serve`` child (the few lines of tests/conftest.py we need)."""

    def __init__(self, base: Path, pool_root: Path, regions: str, log_level: str):
        self.base, self.pool_root, self.regions = base, pool_root, regions
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.contexts: dict[str, dict[str, str]] = {}  # volume id -> its volume_context

    socket = property(lambda self: self.base / "csi.sock")
    kubelet = property(lambda self: self.base / "kubelet")
    state = property(lambda self: self.base / "state")
    log = property(lambda self: self.base / "driver.log")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.socket}", "--node-id", "bench-node",
                "--state-dir", str(self.state), "--kubelet-dir", str(self.kubelet),
                "--backend", "emulated", "--emulated-regions", self.regions,
                "--emulated-root", str(self.pool_root), "--emulated-device", "file",
                "--log-level", self.log_level]

    def start(self, timeout: float = 60) -> float:
        """Spawn the driver; return seconds from spawn to the first ready Probe."""
        self.kubelet.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # so "socket exists" means "this process bound it"
        # The repository first, then what the caller had (a host's own site dirs).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        env.pop("CSI_PMEM_FAILPOINTS", None)
        with open(self.log, "ab") as out:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv(), env=env, stdout=out, stderr=out)
        deadline = t0 + timeout
        while not self.socket.exists():
            self._check_alive(deadline)
            time.sleep(0.001)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}", options=CHANNEL_OPTIONS)
        while True:
            try:
                resp = self.identity.Probe(csi_pb2.ProbeRequest(), timeout=0.5,
                                           wait_for_ready=True)
                if resp.ready.value:
                    return time.perf_counter() - t0
            except grpc.RpcError:
                pass
            self._check_alive(deadline)
            time.sleep(0.001)

    def _check_alive(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None or time.perf_counter() > deadline:
            tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise RuntimeError(f"driver did not start (exit {self.proc.poll()}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM by PID (published mounts stay, as on a real node), SIGKILL if stuck."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError(f"no VmRSS in /proc/{self.pid}/status")

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def create(self, name: str, size: int, params: dict) -> str:
        volume = self.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capabilities=[MOUNT_CAP], parameters=params), timeout=120).volume
        self.contexts[volume.volume_id] = dict(volume.volume_context)
        return volume.volume_id

    def delete(self, vid: str) -> None:
        self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=120)

    def publish(self, vid: str, target: str) -> None:
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=vid, target_path=target, volume_capability=MOUNT_CAP), timeout=60)

    def unpublish(self, vid: str, target: str) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=target), timeout=60)

    def capacity(self) -> int:
        return self.controller.GetCapacity(csi_pb2.GetCapacityRequest(
            volume_capabilities=[MOUNT_CAP]), timeout=30).available_capacity

    def target(self) -> str:
        """A publish target shaped like kubelet's (long: exercises the sun_path workaround)."""
        return str(self.kubelet / "pods" / str(uuid.uuid4()) / "volumes" / "kubernetes.io~csi"
                   / f"pvc-{uuid.uuid4()}" / "mount")


# --------------------------------------------------------------------------- bookkeeping
class Tracker:
    """What exists right now, so cleanup can undo exactly that."""

    def __init__(self) -> None:
        self.volumes: set[str] = set()
        self.publications: dict[str, str] = {}  # target -> volume id

    def create(self, d: DriverProcess, name: str, size: int, params: dict) -> str:
        vid = d.create(name, size, params)
        self.volumes.add(vid)
        return vid

    def delete(self, d: DriverProcess, vid: str) -> None:
        d.delete(vid)
        self.volumes.discard(vid)

    def publish(self, d: DriverProcess, vid: str, target: str) -> None:
        self.publications[target] = vid
        d.publish(vid, target)

    def unpublish(self, d: DriverProcess, vid: str, target: str) -> None:
        d.unpublish(vid, target)
        self.publications.pop(target, None)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def percentile(samples: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(samples)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    out: dict = {"unit": "ms", "n": len(ms)}
    for p in PCTS:
        out[f"p{p}"] = percentile(ms, p)
    return out


def starts_summary(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"unit": "ms", "n": len(ms), "median": percentile(ms, 50), "min": min(ms),
            "max": max(ms)}


def rss(kib: int) -> dict:
    return {"unit": "MiB", "n": 1, "value": kib / 1024}


def settle_rss(d: DriverProcess, seconds: float = 1.0) -> int:
    """VmRSS after the driver has been idle for a moment (late imports, GC, threads)."""
    time.sleep(seconds)
    return d.rss_kib()


# --------------------------------------------------------------------------- phases
def bench_startup(d: DriverProcess, starts: int, what: str) -> list[float]:
    """``starts`` timed starts after one untimed one (page cache, .pyc); leaves it running."""
    times = []
    for i in range(starts + 1):
        d.stop()
        t = d.start()
        if i:
            times.append(t)
        log(f"start-up ({what}) {i}/{starts}: {t * 1000:.0f} ms"
            + ("" if i else " (warm-up, not counted)"))
    return times


def bench_create_delete(d: DriverProcess, tr: Tracker, size: int, n_off: int, n_on: int,
                        warmup: int) -> dict[str, list[float]]:
    """Interleave erase-off and erase-on pairs so drift on a noisy host hits both alike."""
    res: dict[str, list[float]] = {k: [] for k in
                                   ("create_off", "delete_off", "pair_off",
                                    "create_on", "delete_on", "pair_on")}
    # Spread the erase-on pairs evenly through the erase-off ones.
    keyed = [(i + 0.0, "off") for i in range(n_off)]
    keyed += [((j + 0.5) * n_off / n_on, "on") for j in range(n_on)]
    schedule = ["off", "on"] * warmup + [kind for _, kind in sorted(keyed)]
    for i, kind in enumerate(schedule):
        t0 = time.perf_counter()
        vid = tr.create(d, f"bench-cd-{i}", size, ERASE_OFF if kind == "off" else ERASE_ON)
        t1 = time.perf_counter()
        tr.delete(d, vid)
        tc, td = t1 - t0, time.perf_counter() - t1
        if i >= 2 * warmup:
            res[f"create_{kind}"].append(tc)
            res[f"delete_{kind}"].append(td)
            res[f"pair_{kind}"].append(tc + td)
        if (i + 1) % 50 == 0:
            log(f"create/delete {i + 1}/{len(schedule)}")
    return res


def bench_publish(d: DriverProcess, tr: Tracker, size: int, n: int,
                  warmup: int) -> dict[str, list[float]]:
    vid = tr.create(d, "bench-publish", size, ERASE_OFF)
    pub, unpub, opened = [], [], []
    for i in range(n + warmup):
        target = d.target()
        t0 = time.perf_counter()
        tr.publish(d, vid, target)
        t1 = time.perf_counter()
        tr.unpublish(d, vid, target)
        tp, tu = t1 - t0, time.perf_counter() - t1
        if i >= warmup:
            pub.append(tp)
            unpub.append(tu)
        if (i + 1) % 50 == 0:
            log(f"publish/unpublish {i + 1}/{n + warmup}")
    # open_volume on one steady publication: what a pod pays per (re)connect.
    target = d.target()
    tr.publish(d, vid, target)
    for i in range(n + warmup):
        t0 = time.perf_counter()
        meta, fd = daxclient.open_volume(target)
        t = time.perf_counter() - t0
        os.close(fd)
        if meta.get("volume_id") != vid:
            raise RuntimeError(f"dax.sock at {target} answered for {meta.get('volume_id')}")
        if i >= warmup:
            opened.append(t)
    tr.unpublish(d, vid, target)
    tr.delete(d, vid)
    return {"publish": pub, "unpublish": unpub, "open": opened}


def bench_capacity(d: DriverProcess, n: int, warmup: int) -> list[float]:
    out = []
    for i in range(n + warmup):
        t = timed(d.capacity)
        if i >= warmup:
            out.append(t)
    return out


def load(d: DriverProcess, tr: Tracker, size: int, count: int) -> list[tuple[str, str]]:
    """``count`` volumes, each published once; returns (volume id, target) pairs."""
    pairs = []
    for i in range(count):
        vid = tr.create(d, f"bench-load-{i}", size, ERASE_OFF)
        target = d.target()
        tr.publish(d, vid, target)
        pairs.append((vid, target))
    return pairs


# --------------------------------------------------------------------------- cleanup
def cleanup(d: DriverProcess | None, tr: Tracker, dirs: list[Path]) -> None:
    """Unpublish, delete, stop the driver by PID, unmount leftovers, remove temp dirs."""
    problems = []
    if d is not None and d.proc is not None and d.proc.poll() is None and d.channel:
        for target, vid in list(tr.publications.items()):
            try:
                tr.unpublish(d, vid, target)
            except grpc.RpcError as exc:
                problems.append(f"unpublish {target}: {exc.code().name} {exc.details()}")
        for vid in list(tr.volumes):
            try:
                tr.delete(d, vid)
            except grpc.RpcError as exc:
                problems.append(f"delete {vid}: {exc.code().name} {exc.details()}")
    if d is not None:
        try:
            d.stop()
        except Exception as exc:  # keep cleaning up
            problems.append(f"stop driver {d.pid}: {exc}")
    # Whatever is still mounted below our directories (a failed run) goes too.
    for m in reversed(mounts.mountinfo()):
        if any(m.mount_point.startswith(str(p) + "/") for p in dirs):
            subprocess.run(["umount", "-l", m.mount_point], check=False)
            problems.append(f"lazily unmounted leftover {m.mount_point}")
    for p in dirs:
        shutil.rmtree(p, ignore_errors=True)
    for p in problems:
        log(f"cleanup: {p}")


# --------------------------------------------------------------------------- report
def fs_type(path: str) -> str:
    best, kind = "", "unknown"
    for m in mounts.mountinfo():
        mp = m.mount_point
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, kind = mp, m.fstype
    return kind


def machine() -> dict:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    return {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "cpu_model": model, "memory_gib": round(mem_kib / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "grpc": grpc.__version__, "hostname": platform.node()}


LATENCY_ROWS = [  # (metric key, label)
    ("create_erase_off", "CreateVolume         eraseOnDelete=false"),
    ("delete_erase_off", "DeleteVolume         eraseOnDelete=false"),
    ("create_delete_erase_off", "Create+Delete pair   eraseOnDelete=false"),
    ("create_erase_on", "CreateVolume         eraseOnDelete=true"),
    ("delete_erase_on", "DeleteVolume         eraseOnDelete=true"),
    ("create_delete_erase_on", "Create+Delete pair   eraseOnDelete=true"),
    ("node_publish", "NodePublishVolume    (tmpfs + dax.sock)"),
    ("node_unpublish", "NodeUnpublishVolume"),
    ("dax_open_volume", "daxclient.open_volume (fd received)"),
    ("get_capacity", "GetCapacity          no volumes"),
    ("get_capacity_loaded", "GetCapacity          {volumes} volumes"),
]
STARTUP_ROWS = [
    ("startup_empty", "spawn -> ready Probe, empty state"),
    ("startup_published", "spawn -> ready Probe, {volumes} published volumes"),
]
RSS_ROWS = [
    ("rss_idle", "idle driver (just started)"),
    ("rss_loaded", "after {volumes} volumes + {volumes} publications"),
    ("rss_restarted_loaded", "fresh start re-serving {volumes} publications"),
]
METRICS = [key for rows in (LATENCY_ROWS, STARTUP_ROWS, RSS_ROWS) for key, _ in rows]


def _table(title: str, columns: list[str], rows: list[tuple[str, str]], metrics: dict,
           volumes: int) -> None:
    head = f"{title:<44} {'n':>4}" + "".join(f" {c:>9}" for c in columns) + "  unit"
    print(head)
    print("-" * len(head))
    for key, label in rows:
        r = metrics[key]
        cells = "".join(f" {r[c]:>9.2f}" for c in columns)
        print(f"{label.format(volumes=volumes):<44} {r['n']:>4}{cells}  {r['unit']}")
    print()


def print_table(report: dict) -> None:
    m, c, metrics = report["machine"], report["config"], report["metrics"]
    print(f"csi-pmem driver benchmark, {report['date']}")
    print(f"machine: {m['cpus']} CPUs ({m['cpus_usable']} usable, {m['cpu_model']}), "
          f"{m['memory_gib']} GiB RAM, Linux {m['kernel']}, Python {m['python']}, "
          f"grpcio {m['grpc']}")
    print(f"setup:   emulated back end, {format_bytes(c['size_bytes'])} volumes, pools in "
          f"{c['pool_dir']} ({c['pool_fs']}), state in {c['work_dir']} ({c['work_fs']}), "
          f"driver log level {c['log_level']}{', QUICK (smoke counts)' if c['quick'] else ''}")
    print()
    v = c["volumes"]
    _table("latency (client side)", ["p50", "p90", "p99"], LATENCY_ROWS, metrics, v)
    _table("start-up", ["median", "min", "max"], STARTUP_ROWS, metrics, v)
    _table("driver memory (VmRSS)", ["value"], RSS_ROWS, metrics, v)
    off, on = metrics["delete_erase_off"]["p50"], metrics["delete_erase_on"]["p50"]
    if on > off:
        print(f"erase cost: DeleteVolume p50 +{on - off:.1f} ms with eraseOnDelete=true, "
              f"i.e. ~{c['size_bytes'] / ((on - off) / 1000) / 1e9:.2f} GB/s for "
              f"{format_bytes(c['size_bytes'])}")


# --------------------------------------------------------------------------- main
def default_pool_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and fs_type("/dev/shm") == "tmpfs" \
        else tempfile.gettempdir()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=None,
                    help="create/delete pairs with erase off, publish/unpublish pairs, "
                         "open_volume and GetCapacity calls (default 200, --quick 10)")
    ap.add_argument("--erase-iterations", type=int, default=None,
                    help="create/delete pairs with erase on (default iterations/10, min 5; "
                         "--quick 3)")
    ap.add_argument("--starts", type=int, default=None,
                    help="timed driver starts per start-up case (default 5, --quick 2)")
    ap.add_argument("--volumes", type=int, default=None,
                    help="volumes+publications for the loaded cases (default 50, --quick 5)")
    ap.add_argument("--size", default="64Mi", help="volume size (default 64Mi)")
    ap.add_argument("--pool-dir", default=None,
                    help="where the emulated pools live; use tmpfs (default /dev/shm)")
    ap.add_argument("--work-dir", default=None,
                    help="parent of the state, kubelet and socket directory "
                         "(default: the system temp dir)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="driver log level (default info, as deployed)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--quick", action="store_true",
                    help="small counts for a CI smoke run (numbers are not meaningful)")
    a = ap.parse_args(argv)
    q = a.quick
    a.iterations = a.iterations if a.iterations is not None else (10 if q else 200)
    a.erase_iterations = a.erase_iterations if a.erase_iterations is not None else (
        3 if q else max(5, a.iterations // 10))
    a.starts = a.starts if a.starts is not None else (2 if q else 5)
    a.volumes = a.volumes if a.volumes is not None else (5 if q else 50)
    a.warmup = 1 if q else 3
    a.size_bytes = parse_quantity(a.size)
    for key in ("iterations", "erase_iterations", "starts", "volumes"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1")
    return a


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so the cleanup in ``finally`` runs."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(a: argparse.Namespace) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("bench_driver.py needs root: NodePublishVolume mounts a tmpfs")
    pool_parent = a.pool_dir or default_pool_dir()
    work = Path(tempfile.mkdtemp(prefix="csi-pmem-bench-", dir=a.work_dir))
    pools = Path(tempfile.mkdtemp(prefix="csi-pmem-bench-pools-", dir=pool_parent))
    # Room for the loaded volumes plus metadata, split over two NUMA pools; the emulated
    # pools are only accounting: tmpfs holds just the files that exist.
    per_pool = max(1 << 30, (a.volumes // 2 + 4) * a.size_bytes * 5 // 4)
    regions = f"0={per_pool // 2**20}Mi,1={per_pool // 2**20}Mi"
    d = DriverProcess(work, pools, regions, a.log_level)
    tr = Tracker()
    metrics: dict[str, dict] = {}
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        with terminate_as_exit():
            log(f"work dir {work}, pools {pools} ({fs_type(str(pools))}), driver log {d.log}")
            metrics["startup_empty"] = starts_summary(bench_startup(d, a.starts, "empty"))
            metrics["rss_idle"] = rss(settle_rss(d))

            log("GetCapacity")
            metrics["get_capacity"] = dist(bench_capacity(d, a.iterations, a.warmup))

            log("CreateVolume/DeleteVolume")
            cd = bench_create_delete(d, tr, a.size_bytes, a.iterations, a.erase_iterations,
                                     a.warmup)
            for kind in ("off", "on"):
                metrics[f"create_erase_{kind}"] = dist(cd[f"create_{kind}"])
                metrics[f"delete_erase_{kind}"] = dist(cd[f"delete_{kind}"])
                metrics[f"create_delete_erase_{kind}"] = dist(cd[f"pair_{kind}"])

            log("NodePublishVolume/NodeUnpublishVolume/open_volume")
            pb = bench_publish(d, tr, a.size_bytes, a.iterations, a.warmup)
            metrics["node_publish"] = dist(pb["publish"])
            metrics["node_unpublish"] = dist(pb["unpublish"])
            metrics["dax_open_volume"] = dist(pb["open"])

            log(f"loading {a.volumes} volumes + publications")
            pairs = load(d, tr, a.size_bytes, a.volumes)
            metrics["rss_loaded"] = rss(settle_rss(d))
            metrics["get_capacity_loaded"] = dist(bench_capacity(d, a.iterations, a.warmup))

            metrics["startup_published"] = starts_summary(
                bench_startup(d, a.starts, f"{a.volumes} published"))
            metrics["rss_restarted_loaded"] = rss(settle_rss(d))
            # The restarted driver must really serve the old publications again.
            for vid, target in (pairs[0], pairs[-1]):
                meta, fd = daxclient.open_volume(target)
                os.close(fd)
                if meta.get("volume_id") != vid:
                    raise RuntimeError(f"after restart {target} serves {meta.get('volume_id')}")
    finally:
        log("cleaning up")
        cleanup(d, tr, [work, pools])
    return {
        "benchmark": "bench_driver",
        "date": date,
        "machine": machine(),
        "config": {"iterations": a.iterations, "erase_iterations": a.erase_iterations,
                   "starts": a.starts, "volumes": a.volumes, "warmup": a.warmup,
                   "size_bytes": a.size_bytes, "quick": a.quick, "log_level": a.log_level,
                   "regions": regions, "pool_dir": pool_parent, "pool_fs": fs_type(pool_parent),
                   "work_dir": str(work.parent), "work_fs": fs_type(str(work.parent))},
        "metrics": {key: metrics[key] for key in METRICS},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    report = run(a)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
