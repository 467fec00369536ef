"""Summarise the storage e2e suite's junit reports: per manifest ran, passed, failed,
skipped, with every failure and skip named and its reason.

Why a summary of our own: each manifest runs in two ginkgo invocations (the parallel
specs, then the [Serial] ones), and ginkgo's report lists every spec of e2e.test, most of
them filtered out. A spec counts where it was selected; a spec selected in neither phase
was either dropped for its tag ([Disruptive], [Feature:...]: listed as skipped,
with the reason suite.sh gives) or lies outside the manifest's focus (the Filesystem
patterns for fsdax-block.yaml, which fsdax-fs.yaml runs: counted as not selected).
Skips by the suite itself carry its message (a capability the manifest does not claim).
Specs that not-applicable.yaml names for a manifest are not run (suite.sh passes them
to ginkgo --skip, from --skip-regex) and are listed as skipped with its reason.
A failure that explained.yaml matches (manifest and spec regex) still counts as failed;
its explanation is printed with it, and only unexplained failures fail the run.

Usage: summary.py --results DIR [--extra-focus REGEX] MANIFEST...
Writes DIR/summary.json and DIR/summary.txt; exits 1 when a spec failed or a report is
missing, so the make target fails with it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PHASES = ("parallel", "serial")
TAG_REASONS = {
    "[Disruptive]": "[Disruptive]: restarts kubelet or the node, which this shared test "
                    "bed cannot offer the suite",
    "[Feature:": "[Feature:...]: needs an optional cluster feature this test bed does not "
                 "enable (snapshots, VolumeAttributesClass, SELinux, ...)",
}


def driver_name(manifest: str) -> str:
    for line in (HERE / f"{manifest}.yaml").read_text().splitlines():
        m = re.match(r"^  Name:\s*(\S+)", line)
        if m:
            return m.group(1)
    raise SystemExit(f"summary.py: no DriverInfo.Name in {manifest}.yaml")


def cases(path: Path, name: str) -> dict[str, dict]:
    """The report's specs of this driver: name -> {status, message}."""
    out: dict[str, dict] = {}
    tree = ET.parse(path)
    for tc in tree.iter("testcase"):
        spec = tc.get("name", "")
        status = tc.get("status", "") or "unknown"
        msg = ""
        if (f := tc.find("failure")) is not None or (f := tc.find("error")) is not None:
            status = "failed" if status in ("unknown", "passed") else status
            msg = (f.get("message") or f.text or "").strip()
        elif (s := tc.find("skipped")) is not None:
            msg = (s.get("message") or "").strip()
        if f"[Driver: {name}]" in spec:
            out[spec.removeprefix("[It] ")] = {"status": status, "message": msg}
        elif not spec.startswith("[It]") and status not in ("passed", "skipped"):
            # a suite-level node ([SynchronizedBeforeSuite], ...) that failed: no spec ran
            out[spec] = {"status": status, "message": msg}
    return out


def by_filter(c: dict) -> bool:
    """Filtered out by --focus/--skip (not selected), not skipped by the suite."""
    return c["status"] == "skipped" and c["message"] in ("", "skipped")


def tag_reason(spec: str) -> str | None:
    for tag, reason in TAG_REASONS.items():
        if tag in spec:
            return reason
    return None


def entries(file: str, manifest: str, prefix: str = "") -> list[tuple[re.Pattern[str], str]]:
    """(spec regex, reason) of FILE's entries for MANIFEST (entry "manifests": a list)."""
    out = []
    for e in yaml.safe_load((HERE / file).read_text()) or []:
        if f"{manifest}.yaml" in e["manifests"]:
            out.append((re.compile(e["spec"]), prefix + " ".join(e["reason"].split())))
    return out


def explanations(manifest: str) -> list[tuple[re.Pattern[str], str]]:
    return entries("explained.yaml", manifest)


def not_applicable(manifest: str) -> list[tuple[re.Pattern[str], str]]:
    return entries("not-applicable.yaml", manifest, "not run here: ")


def summarise(results: Path, manifest: str) -> dict:
    name = driver_name(manifest)
    known = explanations(manifest)
    na = not_applicable(manifest)
    phases: dict[str, dict[str, dict]] = {}
    missing = []
    for p in PHASES:
        f = results / f"{manifest}-{p}.xml"
        if f.is_file():
            phases[p] = cases(f, name)
        else:
            missing.append(f.name)
    specs = sorted({s for ph in phases.values() for s in ph})
    passed, failed, skipped, not_selected = [], [], [], []
    for spec in specs:
        seen = [ph[spec] for ph in phases.values() if spec in ph]
        selected = [c for c in seen if not by_filter(c)]
        if not selected:
            reason = next((r for rx, r in na if rx.search(spec)), None) or tag_reason(spec)
            (skipped.append({"spec": spec, "reason": reason}) if reason
             else not_selected.append(spec))
            continue
        c = selected[0]
        if c["status"] == "passed":
            passed.append(spec)
        elif c["status"] == "skipped":
            skipped.append({"spec": spec, "reason": c["message"].removeprefix("skipped - ")
                            .strip() or "skipped"})
        else:
            why = next((r for rx, r in known if rx.search(spec)), None)
            failed.append({"spec": spec, "status": c["status"], "message": c["message"][:2000],
                           "explained": why})
    return {"manifest": f"{manifest}.yaml", "driver": name, "ran": len(passed) + len(failed),
            "passed": len(passed), "failed": len(failed),
            "failed_unexplained": sum(1 for f in failed if not f["explained"]),
            "skipped": len(skipped),
            "not_selected": len(not_selected), "missing_reports": missing,
            "passed_specs": passed, "failures": failed, "skips": skipped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--extra-focus", default="")
    ap.add_argument("--skip-regex", action="store_true",
                    help="print the ginkgo --skip regex of not-applicable.yaml for the one "
                         "manifest given, and exit")
    ap.add_argument("manifests", nargs="+")
    a = ap.parse_args(argv)
    if a.skip_regex:
        print("|".join(f"(?:{rx.pattern})" for rx, _ in not_applicable(a.manifests[0])))
        return 0
    out = {"extra_focus": a.extra_focus, "manifests": [summarise(a.results, m)
                                                       for m in a.manifests]}
    (a.results / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = []
    if a.extra_focus:
        lines.append(f"NARROWED by E2E_STORAGE_FOCUS={a.extra_focus!r}: not a full run")
    for s in out["manifests"]:
        lines.append(f"{s['manifest']} ({s['driver']}): ran {s['ran']}, passed {s['passed']}, "
                     f"failed {s['failed']} ({s['failed_unexplained']} unexplained), "
                     f"skipped {s['skipped']} "
                     f"(not selected for this manifest: {s['not_selected']})")
        for r in s["missing_reports"]:
            lines.append(f"  MISSING REPORT {r}")
        for f in s["failures"]:
            first = f["message"].splitlines()[0] if f["message"] else ""
            lines.append(f"  FAILED {f['spec']}\n         {first}")
            if f["explained"]:
                lines.append(f"         explained: {f['explained']}")
        reasons: dict[str, list[str]] = {}
        for k in s["skips"]:
            reasons.setdefault(k["reason"], []).append(k["spec"])
        for reason, ss in sorted(reasons.items()):
            lines.append(f"  skipped ({len(ss)}): {reason}")
            lines.extend(f"    - {x}" for x in ss)
    text = "\n".join(lines) + "\n"
    (a.results / "summary.txt").write_text(text)
    # stdout: the counts, failures and skip reasons; the skipped specs are in the file
    sys.stdout.write("".join(ln + "\n" for ln in lines if not ln.startswith("    - ")))
    sys.stdout.write(f"every skipped spec by name: {a.results / 'summary.txt'}\n")
    bad = any(s["failed_unexplained"] or s["missing_reports"] for s in out["manifests"])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
