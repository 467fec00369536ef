#!/usr/bin/env python3
"""Driver memory, fds and latency under a mixed load with crashes (issue 36, part 2).

Why: the node plugin runs for months on every node. A load of volume churn with the
driver killed and restarted now and then must lose nothing, and must leave the driver
no bigger than a fresh one: memory kept after the load is paid on every node, forever.
This was not so: fsdax erases left 16 MiB read-back buffers per thread in glibc's
arenas, and a driver that had been 46 MiB fresh stayed at 372-468 MiB after the load.

What runs: a real ``python -m csi_pmem serve`` process (emulated back end, unix socket,
its own state and kubelet directories in a new temporary directory, pools on tmpfs),
and --clients threads that each repeat, until --seconds have passed:

  CreateVolume (devdax and fsdax in turn; fsdax with a Block capability)
  NodePublishVolume (devdax: tmpfs + dax.sock; fsdax: the loop device bound onto the
                     target file, as kubelet asks for a raw block volume)
  check that the fresh volume reads as zeros where we will write, write a pattern
    (devdax: mmap of the fd that dax.sock hands out; fsdax: pwrite + fsync)
  read it back through a new fd (devdax: a second dax.sock hand-off; fsdax: a new open
    after the cached pages are dropped) and compare every byte
  NodeUnpublishVolume, DeleteVolume (which erases in the background)

(Block volumes of deviceMode devdax do not exist: the driver refuses them, a devdax
volume reaches pods only through dax.sock; so devdax volumes use a Mount capability.)

The driver is SIGKILLed --kills times, evenly spread over the run, and started again;
every call a kill cuts off is retried (CSI calls are idempotent), as kubelet and
external-provisioner do. At the end every DeleteVolume's erase must have finished, no
volume, pool file, mount or loop device may be left, and every byte written must have
been read back.

It prints and records: the driver's VmRSS fresh, at the peak (VmRSS sampled every
100 ms and VmHWM of each process, across restarts) and after the load (the last
process, once the erases are done and it idled 2 s); its open fds fresh and after;
CreateVolume and NodePublishVolume p50/p99 (client side; the successful attempt).

--driver-src DIR runs the driver from DIR (first on PYTHONPATH); --compare DIR runs the
same load against the driver in DIR first, in the same invocation, so both sides are
measured on the same host at the same time of day, e.g. the code before a change:

  git worktree add /tmp/bench-before HEAD
  sudo .venv/bin/python benchmarks/bench_load.py --compare /tmp/bench-before
  git worktree remove --force /tmp/bench-before

Needs root (mounts, loop devices). Everything it creates (mounts, loop devices, driver
processes, by PID, directories) is removed at the end, also after an error or Ctrl-C.
The JSON result goes to benchmarks/results/ (--results-dir).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import mmap
import os
import platform
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from bench_driver import (  # noqa: E402
    CHANNEL_OPTIONS,
    default_pool_dir,
    fs_type,
    machine,
    percentile,
    terminate_as_exit,
)

from csi_pmem import daxclient  # noqa: E402
from csi_pmem.csi import csi_pb2, csi_pb2_grpc  # noqa: E402
from csi_pmem.driver.host import mounts  # noqa: E402
from csi_pmem.sizes import format_bytes, parse_quantity  # noqa: E402

Mode = csi_pb2.VolumeCapability.AccessMode
WRITER = Mode(mode=Mode.SINGLE_NODE_WRITER)
MOUNT_CAP = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                     access_mode=WRITER)
BLOCK_CAP = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                     access_mode=WRITER)
KINDS = ("devdax", "fsdax")
# What a kill (or the restart's reconcile) answers for a while; retried like kubelet does.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED}
STEP_TIMEOUT = 180.0  # one step may wait this long for a restarted driver
PIECE = 256 << 10     # bytes written at each of three offsets of a volume
SAMPLE_EVERY = 0.1    # seconds between VmRSS samples


def log(msg: str) -> None:
    print(f"[bench_load] {msg}", file=sys.stderr, flush=True)


STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and the parts of VmRSS of ``pid`` in KiB; {} if it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(tuple(f"{k}:" for k in STATUS_KEYS)):
                    out[line.split(":")[0]] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return out


def top_mappings(pid: int, n: int = 6) -> list[dict[str, Any]]:
    """The ``n`` mappings of ``pid`` with the most resident memory (/proc/PID/smaps):
    where a peak goes. [] if the process is gone."""
    maps: list[dict[str, Any]] = []
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if not head:
                    continue
                if not head[0].endswith(":"):  # a mapping's header line
                    maps.append({"mapping": head[5] if len(head) > 5 else "[anon]",
                                 "size_kib": (int(head[0].split("-")[1], 16)
                                              - int(head[0].split("-")[0], 16)) >> 10})
                elif maps and head[0] in ("Rss:", "Anonymous:", "Shared_Clean:",
                                          "Shared_Dirty:", "Private_Dirty:"):
                    maps[-1][head[0][:-1].lower() + "_kib"] = int(head[1])
    except (FileNotFoundError, ProcessLookupError):
        return []
    return sorted(maps, key=lambda m: -m.get("rss_kib", 0))[:n]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def git_info(src: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        res = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True,
                             timeout=30)
        return res.stdout.strip() if res.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# --------------------------------------------------------------------------- driver
class Driver:
    """One ``csi-pmem serve`` at a time from ``src``, restarted in place after a kill."""

    def __init__(self, src: Path, base: Path, pools: Path, regions: str, log_level: str):
        self.src, self.base, self.pools = src, base, pools
        self.regions, self.log_level = regions, log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.channel: grpc.Channel | None = None

    socket = property(lambda self: self.base / "csi.sock")
    kubelet = property(lambda self: self.base / "kubelet")
    log = property(lambda self: self.base / "driver.log")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120) -> float:
        """Spawn the driver; seconds from spawn to the first ready Probe."""
        self.kubelet.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a killed driver leaves its socket behind
        env = dict(os.environ, PYTHONPATH=str(self.src))
        env.pop("CSI_PMEM_FAILPOINTS", None)
        argv = [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.socket}", "--node-id", "bench-load-node",
                "--state-dir", str(self.base / "state"), "--kubelet-dir", str(self.kubelet),
                "--backend", "emulated", "--emulated-regions", self.regions,
                "--emulated-root", str(self.pools), "--emulated-device", "file",
                "--log-level", self.log_level]
        with open(self.log, "ab") as out:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=self.src)
        self.pids.append(self.proc.pid)
        if self.channel is None:
            # One channel for the whole run: it reconnects to each new process.
            self.channel = grpc.insecure_channel(f"unix://{self.socket}",
                                                 options=CHANNEL_OPTIONS)
        identity = csi_pb2_grpc.IdentityStub(self.channel)
        while True:
            if self.proc.poll() is not None or time.perf_counter() - t0 > timeout:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"driver from {self.src} did not start "
                                   f"(exit {self.proc.poll()}):\n{tail}")
            if self.socket.exists():
                with contextlib.suppress(grpc.RpcError):
                    if identity.Probe(csi_pb2.ProbeRequest(), timeout=1).ready.value:
                        return time.perf_counter() - t0
            time.sleep(0.005)

    def kill(self) -> None:
        """SIGKILL by PID, as the OOM killer or a node crash would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL if it does not exit."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

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
        return sorted(p for p in self.pools.glob("region*/*")
                      if p.suffix in (".dax", ".fsdax"))


# --------------------------------------------------------------------------- the load
@dataclass
class Stats:
    """What the clients saw; every field guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    create: list[float] = field(default_factory=list)
    publish: list[float] = field(default_factory=list)
    cycles: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    retries: dict[str, int] = field(default_factory=dict)
    written: int = 0
    verified: int = 0
    not_zero: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # What exists right now, so cleanup can undo exactly that.
    volumes: dict[str, str] = field(default_factory=dict)       # id -> kind
    publications: dict[str, tuple[str, str]] = field(default_factory=dict)  # target -> (id, kind)

    def retried(self, what: str) -> None:
        with self.lock:
            self.retries[what] = self.retries.get(what, 0) + 1


class Load:
    def __init__(self, d: Driver, stats: Stats, size: int, label: str, stop: threading.Event):
        self.d, self.stats, self.size, self.label, self.stop = d, stats, size, label, stop

    def retry(self, what: str, fn: Callable[[], Any], samples: list[float] | None = None) -> Any:
        """``fn`` until it succeeds; transient answers (a killed or restarting driver)
        are retried for up to STEP_TIMEOUT. ``samples`` gets the successful attempt's
        wall time."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            t0 = time.perf_counter()
            try:
                out = fn()
            except grpc.RpcError as exc:
                if exc.code() not in TRANSIENT or time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {exc.code().name}: {exc.details()}") from exc
            except daxclient.DaxSocketError as exc:  # dax.sock of a killed driver
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {exc}") from exc
            else:
                if samples is not None:
                    with self.stats.lock:
                        samples.append(time.perf_counter() - t0)
                return out
            self.stats.retried(what)
            time.sleep(0.05)

    def client(self, i: int) -> None:
        j = 0
        try:
            while not self.stop.is_set():
                self.cycle(i, j)
                j += 1
        except Exception as exc:  # recorded; the run then fails
            with self.stats.lock:
                self.stats.failures.append(f"client {i} cycle {j}: {exc}")
            self.stop.set()

    def cycle(self, i: int, j: int) -> None:
        kind = KINDS[(i + j) % 2]
        name = f"load-{self.label}-{i}-{j}"
        ctl, node, st = self.d.controller, self.d.node, self.stats
        cap = MOUNT_CAP if kind == "devdax" else BLOCK_CAP
        vol = self.retry("CreateVolume", lambda: ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=self.size),
            volume_capabilities=[cap], parameters={"deviceMode": kind}), timeout=60).volume,
            st.create)
        vid, capacity = vol.volume_id, vol.capacity_bytes
        with st.lock:
            st.volumes[vid] = kind
        if kind == "devdax":
            target = str(self.d.kubelet / "pods" / str(uuid.uuid4()) / "volumes"
                         / "kubernetes.io~csi" / f"pvc-{uuid.uuid4()}" / "mount")
        else:  # kubelet creates the parent, the driver the file it binds the device onto
            parent = self.d.kubelet / "plugins" / "volumeDevices" / "publish" / str(uuid.uuid4())
            parent.mkdir(parents=True)
            target = str(parent / "dev")
        with st.lock:
            st.publications[target] = (vid, kind)
        self.retry("NodePublishVolume", lambda: node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(volume_id=vid, target_path=target,
                                             volume_capability=cap), timeout=60), st.publish)
        pattern = hashlib.sha256(f"{self.label}/{name}".encode()).digest() * (PIECE // 32)
        if kind == "devdax":
            self.devdax_io(name, target, capacity, pattern)
        else:
            self.fsdax_io(name, target, capacity, pattern)
        self.retry("NodeUnpublishVolume", lambda: node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target), timeout=60))
        with st.lock:
            st.publications.pop(target, None)
        self.retry("DeleteVolume", lambda: ctl.DeleteVolume(
            csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=120))
        with st.lock:
            st.volumes.pop(vid, None)
            st.cycles[kind] += 1

    @staticmethod
    def offsets(length: int) -> list[int]:
        return [0, (length // 2) & ~4095, length - PIECE]

    def check(self, name: str, off: int, got: bytes, want: bytes, fresh: bool) -> None:
        st = self.stats
        with st.lock:
            if fresh:
                if got != want:
                    st.not_zero.append(f"{name} at {off}")
            elif got != want:
                st.mismatches.append(f"{name} at {off}")
            else:
                st.verified += len(got)

    def devdax_io(self, name: str, target: str, capacity: int, pattern: bytes) -> None:
        """Write through one dax.sock hand-off, read back through another."""
        zeros = bytes(PIECE)
        for phase in ("write", "read"):
            _, fd = self.retry("dax.sock", lambda: daxclient.open_volume(target))
            try:
                st = os.fstat(fd)
                length = min(capacity, st.st_size) if stat.S_ISREG(st.st_mode) else capacity
                with mmap.mmap(fd, length, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                    for off in self.offsets(length):
                        if phase == "write":
                            self.check(name, off, mm[off:off + PIECE], zeros, fresh=True)
                            mm[off:off + PIECE] = pattern
                            with self.stats.lock:
                                self.stats.written += PIECE
                        else:
                            self.check(name, off, mm[off:off + PIECE], pattern, fresh=False)
            finally:
                os.close(fd)

    def fsdax_io(self, name: str, target: str, capacity: int, pattern: bytes) -> None:
        """pwrite + fsync through the published device node; read back through a new
        open after dropping the cached pages, so the bytes come from the device."""
        zeros = bytes(PIECE)
        fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
        try:
            length = os.lseek(fd, 0, os.SEEK_END)
            for off in self.offsets(length):
                self.check(name, off, os.pread(fd, PIECE, off), zeros, fresh=True)
                os.pwrite(fd, pattern, off)
                with self.stats.lock:
                    self.stats.written += PIECE
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for off in self.offsets(length):
                self.check(name, off, os.pread(fd, PIECE, off), pattern, fresh=False)
        finally:
            os.close(fd)


class Sampler(threading.Thread):
    """VmRSS of whichever driver process runs now, every SAMPLE_EVERY seconds, and each
    process's VmHWM (the kernel's own peak), so a peak between samples is not missed.
    The parts of VmRSS are kept at the sample with the most: RssAnon (the driver's own
    memory), RssShmem (tmpfs pages it maps: with the emulated back end, a devdax volume
    is a tmpfs file, and zeroing it through a shared mapping maps its pages), RssFile."""

    def __init__(self, d: Driver) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.d, self.done = d, threading.Event()
        self.peak_rss = 0
        self.hwm: dict[int, int] = {}
        self.at_peak: dict[str, int] = {}
        self.peak_maps: list[dict[str, Any]] = []
        self.peak_anon = 0
        self.samples = 0

    def sample(self) -> None:
        pid = self.d.proc.pid if self.d.proc is not None else 0
        s = proc_status(pid) if pid else {}
        if s:
            self.samples += 1
            if s.get("VmRSS", 0) > self.peak_rss:
                self.peak_rss, self.at_peak = s["VmRSS"], s
                self.peak_maps = top_mappings(pid)
            self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
            self.hwm[pid] = max(self.hwm.get(pid, 0), s.get("VmHWM", 0))

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY):
            self.sample()

    @property
    def peak_kib(self) -> int:
        return max([self.peak_rss, *self.hwm.values()])


# --------------------------------------------------------------------------- cleanup
def loops_below(pools: Path) -> list[str]:
    """Loop devices on our pool files, and read-only views on those loop devices."""
    res = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                         capture_output=True, text=True, timeout=30)
    pairs = [line.split(None, 1) for line in res.stdout.splitlines() if len(line.split()) > 1]
    ours = {name for name, back in pairs if back.strip().startswith(str(pools) + "/")}
    views = {name for name, back in pairs if back.strip() in ours}
    return sorted(ours | views)


def mounts_below(paths: list[Path]) -> list[str]:
    return [m.mount_point for m in mounts.mountinfo()
            if any(m.mount_point.startswith(str(p) + "/") for p in paths)]


def cleanup(d: Driver, st: Stats, dirs: list[Path]) -> list[str]:
    """Undo what is left: through the driver if it still runs, then by force (driver by
    PID, lazy unmounts, loop devices, directories). Returns what it had to do."""
    problems = []
    if d.alive() and d.channel is not None:
        for target, (vid, _) in list(st.publications.items()):
            try:
                d.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id=vid, target_path=target), timeout=60)
            except grpc.RpcError as exc:
                problems.append(f"unpublish {target}: {exc.code().name} {exc.details()}")
        for vid in list(st.volumes):
            try:
                d.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid),
                                          timeout=120)
            except grpc.RpcError as exc:
                problems.append(f"delete {vid}: {exc.code().name} {exc.details()}")
    try:
        d.stop()
    except Exception as exc:  # keep cleaning up
        problems.append(f"stop driver {d.pids[-1] if d.pids else '?'}: {exc}")
    for mp in reversed(mounts_below(dirs)):
        subprocess.run(["umount", "-l", mp], check=False, timeout=60)
        problems.append(f"lazily unmounted leftover {mp}")
    for loop in reversed(loops_below(d.pools)):
        subprocess.run(["losetup", "--detach", loop], check=False, timeout=60)
        problems.append(f"detached leftover loop device {loop}")
    for p in dirs:
        subprocess.run(["rm", "-rf", "--one-file-system", str(p)], check=False, timeout=120)
    return problems


# --------------------------------------------------------------------------- one side
def wait_drained(d: Driver, timeout: float) -> tuple[list[str], list[Path]]:
    """Until no volume is listed and no pool file is left (background erases done)."""
    deadline = time.monotonic() + timeout
    while True:
        ids, files = d.list_ids(), d.pool_files()
        if (not ids and not files) or time.monotonic() > deadline:
            return ids, files
        time.sleep(0.2)


def ms(samples: list[float]) -> dict[str, Any]:
    xs = [s * 1000 for s in samples]
    return {"n": len(xs), "p50": percentile(xs, 50) if xs else None,
            "p99": percentile(xs, 99) if xs else None}


def run_side(label: str, src: Path, a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"csi-pmem-load-{label}-", dir=a.work_dir))
    pools = Path(tempfile.mkdtemp(prefix=f"csi-pmem-load-pools-{label}-", dir=a.pool_parent))
    # Room for every client's volume plus those being erased; tmpfs holds only the files
    # that exist, so this is accounting, not memory.
    per_pool = max(1 << 30, a.clients * a.size_bytes * 2)
    regions = f"0={per_pool >> 20}Mi,1={per_pool >> 20}Mi"
    d = Driver(src, work, pools, regions, a.log_level)
    st = Stats()
    stop = threading.Event()
    sampler = Sampler(d)
    out: dict[str, Any] = {"label": label, "driver_src": str(src), **git_info(src),
                           "regions": regions}
    log(f"[{label}] driver from {src}; work {work}, pools {pools}, log {d.log}")
    problems: list[str] = []
    try:
        out["startup_s"] = [d.start()]
        time.sleep(a.settle)
        fresh = proc_status(d.pid)
        out["rss_fresh_mib"] = fresh["VmRSS"] / 1024
        out["fds_fresh"] = open_fds(d.pid)
        sampler.start()
        load = Load(d, st, a.size_bytes, label, stop)
        clients = [threading.Thread(target=load.client, args=(i,), name=f"client-{i}")
                   for i in range(a.clients)]
        t0 = time.monotonic()
        for t in clients:
            t.start()
        kills = []
        for k in range(a.kills):
            if stop.wait(max(0.0, t0 + a.seconds * (k + 1) / (a.kills + 1) - time.monotonic())):
                break  # a client failed
            sampler.sample()  # the dying process's VmHWM, as late as possible
            pid = d.pid
            d.kill()
            restart = d.start()
            kills.append({"at_s": round(time.monotonic() - t0, 2), "pid": pid,
                          "restart_s": round(restart, 3)})
            log(f"[{label}] SIGKILL {pid} at {kills[-1]['at_s']} s; restarted as {d.pid} "
                f"in {restart:.2f} s")
        stop.wait(max(0.0, t0 + a.seconds - time.monotonic()))
        stop.set()
        for t in clients:
            t.join()
        out["load_s"] = round(time.monotonic() - t0, 1)
        out["kills"] = kills
        out["fds_restarted"] = open_fds(d.pid)
        ids, files = wait_drained(d, a.drain_timeout)
        time.sleep(2)
        sampler.done.set()
        sampler.join()
        sampler.sample()
        after = proc_status(d.pid)
        out.update({
            "rss_peak_mib": sampler.peak_kib / 1024, "rss_samples": sampler.samples,
            "rss_peak_sampled_kib": {k: v for k, v in sampler.at_peak.items()
                                     if k != "VmHWM"},
            "rss_anon_peak_mib": sampler.peak_anon / 1024,
            "rss_peak_top_mappings": sampler.peak_maps,
            "rss_after_kib": {k: v for k, v in after.items() if k != "VmHWM"},
            "rss_after_mib": after["VmRSS"] / 1024, "fds_after": open_fds(d.pid),
            "pids": list(d.pids),
            "volumes_left": ids, "pool_files_left": [str(p) for p in files],
            "mounts_left": mounts_below([work, pools]), "loops_left": loops_below(pools)})
    finally:
        stop.set()
        sampler.done.set()
        problems = cleanup(d, st, [work, pools])
        for p in problems:
            log(f"[{label}] cleanup: {p}")
    out.update({
        "create_ms": ms(st.create), "publish_ms": ms(st.publish), "cycles": st.cycles,
        "retries": st.retries, "bytes_written": st.written, "bytes_verified": st.verified,
        "not_zero_before_write": st.not_zero, "mismatches": st.mismatches,
        "failures": st.failures, "cleanup": problems})
    out["ok"] = bool(
        not st.failures and not st.mismatches and not st.not_zero and not problems
        and st.written == st.verified and sum(st.cycles.values()) > 0
        and not out["volumes_left"] and not out["pool_files_left"]
        and not out["mounts_left"] and not out["loops_left"])
    return out


# --------------------------------------------------------------------------- report
def goals(r: dict[str, Any]) -> dict[str, bool]:
    return {"rss_after_within_1.5x_fresh": r["rss_after_mib"] <= 1.5 * r["rss_fresh_mib"],
            "rss_peak_under_150MiB": r["rss_peak_mib"] < 150,
            "no_fd_growth": r["fds_after"] <= r["fds_fresh"]}


def print_report(report: dict[str, Any]) -> None:
    sides = report["sides"]
    c, m = report["config"], report["machine"]
    print(f"csi-pmem load benchmark, {report['date']}, host {m['hostname']}: {m['cpus']} "
          f"CPUs ({m['cpus_usable']} usable), Linux {m['kernel']}")
    print(f"load: {c['clients']} clients x {c['seconds']} s, {c['kills']} SIGKILLs, "
          f"{format_bytes(c['size_bytes'])} volumes (devdax Mount + fsdax Block), pools in "
          f"{c['pool_dir']} ({c['pool_fs']})")
    print()

    def fmt(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("driver (commit, dirty)", lambda r: f"{r['commit'][:10]}{'+' if r['dirty'] else ''}"),
        ("VmRSS fresh (MiB)", lambda r: fmt(r.get("rss_fresh_mib"))),
        ("VmRSS peak (MiB)", lambda r: fmt(r.get("rss_peak_mib"))),
        ("  sampled peak: anon/shmem/file",
         lambda r: "/".join(f"{r['rss_peak_sampled_kib'].get(k, 0) / 1024:.0f}"
                            for k in ("RssAnon", "RssShmem", "RssFile"))
         if "rss_peak_sampled_kib" in r else "-"),
        ("  RssAnon peak (MiB)", lambda r: fmt(r.get("rss_anon_peak_mib"))),
        ("VmRSS after load (MiB)", lambda r: fmt(r.get("rss_after_mib"))),
        ("open fds fresh / after", lambda r: f"{r.get('fds_fresh')} / {r.get('fds_after')}"),
        ("CreateVolume p50 / p99 (ms)",
         lambda r: f"{fmt(r['create_ms']['p50'], '.0f')} / {fmt(r['create_ms']['p99'], '.0f')}"),
        ("NodePublishVolume p50 / p99 (ms)",
         lambda r: f"{fmt(r['publish_ms']['p50'], '.0f')} / "
                   f"{fmt(r['publish_ms']['p99'], '.0f')}"),
        ("cycles devdax / fsdax",
         lambda r: f"{r['cycles']['devdax']} / {r['cycles']['fsdax']}"),
        ("MiB written = read back", lambda r: f"{r['bytes_written'] / 2**20:.1f} = "
                                              f"{r['bytes_verified'] / 2**20:.1f}"),
        ("kills (restart s)", lambda r: ", ".join(f"{k['restart_s']:.2f}"
                                                  for k in r.get("kills", [])) or "-"),
        ("retried calls", lambda r: str(sum(r["retries"].values()))),
        ("nothing lost or left", lambda r: "yes" if r["ok"] else "NO"),
    ]
    width = max(28, *(len(s["label"]) + 2 for s in sides))
    print(f"{'':<34}" + "".join(f"{s['label']:>{width}}" for s in sides))
    for title, cell in rows:
        print(f"{title:<34}" + "".join(f"{cell(s):>{width}}" for s in sides))
    print()
    for s in sides:
        if "rss_after_mib" in s:
            g = goals(s)
            print(f"{s['label']}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                                for k, v in g.items()))
        for key in ("failures", "mismatches", "not_zero_before_write", "volumes_left",
                    "pool_files_left", "mounts_left", "loops_left", "cleanup"):
            if s.get(key):
                print(f"{s['label']}: {key}: {s[key][:5]}")


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40, help="load duration (default 40)")
    ap.add_argument("--kills", type=int, default=3,
                    help="SIGKILLs of the driver during the load, each followed by a "
                         "restart (default 3)")
    ap.add_argument("--clients", type=int, default=16, help="client threads (default 16)")
    ap.add_argument("--size", default="64Mi", help="volume size (default 64Mi)")
    ap.add_argument("--driver-src", type=Path, default=ROOT,
                    help="directory put first on the driver's PYTHONPATH (default: this tree)")
    ap.add_argument("--compare", type=Path, default=None, metavar="DIR",
                    help="first run the same load against the driver in DIR (e.g. a git "
                         "worktree of the code before a change)")
    ap.add_argument("--pool-dir", default=None, help="parent of the emulated pools (tmpfs; "
                                                     "default /dev/shm)")
    ap.add_argument("--work-dir", default=None, help="parent of state, kubelet dir and socket")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results",
                    help="where the JSON result is written (default benchmarks/results)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                    help="the driver's log level (default info, as deployed)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds a fresh driver idles before its RSS is read (default 1)")
    ap.add_argument("--drain-timeout", type=float, default=300,
                    help="seconds to wait for the background erases after the load")
    ap.add_argument("--json", action="store_true", help="print the JSON result instead")
    a = ap.parse_args(argv)
    if a.seconds <= 0 or a.clients < 1 or a.kills < 0:
        ap.error("--seconds must be positive, --clients at least 1, --kills at least 0")
    a.size_bytes = parse_quantity(a.size)
    for src in filter(None, (a.driver_src, a.compare)):
        if not (src / "csi_pmem" / "__main__.py").is_file():
            ap.error(f"{src} holds no csi_pmem package (csi_pmem/__main__.py)")
    a.driver_src, a.compare = a.driver_src.resolve(), a.compare and a.compare.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_load.py needs root: it mounts and attaches loop devices")
    a.pool_parent = a.pool_dir or default_pool_dir()
    date = datetime.datetime.now().astimezone()
    sides = []
    with terminate_as_exit():
        if a.compare is not None:
            sides.append(run_side("compare", a.compare, a))
        sides.append(run_side("driver-src", a.driver_src, a))
    report = {
        "benchmark": "bench_load", "date": date.isoformat(timespec="seconds"),
        "commit": git_info(ROOT)["commit"], "host": platform.node(),
        "machine": machine(), "argv": sys.argv[1:] if argv is None else argv,
        "config": {"seconds": a.seconds, "kills": a.kills, "clients": a.clients,
                   "size_bytes": a.size_bytes, "log_level": a.log_level,
                   "pool_dir": a.pool_parent, "pool_fs": fs_type(a.pool_parent)},
        "sides": sides,
        "goals": {s["label"]: goals(s) for s in sides if "rss_after_mib" in s},
    }
    a.results_dir.mkdir(parents=True, exist_ok=True)
    path = a.results_dir / f"bench_load-{date:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    log(f"result written to {path}")
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0 if all(s["ok"] for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
