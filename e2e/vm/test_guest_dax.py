"""The VM tier's hmem boots: the daxctl back end against the real kernel and daxctl.

Runs inside the guests that e2e/vm/run.sh boots as ``hmem`` and ``hmem-reboot``: Debian's
6.1 kernel with ``memmap=512M%1G-1+0xefffffff``, which makes guest RAM 1G-1.5G a
soft-reserved range; ``dax_hmem`` turns it into a dax region whose boot-time device
``dax0.0`` holds all of it (devdax on 6.1). The emulated NVDIMMs of the main
configuration are there too, so one driver (``--backend ndctl,daxctl``) serves a
persistent and a volatile kind of pool on one node, and their timings compare in one
boot.

Why a suite of its own: everything the daxctl back end does was only unit-tested against
a model of daxctl (tests/unit/fake_daxctl.py). Here the kernel decides device numbers,
ranges, what ``daxctl list`` prints and what a reboot leaves in memory.

``hmem``: the firmware state the driver reports before it may touch the region, then
(``--dax-setup=reconfigure``) csi-sanity on the devdax-volatile class, the core workflow
(create, publish, map through dax.sock, write and read, read-only, erase before reuse,
delete), the weights workflow, CreateVolume/DeleteVolume medians next to ndctl's on the
NVDIMM; last, it leaves one published volume with a staged model and writes
``reboot-plan.json``. The driver's state dir lies in the results share, which is the
node's disk: run.sh hands it to the next boot.

``hmem-reboot``: the same machine again. Node 0's RAM is a file on the host, so the
soft-reserved memory still holds the old volume's bytes, as DRAM may after a warm
reboot and CXL memory after a host restart; the dax devices themselves are gone. The
driver must carve the volume again under its id, zero it before anyone maps it, say so
in its log, metric and the volume's condition, and the staging sidecar stages again.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

CONFIG = os.environ.get("E2E_VM_CONFIG", "")
if not CONFIG or "csi_pmem.vm=1" not in Path("/proc/cmdline").read_text().split():
    pytest.skip("runs inside the QEMU guest only: make e2e-vm", allow_module_level=True)

from csi_pmem.csi import csi_pb2  # noqa: E402
from csi_pmem.daxclient import DaxSocketError, map_volume, open_volume  # noqa: E402
from csi_pmem.driver.backends.daxctl_listing import (  # noqa: E402
    DaxRegion,
    is_dynamic,
    parse_regions,
)
from csi_pmem.loader import load_numpy  # noqa: E402
from csi_pmem.sizes import MiB  # noqa: E402
from csi_pmem.weights.errors import LoaderError  # noqa: E402
from e2e.vm import dax_guest as dg  # noqa: E402
from e2e.vm import test_guest as tg  # noqa: E402
from e2e.vm import weights_guest as wg  # noqa: E402
from e2e.vm.dax_guest import (  # noqa: E402
    DaxDriver,
    daxctl_list,
    driver_session_fixture,  # noqa: F401 (a fixture: dax_guest.py)
    drv_fixture,  # noqa: F401 (a fixture)
    leak_check,  # noqa: F401 (an autouse fixture)
    record,
    results,  # noqa: F401 (an autouse fixture)
    save_listing,
    volume,
    volume_condition,
    write_read,
)
from tests.test_csi_sanity import FLAVOURS  # noqa: E402

pytestmark = pytest.mark.vmconfig("hmem")

OUT = tg.OUT
BASE = tg.BASE
FACTS = tg.FACTS
PLAN_FILE = OUT / "reboot-plan.json"
SANITY_FLAVOUR = "devdax-volatile.yaml"
VOLATILE = {"media": "volatile"}
PERSISTENT = {"media": "persistent"}
HMEM_SIZE = 512 * MiB  # run.sh's memmap
WORK = Path("/tmp/e2e-dax")


# ------------------------------------------------------------------------- daxctl

def hmem_region() -> DaxRegion:
    found = [r for r in parse_regions(daxctl_list()) if "hmem" in r.path]
    assert len(found) == 1, f"expected one hmem dax region: {daxctl_list()}"
    return found[0]


def raw_device(chardev: str) -> dict:
    """The device as ``daxctl list -D -M`` prints it (its mappings with page_offset)."""
    for region in tg._as_list(daxctl_list()):
        for dev in region.get("devices") or []:
            if dev.get("chardev") == chardev:
                return dict(dev)
    raise AssertionError(f"daxctl lists no {chardev}: {daxctl_list()}")


def physical(chardev: str, offset: int) -> int:
    """The physical address of byte ``offset`` of a dax device (its mappings)."""
    for m in raw_device(chardev).get("mappings") or []:
        start = m["page_offset"] * 4096
        if start <= offset < start + m["size"]:
            return m["start"] + offset - start
    raise AssertionError(f"offset {offset} is in no mapping of {chardev}")


def ranges(chardev: str) -> list[tuple[int, int]]:
    return [(m["start"], m["end"]) for m in raw_device(chardev).get("mappings") or []]


def overlaps(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(s1 <= e2 and s2 <= e1 for s1, e1 in a for s2, e2 in b)


def own_devices() -> list[str]:
    """Sized devices in the hmem region other than the kernel's daxN.0: the volumes."""
    return [d.chardev for d in hmem_region().sized() if d.instance != 0]


# ------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def boot_state() -> dict[str, Any]:
    raw = daxctl_list()
    (OUT / "daxctl-list-boot.json").write_text(json.dumps(raw, indent=1) + "\n")
    iomem = [line.strip() for line in Path("/proc/iomem").read_text().splitlines()
             if "Soft Reserved" in line or "dax" in line.lower() or "hmem" in line]
    state = {"daxctl_list": raw, "iomem": iomem,
             "ndctl_regions": [{k: r.get(k) for k in ("dev", "size", "numa_node")}
                               for r in tg.regions()],
             "namespaces": [ns.get("dev") for ns in tg.all_namespaces()],
             "kernel": os.uname().release,
             "daxctl": tg.run(["daxctl", "--version"]).stdout.strip(),
             "ndctl": tg.run(["ndctl", "--version"]).stdout.strip()}
    FACTS["boot"] = state
    return state


def leaks() -> list[str]:
    """This suite's part of the leak check: dax devices in the hmem region, and the
    daxctl back end's device records."""
    problems = []
    if own_devices():
        problems.append(f"dax devices left in the hmem region: {own_devices()}")
    devices = OUT / "state" / "daxctl-devices.json"
    if devices.exists() and json.loads(devices.read_text()).get("devices"):
        problems.append(f"daxctl device records left: {devices.read_text()}")
    return problems


@pytest.fixture(scope="session")
def dax_suite() -> dg.Suite:
    """hmem: the first start sees the region as the firmware left it (setup off); the
    shared fixtures (dax_guest.py) run the driver and the leak check."""
    return dg.Suite(DaxDriver, first_boot="hmem", leaks=leaks, scrub_at_start=True)


def all_zero(target: str) -> bool:
    md, m = map_volume(target, writable=False)
    try:
        return m[:].count(0) == md["usable_size"]
    finally:
        m.close()


# ==================================================================== hmem boot

def test_hmem_region_is_devdax_at_boot(boot_state: dict[str, Any]) -> None:
    """The premise: memmap made a soft-reserved range, dax_hmem a dynamic region whose
    boot-time device holds all of it in devdax mode (6.1), and daxctl's JSON is what
    the back end parses."""
    assert any("Soft Reserved" in line for line in boot_state["iomem"]), boot_state["iomem"]
    region = hmem_region()
    assert region.size == HMEM_SIZE, region
    assert is_dynamic(region, "/sys"), f"{region.path} has no dax_region/create"
    boot = [d for d in region.sized() if d.instance == 0]
    assert boot and boot[0].mode == "devdax" and boot[0].size == HMEM_SIZE, region
    assert region.available == 0, region
    static = [r for r in parse_regions(boot_state["daxctl_list"]) if "/ndbus" in r.path]
    FACTS["hmem_region"] = {"path": region.path, "id": region.id, "size": region.size,
                            "align": region.align, "target_node": region.target_node(),
                            "boot_device": boot[0].chardev,
                            "static_pmem_regions_listed": len(static)}


def test_boot_device_is_reported_without_setup(driver_session: DaxDriver) -> None:
    """--dax-setup=off: the region is held whole by dax0.0, which the driver must not
    touch; the pool is unusable with reason foreign_device in the metric, a create
    asking for volatile memory says how to fix it, and ndctl's pools serve on."""
    d = driver_session
    assert d.setup == "off" and d.running
    region = hmem_region()
    text = tg.metrics_text()
    usable = tg.metric_value(text, "csi_pmem_pool_usable", pool=region.name,
                             reason="foreign_device")
    assert usable == 0, [line for line in text.splitlines() if "pool_usable" in line]
    assert tg.metric_value(text, "csi_pmem_pool_volatile", pool=region.name) == 1
    err = tg.rpc_error(lambda: tg.create(d, tg.unique("nosetup"), 64 * MiB, VOLATILE))
    FACTS["no_setup_create"] = f"{err.code().name}: {err.details()}"
    assert err.code() in (tg.Code.RESOURCE_EXHAUSTED, tg.Code.UNAVAILABLE), err
    assert "held whole by" in err.details() and "reconfigure-device -s 0" in err.details(), \
        err.details()
    probe = d.identity.Probe(csi_pb2.ProbeRequest(), timeout=60)
    assert probe.ready.value is True  # the NVDIMM pools serve
    with volume(d, tg.unique("nvd"), 64 * MiB, PERSISTENT) as vol:
        assert record(d, vol.volume_id)["pool"].startswith("region")
    assert hmem_region().sized()[0].size == HMEM_SIZE, "the driver touched dax0.0"


def test_setup_gives_the_region_back(drv: DaxDriver) -> None:
    """--dax-setup=reconfigure: dax0.0 shrunk to 0 at start, the pool usable, on the
    region's target node, with all of the region free."""
    tg.wait_erase_idle()  # the region is first seen: its scrub holds it a moment
    save_listing("after-setup")
    region = hmem_region()
    assert [d for d in region.sized()] == [], region
    assert region.available == HMEM_SIZE
    assert re.search(rf"dax set-up: {region.name}\.0 .* given back to device-dax",
                     drv.log_text()), drv.log_tail()
    free, biggest = tg.capacity(drv, VOLATILE)
    assert free == HMEM_SIZE and biggest == HMEM_SIZE, (free, biggest)
    text = tg.metrics_text()
    assert tg.metric_value(text, "csi_pmem_pool_usable", pool=region.name, reason="ok") == 1
    FACTS["dax_pool"] = {"pool": region.name, "capacity": free, "maximum_volume_size": biggest}


@pytest.mark.timeout(900)
def test_csi_sanity_devdax_volatile(drv: DaxDriver) -> None:
    binary = tg._sanity_binary()
    res, text = tg.run_sanity(drv, binary, SANITY_FLAVOUR, FLAVOURS[SANITY_FLAVOUR],
                              timeout=840)
    assert not res.failed, text
    assert res.passed, text


def test_core_workflow_on_the_dax_pool(drv: DaxDriver) -> None:
    """Create (a daxctl device of the size asked, in the hmem region, on its node),
    publish, map through dax.sock, write and read, a read-only publication, then erase
    before reuse: a new volume over the deleted one's memory reads zeros. Delete."""
    size, pattern = 64 * MiB, secrets.token_bytes(4096)
    region = hmem_region()
    fact: dict[str, Any] = {}
    vol = tg.create(drv, tg.unique("core"), size, VOLATILE)
    try:
        rec = record(drv, vol.volume_id)
        chardev = os.path.basename(rec["device"])
        dev = next(d for d in hmem_region().devices if d.chardev == chardev)
        assert rec["pool"] == region.name and dev.size == size and dev.mode == "devdax"
        assert rec["usable_size"] == size, rec  # struct pages in system RAM
        assert rec["numa_node"] == region.target_node(), rec
        assert os.path.exists(rec["device"]), rec
        first = ranges(chardev)
        save_listing("with-a-volume")
        fact.update(device=chardev, ranges=[[hex(s), hex(e)] for s, e in first],
                    numa_node=rec["numa_node"])
        target = drv.target("core-rw")
        with tg.published(drv, vol.volume_id, target):
            offsets = write_read(target, pattern)
            md, fd = open_volume(os.path.join(target, "dax.sock"))
            try:
                assert os.path.realpath(f"/proc/self/fd/{fd}") == rec["device"]
                assert md["usable_size"] == size
            finally:
                os.close(fd)
            ro = drv.target("core-ro")
            with tg.published(drv, vol.volume_id, ro, readonly=True):
                md, m = map_volume(ro)
                try:
                    assert md["readonly"] is True
                    assert all(m[o:o + len(pattern)] == pattern for o in offsets)
                finally:
                    m.close()
                with pytest.raises(DaxSocketError, match="read-only"):
                    map_volume(ro, writable=True)
                _, fd = open_volume(ro)
                try:
                    with pytest.raises(PermissionError):
                        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
    finally:
        tg.delete(drv, vol.volume_id, op="DeleteVolume (erase)")
    assert own_devices() == [], "DeleteVolume left its dax device"
    with volume(drv, tg.unique("reuse"), size, VOLATILE) as vol2:
        chardev2 = os.path.basename(record(drv, vol2.volume_id)["device"])
        fact["reuse_device"] = chardev2
        fact["reuse_same_memory"] = overlaps(first, ranges(chardev2))
        assert fact["reuse_same_memory"], "the new device does not cover the old memory"
        target = drv.target("core-reuse")
        with tg.published(drv, vol2.volume_id, target):
            md, m = map_volume(target, writable=False)
            try:
                for off in offsets:
                    assert m[off:off + len(pattern)] == bytes(len(pattern)), \
                        f"the deleted volume's bytes are visible at offset {off}"
                assert m[:].count(0) == md["usable_size"], "non-zero bytes in a new volume"
            finally:
                m.close()
    FACTS["core_workflow"] = fact


def test_fsdax_on_the_dax_pool_is_refused(drv: DaxDriver) -> None:
    err = tg.rpc_error(lambda: tg.create(drv, tg.unique("fsdax"), 64 * MiB,
                                         {"deviceMode": "fsdax", "media": "volatile"}))
    FACTS["fsdax_refused"] = f"{err.code().name}: {err.details()}"
    assert "devdax" in err.details(), err.details()


CAPACITY_RACE_STARTS = ("", "", "scrub-after-create=sleep:1")


def _start_log(drv: DaxDriver) -> str:
    """The driver log of its latest start (after tg.Driver.start's marker line)."""
    return drv.log_text().rsplit(f"===== e2e: driver start #{drv.starts} ", 1)[-1]


def _scrub_queued() -> float | None:
    """csi_pmem_erase_queue_length{kind="scrub"} now; None while metrics do not serve."""
    try:
        return tg.metric_value(tg.metrics_text(), "csi_pmem_erase_queue_length", kind="scrub")
    except OSError:
        return None


def _capacity_until_idle(drv: DaxDriver, params: dict[str, str]) -> list[int]:
    """GetCapacity back to back until the erase queue is empty: the scrub the create
    queued again carves and destroys its scratch device meanwhile, the moments at
    which a listing and the held space could disagree. Not kept in latency.json."""
    req = csi_pb2.GetCapacityRequest(parameters=params, volume_capabilities=[tg.mount_cap()])
    got: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got.append(tg.timed("GetCapacity", drv.controller.GetCapacity, req,
                            record=False).available_capacity)
        text = tg.metrics_text()
        if not sum(tg.metric_value(text, "csi_pmem_erase_queue_length", kind=k) or 0
                   for k in ("delete", "scrub")):
            break
    return got


def test_capacity_right_after_start_during_the_scrub(drv: DaxDriver) -> None:
    """Issue 45 item 6 in the guest: right after a start whose start-up scrub is still
    running, GetCapacity for the pool's numaNode, CreateVolume 64 MiB there, the same
    create again (idempotent), the same name at 512 MiB (ALREADY_EXISTS), GetCapacity
    again. The second reading is at most the first minus 64 MiB, and never above the
    region's free space as daxctl lists it once the scrubs are done (the volume still
    there); so is every GetCapacity taken back to back after it until the erase queue is
    empty (the scrub the create queued again carves and destroys meanwhile). Three
    starts in this boot, each made to scrub dax0 at start by deleting its
    region record while the driver is stopped (cleanspace.py's documented way: first
    seen again, dirty); the third holds each scrub 1 s with its scratch devices carved
    (fail point ``scrub-after-create=sleep:1``), so that at least that start's first
    reading is certainly taken during the scrub. Whether each first reading was taken
    while the scrub was still running (that start's log says dax0 was first seen and,
    read after the call, not yet that it is clean; the erase queue's scrub metric just
    after) is recorded in facts.json."""
    region = hmem_region()
    pool, node = region.name, str(region.target_node() or 0)
    params = VOLATILE | {"numaNode": node}
    size = 64 * MiB
    readings: list[dict[str, Any]] = []
    try:
        for i, failpoints in enumerate(CAPACITY_RACE_STARTS):
            drv.stop()
            drv.state.joinpath("regions", f"{pool}.json").unlink(missing_ok=True)
            drv.start(failpoints=failpoints)
            first, _ = tg.capacity(drv, params)
            # The scrub is queued at start-up (reconcile), before the driver serves, and
            # logs "is clean" when it ends: not logged yet, it ran during the reading.
            log = _start_log(drv)
            scrubbing = (f"region {pool}: first seen by the driver" in log
                         and f"region {pool} is clean" not in log)
            queued = _scrub_queued()
            name = tg.unique(f"race{i}")
            vol = tg.create(drv, name, size, params)
            try:
                again = tg.create(drv, name, size, params)
                assert again.volume_id == vol.volume_id, (vol, again)
                err = tg.rpc_error(lambda n=name: tg.create(drv, n, 512 * MiB, params))
                assert err.code() == tg.Code.ALREADY_EXISTS, err
                second, _ = tg.capacity(drv, params)
                polled = _capacity_until_idle(drv, params)
                tg.wait_erase_idle()
                free = hmem_region().available  # no scratch device left: the real free
                settled, _ = tg.capacity(drv, params)
            finally:
                tg.delete(drv, vol.volume_id)
            tg.wait_erase_idle()
            readings.append({"start": drv.starts, "failpoints": failpoints or "-",
                             "scrub_queued_after_first": queued,
                             "scrub_running_at_first": scrubbing,
                             "first": first, "second": second, "settled": settled,
                             "region_free_with_volume": free,
                             "dropped_by": first - second,
                             "polled_until_idle": len(polled),
                             "polled_max": max(polled, default=None)})
            FACTS["capacity_during_start_scrub"] = readings
            print(json.dumps(readings[-1]))
            assert first <= HMEM_SIZE, readings[-1]
            assert second <= first - size, f"not dropped by 64 MiB: {readings[-1]}"
            assert second <= free, f"above the region's free space: {readings[-1]}"
            assert all(p <= min(first - size, free) for p in polled), \
                f"a reading during the scrub over-reported: {polled} {readings[-1]}"
            assert settled == free == HMEM_SIZE - size, readings[-1]
        assert readings[-1]["scrub_running_at_first"], \
            f"the scrub held by the fail point was not running at the first reading: {readings}"
    finally:
        if drv.running and drv.failpoints:
            tg.wait_erase_idle()
            drv.stop()  # the next test's drv fixture starts it without fail points


def test_create_and_delete_medians_next_to_ndctl(drv: DaxDriver) -> None:
    """Five CreateVolume and DeleteVolume of 64 MiB on each kind, in this boot: the
    daxctl device on soft-reserved memory and the ndctl namespace on the NVDIMM of the
    same NUMA node (client-side wall time; under TCG only the ratio means anything).
    Five samples of each, each positive, together within the loop's wall time."""
    import statistics

    node = str(hmem_region().target_node() or 0)
    kinds = {"daxctl": VOLATILE | {"numaNode": node},
             "ndctl": {"media": "persistent", "numaNode": node}}
    out: dict[str, dict[str, float]] = {}
    calls = ("CreateVolume", "DeleteVolume")
    with tg.new_samples({f"{op} 64Mi {kind}": 5 for op in calls for kind in kinds}) as got:
        for i in range(5):
            for kind, params in kinds.items():  # interleaved: the host's load hits both
                vol = tg.create(drv, tg.unique(f"t{kind}{i}"), 64 * MiB, params,
                                op=f"CreateVolume 64Mi {kind}")
                tg.delete(drv, vol.volume_id, op=f"DeleteVolume 64Mi {kind}")
                tg.wait_erase_idle()
    for kind in kinds:
        out[kind] = {op: round(statistics.median(got[f"{op} 64Mi {kind}"]), 3)
                     for op in calls}
    out["ratio daxctl/ndctl"] = {op: round(out["daxctl"][op] / out["ndctl"][op], 2)
                                 for op in ("CreateVolume", "DeleteVolume")}
    FACTS["create_delete_medians"] = out
    print(json.dumps(out, indent=1))


def test_weights_on_the_dax_pool(drv: DaxDriver) -> None:
    """csi-pmem-weights on a published daxctl volume: stage, verify, ls, export, CPU load
    bit-exact, restage without copying, a flipped byte repaired; the sidecar's first
    start and warm restart; a read-only publication loads."""
    WORK.mkdir(parents=True, exist_ok=True)
    model = wg.make_model(WORK / "model")
    with volume(drv, tg.unique("w"), 64 * MiB, VOLATILE) as vol, \
            tg.published(drv, vol.volume_id, drv.target("weights-rw")) as target:
        fact = wg.workflow(target, model, WORK)
        fact["sidecar"] = wg.sidecar_first_and_warm(target, model)
        with tg.published(drv, vol.volume_id, drv.target("weights-ro"), readonly=True) as ro:
            wg.assert_loads_bit_exact(ro, model, "m")
    FACTS.setdefault("weights", {})["daxctl devdax on soft-reserved memory"] = fact


@pytest.mark.no_leak_check
def test_leave_a_staged_volume_for_the_reboot(drv: DaxDriver) -> None:
    """Last in this boot: a published volume with a model the sidecar staged and a
    marker at its end, left as they are when the machine goes down."""
    model = wg.make_model(OUT / "model")
    vol = tg.create(drv, tg.unique("reboot"), 64 * MiB, VOLATILE)
    rec = record(drv, vol.volume_id)
    target = drv.target("reboot-pod")
    tg.publish(drv, vol.volume_id, target)
    first = wg.sidecar_once(target, model, "m")
    assert first["action"] == "staged", first
    assert wg.verified(target, "m")
    marker = secrets.token_bytes(4096)
    md, m = map_volume(target)
    try:
        offset = md["usable_size"] - len(marker)
        m[offset:offset + len(marker)] = marker
    finally:
        m.close()
    chardev = os.path.basename(rec["device"])
    plan = {"volume_id": vol.volume_id, "name": rec["name"], "size": rec["size"],
            "pool": rec["pool"], "device": rec["device"], "target": target,
            "ranges": ranges(chardev), "marker": marker.hex(), "marker_offset": offset,
            "marker_physical": physical(chardev, offset), "model": "m",
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}
    PLAN_FILE.write_text(json.dumps(plan, indent=1) + "\n")
    FACTS["reboot_plan"] = plan


# ============================================================= hmem-reboot boot

def _plan() -> dict[str, Any]:
    assert PLAN_FILE.exists(), "the hmem boot left no reboot-plan.json (did it fail?)"
    return json.loads(PLAN_FILE.read_text())


@pytest.mark.vmconfig("hmem-reboot")
@pytest.mark.no_leak_check
def test_reboot_left_the_old_bytes_in_memory() -> None:
    """Before the driver starts: the kernel's dax0.0 holds the whole region again, and
    the memory under it still holds the volume's marker. The hazard is real: a device
    carved there without zeroing would hand out another tenant's bytes."""
    plan = _plan()
    assert Path("/proc/sys/kernel/random/boot_id").read_text().strip() != plan["boot_id"]
    region = hmem_region()
    sized = region.sized()
    assert [(d.instance, d.size) for d in sized] == [(0, HMEM_SIZE)], region
    dev = sized[0].chardev
    offset = plan["marker_physical"] - ranges(dev)[0][0]
    window = offset - offset % (2 * MiB)
    fd = os.open(f"/dev/{dev}", os.O_RDONLY)
    try:
        with mmap.mmap(fd, 2 * MiB, mmap.MAP_SHARED, mmap.PROT_READ, offset=window) as m:
            at = offset - window
            seen = m[at:at + 4096]
    finally:
        os.close(fd)
    FACTS["old_bytes_survived_reboot"] = seen == bytes.fromhex(plan["marker"])
    assert FACTS["old_bytes_survived_reboot"], "the marker did not survive the reboot"


@pytest.mark.vmconfig("hmem-reboot")
@pytest.mark.no_leak_check
def test_volatile_volume_comes_back_zeroed_under_its_id(drv: DaxDriver) -> None:
    plan = _plan()
    vid = plan["volume_id"]
    log = drv.log_text()
    lost = [line for line in log.splitlines() if "contents lost at a node restart" in line]
    dropped = [line for line in log.splitlines() if "lost its mount (node reboot?)" in line]
    FACTS["reboot_log"] = lost + dropped
    assert len(lost) == 1 and vid in lost[0] and "zeroed" in lost[0], drv.log_tail()
    assert dropped and plan["target"] in dropped[0], drv.log_tail()
    rec = record(drv, vid)
    assert rec["contents_lost_at"] > 0 and not rec["recreating"], rec
    assert rec["pool"] == plan["pool"] and rec["size"] == plan["size"], rec
    abnormal, message = volume_condition(drv, vid)
    FACTS["reboot_condition"] = {"abnormal": abnormal, "message": message}
    assert not abnormal and "contents were lost at a node restart" in message, message
    text = tg.metrics_text()
    assert tg.metric_value(text, "csi_pmem_volumes_recreated_total", pool=plan["pool"]) == 1
    chardev = os.path.basename(rec["device"])
    FACTS["reboot_same_memory"] = overlaps([tuple(r) for r in plan["ranges"]], ranges(chardev))
    tg.publish(drv, vid, plan["target"])  # what kubelet does after the reboot
    md, m = map_volume(plan["target"], writable=False)
    try:
        off = plan["marker_offset"]
        assert m[off:off + 4096] == bytes(4096), "the old marker is visible"
        assert m[:].count(0) == md["usable_size"], "non-zero bytes in the recreated volume"
    finally:
        m.close()
    FACTS["reboot_zeroed"] = True


@pytest.mark.vmconfig("hmem-reboot")
def test_sidecar_stages_again_after_the_reboot(drv: DaxDriver) -> None:
    plan = _plan()
    vid, target, model = plan["volume_id"], plan["target"], OUT / "model"
    try:
        with pytest.raises(LoaderError) as refused:
            load_numpy(target, model="m")
        FACTS["reboot_load_refused"] = str(refused.value)
        again = wg.sidecar_once(target, model, "m")
        assert again["action"] == "staged" and again["bytes_copied"] == again["bytes"], again
        assert wg.verified(target, "m")
        wg.assert_loads_bit_exact(target, model, "m")
        warm = wg.sidecar_once(target, model, "m")
        assert warm["action"] == "already-staged", warm
        FACTS["reboot_sidecar"] = {"first": again.get("action"), "warm": warm.get("action"),
                                   "bytes": again.get("bytes")}
    finally:
        tg.unpublish(drv, vid, target)
        tg.delete(drv, vid)
