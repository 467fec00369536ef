#!/usr/bin/env python3
"""CreateVolume/DeleteVolume of csi-pmem next to intel/pmem-csi v1.1.0, in one guest boot.

Why (issue 17): the issue was filed after this comparison showed csi-pmem 3.4x slower
in CreateVolume and 5.6x in DeleteVolume (64 MiB, erase on), both growing with the
volume; "erase once" was to close that gap. Only a run on the same kernel, the same
emulated NVDIMMs and the same ndctl in one boot gives ratios that mean something (QEMU
under TCG makes absolute times meaningless), so this runs inside the VM tier's guest:

    e2e/vm/run.sh --config main --cmd '.venv/bin/python benchmarks/bench_vs_pmem_csi.py \
        --pmem-csi build/pmem-csi/pmem-csi-driver'

Each driver gets the NVDIMMs to itself in turn (pmem-csi first, direct mode; then
``csi-pmem serve --backend ndctl``, after its first-start scrub). For each: the time
from exec to a ready Probe, then ``--pairs`` CreateVolume/DeleteVolume pairs of
``--size`` (mount capability, no parameters: both erase on delete by default) after
one warm-up pair, client-side wall time, each pair followed by GetCapacity polls until
the space is back (csi-pmem's DeleteVolume returns once its erase is done or after
``--delete-wait-seconds``, and destroys the namespace in the background). Prints a
table and writes ``vs-pmem-csi.json`` to ``$E2E_VM_OUT``. A benchmark, not a test: it
is not part of any make target.

Building pmem-csi v1.1.0 (its module is on the Go module proxy; Go 1.23, since newer
Go refuses its cgo aliases; cgo needs libndctl-dev and libdaxctl-dev; its go.mod has
replace directives, so ``go install module@version`` refuses it)::

    GOTOOLCHAIN=go1.23.12 go mod download -json github.com/intel/pmem-csi@v1.1.0
    cp -r <Dir> src && cd src && GOTOOLCHAIN=go1.23.12 go build \
        -o <repo>/build/pmem-csi/pmem-csi-driver ./cmd/pmem-csi-driver

(the guest sees the host's files except under /tmp, so the binary lives in build/).
pmem-csi's start-up check wants sysfs mounted at /sys with the source name ``sysfs``,
which the guest's init does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from csi_pmem.csi import csi_pb2, csi_pb2_grpc  # noqa: E402
from csi_pmem.sizes import format_bytes, parse_quantity  # noqa: E402

WORK = Path("/run/bench-vs-pmem-csi")


def mount_cap() -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


class Plugin:
    """One CSI driver process on a unix socket under WORK."""

    def __init__(self, name: str, argv: list[str], sock: Path) -> None:
        self.name, self.argv, self.sock = name, argv, sock
        self.log = WORK / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> float:
        t0 = time.perf_counter()
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=ROOT)
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        identity = csi_pb2_grpc.IdentityStub(self.channel)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                resp = identity.Probe(csi_pb2.ProbeRequest(), timeout=5)
                if not resp.HasField("ready") or resp.ready.value:  # unset means ready
                    break
            except grpc.RpcError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s")
            time.sleep(0.05)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.channel.close()

    def capacity(self) -> int:
        return self.controller.GetCapacity(csi_pb2.GetCapacityRequest(
            volume_capabilities=[mount_cap()]), timeout=600).available_capacity

    def pairs(self, size: int, n: int, params: dict[str, str]) -> dict:
        """CreateVolume, DeleteVolume, then GetCapacity until the space is back (csi-pmem
        erases and destroys in the background after DeleteVolume returns, and the next
        create would otherwise wait for that destroy's node lock)."""
        create, delete, back = [], [], []
        full = self.capacity()
        for i in range(n + 1):  # the first pair warms up
            t0 = time.perf_counter()
            vol = self.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
                name=f"bench-vs-{self.name}-{i}",
                capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[mount_cap()], parameters=params), timeout=600).volume
            t1 = time.perf_counter()
            self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(
                volume_id=vol.volume_id), timeout=600)
            t2 = time.perf_counter()
            while self.capacity() < full:
                time.sleep(0.05)
            t3 = time.perf_counter()
            if i:
                create.append(t1 - t0)
                delete.append(t2 - t1)
                back.append(t3 - t1)
        return {"create_ms": [round(x * 1000, 1) for x in create],
                "delete_ms": [round(x * 1000, 1) for x in delete],
                "space_back_ms": [round(x * 1000, 1) for x in back],
                "create_p50_ms": statistics.median(create) * 1000,
                "delete_p50_ms": statistics.median(delete) * 1000,
                "space_back_p50_ms": statistics.median(back) * 1000,
                "capacity_bytes": vol.capacity_bytes}


def wait_clean(state: Path, timeout: float = 900) -> float:
    """csi-pmem's first-start scrub: every region record clean."""
    t0 = time.perf_counter()
    while True:
        recs = [json.loads(p.read_text()) for p in (state / "regions").glob("*.json")]
        if recs and all(r["clean"] and not r["scrub"] for r in recs):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError("csi-pmem's first-start scrub did not finish")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pmem-csi", required=True, type=Path, help="pmem-csi-driver binary")
    p.add_argument("--size", default="64Mi")
    p.add_argument("--pairs", type=int, default=10)
    a = p.parse_args(argv)
    size = parse_quantity(a.size)
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    results: dict = {"size": a.size, "pairs": a.pairs,
                     "note": "guest wall time under QEMU TCG: only the ratios mean something",
                     "ndctl": subprocess.run(["ndctl", "--version"], capture_output=True,
                                             text=True).stdout.strip(),
                     "kernel": os.uname().release}

    pmem_csi = Plugin("pmem-csi", [str(a.pmem_csi.resolve()), "-mode=node",
                                   "-deviceManager=direct", "-nodeid=vm",
                                   f"-endpoint=unix://{WORK}/pmem-csi.sock",
                                   f"-statePath={WORK}/pmem-csi-state", "-v=3"],
                      WORK / "pmem-csi.sock")
    started = pmem_csi.start()
    try:
        results["pmem-csi"] = {"startup_s": started, **pmem_csi.pairs(size, a.pairs, {})}
    finally:
        pmem_csi.stop()

    state = WORK / "csi-pmem-state"
    csi_pmem = Plugin("csi-pmem", [sys.executable, "-m", "csi_pmem", "serve",
                                   "--backend", "ndctl", "--node-id", "vm",
                                   "--endpoint", f"unix://{WORK}/csi-pmem.sock",
                                   "--state-dir", str(state),
                                   "--kubelet-dir", str(WORK / "kubelet")],
                      WORK / "csi-pmem.sock")
    (WORK / "kubelet").mkdir()
    started = csi_pmem.start()
    try:
        scrub = wait_clean(state)
        results["csi-pmem"] = {"startup_s": started, "first_start_scrub_s": scrub,
                               **csi_pmem.pairs(size, a.pairs, {})}
    finally:
        csi_pmem.stop()

    ours, theirs = results["csi-pmem"], results["pmem-csi"]
    print(f"CreateVolume/DeleteVolume, {format_bytes(size)}, {a.pairs} pairs, one guest boot "
          f"(TCG: ratios only), {results['kernel']}, ndctl {results['ndctl']}")
    print(f"{'op (median)':<24} {'pmem-csi':>10} {'csi-pmem':>10} {'ratio':>7}")
    for label, key, unit in (("CreateVolume", "create_p50_ms", "ms"),
                             ("DeleteVolume (erase on)", "delete_p50_ms", "ms"),
                             ("Delete to space back", "space_back_p50_ms", "ms"),
                             ("start-up to ready Probe", "startup_s", "s")):
        print(f"{label:<24} {theirs[key]:>8.0f}{unit:>2} {ours[key]:>8.0f}{unit:>2} "
              f"{ours[key] / theirs[key]:>6.2f}x")
    print(f"capacity_bytes for {a.size}: pmem-csi {theirs['capacity_bytes']}, csi-pmem "
          f"{ours['capacity_bytes']}; csi-pmem's first-start scrub took "
          f"{ours['first_start_scrub_s']:.1f} s")
    out = Path(os.environ.get("E2E_VM_OUT", WORK))
    (out / "vs-pmem-csi.json").write_text(json.dumps(results, indent=1) + "\n")
    for plugin in (pmem_csi, csi_pmem):
        shutil.copy(plugin.log, out / plugin.log.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
