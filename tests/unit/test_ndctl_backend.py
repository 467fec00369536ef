"""The ndctl back end against recorded ``ndctl`` JSON, a fake sysfs and a fake runner.

The fixtures under ``fixtures/ndctl`` are shaped after what ndctl prints
(``ndctl/list.c`` ``region_to_json``, ``ndctl/json.c`` ``util_namespace_to_json``,
``daxctl/json.c``) for a QEMU guest with two 1 GiB NVDIMMs on NUMA nodes 0 and 1
(docs/design.md §7). ``*_fsdax.json`` add fsdax namespaces (a pfn device: ``blockdev``,
``sector_size``, the block device's size) and a sector one. ``sysfs_*.json`` map paths
under ``/sys`` to file contents. No root, no ndctl, no kernel. Also covers
:mod:`csi_pmem.driver.udev`.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from csi_pmem.driver.backends.ndctl import NdctlBackend
from csi_pmem.driver.backends.ndctl_listing import LABELLESS_FIX, classify, disabled_problem
from csi_pmem.driver.udev import DeviceWatcher, netlink_monitor
from csi_pmem.errors import (
    AlreadyExists,
    BackendError,
    CommandError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from csi_pmem.sizes import GiB, MiB, devdax_usable

FIXTURES = Path(__file__).parent / "fixtures" / "ndctl"
LIST_ARGV = ["ndctl", "list", "--regions", "--namespaces", "--dimms", "--idle", "--verbose"]


def load(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class FakeRunner:
    """Replays ndctl output and records every argv.

    ``listings`` are returned by successive ``ndctl list`` calls; the last one repeats.
    ``create`` is the create-namespace result (a dict, or an exception to raise).
    ``fail`` maps a subcommand run through ``run()`` to the exception it raises.
    """

    def __init__(self, *listings: Any, create: Any = None):
        self.listings = [copy.deepcopy(x) for x in listings]
        self.create = create
        self.fail: dict[str, BaseException] = {}
        self.said: dict[str, str] = {}  # a subcommand's stderr on success
        self.calls: list[list[str]] = []
        self.timeouts: list[float] = []

    def run_json(self, argv: list[str], timeout: float = 60.0) -> Any:
        self.calls.append(list(argv))
        self.timeouts.append(timeout)
        if argv[1] == "list":
            if not self.listings:
                return []
            current = self.listings[0] if len(self.listings) == 1 else self.listings.pop(0)
            return copy.deepcopy(current)
        if argv[1] == "create-namespace":
            if isinstance(self.create, BaseException):
                raise self.create
            return copy.deepcopy(self.create)
        raise AssertionError(f"unexpected run_json {argv}")

    def run(self, argv: list[str], timeout: float = 60.0, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        self.timeouts.append(timeout)
        err = self.fail.get(argv[1])
        if err is not None:
            raise err
        return subprocess.CompletedProcess(argv, 0, "", self.said.get(argv[1], ""))

    def writes(self) -> list[list[str]]:
        return [c for c in self.calls if c[1] != "list"]


@pytest.fixture
def sysroot(tmp_path: Path):
    """Returns install(name) that materialises ``sysfs_<name>.json`` and the root path."""
    root = tmp_path / "sys"
    root.mkdir()

    def install(name: str | None = None, **extra: str) -> Path:
        files = load(f"sysfs_{name}") if name else {}
        files.update(extra)
        for rel, content in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        return root

    return install


def backend(runner: FakeRunner, sysfs_root: Path, **kw: Any) -> NdctlBackend:
    return NdctlBackend(runner=runner, sysfs_root=sysfs_root, **kw)


def pools_by_name(b: NdctlBackend) -> dict:
    return {p.name: p for p in b.pools()}


# ------------------------------------------------------------------------- pools
def test_two_regions_on_two_numa_nodes(sysroot):
    runner = FakeRunner(load("list_two_regions"))
    b = backend(runner, sysroot("two_regions"))
    pools = pools_by_name(b)
    assert sorted(pools) == ["region0", "region1"]
    for name, node in (("region0", 0), ("region1", 1)):
        p = pools[name]
        assert p.numa_node == node
        assert p.size == 1008 * MiB
        assert p.free == 1008 * MiB
        assert p.largest_extent == 1008 * MiB
        assert p.align == 16 * MiB
        assert p.problem is None and p.usable
        assert p.label_slots == 509
    assert runner.calls == [LIST_ARGV]
    assert runner.timeouts == [120]
    assert b.max_volumes() == 2 * 509
    assert b.probe() == (True, "ok")


def test_pool_math_with_existing_namespaces(sysroot):
    b = backend(FakeRunner(load("list_namespaces")), sysroot("namespaces"))
    pools = pools_by_name(b)
    # region0: 256 + 64 (devdax) + 128 (fsdax) + 64 (disabled devdax) MiB used of 1008.
    assert pools["region0"].free == 496 * MiB
    assert pools["region0"].largest_extent == 496 * MiB
    # Label slots: 505 free now + 4 configured namespaces (the size-0 seed holds none).
    assert pools["region0"].label_slots == 509
    assert pools["region1"].free == 752 * MiB
    assert pools["region1"].label_slots == 508 + 1


def test_largest_extent_is_rounded_to_the_pool_align(sysroot):
    listing = load("list_two_regions")
    region0 = next(r for r in listing["regions"] if r["dev"] == "region0")
    region0["max_available_extent"] = 100 * MiB + 4096
    region0["available_size"] = 300 * MiB
    pools = pools_by_name(backend(FakeRunner(listing), sysroot("two_regions")))
    assert pools["region0"].largest_extent == 96 * MiB
    assert pools["region0"].free == 300 * MiB


def test_misaligned_region_is_reported_with_its_start(sysroot):
    b = backend(FakeRunner(load("list_misaligned")), sysroot("misaligned"))
    pools = pools_by_name(b)
    bad = pools["region1"]
    assert not bad.usable
    assert "0x13fe00000" in bad.problem
    assert "not 16 MiB aligned" in bad.problem
    assert "misaligned to 16M" in bad.problem
    assert "align=16M" in bad.problem
    assert bad.reasons == ("misaligned",)
    assert (bad.free, bad.largest_extent, bad.label_slots) == (0, 0, 0)
    good = pools["region0"]  # starts at 0x100000000
    assert good.usable
    assert good.size == 1022 * MiB
    assert good.largest_extent == 1008 * MiB  # 1022 MiB rounded down to 16 MiB
    ok, message = b.probe()
    assert ok and "region1" in message and "unusable" in message
    assert b.max_volumes() == 509


def test_labelless_region_reported_from_sysfs_nstype(sysroot):
    b = backend(FakeRunner(load("list_labelless")), sysroot("labelless"))
    pools = pools_by_name(b)
    bad = pools["region0"]
    assert not bad.usable
    assert "label-less" in bad.problem
    assert LABELLESS_FIX in bad.problem
    assert bad.reasons == ("label_less",)
    assert (bad.free, bad.largest_extent, bad.label_slots) == (0, 0, 0)
    assert bad.size == 1008 * MiB  # the capacity is there, it just cannot be carved
    assert pools["region1"].usable


def test_labelless_region_detected_from_json_without_sysfs(sysroot):
    b = backend(FakeRunner(load("list_labelless")), sysroot())
    pools = pools_by_name(b)
    assert LABELLESS_FIX in pools["region0"].problem
    assert pools["region1"].usable  # iset_id proves labels


def test_sysfs_nstype_wins_over_json(sysroot):
    listing = load("list_two_regions")
    root = sysroot("two_regions", **{"bus/nd/devices/region1/nstype": "4\n"})
    pools = pools_by_name(backend(FakeRunner(listing), root))
    assert "label-less" in pools["region1"].problem
    assert pools["region0"].usable


def test_full_labelled_region_is_not_mistaken_for_labelless(sysroot):
    listing = load("list_two_regions")
    for region in listing["regions"]:
        region["available_size"] = region["max_available_extent"] = 0
    pools = pools_by_name(backend(FakeRunner(listing), sysroot()))
    assert all(p.usable and p.free == 0 for p in pools.values())


def test_all_regions_labelless_fails_probe(sysroot):
    listing = load("list_labelless")
    for region in listing["regions"]:
        region.pop("iset_id", None)
        region["available_size"] = region["max_available_extent"] = 0
    ok, message = backend(FakeRunner(listing), sysroot()).probe()
    assert not ok
    assert "region0" in message and "region1" in message and LABELLESS_FIX in message


def test_disabled_and_readonly_regions(sysroot):
    listing = load("list_two_regions")
    next(r for r in listing["regions"] if r["dev"] == "region1")["state"] = "disabled"
    root = sysroot("two_regions", **{"bus/nd/devices/region0/read_only": "1\n"})
    pools = pools_by_name(backend(FakeRunner(listing), root))
    assert "ndctl enable-region region1" in pools["region1"].problem
    assert "read-only" in pools["region0"].problem
    assert (pools["region1"].reasons, pools["region0"].reasons) == (("disabled",), ("read_only",))


def test_region_without_devdax_support(sysroot):
    # No dax_seed: devdax cannot be carved there, fsdax still can (nd_pmem's pfn).
    root = sysroot("two_regions", **{"bus/nd/devices/region0/dax_seed": "\n"})
    pools = pools_by_name(backend(FakeRunner(load("list_two_regions")), root))
    assert pools["region0"].usable and pools["region0"].problem_for("fsdax") is None
    assert "modprobe dax_pmem" in pools["region0"].problem_for("devdax")
    assert pools["region1"].usable and pools["region1"].problem_for("devdax") is None
    # Neither seed: nothing can be carved, the region is unusable.
    root = sysroot("two_regions", **{"bus/nd/devices/region0/dax_seed": "\n",
                                     "bus/nd/devices/region0/pfn_seed": "\n"})
    pools = pools_by_name(backend(FakeRunner(load("list_two_regions")), root))
    assert "modprobe dax_pmem" in pools["region0"].problem
    assert "nd_pmem" in pools["region0"].problem
    assert pools["region0"].reasons == ("mode",)


def test_unbound_region_is_disabled_even_if_the_listing_is_older(sysroot):
    # Right after 'ndctl disable-region' the cached listing still shows it enabled; sysfs
    # (no driver link) is live and its seeds read empty: say "disabled", not "no dax".
    root = sysroot("two_regions", **{"bus/nd/devices/region0/dax_seed": "\n",
                                     "bus/nd/devices/region0/pfn_seed": "\n",
                                     "bus/nd/devices/region0/subsystem/.keep": ""})
    pools = pools_by_name(backend(FakeRunner(load("list_two_regions")), root))
    assert pools["region0"].problem == disabled_problem("region0")


def test_no_regions_and_broken_ndctl_fail_probe(sysroot):
    ok, message = backend(FakeRunner(), sysroot()).probe()  # ndctl printed nothing
    assert not ok and "no pmem regions" in message
    runner = FakeRunner()
    runner.run_json = lambda argv, timeout=0: (_ for _ in ()).throw(  # type: ignore[method-assign]
        CommandError(argv, 1, "libndctl: ndctl_new: failed to initialize"))
    ok, message = backend(runner, sysroot()).probe()
    assert not ok and "ndctl is not usable" in message and "failed to initialize" in message


def test_regions_array_output_and_sysfs_fallbacks(sysroot, tmp_path):
    # `ndctl list -R -v` shape (an array, no mappings); DIMMs found through sysfs.
    b = backend(FakeRunner(load("list_regions_only")), sysroot("two_regions"))
    pools = pools_by_name(b)
    assert {n: p.numa_node for n, p in pools.items()} == {"region0": 0, "region1": 1}
    assert pools["region0"].label_slots == 509
    # Without sysfs the label capacity is unknown (0), never invented.
    assert all(p.label_slots == 0 for p in backend(
        FakeRunner(load("list_regions_only")), tmp_path / "no-sysfs").pools())


def test_bus_and_single_object_shapes(sysroot):
    regions = load("list_regions_only")
    buses = [{"provider": "ACPI.NFIT", "dev": "ndbus0", "regions": regions}]
    assert sorted(p.name for p in backend(FakeRunner(buses), sysroot()).pools()) == \
        ["region0", "region1"]
    single = backend(FakeRunner(regions[0]), sysroot()).pools()
    assert [p.name for p in single] == ["region1"]


@pytest.mark.parametrize(("ways", "region_align", "expected"), [
    (1, 16 * MiB, 16 * MiB),
    (2, 16 * MiB, 16 * MiB),
    (3, 48 * MiB, 48 * MiB),    # default_align(): 16 MiB x 3 when 3 does not divide 16 MiB
    (6, 96 * MiB, 96 * MiB),    # six-way interleave as in the ndctl user guide
    (1, 2 * MiB, 16 * MiB),     # a lowered region align still gets 16 MiB sizes
    (16, 16 * MiB, 32 * MiB),   # 2 MiB devdax align x 16 ways exceeds the region align
])
def test_pool_align_follows_region_align_and_ways(sysroot, ways, region_align, expected):
    listing = load("list_regions_only")
    region = listing[1]
    region["align"] = region_align
    region["mappings"] = [{"dimm": f"nmem{i}", "offset": 0, "length": 1, "position": i}
                          for i in range(ways)]
    pool = pools_by_name(backend(FakeRunner(listing), sysroot()))["region0"]
    assert pool.align == expected


# -------------------------------------------------------------------- namespaces
def test_namespaces_lists_named_devdax_and_fsdax(sysroot):
    b = backend(FakeRunner(load("list_namespaces")), sysroot("namespaces"))
    found = {ns.name: ns for ns in b.namespaces()}
    # namespace0.1 has no name, namespace0.4 and 1.1 are idle seeds. Which names are
    # volume ids is the driver's business, not the back end's.
    assert sorted(found) == ["pvc-0f1e2d3c4b", "pvc-7a3b1c9d2e", "pvc-disabled01", "scratch"]
    ns = found["pvc-7a3b1c9d2e"]
    assert ns.pool == "region0"
    assert ns.numa_node == 0
    assert ns.size == 256 * MiB            # raw size from sysfs
    assert ns.usable_size == 250 * MiB     # dax device size printed by ndctl
    assert ns.align == 2 * MiB
    assert ns.device == "/dev/dax0.0"
    assert ns.handle == "namespace0.0"
    assert (ns.mode, ns.fs_dax) == ("devdax", True)
    other = found["pvc-0f1e2d3c4b"]
    assert (other.pool, other.numa_node, other.device) == ("region1", 1, "/dev/dax1.0")
    disabled = found["pvc-disabled01"]
    assert disabled.device == "" and disabled.size == 64 * MiB
    assert b.get("pvc-7a3b1c9d2e") == ns
    scratch = b.get("scratch")
    assert (scratch.mode, scratch.device, scratch.size, scratch.usable_size) == \
        ("fsdax", "/dev/pmem0.2", 128 * MiB, 124 * MiB)


DEVDAX_VOL = "pmem-3c1f0a9e5b7d4e2a8f6c0b1d9e7a5c3f"    # namespace0.0, region0
FSDAX_VOL = "pmem-8e2d4b6f1a3c5e7d9b0f2a4c6e8d0b1a"     # namespace0.1, region0
IDLE_FSDAX_VOL = "pmem-0b2d4f6a8c0e2b4d6f8a0c2e4b6d8f0a"  # namespace1.0, region1, disabled
SECTOR_NAME = "pmem-5a7c9e1b3d5f7a9c1e3b5d7f9a1c3e5b"   # namespace0.2: BTT, never ours


def test_namespaces_lists_devdax_and_fsdax_with_their_devices(sysroot):
    b = backend(FakeRunner(load("list_fsdax")), sysroot("fsdax"))
    found = {ns.name: ns for ns in b.namespaces()}
    assert sorted(found) == sorted([DEVDAX_VOL, FSDAX_VOL, IDLE_FSDAX_VOL])  # no sector
    dev = found[DEVDAX_VOL]
    assert (dev.mode, dev.device, dev.size, dev.usable_size, dev.align, dev.fs_dax) == \
        ("devdax", "/dev/dax0.0", 256 * MiB, 250 * MiB, 2 * MiB, True)
    fs = found[FSDAX_VOL]
    assert fs.mode == "fsdax"
    assert fs.device == "/dev/pmem0.1"     # the block device, not a dax node
    assert fs.fs_dax                       # real pmem: mount -o dax works
    assert fs.size == 512 * MiB            # raw size from sysfs
    assert fs.usable_size == 502 * MiB     # pfn (block device) size printed by ndctl
    assert fs.usable_size == devdax_usable(fs.size, fs.align)  # same struct-page arithmetic
    assert (fs.pool, fs.numa_node, fs.align, fs.handle) == \
        ("region0", 0, 2 * MiB, "namespace0.1")
    idle = found[IDLE_FSDAX_VOL]
    assert (idle.mode, idle.device, idle.size, idle.pool, idle.numa_node) == \
        ("fsdax", "", 128 * MiB, "region1", 1)
    assert b.get(FSDAX_VOL) == fs
    assert b.get(SECTOR_NAME) is None
    # Every configured namespace holds a label slot, whatever its mode: 506 free + 3.
    pools = pools_by_name(b)
    assert pools["region0"].label_slots == 509
    assert pools["region0"].free == 176 * MiB


def test_fsdax_raw_size_estimated_without_sysfs(sysroot):
    ns = backend(FakeRunner(load("list_fsdax")), sysroot()).get(FSDAX_VOL)
    assert ns.size == 512 * MiB


def test_namespace_raw_size_estimated_without_sysfs(sysroot):
    b = backend(FakeRunner(load("list_namespaces")), sysroot())
    ns = b.get("pvc-7a3b1c9d2e")
    assert ns.size == 256 * MiB
    assert devdax_usable(ns.size, ns.align) == ns.usable_size


# ------------------------------------------------------------------------ create
CREATE_ARGV = ["ndctl", "create-namespace", "--region=region1", "--mode=devdax", "--map=dev",
               "--size=268435456", "--align=2097152", "--name=pvc-5d4c3b2a19"]
CREATE_FSDAX_ARGV = ["ndctl", "create-namespace", "--region=region1", "--mode=fsdax",
                     "--map=dev", "--size=268435456", "--align=2097152",
                     "--name=pvc-5d4c3b2a19"]


def test_create_runs_exact_argv_and_parses_output(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_devdax"))
    b = backend(runner, sysroot("namespaces"))
    ns = b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert runner.writes() == [CREATE_ARGV]
    assert set(runner.timeouts) == {120}
    assert ns.name == "pvc-5d4c3b2a19"
    assert ns.pool == "region1"
    assert ns.numa_node == 1       # create output has no numa_node: the region's
    assert ns.size == 256 * MiB
    assert ns.usable_size == devdax_usable(256 * MiB, 2 * MiB) == 250 * MiB
    assert ns.align == 2 * MiB
    assert ns.device == "/dev/dax1.1"
    assert ns.handle == "namespace1.1"


def test_create_fsdax_runs_exact_argv_and_parses_output(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_fsdax"))
    b = backend(runner, sysroot("namespaces"))
    ns = b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    assert runner.writes() == [CREATE_FSDAX_ARGV]
    assert ns.mode == "fsdax" and ns.fs_dax
    assert ns.device == "/dev/pmem1.1"
    assert ns.handle == "namespace1.1"
    assert (ns.pool, ns.numa_node) == ("region1", 1)
    assert ns.size == 256 * MiB
    assert ns.usable_size == devdax_usable(256 * MiB, 2 * MiB) == 250 * MiB
    assert ns.align == 2 * MiB


def test_create_defaults_to_devdax_and_rejects_unknown_modes(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_devdax"))
    b = backend(runner, sysroot("namespaces"))
    assert b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB).mode == "devdax"
    for mode in ("sector", "raw", "FSDAX"):
        with pytest.raises(InvalidArgument, match="unknown namespace mode"):
            b.create("pvc-other", "region1", 256 * MiB, 2 * MiB, mode=mode)
    assert runner.writes() == [CREATE_ARGV]


def test_create_fsdax_output_of_the_wrong_mode_is_re_read(sysroot, caplog):
    # ndctl printed something else (a devdax object): trust the listing, not the output.
    after = with_namespace(load("list_namespaces"), "region1",
                           dict(load("create_fsdax"), numa_node=1))
    runner = FakeRunner(load("list_namespaces"), after, create=load("create_devdax"))
    with caplog.at_level(logging.WARNING):
        ns = backend(runner, sysroot("namespaces")).create(
            "pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    assert (ns.mode, ns.device) == ("fsdax", "/dev/pmem1.1")
    assert "unexpected create-namespace output" in caplog.text


def test_create_name_taken_by_any_mode_is_already_exists(sysroot):
    runner = FakeRunner(load("list_fsdax"), create=load("create_fsdax"))
    b = backend(runner, sysroot("fsdax"))
    for taken in (FSDAX_VOL, SECTOR_NAME):
        with pytest.raises(AlreadyExists):
            b.create(taken, "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    assert runner.writes() == []


def test_create_uses_configured_ndctl_and_timeout(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_devdax"))
    b = backend(runner, sysroot("namespaces"), ndctl="/opt/ndctl/bin/ndctl", timeout=33)
    b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert {c[0] for c in runner.calls} == {"/opt/ndctl/bin/ndctl"}
    assert set(runner.timeouts) == {33}


def test_create_warns_when_kernel_usable_size_differs(sysroot, caplog):
    out = load("create_devdax")
    out["daxregion"]["devices"][0]["size"] = 248 * MiB
    b = backend(FakeRunner(load("list_namespaces"), create=out), sysroot("namespaces"))
    with caplog.at_level(logging.WARNING, logger="csi_pmem.driver.backends.ndctl"):
        ns = b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert ns.usable_size == 248 * MiB  # the kernel's word, not the formula's
    assert "sizes.devdax_usable predicts 262144000" in caplog.text


def test_create_existing_name_is_already_exists_without_ndctl_write(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_devdax"))
    b = backend(runner, sysroot("namespaces"))
    with pytest.raises(AlreadyExists, match=r"namespace0\.0 on region0"):
        b.create("pvc-7a3b1c9d2e", "region1", 256 * MiB, 2 * MiB)
    assert runner.writes() == []


def test_create_on_a_problem_region_is_unavailable_without_ndctl_write(sysroot):
    runner = FakeRunner(load("list_labelless"), create=load("create_devdax"))
    b = backend(runner, sysroot("labelless"))
    with pytest.raises(Unavailable, match="init-labels"):
        b.create("pvc-5d4c3b2a19", "region0", 256 * MiB, 2 * MiB)
    with pytest.raises(Unavailable, match="not present"):
        b.create("pvc-5d4c3b2a19", "region7", 256 * MiB, 2 * MiB)
    assert runner.writes() == []


@pytest.mark.parametrize(("name", "size", "align"), [
    ("pvc-x", 8 * MiB, 2 * MiB),                 # not a multiple of the 16 MiB region align
    ("pvc-x", 256 * MiB + 2 * MiB, 2 * MiB),
    ("pvc-x", 256 * MiB, 3 * MiB),               # not a multiple of the devdax align
    ("", 256 * MiB, 2 * MiB),
    ("x" * 64, 256 * MiB, 2 * MiB),              # alt-name holds 63 bytes
    ("has space", 256 * MiB, 2 * MiB),
])
def test_create_rejects_bad_requests_before_ndctl(sysroot, name, size, align):
    runner = FakeRunner(load("list_namespaces"), create=load("create_devdax"))
    with pytest.raises(InvalidArgument):
        backend(runner, sysroot("namespaces")).create(name, "region1", size, align)
    assert runner.writes() == []


def test_create_checks_devdax_align_times_interleave_ways(sysroot):
    listing = load("list_regions_only")
    listing[0]["mappings"] = [{"dimm": "nmem1", "offset": 0, "length": 1, "position": 0},
                              {"dimm": "nmem2", "offset": 0, "length": 1, "position": 1}]
    listing[0]["size"] = listing[0]["available_size"] = listing[0]["max_available_extent"] = \
        8 * GiB
    runner = FakeRunner(listing, create=load("create_devdax"))
    with pytest.raises(InvalidArgument, match="2 interleave ways"):
        backend(runner, sysroot()).create("pvc-x", "region1", 3 * GiB, GiB)
    assert runner.writes() == []


ENOSPC = "failed to create namespace: No space left on device\n"
LABELLESS = ("  Error: Legacy / label-less namespaces do not support sub-dividing a region\n"
             "  Error: Retry without -s/--size=\n\nfailed to create namespace: Invalid argument\n")
MISALIGNED = ("  Error: namespace1.1 misaligned to 16M, adjust region alignment and retry\n\n"
              "failed to create namespace: Invalid argument\n")
EXISTS = "create-namespace: namespace1.1: set_alt_name failed: File exists\n"
SIZE = ("  Error: '--size=' must align to interleave-width: 2 and alignment: 2097152\n"
        "did you intend --size=272629760?\n\nfailed to create namespace: Invalid argument\n")
ALIGN = ("  Error: unsupported align: 1073741824\n\n"
         "failed to create namespace: No such device or address\n")
NODAX = ("  Error: Kernel does not support devdax mode\n\n"
         "failed to create namespace: No such device\n")
ENABLE = ("libndctl: ndctl_dax_enable: dax1.1: failed to enable\n"
          "  Error: namespace1.1: failed to enable\n\n"
          "failed to create namespace: No such device or address\n")


@pytest.mark.parametrize(("stderr", "exc", "fragments"), [
    (ENOSPC, ResourceExhausted, ["region1", "NUMA node 1", "256Mi", "No space left on device"]),
    (LABELLESS, Unavailable, [LABELLESS_FIX, "region1"]),
    (MISALIGNED, Unavailable, ["new namespace on region1", "not 16 MiB aligned",
                               "misaligned to 16M"]),
    (EXISTS, AlreadyExists, ["pvc-5d4c3b2a19", "File exists"]),
    (SIZE, InvalidArgument, ["interleave-width: 2", "region granularity 16Mi"]),
    (ALIGN, InvalidArgument, ["does not support the 2Mi devdax align", "unsupported align",
                                "1Gi pages"]),
    (NODAX, Unavailable, ["modprobe dax_pmem", "Kernel does not support devdax mode"]),
    (ENABLE, CommandError, ["dax_pmem", "dmesg"]),
    ("something nobody has seen\n", CommandError, ["something nobody has seen"]),
])
def test_create_failures_become_domain_errors(sysroot, stderr, exc, fragments):
    err = CommandError(CREATE_ARGV, 234, stderr)
    runner = FakeRunner(load("list_namespaces"), create=err)
    b = backend(runner, sysroot("namespaces"))
    with pytest.raises(exc) as info:
        b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert type(info.value) is exc
    for fragment in fragments:
        assert fragment in str(info.value)
    assert runner.writes() == [CREATE_ARGV]  # nothing was cleaned up: nothing was left


# ndctl/namespace.c validate_namespace_options(): without a pfn seed, --align fails
# first; without --align, do_setup_pfn() fails with "cannot support requested mode".
NOFSDAX_ALIGN = ("  Error: Kernel does not support setting an alignment in fsdax mode\n\n"
                 "failed to create namespace: Invalid argument\n")
NOFSDAX_MODE = ("  Error: operation failed, region1 cannot support requested mode\n\n"
                "failed to create namespace: Invalid argument\n")
ENABLE_FSDAX = ("libndctl: ndctl_pfn_enable: pfn1.1: failed to enable\n"
                "  Error: namespace1.1: failed to enable\n\n"
                "failed to create namespace: No such device or address\n")


@pytest.mark.parametrize(("stderr", "exc", "fragments", "absent"), [
    (ENOSPC, ResourceExhausted, ["region1", "256Mi", "fsdax namespace"], ["devdax"]),
    (NOFSDAX_ALIGN, Unavailable, ["nd_pmem", "CONFIG_FS_DAX", "ZONE_DEVICE",
                                  "setting an alignment in fsdax mode"], ["dax_pmem"]),
    (NOFSDAX_MODE, Unavailable, ["modprobe nd_pmem", "cannot support requested mode"],
     ["device_dax"]),
    (ALIGN, InvalidArgument, ["does not support the 2Mi fsdax align", "unsupported align"],
     ["device-dax"]),
    (ENABLE_FSDAX, CommandError, ["fsdax block device", "nd_pmem", "dmesg"], ["dax_pmem"]),
    (MISALIGNED, Unavailable, ["not 16 MiB aligned"], []),
])
def test_create_fsdax_failures_name_the_mode(sysroot, stderr, exc, fragments, absent):
    runner = FakeRunner(load("list_namespaces"), create=CommandError(CREATE_FSDAX_ARGV, 234,
                                                                     stderr))
    with pytest.raises(exc) as info:
        backend(runner, sysroot("namespaces")).create(
            "pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    assert type(info.value) is exc
    for fragment in fragments:
        assert fragment in str(info.value)
    for fragment in absent:
        assert fragment not in str(info.value)
    assert runner.writes() == [CREATE_FSDAX_ARGV]


def test_create_fsdax_size_errors_name_the_fsdax_align(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=load("create_fsdax"))
    with pytest.raises(InvalidArgument, match="fsdax align"):
        backend(runner, sysroot("namespaces")).create(
            "pvc-x", "region1", 256 * MiB, 3 * MiB, mode="fsdax")
    assert runner.writes() == []


@pytest.mark.parametrize(("stderr", "kind"), [
    (ENOSPC, "space"), (LABELLESS, "labelless"), (MISALIGNED, "misaligned"),
    (EXISTS, "exists"), (SIZE, "size"), (ALIGN, "align"), (NODAX, "nodax"),
    (NOFSDAX_ALIGN, "nodax"), (NOFSDAX_MODE, "nodax"), (ENABLE_FSDAX, None),
    ("  Error: namespace0.0: read-only, re-configuration disabled\n", "readonly"),
    (ENABLE, None), ("", None),
])
def test_classify(stderr, kind):
    assert classify(stderr) == kind


def test_learned_problem_makes_pool_unusable(sysroot):
    runner = FakeRunner(load("list_namespaces"), create=CommandError(CREATE_ARGV, 22, LABELLESS))
    b = backend(runner, sysroot("namespaces"))
    with pytest.raises(Unavailable):
        b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    pools = pools_by_name(b)
    assert LABELLESS_FIX in pools["region1"].problem  # sysfs said labelled; ndctl knew better
    assert pools["region1"].reasons == ("label_less",)
    assert pools["region0"].usable
    # The next create is refused up front instead of failing inside ndctl again.
    with pytest.raises(Unavailable):
        b.create("pvc-other", "region1", 256 * MiB, 2 * MiB)
    assert runner.writes() == [CREATE_ARGV]


def with_namespace(listing: dict, region: str, ns: dict) -> dict:
    listing = copy.deepcopy(listing)
    next(r for r in listing["regions"] if r["dev"] == region)["namespaces"].append(ns)
    return listing


def test_create_timeout_that_completed_returns_the_namespace(sysroot, caplog):
    before = load("list_namespaces")
    created = dict(load("create_devdax"), numa_node=1)
    after = with_namespace(before, "region1", created)
    runner = FakeRunner(before, after, create=CommandError(CREATE_ARGV, None, ""))
    b = backend(runner, sysroot("namespaces"))
    with caplog.at_level(logging.WARNING):
        ns = b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert ns.device == "/dev/dax1.1" and ns.usable_size == 250 * MiB
    assert runner.writes() == [CREATE_ARGV]
    assert "namespace is complete" in caplog.text


def test_create_timeout_removes_a_partial_namespace(sysroot):
    before = load("list_namespaces")
    partial = {"dev": "namespace1.1", "mode": "raw", "size": 256 * MiB,
               "uuid": "3e9c2a71-58b4-4d0f-b6a3-91c7e2f04d58", "sector_size": 512,
               "state": "disabled", "name": "pvc-5d4c3b2a19"}
    after = with_namespace(before, "region1", partial)
    runner = FakeRunner(before, after, before, create=CommandError(CREATE_ARGV, None, ""))
    b = backend(runner, sysroot("namespaces"))
    with pytest.raises(CommandError, match="timed out"):
        b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB)
    assert runner.writes() == [CREATE_ARGV,
                               ["ndctl", "destroy-namespace", "namespace1.1", "--force"]]


def test_create_fsdax_timeout_that_completed_returns_the_namespace(sysroot, caplog):
    before = load("list_namespaces")
    after = with_namespace(before, "region1", dict(load("create_fsdax"), numa_node=1))
    runner = FakeRunner(before, after, create=CommandError(CREATE_FSDAX_ARGV, None, ""))
    b = backend(runner, sysroot("namespaces"))
    with caplog.at_level(logging.WARNING):
        ns = b.create("pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    assert (ns.mode, ns.device, ns.usable_size) == ("fsdax", "/dev/pmem1.1", 250 * MiB)
    assert runner.writes() == [CREATE_FSDAX_ARGV]
    assert "namespace is complete" in caplog.text


@pytest.mark.parametrize(("left", "disable"), [
    # Killed after the pfn device claimed the namespace, before it was enabled: the
    # namespace is fsdax but idle, without size or blockdev.
    ({"dev": "namespace1.1", "mode": "fsdax", "map": "dev",
      "uuid": "9a1c3e5f-7b2d-4f60-8e4a-c6b8d0f2a413", "sector_size": 512,
      "align": 2097152, "state": "disabled", "name": "pvc-5d4c3b2a19"}, False),
    # An enabled namespace, but not of the requested mode: not what was asked for.
    (dict(load("create_devdax"), numa_node=1), True),
])
def test_create_fsdax_timeout_removes_what_is_not_a_complete_fsdax_namespace(
        sysroot, left, disable):
    before = load("list_namespaces")
    after = with_namespace(before, "region1", left)
    runner = FakeRunner(before, after, before, create=CommandError(CREATE_FSDAX_ARGV, None, ""))
    with pytest.raises(CommandError, match="timed out"):
        backend(runner, sysroot("namespaces")).create(
            "pvc-5d4c3b2a19", "region1", 256 * MiB, 2 * MiB, mode="fsdax")
    cleanup = [["ndctl", "destroy-namespace", "namespace1.1", "--force"]]
    if disable:
        cleanup.insert(0, ["ndctl", "disable-namespace", "namespace1.1"])
    assert runner.writes() == [CREATE_FSDAX_ARGV, *cleanup]


# ----------------------------------------------------------------------- destroy
def destroyed(listing: dict, handle: str) -> dict:
    """The listing after ndctl destroyed ``handle``: a size-0 raw seed without a name."""
    listing = copy.deepcopy(listing)
    for region in listing["regions"]:
        for i, ns in enumerate(region.get("namespaces") or []):
            if ns["dev"] == handle:
                region["namespaces"][i] = {
                    "dev": handle, "mode": "raw", "size": 0, "sector_size": 512,
                    "uuid": "00000000-0000-0000-0000-000000000000", "state": "disabled"}
    return listing


def test_destroy_disables_then_destroys_by_handle(sysroot):
    before = load("list_namespaces")
    runner = FakeRunner(before, destroyed(before, "namespace0.0"))
    backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")
    assert runner.writes() == [["ndctl", "disable-namespace", "namespace0.0"],
                               ["ndctl", "destroy-namespace", "namespace0.0", "--force"]]
    assert set(runner.timeouts) == {120}


def test_destroy_confirmed_by_ndctl_needs_no_second_listing(sysroot):
    """ndctl prints "destroyed 1 namespace" (ndctl/namespace.c): then the listing that
    checks the namespace is gone is one exec too many."""
    before = load("list_namespaces")
    runner = FakeRunner(before, before)  # a second listing would still show it
    runner.said = {"disable-namespace": "disabled 1 namespace\n",
                   "destroy-namespace": "destroyed 1 namespace\n"}
    backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")
    assert runner.calls == [LIST_ARGV, ["ndctl", "disable-namespace", "namespace0.0"],
                            ["ndctl", "destroy-namespace", "namespace0.0", "--force"]]
    runner = FakeRunner(before, before)
    runner.said = {"destroy-namespace": "destroyed 0 namespaces\n"}
    with pytest.raises(BackendError, match="still present"):
        backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")


def test_reads_after_a_write_list_afresh(sysroot):
    """The listing cached during a destroy or create predates it: the next read (a
    GetCapacity right after) must list again, not show the old free space."""
    before = load("list_namespaces")
    after = destroyed(before, "namespace0.0")

    class ReadDuringDestroy(FakeRunner):
        def run(self, argv, *args, **kwargs):
            if argv[1] == "destroy-namespace":
                b.pools()  # a GetCapacity while ndctl destroys: lists the old state
            return super().run(argv, *args, **kwargs)

    runner = ReadDuringDestroy(before, before, after)
    runner.said = {"destroy-namespace": "destroyed 1 namespace\n"}
    b = backend(runner, sysroot("namespaces"))
    b.destroy("pvc-7a3b1c9d2e")
    assert "pvc-7a3b1c9d2e" not in [ns.name for ns in b.namespaces()], \
        "a read right after the destroy showed the listing from before it"
    assert runner.calls.count(LIST_ARGV) == 3


def test_destroy_of_a_disabled_namespace_skips_disable(sysroot):
    before = load("list_namespaces")
    runner = FakeRunner(before, destroyed(before, "namespace0.3"))
    backend(runner, sysroot("namespaces")).destroy("pvc-disabled01")
    assert runner.writes() == [["ndctl", "destroy-namespace", "namespace0.3", "--force"]]


def test_destroy_missing_name_is_ok_and_touches_nothing(sysroot):
    runner = FakeRunner(load("list_namespaces"))
    backend(runner, sysroot("namespaces")).destroy("pvc-never-created")
    assert runner.writes() == []
    assert runner.calls == [LIST_ARGV]


def test_destroy_never_touches_unnamed_or_sector_namespaces(sysroot):
    runner = FakeRunner(load("list_fsdax"))
    b = backend(runner, sysroot("fsdax"))
    with pytest.raises(InvalidArgument):
        b.destroy("")
    b.destroy(SECTOR_NAME)  # a BTT namespace carrying a volume id: never ours
    assert runner.writes() == []


def test_destroy_of_a_named_fsdax_namespace(sysroot):
    before = load("list_fsdax")
    runner = FakeRunner(before, destroyed(before, "namespace0.1"))
    backend(runner, sysroot("fsdax")).destroy(FSDAX_VOL)
    assert runner.writes() == [["ndctl", "disable-namespace", "namespace0.1"],
                               ["ndctl", "destroy-namespace", "namespace0.1", "--force"]]


def test_destroy_of_a_disabled_fsdax_namespace_skips_disable(sysroot):
    before = load("list_fsdax")
    runner = FakeRunner(before, destroyed(before, "namespace1.0"))
    backend(runner, sysroot("fsdax")).destroy(IDLE_FSDAX_VOL)
    assert runner.writes() == [["ndctl", "destroy-namespace", "namespace1.0", "--force"]]


def test_destroy_of_a_mounted_fsdax_namespace_reports_busy(sysroot):
    runner = FakeRunner(load("list_fsdax"))
    runner.fail["disable-namespace"] = CommandError(
        ["ndctl", "disable-namespace", "namespace0.1"], 1,
        "libndctl: ndctl_namespace_disable_safe: namespace0.1: active mount(s)\n"
        "error disabling namespaces: Device or resource busy\n")
    with pytest.raises(CommandError, match="busy"):
        backend(runner, sysroot("fsdax")).destroy(FSDAX_VOL)
    assert runner.writes() == [["ndctl", "disable-namespace", "namespace0.1"]]


def test_destroy_that_leaves_the_namespace_is_an_error(sysroot):
    runner = FakeRunner(load("list_namespaces"))  # still listed afterwards
    with pytest.raises(BackendError, match="still present"):
        backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")


def test_destroy_failure_of_a_vanished_namespace_is_ok(sysroot):
    before = load("list_namespaces")
    gone = destroyed(before, "namespace0.0")
    runner = FakeRunner(before, gone)
    runner.fail["disable-namespace"] = CommandError(
        ["ndctl", "disable-namespace", "namespace0.0"], 1, "error disabling namespaces: "
        "No such device or address\n")
    backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")
    assert runner.writes() == [["ndctl", "disable-namespace", "namespace0.0"]]


def test_destroy_failure_of_a_present_namespace_raises(sysroot):
    runner = FakeRunner(load("list_namespaces"))
    runner.fail["destroy-namespace"] = CommandError(
        ["ndctl", "destroy-namespace", "namespace0.0", "--force"], 1,
        "error destroying namespaces: Device or resource busy\n")
    with pytest.raises(CommandError, match="busy"):
        backend(runner, sysroot("namespaces")).destroy("pvc-7a3b1c9d2e")


# ------------------------------------------------------------------------ devices
def test_open_device_flags(sysroot, tmp_path):
    device = tmp_path / "dax9.0"
    device.write_bytes(b"\0" * 4096)
    b = backend(FakeRunner(load("list_namespaces")), sysroot("namespaces"))
    ns = b.get("pvc-7a3b1c9d2e")
    ns = type(ns)(**{**ns.to_dict(), "device": str(device)})
    for readonly, mode in ((True, os.O_RDONLY), (False, os.O_RDWR)):
        fd = b.open_device(ns, readonly=readonly)
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == mode
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        finally:
            os.close(fd)


def test_open_device_errors(sysroot, tmp_path):
    b = backend(FakeRunner(load("list_namespaces")), sysroot("namespaces"))
    disabled = b.get("pvc-disabled01")
    with pytest.raises(Unavailable, match=r"enable-namespace namespace0\.3"):
        b.open_device(disabled, readonly=True)
    ns = b.get("pvc-7a3b1c9d2e")
    missing = type(ns)(**{**ns.to_dict(), "device": str(tmp_path / "nope")})
    with pytest.raises(NotFound):
        b.open_device(missing, readonly=False)


def test_open_device_of_fsdax_namespaces(sysroot, tmp_path):
    b = backend(FakeRunner(load("list_fsdax")), sysroot("fsdax"))
    with pytest.raises(Unavailable, match=r"no block device; .*enable-namespace namespace1\.0"):
        b.open_device(b.get(IDLE_FSDAX_VOL), readonly=True)
    with pytest.raises(Unavailable, match="no dax device"):
        b.open_device(type(b.get(DEVDAX_VOL))(**{**b.get(DEVDAX_VOL).to_dict(), "device": ""}),
                      readonly=True)
    device = tmp_path / "pmem0.1"  # stands in for the block device node
    device.write_bytes(b"\0" * 4096)
    ns = b.get(FSDAX_VOL)
    fd = b.open_device(type(ns)(**{**ns.to_dict(), "device": str(device)}), readonly=True)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    finally:
        os.close(fd)


# ------------------------------------------------------------------- udev watcher
class Recorder:
    def __init__(self, fail_first: int = 0):
        self.events: list[tuple[str, str]] = []
        self.fail_first = fail_first
        self.seen = threading.Event()

    def __call__(self, action: str, name: str) -> None:
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("callback bug")
        self.events.append((action, name))
        if len(self.events) >= 2:
            self.seen.set()


def test_watcher_polling_fallback_calls_back_and_stops():
    rec = Recorder()
    watcher = DeviceWatcher(rec, poll_interval=0.02, use_netlink=False)
    watcher.start()
    try:
        assert rec.seen.wait(5)
        assert watcher.mode == "polling" and watcher.running
    finally:
        watcher.stop()
    assert not watcher.running
    assert set(rec.events) == {("poll", "")}
    count = len(rec.events)
    time.sleep(0.1)
    assert len(rec.events) == count  # really stopped


def test_watcher_falls_back_when_netlink_is_unavailable(caplog):
    def no_libudev(subsystems, source):
        raise ImportError("libudev.so.1: cannot open shared object file")

    rec = Recorder()
    watcher = DeviceWatcher(rec, poll_interval=0.02, monitor_factory=no_libudev)
    with caplog.at_level(logging.INFO, logger="csi_pmem.driver.udev"):
        watcher.start()
    try:
        assert rec.seen.wait(5)
    finally:
        watcher.stop()
    assert watcher.mode == "polling"
    assert "falling back to polling" in caplog.text and "libudev" in caplog.text


def test_watcher_survives_callback_errors():
    rec = Recorder(fail_first=2)
    watcher = DeviceWatcher(rec, poll_interval=0.02, use_netlink=False)
    watcher.start()
    try:
        assert rec.seen.wait(5)
    finally:
        watcher.stop()


class FakeMonitor:
    def __init__(self, events: list[Any], then_fail: bool = False):
        self.events = list(events)
        self.then_fail = then_fail
        self.subsystems: tuple[str, ...] = ()

    def poll(self, timeout: float | None = None) -> Any:
        if self.events:
            return self.events.pop(0)
        if self.then_fail:
            raise OSError("netlink socket closed")
        time.sleep(0.01)
        return None


def test_watcher_netlink_events_reach_the_callback():
    monitor = FakeMonitor([SimpleNamespace(action="add", sys_name="dax1.1"),
                           SimpleNamespace(action="remove", sys_name="namespace1.1")])
    asked = []

    def factory(subsystems, source):
        asked.append((tuple(subsystems), source))
        return monitor

    rec = Recorder()
    watcher = DeviceWatcher(rec, monitor_factory=factory, resync_interval=None)
    watcher.start()
    try:
        assert rec.seen.wait(5)
        assert watcher.mode == "netlink"
    finally:
        watcher.stop()
    assert rec.events[:2] == [("add", "dax1.1"), ("remove", "namespace1.1")]
    assert asked == [(("nd", "dax"), "udev")]


def test_watcher_netlink_resyncs_and_falls_back_on_socket_errors():
    rec = Recorder()
    watcher = DeviceWatcher(rec, poll_interval=0.02, resync_interval=0.02,
                            monitor_factory=lambda s, src: FakeMonitor([]))
    watcher.start()
    try:
        assert rec.seen.wait(5)
    finally:
        watcher.stop()
    assert set(rec.events) == {("poll", "")}

    rec = Recorder()
    watcher = DeviceWatcher(rec, poll_interval=0.02, resync_interval=None,
                            monitor_factory=lambda s, src: FakeMonitor([], then_fail=True))
    watcher.start()
    try:
        assert rec.seen.wait(5)
        assert watcher.mode == "polling"
    finally:
        watcher.stop()


def test_netlink_monitor_filters_nd_and_dax(monkeypatch):
    calls = []

    class FakeMonitorClass:
        @classmethod
        def from_netlink(cls, context, source="udev"):
            calls.append(("from_netlink", source))
            return cls()

        def filter_by(self, subsystem, device_type=None):
            calls.append(("filter_by", subsystem))

        def start(self):
            calls.append(("start",))

    fake = SimpleNamespace(Context=lambda: object(), Monitor=FakeMonitorClass)
    monkeypatch.setitem(sys.modules, "pyudev", fake)
    monitor = netlink_monitor(("nd", "dax"), source="kernel")
    assert isinstance(monitor, FakeMonitorClass)
    assert calls == [("from_netlink", "kernel"), ("filter_by", "nd"), ("filter_by", "dax"),
                     ("start",)]


def test_watcher_with_the_real_pyudev_starts_and_stops():
    watcher = DeviceWatcher(Recorder(), poll_interval=0.05)
    watcher.start()
    try:
        assert watcher.mode in ("netlink", "polling") and watcher.running
    finally:
        watcher.stop()
    assert not watcher.running


# ------------------------------------------------------------------------- cache
def test_reads_share_one_listing_until_invalidated(sysroot):
    runner = FakeRunner(load("list_two_regions"))
    b = backend(runner, sysroot("two_regions"), cache_seconds=60)
    b.pools()
    b.namespaces()
    b.pools()
    assert runner.calls == [LIST_ARGV]  # one ndctl call for three reads
    b.invalidate()  # what the device watcher does on a uevent
    b.pools()
    assert runner.calls == [LIST_ARGV, LIST_ARGV]
    b0 = backend(runner, sysroot("two_regions"), cache_seconds=0)
    b0.pools()
    b0.pools()
    assert runner.calls == [LIST_ARGV] * 4  # no cache: every read lists


def test_a_listing_that_overlaps_a_change_does_not_become_the_cache(sysroot):
    """A read lists; while ndctl runs, a destroy (or a uevent) invalidates the cache.
    That listing may predate the change: it answers its own read, but the next read
    lists again. It used to be cached, and a scrape listing during a scrub's teardown
    left GetCapacity short by the scratch namespace for the cache's lifetime."""
    before, after = load("list_namespaces"), load("list_two_regions")
    runner = FakeRunner(before, after)
    b = backend(runner, sysroot("two_regions"), cache_seconds=60)
    run_json = runner.run_json

    def listing_overlapped_by_a_change(argv, timeout=60.0):
        out = run_json(argv, timeout)
        if len(runner.calls) == 1:
            b.invalidate()  # the change lands while the first listing is on its way
        return out

    runner.run_json = listing_overlapped_by_a_change
    first = b.namespaces()
    second = b.namespaces()
    assert runner.calls == [LIST_ARGV, LIST_ARGV]
    assert first != second  # the second read saw the listing after the change
    b.namespaces()
    assert runner.calls == [LIST_ARGV, LIST_ARGV]  # and that one is cached


# ----------------------------------------------------- a destroy cut short, resumed
def test_resumed_delete_destroys_the_raw_leftover_of_a_destroy_cut_short(sysroot, tmp_path):
    """Killed between disable-namespace and destroy-namespace, the namespace keeps its
    name and label but the kernel lists it as a disabled raw namespace (its dax claim is
    gone; seen in the VM tier), which is no volume namespace. The resumed delete must
    still destroy it: it used to drop the record and leak the namespace and its label."""
    from csi_pmem.driver.config import DriverConfig
    from csi_pmem.driver.core import Driver, volume_id_for
    from csi_pmem.driver.daxsock import DaxSocketServer
    from csi_pmem.driver.state import DELETING, RegionRecord, StateStore, VolumeRecord

    vid = volume_id_for("victim")
    before = load("list_namespaces")
    for region in before["regions"]:
        for ns in region.get("namespaces") or []:
            if ns["dev"] == "namespace0.3":  # disabled, as disable-namespace leaves it
                ns.update(mode="raw", name=vid)
                ns.pop("map", None)
                ns.pop("align", None)
    runner = FakeRunner(before, before, destroyed(before, "namespace0.3"))
    b = backend(runner, sysroot("namespaces"))
    assert b.get(vid) is None, "the premise: the leftover is no volume namespace"
    store = StateStore(tmp_path / "state")
    for region in before["regions"]:  # clean, expecting the free space it shows
        store.put_region(RegionRecord(pool=region["dev"], clean=True,
                                      free=region["available_size"]))
    store.put(VolumeRecord(id=vid, name="victim", state=DELETING, params={},
                           required_bytes=64 * MiB, pool="region0", size=80 * MiB,
                           erased=True))
    d = Driver(DriverConfig(driver_name="csi-pmem.test", node_id="n",
                            kubelet_dir=str(tmp_path), scrub=False),
               b, store, DaxSocketServer())
    try:
        d.reconcile()
        assert d.eraser.wait(vid, 10)
    finally:
        d.close()
    assert ["ndctl", "destroy-namespace", "namespace0.3", "--force"] in runner.writes()
    assert ["ndctl", "disable-namespace", "namespace0.3"] not in runner.writes()
    assert store.get(vid) is None
    assert store.get_region("region0").clean, "an erased leftover dirtied the region"
