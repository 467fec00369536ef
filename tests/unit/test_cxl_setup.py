"""The driver's opt-in CXL region set-up (csi_pmem.driver.backends.cxl_setup): which
``cxl create-region`` it runs, what it says when it cannot, and that it never stops
the driver. The listings have the shape cxl 81 printed in the VM tier's CXL boot
(e2e/vm/test_guest_cxl.py: a pmem and a ram type-3 device, one root decoder each)."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from csi_pmem.driver.backends import cxl_setup
from csi_pmem.driver.backends.cxl_setup import (
    CxlRegionMaker,
    RegionPlan,
    await_region_children,
    plan_regions,
)
from csi_pmem.errors import CommandError

M512 = 512 << 20
G4 = 4 << 30


def memdevs():
    return [{"memdev": "mem0", "ram_size": M512, "serial": 7, "host": "0000:df:00.0"},
            {"memdev": "mem1", "pmem_size": M512, "serial": 8, "host": "0000:0d:00.0"}]


def roots():
    return [{"decoder": "decoder0.0", "size": G4, "max_available_extent": G4,
             "pmem_capable": True, "volatile_capable": True, "nr_targets": 1},
            {"decoder": "decoder0.1", "size": G4, "max_available_extent": G4,
             "pmem_capable": True, "volatile_capable": True, "nr_targets": 1}]


REACH = {"decoder0.0": {"mem1"}, "decoder0.1": {"mem0"}}


class FakeCxl:
    """``cxl list`` and ``cxl create-region`` over a small model of the topology."""

    def __init__(self, sysfs: Path | None = None):
        self.sysfs = sysfs  # where the "kernel" binds the regions it is asked to make
        self.memdevs, self.roots, self.reach = memdevs(), roots(), dict(REACH)
        self.regions: list[dict] = []
        self.calls: list[list[str]] = []
        self.refuse: str | None = None

    def run(self, argv, timeout=0, check=True, input=None):
        self.calls.append(list(argv))
        args = argv[1:]
        if args[:1] == ["create-region"]:
            if self.refuse:
                raise CommandError(list(argv), 1, f"cxl region: {self.refuse}\n")
            kind, mem = args[args.index("-t") + 1], args[-1]
            name = f"region{len(self.regions)}"
            self.regions.append({"region": name, "type": kind, "size": M512,
                                 "decode_state": "commit",
                                 "mappings": [{"position": 0, "memdev": mem,
                                               "decoder": "decoder9.0"}]})
            doc = {"region": name, "type": kind, "size": M512}
            if self.sysfs is not None:
                child = self.sysfs / "bus/cxl/devices" / name / \
                    f"{'dax' if kind == 'ram' else 'pmem'}_{name}"
                child.mkdir(parents=True)
                (child / "driver").symlink_to(self.sysfs)
        elif args == ["list", "-M"]:
            doc = self.memdevs
        elif args == ["list", "-R", "-T"]:
            doc = self.regions
        elif args == ["list", "-D", "-d", "root"]:
            doc = self.roots
        elif args[:3] == ["list", "-M", "-d"]:
            doc = [m for m in self.memdevs if m["memdev"] in self.reach.get(args[3], ())]
        else:
            raise AssertionError(argv)
        return subprocess.CompletedProcess(argv, 0, json.dumps(doc) if doc else "", "")

    def run_json(self, argv, timeout=0):
        out = self.run(argv, timeout).stdout
        return json.loads(out) if out.strip() else []


def test_plans_one_region_per_device_in_the_decoder_above_it():
    plans, why = plan_regions(memdevs(), [], roots(), REACH)
    assert plans == [RegionPlan("mem0", "ram", "decoder0.1", M512, 7),
                     RegionPlan("mem1", "pmem", "decoder0.0", M512, 8)]
    assert why == {}
    assert plans[0].argv("cxl") == ["cxl", "create-region", "-m", "-d", "decoder0.1",
                                    "-t", "ram", "-w", "1", "mem0"]


def test_a_device_already_in_a_region_is_left_alone():
    regions = [{"region": "region0", "type": "pmem",
                "mappings": [{"position": 0, "memdev": "mem1"}]}]
    plans, _ = plan_regions(memdevs(), regions, roots(), REACH)
    assert [p.memdev for p in plans] == ["mem0"]


def test_no_capable_or_roomy_decoder_is_said_not_guessed():
    r = roots()
    r[1]["volatile_capable"] = False
    r[0]["max_available_extent"] = 0
    plans, why = plan_regions(memdevs(), [], r, REACH)
    assert plans == []
    assert "no root decoder above mem0 allows ram" in why["mem0 ram"]
    assert "decoder0.0) have less than 512Mi free" in why["mem1 pmem"]


def test_ensure_creates_both_and_then_nothing(caplog):
    fake = FakeCxl()
    maker = CxlRegionMaker(fake, "cxl")
    caplog.set_level(logging.WARNING)
    assert maker.ensure() == ["region0", "region1"]
    assert "created ram region region0 of 512Mi on mem0 in decoder0.1" in caplog.text
    # The next call lists again at once (something was made) and finds nothing to do,
    # from the two listings alone.
    before = len(fake.calls)
    assert maker.ensure() == []
    assert fake.calls[before:] == [["cxl", "list", "-M"], ["cxl", "list", "-R", "-T"]]
    assert sum(c[1] == "create-region" for c in fake.calls) == 2


def test_a_refusal_is_logged_once_and_retried_after_a_minute(monkeypatch, caplog):
    fake = FakeCxl()
    fake.refuse = "decoder0.1: failed to set interleave ways: Device or resource busy"
    now = [1000.0]
    monkeypatch.setattr(cxl_setup.time, "monotonic", lambda: now[0])
    maker = CxlRegionMaker(fake, "cxl")
    caplog.set_level(logging.ERROR)
    assert maker.ensure() == []
    assert "Device or resource busy" in maker.failed["mem0 ram"]
    first = len(fake.calls)
    now[0] += 30
    assert maker.ensure() == [] and len(fake.calls) == first  # not before a minute
    now[0] += 31
    maker.ensure()
    assert caplog.text.count("Device or resource busy") == 2  # mem0 and mem1, once each
    fake.refuse = None
    now[0] += 61
    assert maker.ensure() == ["region0", "region1"] and maker.failed == {}


def test_a_pmem_device_without_a_serial_number_is_warned_about(caplog):
    fake = FakeCxl()
    fake.memdevs[1]["serial"] = 0
    caplog.set_level(logging.WARNING)
    CxlRegionMaker(fake, "cxl").ensure()
    assert "mem1 reports no serial number" in caplog.text
    assert "mem0 reports no serial" not in caplog.text


def test_a_node_without_cxl_is_quiet(caplog):
    class NoCxl:
        def run_json(self, argv, timeout=0):
            raise CommandError(list(argv), 127, "", message="cannot be started (No such file)")

    caplog.set_level(logging.DEBUG)
    assert CxlRegionMaker(NoCxl(), "cxl").ensure() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_waits_for_the_kernel_to_bind_the_region(tmp_path: Path):
    region = tmp_path / "bus/cxl/devices/region0"
    (region / "pmem_region0").mkdir(parents=True)
    assert not await_region_children(tmp_path, ["region0"], timeout=0.3)
    (region / "pmem_region0/driver").symlink_to(tmp_path)
    assert await_region_children(tmp_path, ["region0"], timeout=0.3)


def test_the_daxctl_backend_makes_regions_only_when_opted_in(tmp_path):
    from csi_pmem.driver.backends.daxctl import DaxctlBackend

    for setup, made in (("off", 0), ("reconfigure", 2)):
        fake = FakeCxl(tmp_path / setup)
        b = DaxctlBackend(runner=fake, sysfs_root=tmp_path / setup, proc_root=tmp_path,
                          dev_root=tmp_path, setup=setup,
                          state_path=tmp_path / f"{setup}.json")
        b.setup_node()
        assert sum(c[1] == "create-region" for c in fake.calls) == made, setup


def test_the_composite_forwards_the_set_up():
    from csi_pmem.driver.backends.base import Backend
    from csi_pmem.driver.backends.composite import CompositeBackend

    seen = []

    class Probe(Backend):
        kind = "probe"

        def __init__(self, name):
            self.name = name

        def setup_node(self):
            seen.append(self.name)

        def pools(self):
            return []

        def namespaces(self):
            return []

        def create(self, *a, **k):
            raise NotImplementedError

        def destroy(self, name):
            raise NotImplementedError

        def open_device(self, ns, readonly, exclusive=False):
            raise NotImplementedError

    CompositeBackend([Probe("a"), Probe("b")]).setup_node()
    assert seen == ["a", "b"]
