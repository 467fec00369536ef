"""e2e/cluster/storage-e2e/summary.py, which turns ginkgo's junit reports of the storage
e2e suite into the per-manifest counts the cluster tier reports.

Why here: the counts are the suite's verdict. If a spec that ran in the [Serial] phase were
counted as filtered (it is "skipped" in the parallel report), or a failure of the suite's
set-up were dropped because it names no driver, `make e2e-storage` would pass with
failures nobody sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import quoteattr

SUMMARY = Path(__file__).resolve().parents[2] / "e2e" / "cluster" / "storage-e2e" / "summary.py"
D = "[sig-storage] External Storage [Driver: csi-pmem.io-devdax]"


def junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """cases: (name, status, child) with child "", "skip:MSG" or "fail:MSG"."""
    rows = []
    for name, status, child in cases:
        inner = ""
        if child.startswith("skip:"):
            inner = f"<skipped message={quoteattr(child[5:])}/>"
        elif child.startswith("fail:"):
            inner = f"<failure message={quoteattr(child[5:])} type=\"failed\">x</failure>"
        rows.append(f"<testcase name={quoteattr(name)} classname=\"Kubernetes e2e suite\" "
                    f"status=\"{status}\">{inner}</testcase>")
    path.write_text("<testsuites><testsuite name=\"Kubernetes e2e suite\">"
                    + "".join(rows) + "</testsuite></testsuites>")


def summary(tmp: Path) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, str(SUMMARY), "--results", str(tmp), "devdax"],
                       capture_output=True, text=True, check=False)
    return p.returncode, json.loads((tmp / "summary.json").read_text())["manifests"][0], p.stdout


FILTERED = "skip:skipped"
CASES_PARALLEL = [
    ("[SynchronizedBeforeSuite]", "passed", ""),
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] capacity provides", "passed", ""),
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] volumeLimits x [Serial]", "skipped",
     FILTERED),
    (f"[It] {D} [Testpattern: Pre-provisioned PV (default fs)] volumes should store data",
     "skipped", "skip:skipped - Driver \"csi-pmem.io-devdax\" does not support volume type "
     "\"PreprovisionedPV\" - skipping"),
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] disruptive [Disruptive] y", "skipped",
     FILTERED),
    ("[It] [sig-storage] External Storage [Driver: other] z", "failed", "fail:not ours"),
]
CASES_SERIAL = [
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] capacity provides", "skipped", FILTERED),
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] volumeLimits x [Serial]", "passed", ""),
    (f"[It] {D} [Testpattern: Dynamic PV (default fs)] disruptive [Disruptive] y", "skipped",
     FILTERED),
]


def test_phases_merge_into_one_count_per_spec(tmp_path: Path) -> None:
    junit(tmp_path / "devdax-parallel.xml", CASES_PARALLEL)
    junit(tmp_path / "devdax-serial.xml", CASES_SERIAL)
    rc, s, out = summary(tmp_path)
    assert rc == 0, out
    assert (s["ran"], s["passed"], s["failed"], s["skipped"]) == (2, 2, 0, 2)
    reasons = {k["spec"].split("] ", 3)[-1]: k["reason"] for k in s["skips"]}
    assert any("does not support volume type" in r for r in reasons.values())
    assert any(r.startswith("[Disruptive]") for r in reasons.values())
    assert "ran 2, passed 2, failed 0" in out


def test_a_failure_fails_and_is_named(tmp_path: Path) -> None:
    junit(tmp_path / "devdax-parallel.xml", [
        *CASES_PARALLEL[:1],
        (f"[It] {D} [Testpattern: Dynamic PV (default fs)] provisioning should x", "failed",
         "fail:timed out waiting for the condition")])
    junit(tmp_path / "devdax-serial.xml", [])
    rc, s, out = summary(tmp_path)
    assert rc == 1
    assert s["failed"] == s["failed_unexplained"] == 1
    assert f"FAILED {D}" in out and "timed out waiting" in out


def test_a_failed_suite_setup_counts_as_a_failure(tmp_path: Path) -> None:
    junit(tmp_path / "devdax-parallel.xml", [
        ("[SynchronizedBeforeSuite]", "failed", "fail:no nodes are ready")])
    junit(tmp_path / "devdax-serial.xml", [])
    rc, s, _ = summary(tmp_path)
    assert rc == 1 and s["failed"] == 1 and s["ran"] == 1


def test_a_missing_report_fails(tmp_path: Path) -> None:
    junit(tmp_path / "devdax-parallel.xml", CASES_PARALLEL)
    rc, s, out = summary(tmp_path)
    assert rc == 1
    assert s["missing_reports"] == ["devdax-serial.xml"]
    assert "MISSING REPORT devdax-serial.xml" in out
