"""The ``crash-check`` boot of the VM tier: what a power cut mid-stage left on the device.

Runs on the same NVDIMM backing files as the ``crash`` boot (e2e/vm/crash_prepare.py),
which QEMU was SIGKILLed under with stages stopped at every step of the commit
protocol and one stage cut at a random moment. Labels are kept (``csi_pmem.labels=0``),
so the namespaces come back with their names. For each: the model is either committed
and verifies bit-exact, or it is not committed, every load refuses it, and the next
``stage`` resumes and then verifies bit-exact. Never committed and wrong.

Also here, on this boot's 6 GiB NVDIMM: the whole workflow on a 1 GiB-aligned devdax
namespace (the main configuration's 1 GiB NVDIMMs cannot hold one): 5 GiB, of which
4 GiB are usable, enough for the index area and two one-shard models, each safetensors
file on its own 1 GiB boundary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from csi_pmem.loader import load_numpy, open_volume
from csi_pmem.weights import layout
from csi_pmem.weights.errors import LoaderError
from e2e.vm import weights_guest as wg

pytestmark = pytest.mark.vmconfig("crash-check")

OUT = Path(os.environ.get("E2E_VM_OUT", "/tmp/e2e-vm-out"))
PLAN_FILE = OUT / "crash-plan.json"
PLAN: dict[str, dict] = (json.loads(PLAN_FILE.read_text())["namespaces"]
                         if PLAN_FILE.exists() else {})
FACTS: dict[str, Any] = {"config": os.environ.get("E2E_VM_CONFIG", "")}
GiB = 1 << 30


def ndctl(*args: str) -> Any:
    proc = subprocess.run(["ndctl", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LC_ALL": "C"})
    assert proc.returncode == 0, f"ndctl {args}: {proc.stderr}"
    return json.loads(proc.stdout) if proc.stdout.strip() else None


def as_list(doc: Any) -> list[dict]:
    if doc is None:
        return []
    return doc if isinstance(doc, list) else [doc]


def chardev(ns: dict) -> str:
    name = ns.get("chardev") or ns["daxregion"]["devices"][0]["chardev"]
    return f"/dev/{name}"


def devices_by_name() -> dict[str, str]:
    return {ns["name"]: chardev(ns) for ns in as_list(ndctl("list", "-N", "-X"))
            if ns.get("name") and ns.get("mode") == "devdax"}


@pytest.fixture(scope="session", autouse=True)
def results():
    yield
    (OUT / "facts.json").write_text(json.dumps(FACTS, indent=1, default=str) + "\n")


def test_the_crash_boot_left_a_plan_and_its_namespaces():
    assert PLAN, f"{PLAN_FILE} is missing: the crash boot did not get to the power cut"
    assert set(PLAN) <= set(devices_by_name()), (sorted(PLAN), devices_by_name())


@pytest.mark.parametrize("name", sorted(PLAN))
def test_power_cut_leaves_the_model_committed_or_resumable(name: str) -> None:
    entry = PLAN[name]
    dev = devices_by_name()[name]
    model = OUT / entry["model"]
    with open_volume(dev) as v:
        index = layout.read_index(v)
        found = index.find("m") if index else None
        state = found.state if found else None
    fact: dict[str, Any] = {"point": entry["point"], "state_after_power_cut": state}
    if entry["expect"] != "either":
        assert state == entry["expect"], (entry, state)
    if state == layout.COMMITTED:
        assert wg.verified(dev, "m")
        fact["tensors_bit_exact"] = wg.assert_loads_bit_exact(dev, model)
        fact["outcome"] = "committed and verifying"
    else:
        with pytest.raises(LoaderError, match=r"not committed|holds no"):
            load_numpy(dev)
        refused = wg.cli("verify", dev, "-q", rc=None)
        assert refused.returncode != 0
        out = wg.cli("stage", model, dev, "--name", "m", "-q", "-o", "table").stdout
        reused = re.search(r"copied, (.*?) reused", out)
        fact["resume"] = out.splitlines()[0]
        fact["reused"] = reused.group(1) if reused else "?"
        assert wg.verified(dev, "m")
        fact["tensors_bit_exact"] = wg.assert_loads_bit_exact(dev, model)
        fact["outcome"] = "not committed, refused by loads, resumed and verifying"
    FACTS.setdefault("power_cut", {})[name] = fact


def test_weights_on_a_1gib_aligned_devdax_namespace(tmp_path: Path) -> None:
    regions = as_list(ndctl("list", "-R"))
    big = max(regions, key=lambda r: r["size"])
    ns = ndctl("create-namespace", "-r", big["dev"], "-m", "devdax", "-a", "1G", "-s", "5G",
               "-n", "weights-1g")
    dev = chardev(ns)
    try:
        with open_volume(dev) as v:
            assert v.align == GiB and v.size % GiB == 0 and v.size >= GiB, v
            fact: dict[str, Any] = {"device": dev, "usable": v.size, "align": v.align}
        model = wg.make_model(tmp_path / "model", shards=1)
        fact.update(wg.workflow(dev, model, tmp_path))
        assert fact["persist"].startswith("libpmem pmem_persist"), fact
        listing = json.loads(wg.cli("ls", dev, "--json").stdout)
        offsets = [f["offset"] for m in listing["models"] for f in m["files"]
                   if f["name"].endswith(".safetensors")]
        assert offsets and all(o % GiB == 0 for o in offsets), offsets
        fact["safetensors_offsets"] = offsets
        fact["sidecar"] = wg.sidecar_first_and_warm(dev, model)
        FACTS["weights_1gib_align"] = fact
    finally:
        name = ns["dev"]
        subprocess.run(["ndctl", "disable-namespace", name], capture_output=True, timeout=120)
        subprocess.run(["ndctl", "destroy-namespace", "-f", name], capture_output=True,
                       timeout=120)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
