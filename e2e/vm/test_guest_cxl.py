"""The VM tier's CXL boots: CXL persistent and volatile memory through the real kernel.

Runs inside the guests that e2e/vm/run.sh boots as ``cxl`` and ``cxl-reboot``: QEMU 10
(bookworm-backports) with one persistent CXL type-3 device (512 MiB, a 256 KiB label
storage area) and one volatile one (512 MiB), each behind its own host bridge; Debian's
6.12 kernel from bookworm-backports; trixie's ``cxl`` 81 ($E2E_VM_CXL, through trixie's
loader: e2e/vm/prepare_cxl.sh). ndctl and daxctl are the host's 76.1, as in every boot.

Why a suite of its own: nothing else runs the driver on CXL. The kernel decides here how
a CXL pmem region looks to ndctl (an nd region on bus ``CXL``, labels in the LSA) and a
CXL ram region to daxctl (a dynamic dax region whose device 6.12 onlines as system RAM,
on a CPU-less NUMA node), and what a reboot leaves of either.

Regions are node set-up, not the driver's: the driver never creates CXL regions. The
suite creates them with ``cxl create-region`` (once per boot: a reboot resets the HDM
decoders, so the same command creates the pmem region again and the kernel finds its
namespaces in the LSA labels), as a node's boot script would.

``cxl``: the memory devices without regions (the driver reports ``cxl_no_region``), the
regions created, ``--dax-setup=reconfigure`` turning the ram region's system-ram device
back to devdax, csi-sanity on a persistent and a volatile class, the core workflow on
each kind, CreateVolume/DeleteVolume medians of both kinds, the weights workflow on CXL
ram; last, a pmem and a ram volume, each published with a staged model and a marker.

``cxl-reboot``: the same machine again (pmem and LSA files, the ram file, the driver's
state dir): the pmem region created again holds the namespace, the pmem volume's model
and marker read back; the ram volume comes back zeroed under its id and is staged again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

CONFIG = os.environ.get("E2E_VM_CONFIG", "")
if not CONFIG or "csi_pmem.vm=1" not in Path("/proc/cmdline").read_text().split():
    pytest.skip("runs inside the QEMU guest only: make e2e-vm", allow_module_level=True)

from csi_pmem.daxclient import DaxSocketError, map_volume  # noqa: E402
from csi_pmem.driver.backends.daxctl_listing import DaxRegion, parse_regions  # noqa: E402
from csi_pmem.loader import load_numpy  # noqa: E402
from csi_pmem.sizes import MiB  # noqa: E402
from csi_pmem.weights.errors import LoaderError  # noqa: E402
from e2e.vm import dax_guest as dg  # noqa: E402
from e2e.vm import test_guest as tg  # noqa: E402
from e2e.vm import weights_guest as wg  # noqa: E402
from e2e.vm.dax_guest import (  # noqa: E402
    driver_session_fixture,  # noqa: F401 (a fixture: dax_guest.py)
    drv_fixture,  # noqa: F401 (a fixture)
    leak_check,  # noqa: F401 (an autouse fixture)
    results,  # noqa: F401 (an autouse fixture)
)
from tests.test_csi_sanity import FLAVOURS  # noqa: E402

pytestmark = pytest.mark.vmconfig("cxl")

OUT, BASE, FACTS = tg.OUT, tg.BASE, tg.FACTS
CXL = os.environ.get("E2E_VM_CXL", "cxl")
PLAN_FILE = OUT / "reboot-plan.json"
PERSISTENT = {"media": "persistent"}
VOLATILE = {"media": "volatile"}
DEVICE_SIZE = 512 * MiB  # run.sh's type-3 devices
WORK = Path("/tmp/e2e-cxl")
# The model lives on the guest's tmpfs, never in the results share: on QEMU 10 with
# kernel 6.12 a large write to the 9p share stops its virtio queue ("virtio: bogus
# descriptor or out of resources") and the guest hangs. make_model is deterministic,
# so the reboot builds the same model again.
MODEL = WORK / "model-reboot"


# ---------------------------------------------------------------------------- cxl

def cxl_list(*args: str) -> list[dict]:
    out = tg.run([CXL, "list", *args]).stdout
    return tg._as_list(json.loads(out)) if out.strip() else []


def create_regions() -> dict[str, dict]:
    """``cxl create-region`` for the pmem and the ram device, each in the root decoder
    (fixed memory window) that reaches it: what a node's boot script does. Returns what
    cxl printed, with the time it took."""
    made = {}
    decoders = [d["decoder"] for d in cxl_list("-D", "-d", "root")]
    for kind, size_key in (("pmem", "pmem_size"), ("ram", "ram_size")):
        mem = next(m["memdev"] for m in cxl_list("-M") if m.get(size_key))
        decoder = next(d for d in decoders
                       if any(m["memdev"] == mem for m in cxl_list("-M", "-d", d)))
        argv = [CXL, "create-region", "-m", "-d", decoder, "-t", kind, "-w", "1", mem]
        t = time.monotonic()
        region = json.loads(tg.run(argv).stdout)
        made[kind] = {"argv": " ".join(["cxl", *argv[1:]]), "region": region["region"],
                      "size": region["size"], "decode_state": region.get("decode_state"),
                      "seconds": round(time.monotonic() - t, 2)}
    return made


def nd_region(wait_s: float = 15.0) -> dict:
    """The nd region of the CXL pmem region: on bus provider CXL. The kernel probes it
    after the commit returns (and reads the labels then), so wait for it a while; if it
    never comes, say what the nd bus and the kernel log show."""
    deadline = time.monotonic() + wait_s
    while True:
        found = tg._as_list(json.loads(tg.run(["ndctl", "list", "-b", "CXL", "-R", "-N",
                                               "-v"]).stdout or "[]"))
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if len(found) != 1:
        idle = tg.run(["ndctl", "list", "-b", "CXL", "-R", "-N", "-D", "-i", "-v"]).stdout
        enable = tg.run(["ndctl", "enable-region", "-b", "CXL", "all"], check=False)
        idle += (f"\nndctl enable-region: exit {enable.returncode}: {enable.stdout} "
                 f"{enable.stderr}\nafter: " + tg.run(["ndctl", "list", "-b", "CXL", "-R",
                                                      "-N", "-i", "-v"]).stdout)
        nd = sorted(os.listdir("/sys/bus/nd/devices")) if os.path.isdir(
            "/sys/bus/nd/devices") else []
        dmesg = [line for line in tg.run(["dmesg"]).stdout.splitlines()
                 if re.search(r"nd_|nvdimm|region|namespace|label|pmem|cxl|nmem|btt|pfn|dax",
                              line, re.I)][-80:]
        raise AssertionError(f"expected one nd region on bus CXL: {found}\n"
                             f"ndctl list -i: {idle}\n/sys/bus/nd/devices: {nd}\n"
                             "dmesg:\n" + "\n".join(dmesg))
    return found[0]


def _nvdimm_debug() -> None:
    """libnvdimm's and cxl_pmem's debug messages into dmesg (dynamic debug), so that a
    region that does not come up says why."""
    control = Path("/sys/kernel/debug/dynamic_debug/control")
    if not control.exists():
        tg.run(["mount", "-t", "debugfs", "debugfs", "/sys/kernel/debug"], check=False)
    for module in ("libnvdimm", "nd_pmem", "cxl_pmem", "cxl_core"):
        try:
            control.write_text(f"module {module} +p\n")
        except OSError:
            pass


def ram_region() -> DaxRegion:
    found = [r for r in parse_regions(dg.daxctl_list()) if "/decoder" in r.path]
    assert len(found) == 1, f"expected one CXL dax region: {dg.daxctl_list()}"
    return found[0]


def own_devices() -> list[str]:
    return [d.chardev for d in ram_region().sized() if d.instance != 0]


def cpu_nodes() -> set[int]:
    text = Path("/sys/devices/system/node/has_cpu").read_text().strip()
    nodes: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        nodes.update(range(int(lo), int(hi or lo) + 1))
    return nodes


# --------------------------------------------------------------------------- driver

class CxlDriver(dg.DaxDriver):
    """``--backend ndctl,daxctl --cxl <trixie's cxl>``, state dir in the results share."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--cxl", CXL]


@pytest.fixture(scope="session")
def boot_state() -> dict[str, Any]:
    _nvdimm_debug()
    state = {"kernel": os.uname().release, "cxl": tg.run([CXL, "--version"]).stdout.strip(),
             "ndctl": tg.run(["ndctl", "--version"]).stdout.strip(),
             "daxctl": tg.run(["daxctl", "--version"]).stdout.strip(),
             "memdevs": cxl_list("-M"), "root_decoders": cxl_list("-D", "-d", "root"),
             "regions": cxl_list("-R"), "cpu_nodes": sorted(cpu_nodes())}
    FACTS["boot"] = state
    return state


def leaks() -> list[str]:
    """This suite's part of the leak check: dax devices in the CXL ram region (once
    there is one). Every namespace counts as left (boot_state lists none)."""
    if cxl_list("-R") and own_devices():
        return [f"dax devices left in the CXL ram region: {own_devices()}"]
    return []


@pytest.fixture(scope="session")
def dax_suite() -> dg.Suite:
    """cxl: the first start sees the memory devices without regions (setup off); the
    shared fixtures (dax_guest.py) run the driver and the leak check."""
    return dg.Suite(CxlDriver, first_boot="cxl", leaks=leaks)


def marker_at_end(target: str, marker: bytes) -> int:
    md, m = map_volume(target)
    try:
        offset = md["usable_size"] - len(marker)
        m[offset:offset + len(marker)] = marker  # no msync: EINVAL on device-dax
    finally:
        m.close()
    return offset


def read_at(target: str, offset: int, n: int) -> bytes:
    _, m = map_volume(target, writable=False)
    try:
        return bytes(m[offset:offset + n])
    finally:
        m.close()


# ====================================================================== cxl boot

def test_cxl_devices_without_regions(boot_state: dict[str, Any]) -> None:
    """The premise: a pmem and a ram memory device, a root decoder each, no region
    (the firmware commits none), on kernel 6.12 with cxl 77 or later."""
    assert boot_state["kernel"].startswith("6.12"), boot_state["kernel"]
    assert int(boot_state["cxl"].split(".")[0]) >= 77, boot_state["cxl"]
    kinds = sorted("pmem" if m.get("pmem_size") else "ram" for m in boot_state["memdevs"])
    assert kinds == ["pmem", "ram"], boot_state["memdevs"]
    assert len(boot_state["root_decoders"]) == 2, boot_state["root_decoders"]
    assert boot_state["regions"] == [], boot_state["regions"]


def test_no_region_is_reported(driver_session: CxlDriver) -> None:
    """Before any region: the volatile pool is unusable with reason cxl_no_region (the
    driver asked cxl), and a volatile CreateVolume says what to run."""
    d = driver_session
    assert d.setup == "off" and d.running
    text = tg.metrics_text()
    usable = tg.metric_value(text, "csi_pmem_pool_usable", reason="cxl_no_region")
    assert usable == 0, [line for line in text.splitlines() if "pool_usable" in line]
    err = tg.rpc_error(lambda: tg.create(d, tg.unique("noregion"), 64 * MiB, VOLATILE))
    FACTS["no_region_create"] = f"{err.code().name}: {err.details()}"
    assert "cxl create-region" in err.details(), err.details()


def test_create_regions() -> None:
    """cxl create-region: the pmem region is an nd region on bus CXL with labels (the
    LSA, initialised at boot by init.sh), the ram region a dynamic dax region whose
    device 6.12 brings up as system-ram, on a CPU-less node."""
    FACTS["regions_created"] = create_regions()
    region = nd_region()
    name = str(region["dev"])
    assert region["size"] == DEVICE_SIZE and tg.sysfs(name, "nstype") == "5", region
    ram = ram_region()
    dev = ram.sized()[0]
    FACTS["pmem_nd_region"] = {k: region.get(k) for k in
                               ("dev", "size", "align", "numa_node", "target_node")}
    FACTS["ram_dax_region"] = {"path": ram.path, "id": ram.id, "size": ram.size,
                               "target_node": ram.target_node(), "boot_device": dev.chardev,
                               "boot_mode": dev.mode, "cpu_nodes": sorted(cpu_nodes())}
    assert ram.size == DEVICE_SIZE and dev.size == DEVICE_SIZE, ram
    assert dev.mode == "system-ram", f"6.12 brought {dev.chardev} up as {dev.mode}"
    assert ram.target_node() not in cpu_nodes(), ram.target_node()


def test_setup_turns_system_ram_to_devdax(drv: CxlDriver) -> None:
    """--dax-setup=reconfigure: the driver offlines the system-ram device, turns it to
    devdax, shrinks it to 0 and offers the whole region on a node with CPUs."""
    tg.wait_erase_idle()
    dg.save_listing("after-setup")
    ram = ram_region()
    assert ram.sized() == [] and ram.available == DEVICE_SIZE, ram
    assert re.search(rf"dax set-up: {ram.name}\.0 .* given back to device-dax",
                     drv.log_text()), drv.log_tail()
    free, biggest = tg.capacity(drv, VOLATILE)
    assert free == DEVICE_SIZE == biggest, (free, biggest)
    pfree, _ = tg.capacity(drv, PERSISTENT)
    assert 0 < pfree <= DEVICE_SIZE, pfree
    text = tg.metrics_text()
    assert tg.metric_value(text, "csi_pmem_pool_usable", pool=ram.name, reason="ok") == 1
    assert tg.metric_value(text, "csi_pmem_pool_usable", pool=nd_region()["dev"],
                           reason="ok") == 1
    FACTS["pools"] = {"volatile": {"pool": ram.name, "capacity": free},
                      "persistent": {"pool": nd_region()["dev"], "capacity": pfree}}
    # The ram region's memory is on a CPU-less node: the driver says where it placed
    # the pool and how it found that node.
    placed = re.search(rf"pool {ram.name} \(([^)]*), target node (\d+)\) is on NUMA node "
                       r"(\d+): (.*)", drv.log_text())
    assert placed, drv.log_tail()
    FACTS["ram_placement"] = placed.group(0)
    assert int(placed.group(3)) in cpu_nodes(), placed.group(0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("flavour", ["devdax-persistent.yaml", "devdax-volatile.yaml"])
def test_csi_sanity(drv: CxlDriver, flavour: str) -> None:
    binary = tg._sanity_binary()
    res, text = tg.run_sanity(drv, binary, flavour, FLAVOURS[flavour], timeout=840)
    assert not res.failed, text
    assert res.passed, text


@pytest.mark.parametrize("media", ["persistent", "volatile"])
def test_core_workflow(drv: CxlDriver, media: str) -> None:
    """Create (in the CXL pool of that kind, on a node with CPUs), publish, map through
    dax.sock, write and read, a read-only publication, delete; then erase before reuse:
    a new volume of the same size reads zeros where the old one's pattern was."""
    size, pattern, params = 64 * MiB, secrets.token_bytes(4096), {"media": media}
    pool = nd_region()["dev"] if media == "persistent" else ram_region().name
    vol = tg.create(drv, tg.unique(f"core{media[0]}"), size, params)
    try:
        rec = dg.record(drv, vol.volume_id)
        assert rec["pool"] == pool and rec["numa_node"] in cpu_nodes(), rec
        fact = {"pool": rec["pool"], "device": rec["device"], "numa_node": rec["numa_node"],
                "usable_size": rec["usable_size"]}
        target = drv.target(f"core-{media}")
        with tg.published(drv, vol.volume_id, target):
            offsets = dg.write_read(target, pattern)
            ro = drv.target(f"core-{media}-ro")
            with tg.published(drv, vol.volume_id, ro, readonly=True):
                md, m = map_volume(ro)
                try:
                    assert md["readonly"] is True
                    assert all(m[o:o + len(pattern)] == pattern for o in offsets)
                finally:
                    m.close()
                with pytest.raises(DaxSocketError, match="read-only"):
                    map_volume(ro, writable=True)
    finally:
        tg.delete(drv, vol.volume_id, op=f"DeleteVolume (erase) {media}")
    tg.wait_erase_idle()
    with dg.volume(drv, tg.unique(f"reuse{media[0]}"), size, params) as vol2:
        rec2 = dg.record(drv, vol2.volume_id)
        fact["reuse_device"] = rec2["device"]
        target = drv.target(f"reuse-{media}")
        with tg.published(drv, vol2.volume_id, target):
            md, m = map_volume(target, writable=False)
            try:
                for off in offsets:
                    assert m[off:off + len(pattern)] == bytes(len(pattern)), \
                        f"the deleted volume's bytes are visible at offset {off}"
            finally:
                m.close()
    FACTS.setdefault("cxl_core_workflow", {})[media] = fact


def test_create_and_delete_medians(drv: CxlDriver) -> None:
    """Three CreateVolume and DeleteVolume of 64 MiB on each kind, interleaved: ndctl on
    the CXL pmem region, daxctl on the CXL ram region (client wall time, TCG). Three
    samples of each, each positive, together within the loop's wall time."""
    kinds = {"ndctl": PERSISTENT, "daxctl": VOLATILE}
    calls = ("CreateVolume", "DeleteVolume")
    with tg.new_samples({f"{op} 64Mi {kind}": 3 for op in calls for kind in kinds}) as got:
        for i in range(3):
            for kind, params in kinds.items():
                vol = tg.create(drv, tg.unique(f"t{kind}{i}"), 64 * MiB, params,
                                op=f"CreateVolume 64Mi {kind}")
                tg.delete(drv, vol.volume_id, op=f"DeleteVolume 64Mi {kind}")
                tg.wait_erase_idle()
    out: dict[str, dict[str, float]] = {
        kind: {op: round(statistics.median(got[f"{op} 64Mi {kind}"]), 3) for op in calls}
        for kind in kinds}
    out["ratio daxctl/ndctl"] = {op: round(out["daxctl"][op] / out["ndctl"][op], 2)
                                 for op in ("CreateVolume", "DeleteVolume")}
    FACTS["cxl_create_delete_medians"] = out


def test_weights_on_cxl_ram(drv: CxlDriver) -> None:
    """csi-pmem-weights on a published CXL ram volume: stage, verify, CPU load
    bit-exact; the sidecar's first start stages and its warm restart copies nothing."""
    WORK.mkdir(parents=True, exist_ok=True)
    model = wg.make_model(WORK / "model")
    with dg.volume(drv, tg.unique("w"), 64 * MiB, VOLATILE) as vol, \
            tg.published(drv, vol.volume_id, drv.target("weights")) as target:
        out = wg.cli("stage", model, target, "--name", "m", "-q", "-o", "table").stdout
        fact: dict[str, Any] = {"persist": wg.persisted_with(out)}
        assert wg.verified(target, "m")
        fact["tensors"] = wg.assert_loads_bit_exact(target, model, "m")
        fact["sidecar"] = wg.sidecar_first_and_warm(target, model)
    FACTS.setdefault("weights", {})["daxctl devdax on CXL volatile memory"] = fact


@pytest.mark.no_leak_check
def test_leave_volumes_for_the_reboot(drv: CxlDriver) -> None:
    """Last in this boot: a CXL pmem volume with a model staged and a marker, and a CXL
    ram volume the sidecar staged with a marker, both published."""
    model = wg.make_model(MODEL)
    plan: dict[str, Any] = {"boot_id": Path("/proc/sys/kernel/random/boot_id").read_text()
                            .strip(), "regions": FACTS.get("regions_created")}
    for media in ("persistent", "volatile"):
        vol = tg.create(drv, tg.unique(f"reboot{media[0]}"), 64 * MiB, {"media": media})
        rec = dg.record(drv, vol.volume_id)
        target = drv.target(f"reboot-{media}")
        tg.publish(drv, vol.volume_id, target)
        if media == "persistent":
            wg.cli("stage", model, target, "--name", "m", "-q")
        else:
            assert wg.sidecar_once(target, model, "m")["action"] == "staged"
        assert wg.verified(target, "m")
        marker = secrets.token_bytes(4096)
        plan[media] = {"volume_id": vol.volume_id, "name": rec["name"], "size": rec["size"],
                       "pool": rec["pool"], "device": rec["device"], "target": target,
                       "marker": marker.hex(), "marker_offset": marker_at_end(target, marker)}
    PLAN_FILE.write_text(json.dumps(plan, indent=1) + "\n")
    FACTS["reboot_plan"] = plan


# =============================================================== cxl-reboot boot

def _plan() -> dict[str, Any]:
    assert PLAN_FILE.exists(), "the cxl boot left no reboot-plan.json (did it fail?)"
    return json.loads(PLAN_FILE.read_text())


@pytest.mark.vmconfig("cxl-reboot")
@pytest.mark.no_leak_check
def test_the_driver_creates_the_regions_again(boot_state: dict[str, Any],
                                              drv: CxlDriver) -> None:
    """The reboot reset the decoders (no region at boot). The driver, with
    --dax-setup=reconfigure, creates the pmem and the ram region again at start, and the
    kernel finds the volume's namespace in the pmem device's LSA labels."""
    plan = _plan()
    assert Path("/proc/sys/kernel/random/boot_id").read_text().strip() != plan["boot_id"]
    assert boot_state["regions"] == [], boot_state["regions"]
    made = re.findall(r"cxl set-up: created (\w+) region (region\d+) of (\S+) on (mem\d+) "
                      r"in (decoder[\d.]+)", drv.log_text())
    FACTS["regions_created_by_driver"] = [" ".join(m) for m in made]
    assert sorted(m[0] for m in made) == ["pmem", "ram"], drv.log_tail()
    assert "no serial number" not in drv.log_text()
    region = nd_region()
    names = [ns.get("name") for ns in tg._as_list(region.get("namespaces"))]
    FACTS["namespaces_after_reboot"] = names
    assert plan["persistent"]["volume_id"] in names, region  # namespaces are named by id


@pytest.mark.vmconfig("cxl-reboot")
@pytest.mark.no_leak_check  # the volatile volume is still there
def test_pmem_volume_comes_back_with_its_data(drv: CxlDriver) -> None:
    """The pmem volume is normal in ListVolumes, publishes again at its target (the
    reboot took the mount), its marker reads back and its model verifies and loads."""
    p = _plan()["persistent"]
    vid, target = p["volume_id"], p["target"]
    abnormal, message = dg.volume_condition(drv, vid)
    assert not abnormal, message
    assert dg.record(drv, vid)["pool"] == p["pool"]
    try:
        tg.publish(drv, vid, target)
        seen = read_at(target, p["marker_offset"], 4096)
        FACTS["pmem_marker_survived"] = seen == bytes.fromhex(p["marker"])
        assert FACTS["pmem_marker_survived"], "the pmem volume's marker did not survive"
        assert wg.verified(target, "m")
        wg.assert_loads_bit_exact(target, wg.make_model(MODEL), "m")
        FACTS["pmem_model_survived"] = True
    finally:
        tg.unpublish(drv, vid, target)
        tg.delete(drv, vid)


@pytest.mark.vmconfig("cxl-reboot")
@pytest.mark.no_leak_check
def test_volatile_volume_comes_back_zeroed_under_its_id(drv: CxlDriver) -> None:
    v = _plan()["volatile"]
    vid = v["volume_id"]
    log = drv.log_text()
    lost = [line for line in log.splitlines() if "contents lost at a node restart" in line]
    FACTS["reboot_log"] = lost
    assert len(lost) == 1 and vid in lost[0] and "zeroed" in lost[0], drv.log_tail()
    rec = dg.record(drv, vid)
    assert rec["contents_lost_at"] > 0 and rec["pool"] == v["pool"], rec
    abnormal, message = dg.volume_condition(drv, vid)
    FACTS["reboot_condition"] = {"abnormal": abnormal, "message": message}
    assert not abnormal and "contents were lost at a node restart" in message, message
    assert tg.metric_value(tg.metrics_text(), "csi_pmem_volumes_recreated_total",
                           pool=v["pool"]) == 1
    tg.publish(drv, vid, v["target"])
    md, m = map_volume(v["target"], writable=False)
    try:
        assert m[:].count(0) == md["usable_size"], "non-zero bytes in the recreated volume"
    finally:
        m.close()
    FACTS["reboot_zeroed"] = True


@pytest.mark.vmconfig("cxl-reboot")
def test_sidecar_stages_again_after_the_reboot(drv: CxlDriver) -> None:
    v = _plan()["volatile"]
    vid, target, model = v["volume_id"], v["target"], wg.make_model(MODEL)
    try:
        with pytest.raises(LoaderError) as refused:
            load_numpy(target, model="m")
        FACTS["reboot_load_refused"] = str(refused.value)
        again = wg.sidecar_once(target, model, "m")
        assert again["action"] == "staged" and again["bytes_copied"] == again["bytes"], again
        wg.assert_loads_bit_exact(target, model, "m")
        warm = wg.sidecar_once(target, model, "m")
        assert warm["action"] == "already-staged", warm
        FACTS["reboot_sidecar"] = {"first": again.get("action"), "warm": warm.get("action"),
                                   "bytes": again.get("bytes")}
    finally:
        tg.unpublish(drv, vid, target)
        tg.delete(drv, vid)
