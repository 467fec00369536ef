"""What the guest suites of the daxctl back end share: test_guest_dax.py (the hmem
boots) and test_guest_cxl.py (the CXL boots).

Why a module: both run one ``csi_pmem serve --backend ndctl,daxctl`` for the session
with its state dir in the results share, start it first as the firmware left the
memory (``--dax-setup=off``) and then with ``reconfigure``, and check after every test
that nothing is left behind. Only what differs comes from the suite, through its
``dax_suite`` fixture (:class:`Suite`). A suite takes the fixtures by importing them
(``driver_session_fixture``, ``drv_fixture``, ``leak_check``, ``results``; pytest
finds them under their fixture names, ``driver_session`` and ``drv``).

Imported by those suites only, inside the guest (it imports test_guest, which skips
anywhere else); run.sh's guest sees the whole checkout, this file with it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from csi_pmem.csi import csi_pb2
from csi_pmem.daxclient import map_volume
from e2e.vm import test_guest as tg

OUT, BASE, FACTS, CONFIG = tg.OUT, tg.BASE, tg.FACTS, tg.CONFIG
_SESSION: dict[str, Any] = {}


# ------------------------------------------------------------------------- daxctl

def daxctl_list() -> Any:
    out = tg.run(["daxctl", "list", "--regions", "--devices", "--mappings", "--idle"]).stdout
    return json.loads(out) if out.strip() else []


def save_listing(name: str) -> None:
    """Keep what the real daxctl printed (tests/unit/fake_daxctl.py models it)."""
    (OUT / f"daxctl-list-{name}.json").write_text(json.dumps(daxctl_list(), indent=1) + "\n")


# --------------------------------------------------------------------------- driver

class DaxDriver(tg.Driver):
    """``csi_pmem serve --backend ndctl,daxctl`` with its state dir in the results share
    (the node's disk: it outlives the boot)."""

    def __init__(self, base: Path) -> None:
        super().__init__(base)
        self.state = OUT / "state"
        self.setup = "reconfigure"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "csi_pmem", "serve",
                "--endpoint", f"unix://{self.sock}", "--node-id", tg.NODE_ID,
                "--state-dir", str(self.state), "--backend", "ndctl,daxctl",
                "--dax-setup", self.setup,
                "--kubelet-dir", str(self.kubelet), "--metrics-address", tg.METRICS,
                "--erase-wait-seconds", tg.ERASE_WAIT_SECONDS,
                "--log-level", "debug", *self.extra]


def record(drv: DaxDriver, vid: str) -> dict:
    return json.loads((drv.state / "volumes" / f"{vid}.json").read_text())


def volume_condition(drv: DaxDriver, vid: str) -> tuple[bool, str]:
    resp = drv.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=tg.CALL_TIMEOUT)
    for e in resp.entries:
        if e.volume.volume_id == vid:
            c = e.status.volume_condition
            return c.abnormal, c.message
    raise AssertionError(f"ListVolumes does not list {vid}")


@contextlib.contextmanager
def volume(drv: DaxDriver, name: str, size: int, params: dict[str, str],
           op: str = "CreateVolume") -> Iterator[csi_pb2.Volume]:
    vol = tg.create(drv, name, size, params, op=op)
    try:
        yield vol
    finally:
        tg.delete(drv, vol.volume_id)


def write_read(target: str, pattern: bytes) -> list[int]:
    """Write ``pattern`` at the start, middle and end of the volume through dax.sock and
    read it back through a second mapping; returns the offsets."""
    md, m = map_volume(target)
    try:
        usable = md["usable_size"]
        offsets = [0, usable // 2, usable - len(pattern)]
        for off in offsets:
            m[off:off + len(pattern)] = pattern
    finally:
        m.close()
    _, again = map_volume(target, writable=False)
    try:
        for off in offsets:
            assert again[off:off + len(pattern)] == pattern, f"offset {off} reads otherwise"
    finally:
        again.close()
    return offsets


# ------------------------------------------------------------------------- fixtures

@dataclass(frozen=True)
class Suite:
    """What a suite's ``dax_suite`` fixture tells the shared fixtures."""

    driver: type[DaxDriver]
    first_boot: str  # the configuration whose driver starts with --dax-setup=off
    leaks: Callable[[], list[str]]  # the suite's own leak problems (its dax devices...)
    scrub_at_start: bool = False  # record the first start's scrub time in facts.json


@pytest.fixture(scope="session", name="driver_session")
def driver_session_fixture(boot_state: dict[str, Any], dax_suite: Suite) -> Iterator[DaxDriver]:
    """The session's driver: in the suite's first boot it first sees the memory as the
    firmware left it (setup off); in the boot after the reboot, reconfigure from the
    start. The boot state is read before it starts."""
    if BASE.exists():
        shutil.rmtree(BASE)
    BASE.mkdir(parents=True)
    d = dax_suite.driver(BASE)
    d.setup = "off" if CONFIG == dax_suite.first_boot else "reconfigure"
    _SESSION["driver"] = d
    FACTS["driver_start_seconds"] = round(d.start(), 2)
    if dax_suite.scrub_at_start:
        FACTS["first_start_scrub_seconds"] = round(tg.wait_erase_idle(), 2)
    yield d
    d.stop()


@pytest.fixture(name="drv")
def drv_fixture(driver_session: DaxDriver) -> DaxDriver:
    """The session's driver, running with --dax-setup=reconfigure and no fail points."""
    d = driver_session
    if d.running and (d.failpoints or d.extra or d.setup != "reconfigure"):
        d.stop()
    d.extra, d.setup = [], "reconfigure"
    if not d.running:
        FACTS.setdefault("driver_restart_seconds", []).append(round(d.start(), 2))
    return d


@pytest.fixture(scope="session", autouse=True)
def results() -> Iterator[None]:
    yield
    tg._write_results()


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest, boot_state: dict[str, Any],
               dax_suite: Suite) -> Iterator[None]:
    """After every test: no dax device, namespace (but those at boot), record or mount
    left behind."""
    yield
    if request.node.get_closest_marker("no_leak_check"):
        return
    d = _SESSION.get("driver")
    if d is not None and d.running and not d.failpoints:
        tg.wait_erase_idle()
    problems = dax_suite.leaks()
    left = [ns.get("dev") for ns in tg.all_namespaces()
            if ns.get("dev") not in boot_state.get("namespaces", [])]
    if left:
        problems.append(f"namespaces left: {left}")
    records = sorted(p.name for p in (OUT / "state" / "volumes").glob("*.json"))
    if records:
        problems.append(f"state records left: {records}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if f" {BASE}/kubelet/" in line]
    if mounts:
        problems.append(f"mounts left under the kubelet dir: {mounts}")
    if problems:
        pytest.fail("leak check: " + "\n".join(problems), pytrace=False)
