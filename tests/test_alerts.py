"""The shipped alert rules, checked and unit-tested by a real promtool.

Why promtool and not a PromQL reading of our own: only Prometheus' engine says whether
an expression parses, what ``for`` and ``increase`` do over the series an alert will
really see, and how its annotations render. promtool is built from the Go module proxy
by ``scripts/install-promtool.sh`` (cached outside the repository, like helm);
``PROMTOOL`` points at another binary. The test skips only when the build is
impossible here (exit 3: no module proxy); ``make check`` sets PROMTOOL_REQUIRED=1,
which makes that a failure. tests/monitoring/alerts-test.yaml has a firing and a silent
case for every alert (checked below, so a new alert cannot ship untested).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import tools
import yaml

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "charts" / "csi-pmem" / "monitoring" / "alerts.yaml"
TESTS = REPO / "tests" / "monitoring" / "alerts-test.yaml"

# A cold promtool build takes minutes on 2 cores; it happens in the first test's setup.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def promtool() -> str:
    given = os.environ.get("PROMTOOL")
    if given:
        return given
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install-promtool.sh")],
                          capture_output=True, text=True, timeout=1700)
    if proc.returncode == 3:
        message = "the Go module proxy cannot provide promtool: " + " | ".join(
            proc.stderr.strip().splitlines()[-3:])
        tools.unavailable("PROMTOOL_REQUIRED", message)
    assert proc.returncode == 0, f"scripts/install-promtool.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=300,
                          cwd=TESTS.parent)


def test_promtool_checks_the_rules(promtool):
    proc = run(promtool, "check", "rules", str(RULES))
    print(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"]]
    assert f"SUCCESS: {len(alerts)} rules found" in proc.stdout + proc.stderr


def test_promtool_unit_tests_fire_and_stay_silent_for_every_alert(promtool):
    proc = run(promtool, "test", "rules", str(TESTS))
    print(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"]}
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"]
             for c in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert firing == alerts and silent == alerts, (alerts - firing, alerts - silent)


def test_promtool_catches_a_wrong_expectation(promtool, tmp_path):
    """The run above could not pass by accident: flip one expectation and it fails."""
    doc = yaml.safe_load(TESTS.read_text())
    doc["rule_files"] = [str(RULES)]
    case = next(c for t in doc["tests"] for c in t["alert_rule_test"]
                if c["alertname"] == "CsiPmemPoolNearlyFull" and c["exp_alerts"])
    case["exp_alerts"] = []
    broken = tmp_path / "broken-test.yaml"
    broken.write_text(yaml.safe_dump(doc))
    proc = run(promtool, "test", "rules", str(broken))
    assert proc.returncode != 0
    assert "CsiPmemPoolNearlyFull" in proc.stdout + proc.stderr
