"""The ``crash`` boot of the VM tier: stages stopped at every step, then a power cut.

Why a script and not a test: this boot never ends by itself. It carves one devdax
namespace per step of the staging commit protocol (the ``weights-*`` fail points in
csi_pmem.failpoints), starts ``csi-pmem-weights stage`` into each with that point set to
``stall``, waits until every one of them has stopped there, starts one more stage of a
larger model without any fail point and lets it run a random moment past its plan,
writes ``crash-plan.json`` (which namespace stopped where, what the outcome must be)
and then ``kill-now`` to the results share. run.sh sees ``kill-now`` and SIGKILLs QEMU:
the machine dies with the stages in flight, and the persistent memory (the NVDIMM
backing files) keeps whatever had reached it. The ``crash-check`` boot
(test_guest_weights.py) boots the same backing files and judges the outcome.

Under TCG the guest has no CPU cache to lose: a store that executed is in the backing
file. What this proves is the protocol's order on the real device (never committed and
wrong, always resumable), not the cache flush itself; persist.py's tests and the
device-dax runs of the workflow cover the primitive.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "e2e" / "vm"))

import weights_guest as wg  # noqa: E402

from csi_pmem import failpoints  # noqa: E402
from csi_pmem.loader import open_volume  # noqa: E402
from csi_pmem.weights import layout  # noqa: E402
from csi_pmem.weights.errors import LoaderError  # noqa: E402

OUT = Path(os.environ.get("E2E_VM_OUT", "/run/vm-out"))
STALL_TIMEOUT = 600.0


def ndctl(*args: str) -> object:
    proc = subprocess.run(["ndctl", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LC_ALL": "C"})
    if proc.returncode != 0:
        sys.exit(f"ndctl {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return json.loads(proc.stdout) if proc.stdout.strip() else None


def small_region() -> str:
    """The 1 GiB NVDIMM's region (the other one is kept for the 1 GiB-align test)."""
    regions = ndctl("list", "-R")
    regions = regions if isinstance(regions, list) else [regions]
    return min(regions, key=lambda r: r["size"])["dev"]


def create(region: str, name: str, size: str) -> str:
    ns = ndctl("create-namespace", "-r", region, "-m", "devdax", "-a", "2M", "-s", size,
               "-n", name)
    return "/dev/" + ns["daxregion"]["devices"][0]["chardev"]


def stage_proc(model: Path, dev: str, point: str | None) -> subprocess.Popen:
    env = wg.env_without_csi()
    if point:
        env["CSI_PMEM_FAILPOINTS"] = f"{point}=stall"
    return subprocess.Popen([sys.executable, "-m", "csi_pmem.loader.cli", "stage",
                             str(model), dev, "--name", "m", "-q"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_stalled(proc: subprocess.Popen, point: str) -> float:
    t0 = time.monotonic()
    buf = ""
    while time.monotonic() - t0 < STALL_TIMEOUT:
        if proc.poll() is not None:
            sys.exit(f"stage with {point}=stall exited {proc.returncode}: "
                     f"{buf}{proc.stderr.read()}")
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            buf += proc.stderr.readline()
            if f"failpoint {point} stalled" in buf:
                return time.monotonic() - t0
    sys.exit(f"stage never reached {point} in {STALL_TIMEOUT:.0f} s: {buf}")


def state_of(dev: str) -> str | None:
    try:
        with open_volume(dev) as v:
            index = layout.read_index(v)
            m = index.find("m") if index else None
            return m.state if m else None
    except LoaderError:
        return None


def main() -> int:
    region = small_region()
    model = wg.make_model(OUT / "model")
    big = wg.make_model(OUT / "model-big", big_mib=48)
    plan: dict[str, dict] = {}
    procs = []
    for point in failpoints.WEIGHTS:
        name = f"crash-{point}"
        dev = create(region, name, "64M")
        proc = stage_proc(model, dev, point)
        procs.append(proc)
        plan[name] = {"point": point, "model": "model", "device_at_crash": dev,
                      "expect": (layout.COMMITTED if point == failpoints.WEIGHTS_AFTER_COMMIT
                                 else layout.STAGING)}
        plan[name]["seconds_to_stall"] = round(wait_stalled(proc, point), 1)
        print(f"crash: {name} on {dev} stalled at {point}", flush=True)
    dev = create(region, "crash-free-running", "128M")
    free = stage_proc(big, dev, None)
    deadline = time.monotonic() + STALL_TIMEOUT
    while state_of(dev) is None and time.monotonic() < deadline and free.poll() is None:
        time.sleep(0.2)
    delay = random.uniform(0.0, 3.0)
    time.sleep(delay)
    plan["crash-free-running"] = {"point": f"none: killed {delay:.2f} s after its plan",
                                  "model": "model-big", "device_at_crash": dev,
                                  "expect": "either", "state_seen": state_of(dev),
                                  "exited_before_kill": free.poll()}
    text = json.dumps({"namespaces": plan}, indent=1) + "\n"
    with open(OUT / "crash-plan.json", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    print(f"crash: plan written, asking the host to kill QEMU\n{text}", flush=True)
    with open(OUT / "kill-now", "w") as f:
        f.write(str(time.time()))
        f.flush()
        os.fsync(f.fileno())
    time.sleep(600)
    return 1  # the host did not kill us


if __name__ == "__main__":
    sys.exit(main())
