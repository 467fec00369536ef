"""The `csi-pmem volume` client a newcomer uses: every action against a real driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, needs_root

pytestmark = needs_root()


def cli(driver, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CSI_PMEM_ENDPOINT=f"unix://{driver.socket}")
    return subprocess.run([sys.executable, "-m", "csi_pmem", "volume", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def ok(driver, *args: str):
    res = cli(driver, *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_walkthrough(driver):
    info = ok(driver, "info")
    assert info["probe"]["ready"] is True and info["node"]["node_id"] == "test-node"
    before = int(ok(driver, "capacity", "-p", "numaNode=1")["available_capacity"])
    vol = ok(driver, "create", "llama", "--size", "100Mi", "-p", "numaNode=1")
    assert int(vol["capacity_bytes"]) >= 100 << 20
    assert vol["volume_context"]["numaNode"] == "1"
    assert int(ok(driver, "capacity", "-p", "numaNode=1")["available_capacity"]) < before
    vid = vol["volume_id"]
    assert [e["volume"]["volume_id"] for e in ok(driver, "list")["entries"]] == [vid]
    target = driver.target("demo")
    ok(driver, "publish", vid, target, "--readonly")
    seen = ok(driver, "inspect", target)
    assert seen["metadata"]["volume_id"] == vid and seen["fd_flags"] == "O_RDONLY"
    assert seen["first_16_bytes"] == "00" * 16
    assert int(ok(driver, "stats", vid, target)["usage"][0]["total"]) == \
        int(vol["capacity_bytes"])
    ok(driver, "unpublish", vid, target)
    ok(driver, "delete", vid)
    assert ok(driver, "list")["entries"] == []


def test_errors_are_one_line_with_the_code(driver):
    """The driver's refusals (4), usage errors (2, argparse) and local errors (1) exit
    differently (csi_pmem.cmdline.Exit), each with a message and no traceback."""
    for args, code, needle in [
            (("create", "big", "--size", "10Gi"), 4, "OUT_OF_RANGE: a volume of 10.0 GiB"),
            (("create", "x", "--size", "1Gi", "-p", "align=4Ki"), 4, "2Mi or 1Gi"),
            (("create", "x", "--size", "lots"), 2, "argument --size: invalid size 'lots'"),
            (("create", "x", "--size", "-1Gi"), 2,
             "argument --size: invalid size '-1Gi': a size cannot be negative"),
            (("list", "--timeout", "0"), 2,
             "argument --timeout: '0' is not a positive number of seconds"),
            (("inspect", "/nonexistent"), 1, "does not exist")]:
        res = cli(driver, *args)
        assert res.returncode == code and needle in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_endpoint_after_the_action_beats_the_variable(driver, tmp_path):
    """kubectl-style: --endpoint after the action; it overrides CSI_PMEM_ENDPOINT."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               CSI_PMEM_ENDPOINT=f"unix://{tmp_path}/nothing.sock")
    res = subprocess.run([sys.executable, "-m", "csi_pmem", "volume", "info", "-o", "json",
                          "--endpoint", f"unix://{driver.socket}", "--timeout", "60"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["probe"]["ready"] is True


def test_the_walkthrough_by_name_and_table(driver):
    """What the README does: ids from -o name, tables for people (forced here: the test's
    stdout is no terminal, where JSON is the default)."""
    res = cli(driver, "create", "llama", "--size", "100Mi", "-p", "numaNode=1", "-o", "name")
    vid = res.stdout.strip()
    assert res.returncode == 0 and vid.startswith("pmem-"), res.stderr
    target = driver.target("demo")
    assert cli(driver, "publish", vid, target).returncode == 0
    size = int(ok(driver, "list")["entries"][0]["volume"]["capacity_bytes"])
    assert 100 << 20 <= size < 1 << 30
    seen = cli(driver, "inspect", target, "-o", "table").stdout
    assert f"volume:          {vid}" in seen, seen
    assert f"mapped:          {size / (1 << 20):.1f} MiB" in seen, seen
    table = cli(driver, "list", "-o", "table").stdout.splitlines()
    assert table[0].startswith("VOLUME ID")
    assert table[1].split()[:3] == [vid, f"{size / (1 << 20):.1f}", "MiB"], table
    assert "test-node" in table[1]  # PUBLISHED ON
    assert cli(driver, "unpublish", vid, target).returncode == 0
    assert cli(driver, "delete", vid, "-o", "name").stdout.strip() == vid


def test_fsdax_walkthrough(driver):
    vol = ok(driver, "create", "scratch", "--size", "64Mi", "-p", "deviceMode=fsdax",
             "--fs-type", "ext4")
    vid = vol["volume_id"]
    assert vol["volume_context"]["deviceMode"] == "fsdax"
    staging, target = driver.staging("scratch"), driver.target("fs")
    ok(driver, "stage", vid, staging)
    ok(driver, "publish", vid, target, "--staging", staging)
    with open(os.path.join(target, "hello"), "w") as f:
        f.write("hello")
    usage = {u["unit"]: u for u in ok(driver, "stats", vid, target)["usage"]}
    assert int(usage["BYTES"]["used"]) > 0 and "INODES" in usage
    ok(driver, "unpublish", vid, target)
    ok(driver, "unstage", vid, staging)
    os.makedirs(driver.kubelet / "blk", exist_ok=True)
    device = str(driver.kubelet / "blk" / "dev")
    ok(driver, "publish", vid, device, "--block")
    with open(device, "rb") as f:
        assert f.read(4096) != b"\0" * 4096  # the ext4 made above is on the device
    ok(driver, "unpublish", vid, device)
    ok(driver, "delete", vid)
