"""The daxctl back end against a fake kernel behind the Runner (tests/unit/fake_daxctl.py),
a fake sysfs and a fake /proc: listing, carving, identity, NUMA, firmware states, set-up.
Also the composite back end and the ``media`` StorageClass parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_daxctl import FakeDaxKernel

from csi_pmem.driver import config
from csi_pmem.driver.backends.base import VOLATILE, Backend, Namespace, Pool
from csi_pmem.driver.backends.composite import CompositeBackend
from csi_pmem.driver.backends.daxctl import DaxctlBackend
from csi_pmem.driver.backends.daxctl_listing import Topology, parse_regions
from csi_pmem.driver.params import parse
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
    CommandError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def kernel(tmp_path: Path) -> FakeDaxKernel:
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, 1 * GiB, target_node=0)
    return k


def make(kernel: FakeDaxKernel, tmp_path: Path, **kw) -> DaxctlBackend:
    kw.setdefault("sysfs_root", tmp_path / "sys")
    return DaxctlBackend(runner=kernel, proc_root=kernel.proc_root, dev_root=kernel.dev_root,
                         state_path=tmp_path / "state" / "daxctl-devices.json",
                         cache_seconds=0, **kw)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# ------------------------------------------------------------------- listing
def test_listing_json_is_parsed_as_daxctl_prints_it():
    doc = json.loads("""[{"path": "/platform/hmem.0", "id": 0, "size": 1073741824,
      "available_size": 805306368, "align": 2097152, "devices": [
        {"chardev": "dax0.1", "size": 268435456, "target_node": 2, "align": 2097152,
         "mode": "devdax", "mappings": [{"page_offset": 0, "start": 4294967296,
         "end": 4563402751, "size": 268435456}]},
        {"chardev": "dax0.2", "size": 0, "target_node": 2, "align": 2097152,
         "mode": "devdax", "state": "disabled"}]},
      {"path": "/LNXSYSTM:00/ndbus0/region0/dax0.0", "id": 1, "size": 1056964608,
       "align": 2097152}]""")
    hmem, pmem = parse_regions(doc)
    assert (hmem.name, hmem.available, hmem.kind, hmem.target_node()) == \
        ("dax0", 768 * MiB, "soft-reserved memory", 2)
    dev = hmem.sized()[0]
    assert (dev.chardev, dev.size, dev.mappings, dev.enabled) == \
        ("dax0.1", 256 * MiB, ((4294967296, 4563402751),), True)
    assert not hmem.devices[1].enabled and hmem.devices[1].size == 0
    assert pmem.kind == "pmem" and pmem.available == 0  # absent: 0
    with pytest.raises(BackendError):
        parse_regions("garbage")


def test_pools_capacity_and_static_pmem_regions_left_to_ndctl(kernel, tmp_path):
    kernel.add_region(1, 512 * MiB, path="/LNXSYSTM:00/ndbus0/region0/dax1.0")
    b = make(kernel, tmp_path)
    (pool,) = b.pools()
    assert (pool.name, pool.size, pool.free, pool.largest_extent, pool.media) == \
        ("dax0", GiB, GiB, GiB, VOLATILE)
    assert pool.usable and not pool.struct_pages_on_media
    assert "devdax volumes only" in pool.problem_for("fsdax")
    assert pool.problem_for("devdax") is None
    # The pool sizes volumes with no metadata: usable == raw size.
    assert pool.allocation(100 * MiB, 2 * MiB) == (100 * MiB, 100 * MiB)
    assert pool.allocation(GiB, GiB) == (GiB, GiB)
    assert kernel.calls[0] == ["daxctl", "list", "--regions", "--devices", "--mappings",
                               "--idle"]
    assert b.probe() == (True, "ok") and b.max_volumes() == 0


# What daxctl 76.1 printed on Debian's 6.1 kernel in the VM tier's hmem boot
# (e2e/vm/test_guest_dax.py keeps them as daxctl-list-*.json): at boot, after
# --dax-setup=reconfigure shrank dax0.0, and with one 64 MiB volume.
REAL_BOOT = (
    "[{\"path\": \"/platform/hmem.0\", \"id\": 0, \"size\": 536870912, \"align\": 2097152, "
    "\"devices\": [{\"chardev\": \"dax0.0\", \"size\": 536870912, \"target_node\": 0, \"align\": "
    "2097152, \"mode\": \"devdax\", \"mappings\": [{\"page_offset\": 0, \"start\": 1073741824, "
    "\"end\": 1610612735, \"size\": 536870912}]}]}]")
REAL_AFTER_SETUP = (
    "[{\"path\": \"/platform/hmem.0\", \"id\": 0, \"size\": 536870912, \"available_size\": "
    "536870912, \"align\": 2097152, \"devices\": [{\"chardev\": \"dax0.0\", \"size\": 0, "
    "\"target_node\": 0, \"align\": 2097152, \"mode\": \"devdax\", \"state\": \"disabled\"}]}]")
REAL_WITH_A_VOLUME = (
    "[{\"path\": \"/platform/hmem.0\", \"id\": 0, \"size\": 536870912, \"available_size\": "
    "469762048, \"align\": 2097152, \"devices\": [{\"chardev\": \"dax0.1\", \"size\": 67108864, "
    "\"target_node\": 0, \"align\": 2097152, \"mode\": \"devdax\", \"mappings\": "
    "[{\"page_offset\": 0, \"start\": 1073741824, \"end\": 1140850687, \"size\": 67108864}]}, "
    "{\"chardev\": \"dax0.0\", \"size\": 0, \"target_node\": 0, \"align\": 2097152, \"mode\": "
    "\"devdax\", \"state\": \"disabled\"}]}]")


def _listed(kernel: FakeDaxKernel) -> list[dict]:
    doc = kernel.run_json(["daxctl", "list", "--regions", "--devices", "--mappings", "--idle"])
    for region in doc:
        region["devices"] = sorted(region.get("devices", []), key=lambda d: d["chardev"])
    return doc


def _real(text: str) -> list[dict]:
    doc = json.loads(text)
    for region in doc:
        region["devices"] = sorted(region.get("devices", []), key=lambda d: d["chardev"])
    return doc


def test_the_fake_prints_what_the_real_daxctl_printed(tmp_path):
    """The fake against the VM tier's captures: the boot device, dax0.0 kept at size 0
    (no mappings) after the set-up, the volume made as dax0.1, no other idle device."""
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, 512 * MiB, target_node=0, boot_device="devdax")
    k.regions[0]["base"] = GiB  # memmap=512M%1G
    k.reboot()
    assert _listed(k) == _real(REAL_BOOT)
    b = make(k, tmp_path, setup="reconfigure")
    (pool,) = b.pools()
    assert pool.usable and pool.free == 512 * MiB
    assert _listed(k) == _real(REAL_AFTER_SETUP)
    ns = b.create("v", "dax0", 64 * MiB, 2 * MiB)
    assert ns.handle == "dax0.1"
    assert _listed(k) == _real(REAL_WITH_A_VOLUME)
    # The real documents themselves: dax0.0 at size 0 is an idle seed, not a boot device.
    (hmem,) = parse_regions(json.loads(REAL_WITH_A_VOLUME))
    assert [d.chardev for d in hmem.sized()] == ["dax0.1"] and hmem.target_node() == 0
    assert hmem.available == 448 * MiB and hmem.kind == "soft-reserved memory"


def test_static_region_detected_from_sysfs(kernel, tmp_path):
    kernel.regions[0]["path"] = "/platform/something/dax0.0"
    sysfs = write(tmp_path / "sys", {"devices/platform/something/dax0.0/dax_region/align":
                                     "2097152\n"})
    b = make(kernel, tmp_path, sysfs_root=sysfs)
    assert b.pools()[0].name == "dax"  # no create attribute: static, not ours
    (sysfs / "devices/platform/something/dax0.0/dax_region/create").write_text("")
    assert b.pools()[0].name == "dax0"


# ------------------------------------------------------------------- carve, destroy
def test_carve_and_destroy_argv(kernel, tmp_path):
    b = make(kernel, tmp_path)
    ns = b.create("pvc-1", "dax0", 64 * MiB, 2 * MiB)
    assert ["daxctl", "create-device", "-r", "0", "-s", str(64 * MiB), "-a", str(2 * MiB)] \
        in kernel.calls
    assert (ns.name, ns.pool, ns.size, ns.usable_size, ns.handle, ns.mode) == \
        ("pvc-1", "dax0", 64 * MiB, 64 * MiB, "dax0.1", "devdax")
    assert ns.device == str(kernel.dev_root / "dax0.1") and not ns.fs_dax
    assert b.namespaces() == [ns]
    assert b.pools()[0].free == GiB - 64 * MiB
    with pytest.raises(AlreadyExists):
        b.create("pvc-1", "dax0", 64 * MiB, 2 * MiB)
    kernel.calls.clear()
    b.destroy("pvc-1")
    assert kernel.writes() == [["daxctl", "disable-device", "dax0.1"],
                               ["daxctl", "destroy-device", "dax0.1"]]
    assert b.namespaces() == [] and b.pools()[0].free == GiB
    b.destroy("pvc-1")  # gone: not an error, nothing run
    assert kernel.writes()[-1] == ["daxctl", "destroy-device", "dax0.1"]


def test_one_gib_align_and_bad_sizes(kernel, tmp_path):
    b = make(kernel, tmp_path)
    ns = b.create("big", "dax0", GiB, GiB)
    assert ns.align == GiB and ["-a", str(GiB)] == kernel.writes()[-1][-2:]
    with pytest.raises(InvalidArgument, match="multiple of 2Mi"):
        b.create("odd", "dax0", 3 * MiB, 2 * MiB)
    with pytest.raises(Unavailable, match="devdax volumes only"):
        b.create("fs", "dax0", 64 * MiB, 2 * MiB, mode="fsdax")
    with pytest.raises(Unavailable, match="not present"):
        b.create("x", "dax7", 64 * MiB, 2 * MiB)


def test_no_space_is_resource_exhausted_and_leaves_no_record(kernel, tmp_path):
    b = make(kernel, tmp_path)
    b.create("a", "dax0", 1000 * MiB, 2 * MiB)
    with pytest.raises(ResourceExhausted, match="No space left on device"):
        b._carve("b", "dax0", 64 * MiB, 2 * MiB, "devdax")
    assert "b" not in b._records.entries()


def test_discontiguous_free_space_is_one_extent(kernel, tmp_path):
    b = make(kernel, tmp_path)
    for name in ("a", "b", "c"):
        b.create(name, "dax0", 256 * MiB, 2 * MiB)
    b.destroy("a")
    b.destroy("c")  # free: 256 MiB at the start, 512 MiB at the end
    pool = b.pools()[0]
    assert pool.largest_extent == pool.free == 768 * MiB
    ns = b.create("d", "dax0", 768 * MiB, 2 * MiB)
    dev = kernel._dev(ns.handle)[2]
    assert len(dev["ranges"]) == 2


# ------------------------------------------------------------------- identity
def test_identity_survives_a_driver_restart_and_a_reused_number(kernel, tmp_path):
    b = make(kernel, tmp_path)
    a = b.create("vol-a", "dax0", 64 * MiB, 2 * MiB)
    again = make(kernel, tmp_path)  # a new driver process, same boot
    assert again.get("vol-a") == a
    # The device is destroyed by hand and another made under the same number: the
    # ranges differ, so it is not vol-a's.
    kernel.run(["daxctl", "disable-device", "dax0.1"])
    kernel.run(["daxctl", "destroy-device", "dax0.1"])
    kernel._make(0, 1, [((1 << 36) + 512 * MiB, (1 << 36) + 576 * MiB - 1)], "devdax")
    assert again.get("vol-a") is None
    kernel.calls.clear()
    again.destroy("vol-a")  # never touches a device it cannot prove its own
    assert kernel.writes() == []


def test_a_reboot_loses_every_device(kernel, tmp_path):
    b = make(kernel, tmp_path)
    b.create("vol-a", "dax0", 64 * MiB, 2 * MiB)
    kernel.reboot()
    # Same number, same size, same ranges: only the boot id tells it is not vol-a's.
    kernel.run(["daxctl", "create-device", "-r", "0", "-s", str(64 * MiB), "-a",
                str(2 * MiB)])
    assert make(kernel, tmp_path).get("vol-a") is None


def test_a_create_cut_short_is_adopted_not_leaked(kernel, tmp_path):
    b = make(kernel, tmp_path)
    b.create("first", "dax0", 64 * MiB, 2 * MiB)
    real_run = kernel.run

    def crash_after_create(argv, **kw):
        out = real_run(argv, **kw)
        if argv[1] == "create-device":
            raise KeyboardInterrupt  # the driver dies before writing the record
        return out

    kernel.run = crash_after_create  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        b.create("second", "dax0", 128 * MiB, 2 * MiB)
    kernel.run = real_run  # type: ignore[method-assign]
    again = make(kernel, tmp_path)
    ns = again.get("second")
    assert ns is not None and ns.size == 128 * MiB and ns.handle == "dax0.2"
    again.destroy("second")
    assert again.get("second") is None and again.pools()[0].free == GiB - 64 * MiB


def test_a_failed_create_removes_its_partial_device(kernel, tmp_path):
    b = make(kernel, tmp_path)
    real_run = kernel.run

    def timeout_after_create(argv, **kw):
        out = real_run(argv, **kw)
        if argv[1] == "create-device":
            raise CommandError(list(argv), None, "", message="timed out after 120s")
        return out

    kernel.run = timeout_after_create  # type: ignore[method-assign]
    with pytest.raises(CommandError):
        b.create("vol", "dax0", 64 * MiB, 2 * MiB)
    kernel.run = real_run  # type: ignore[method-assign]
    assert b.get("vol") is None and b.pools()[0].free == GiB
    assert ["daxctl", "destroy-device", "dax0.1"] in kernel.calls


# ------------------------------------------------------------------- NUMA
def test_numa_from_target_node_with_cpus(kernel, tmp_path):
    kernel.regions[0]["target_node"] = 1
    sysfs = write(tmp_path / "sys", {"devices/system/node/node1/cpulist": "4-7\n"})
    assert make(kernel, tmp_path, sysfs_root=sysfs).pools()[0].numa_node == 1


def test_cpu_less_target_node_maps_to_its_initiator(kernel, tmp_path):
    kernel.regions[0]["target_node"] = 2
    sysfs = write(tmp_path / "sys", {
        "devices/system/node/online": "0-2\n",
        "devices/system/node/node0/cpulist": "0-3\n",
        "devices/system/node/node1/cpulist": "4-7\n",
        "devices/system/node/node2/cpulist": "\n",
        "devices/system/node/node2/distance": "20 12 10\n",
        "devices/system/node/node2/access0/initiators/node1": "",
        "devices/system/node/node2/access0/initiators/read_bandwidth": "100\n",
    })
    b = make(kernel, tmp_path, sysfs_root=sysfs)
    assert b.pools()[0].numa_node == 1
    ns = b.create("v", "dax0", 64 * MiB, 2 * MiB)
    assert ns.numa_node == 1


def test_cpu_less_node_without_hmat_takes_the_nearest_node_with_cpus(tmp_path):
    sysfs = write(tmp_path / "sys", {
        "devices/system/node/online": "0-1,3\n",
        "devices/system/node/node0/cpulist": "0-3\n",
        "devices/system/node/node1/cpulist": "4-7\n",
        "devices/system/node/node3/cpulist": "\n",
        # columns: nodes 0, 1, 3 (the online ones)
        "devices/system/node/node3/distance": "30 21 10\n",
    })
    topo = Topology(sysfs)
    assert topo.place(3)[0] == 1
    # A memory-less node that is not online has no directory: the device's numa_node.
    assert topo.place(5, device_node=0) == (0, "the device's numa_node for target node 5")
    assert topo.place(None)[0] == 0


def test_offline_cpu_less_node_maps_to_the_only_node_with_cpus(tmp_path):
    """The VM tier's CXL ram region on 6.12: its target node 2 went offline with its
    memory (no node2 directory) and the device's numa_node says 2 as well."""
    sysfs = write(tmp_path / "sys", {
        "devices/system/node/online": "0\n",
        "devices/system/node/has_cpu": "0\n",
        "devices/system/node/node0/cpulist": "0-1\n",
    })
    topo = Topology(sysfs)
    assert topo.place(2, device_node=2) == (0, "the only node with CPUs (target node 2 is "
                                               "offline)")
    # Several nodes with CPUs and nothing to rank them by: the target node, as before.
    (tmp_path / "sys/devices/system/node/has_cpu").write_text("0-1\n")
    assert topo.place(2, device_node=2)[0] == 2
    # A target node that is online keeps the distance rules (no shortcut).
    assert topo.place(0)[0] == 0


# ------------------------------------------------------------------- firmware states
def test_no_region_without_soft_reserved_memory(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    (k.proc_root / "cmdline").write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1\n")
    b = make(k, tmp_path)
    (pool,) = b.pools()
    assert pool.reasons == ("no_dax_region",) and not pool.usable and pool.free == 0
    assert "EFI_MEMORY_SP" in pool.problem and "memmap=SIZE%OFFSET-1+0xefffffff" in pool.problem
    ok, why = b.probe()
    assert not ok and "no dax region" in why
    (k.proc_root / "cmdline").write_text("root=/dev/sda1 efi=nosoftreserve quiet\n")
    b.invalidate()
    assert "efi=nosoftreserve" in b.pools()[0].problem
    (k.proc_root / "cmdline").write_text("root=/dev/sda1\n")
    (k.proc_root / "iomem").write_text("100000000-13fffffff : Soft Reserved\n")
    b.invalidate()
    assert "modprobe dax_hmem" in b.pools()[0].problem


def test_cxl_memdevs_without_a_region(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.cxl = ([{"memdev": "mem0", "pmem_size": 268435456},
              {"memdev": "mem1", "ram_size": 268435456, "serial": 1}], [])
    (pool,) = make(k, tmp_path).pools()
    assert pool.reasons == ("cxl_no_region",)
    assert "mem1 (256Mi volatile)" in pool.problem and "cxl create-region" in pool.problem
    assert ["cxl", "list", "--memdevs"] in k.calls
    k.cxl = (k.cxl[0], [{"region": "region1", "type": "ram", "size": 268435456}])
    b = make(k, tmp_path)
    assert "dax_cxl" in b.pools()[0].problem


def test_system_ram_region_is_reported_and_never_offlined_without_the_opt_in(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, GiB, boot_device="system-ram")
    b = make(k, tmp_path)
    (pool,) = b.pools()
    assert pool.reasons == ("system_ram",) and pool.free == 0
    assert "reconfigure-device --mode=devdax -f dax0.0" in pool.problem
    assert "--dax-setup=reconfigure" in pool.problem
    assert k.writes() == []


def test_a_kernel_device_holding_the_region_is_reported(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, GiB, boot_device="devdax")  # kernel 6.1: hmem as one devdax device
    (pool,) = make(k, tmp_path).pools()
    assert pool.reasons == ("foreign_device",)
    assert "reconfigure-device -s 0 dax0.0" in pool.problem
    assert k.writes() == []


def test_reconfigure_opt_in_gives_the_region_back(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, GiB, boot_device="system-ram")
    b = make(k, tmp_path, setup="reconfigure")
    (pool,) = b.pools()
    assert pool.usable and pool.free == GiB
    assert k.writes() == [
        ["daxctl", "reconfigure-device", "--mode=devdax", "-f", "dax0.0"],
        ["daxctl", "disable-device", "dax0.0"],
        ["daxctl", "reconfigure-device", "-s", "0", "dax0.0"]]
    b.create("v", "dax0", 64 * MiB, 2 * MiB)
    count = len(k.writes())
    b.pools()
    assert len(k.writes()) == count  # our own devices are never "set up"


def test_reconfigure_ebusy_is_a_reason_not_a_crash(tmp_path):
    k = FakeDaxKernel(tmp_path / "dev", tmp_path / "proc")
    k.add_region(0, GiB, boot_device="system-ram")
    k.busy = True
    b = make(k, tmp_path, setup="reconfigure")
    (pool,) = b.pools()
    assert pool.reasons == ("system_ram",) and not pool.usable
    assert "EBUSY" in pool.problem and "online_movable" in pool.problem
    tries = len(k.writes())
    b.pools()
    assert len(k.writes()) == tries  # retried after SETUP_RETRY, not at every listing
    ok, why = b.probe()
    assert not ok and "EBUSY" in why


def test_bad_setup_mode_is_refused(kernel, tmp_path):
    with pytest.raises(InvalidArgument):
        make(kernel, tmp_path, setup="always")


# ------------------------------------------------------------------- composite, media
class FakePmem(Backend):
    """A persistent back end with one pool, to sit beside daxctl."""

    kind = "fakepmem"

    def __init__(self) -> None:
        self.made: dict[str, Namespace] = {}

    def pools(self) -> list[Pool]:
        return [Pool("region0", 0, GiB, GiB, GiB, 16 * MiB)]

    def namespaces(self) -> list[Namespace]:
        return list(self.made.values())

    def create(self, name, pool, size, align, mode="devdax"):
        self.made[name] = Namespace(name, pool, 0, size, size, align, f"/dev/pmem-{name}")
        return self.made[name]

    def destroy(self, name):
        self.made.pop(name, None)

    def open_device(self, ns, readonly, exclusive=False):
        raise AssertionError("not opened here")


def test_composite_routes_by_pool(kernel, tmp_path):
    dax, pmem = make(kernel, tmp_path), FakePmem()
    both = CompositeBackend([pmem, dax])
    assert [p.name for p in both.pools()] == ["region0", "dax0"]
    assert both.kind == "fakepmem,daxctl" and not both.zeroes_new_namespaces
    a = both.create("on-dax", "dax0", 64 * MiB, 2 * MiB)
    b = both.create("on-pmem", "region0", 64 * MiB, 2 * MiB)
    assert a.handle == "dax0.1" and "on-pmem" in pmem.made
    assert {ns.name for ns in both.namespaces()} == {"on-dax", "on-pmem"}
    assert both.get("on-dax") == a and both.get("on-pmem") == b
    both.destroy("on-dax")
    assert dax.get("on-dax") is None and "on-pmem" in pmem.made
    with pytest.raises(Unavailable, match="not present"):
        both.create("x", "region9", 64 * MiB, 2 * MiB)
    assert both.probe() == (True, "ok") and both.max_volumes() == 0


def test_composite_refuses_clashing_pool_names(kernel, tmp_path):
    with pytest.raises(BackendError, match="unique"):
        CompositeBackend([FakePmem(), FakePmem()]).pools()


def test_backend_flag_offers_the_combination():
    assert config.BACKENDS == ("ndctl", "daxctl", "ndctl,daxctl", "memory", "emulated")
    assert config.CHOICES["backend"] == config.BACKENDS


def test_media_parameter():
    assert parse({}).media == "any" and "media" not in parse({}).to_dict()
    p = parse({"media": "Volatile"})
    assert p.media == "volatile" and p.to_dict()["media"] == "volatile"
    assert p.accepts_media("volatile") and not p.accepts_media("persistent")
    assert parse({"media": "any"}).accepts_media("persistent")
    with pytest.raises(InvalidArgument, match=r"invalid media 'ram'.*persistent.*volatile"):
        parse({"media": "ram"})
    # Idempotency: the pool's media decides; an "any" class accepts both.
    stored = parse({}).to_dict()
    assert parse({"media": "volatile"}).compatible_with(stored, 0, media="volatile") == []
    assert parse({"media": "persistent"}).compatible_with(stored, 0, media="volatile")
    assert parse({}).compatible_with(p.to_dict(), 0) == []


def test_a_volatile_pool_clean_in_an_earlier_boot_is_dirty_at_start(tmp_path, monkeypatch):
    from csi_pmem.driver.erasing import cleanspace
    from csi_pmem.driver.state import RegionRecord, StateStore

    store = StateStore(tmp_path / "state")
    for name in ("dax0", "region0"):
        store.put_region(RegionRecord(pool=name, clean=True, free=GiB))
    pools = [Pool("dax0", 0, GiB, GiB, GiB, 2 * MiB, media=VOLATILE),
             Pool("region0", 0, GiB, GiB, GiB, 16 * MiB)]
    ledger = cleanspace.CleanSpace(store, FakePmem())
    monkeypatch.setattr(cleanspace, "boot_time", lambda: 0.0)  # the records are of this boot
    ledger.start(pools, {})
    assert ledger.is_clean("dax0") and ledger.is_clean("region0")
    monkeypatch.setattr(cleanspace, "boot_time", lambda: 4e9)  # the node restarted since
    ledger.start(pools, {})
    assert not ledger.is_clean("dax0") and "node restarted" in ledger.record("dax0").reason
    assert ledger.is_clean("region0")  # persistent: its zeros survived
