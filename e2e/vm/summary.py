"""Summarise a `make e2e-vm` run from the files the guests left in the results directory.

Why a separate step on the host: the guest may die (kernel oops, timeout) before it
prints anything useful, so the verdict is built from what reached the share: each
configuration's exit status, its JUnit XML, ``facts.json`` and ``latency.json``.
Prints a human summary, writes ``summary.json`` next to them, and exits 1 when any
configuration failed, reported a failing test, or produced no report at all.

Usage: summary.py RESULTS_DIR [--configs main,misaligned] [--total-seconds S]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CONFIGS = ("main", "misaligned", "crash", "crash-check", "hmem", "hmem-reboot")
# Opt-in (run.sh --config cxl), so not in the default list above.
CXL_CONFIGS = ("cxl", "cxl-reboot")


def junit_cases(path: Path) -> list[dict]:
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "").strip()
                break
        cases.append({"name": tc.get("name", "?"), "outcome": outcome,
                      "seconds": float(tc.get("time", 0) or 0), "message": message})
    return cases


def load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def fsdax_lines(facts: dict) -> list[str]:
    """What the fsdax tests found out about the kernel: block device sizes, DAX."""
    lines = []
    sizes = facts.get("usable_sizes_fsdax") or []
    if sizes:
        seen, parts = set(), []
        for row in sizes:
            key = (row["requested"], row["namespace"])
            if key not in seen:
                seen.add(key)
                parts.append(f"{row['requested']} -> {row['kernel_bytes'] / (1 << 20):g} MiB "
                             f"({row['namespace'] >> 20} MiB namespace)")
        lines.append("  fsdax block device sizes (requested -> kernel): " + ", ".join(parts))
    for fs, fact in sorted((facts.get("fsdax_filesystems") or {}).items()):
        dax, nodax = fact.get("dax") or {}, fact.get("without_dax") or {}
        ok = dax.get("statx_dax") and "sf" in (dax.get("vm_flags") or []) \
            and "errno" not in dax
        mounted = "dax=always" if "dax=always" in fact.get("super_options", []) else "NO dax"
        lines.append(f"  fsdax {fs}: {mounted}, "
                     f"MAP_SYNC {'works (statx DAX, VmFlags sf)' if ok else 'FAILED'}; "
                     f"with dax=never MAP_SYNC -> {nodax.get('errno', 'accepted')}")
    return lines


def share_lines(share: dict) -> list[str]:
    """Issue 17: the share of CreateVolume/DeleteVolume that is ndctl (test_guest.py)."""
    lines = []
    for op in ("CreateVolume", "DeleteVolume"):
        v = share.get(op)
        if v:
            lines.append(f"  {op} 64Mi in the guest: {v['total_ms']:.0f} ms, ndctl "
                         f"{v['backend_ms']:.0f} ms in {v['execs']:.0f} execs "
                         f"({v['backend_share']:.0%}), erase {v['erase_ms']:.0f} ms, the "
                         f"driver's own {v['ours_ms']:.0f} ms ({v['ours_share']:.0%})")
    return lines


def weights_lines(facts: dict, root: Path) -> list[str]:
    """The weights workflow on the real devices: the persist primitive per kind of
    volume, the staging benchmark against the host's, power-cut outcomes."""
    lines = []
    for kind, fact in sorted((facts.get("weights") or {}).items()):
        lines.append(f"  weights on {kind}: stage/verify/ls/export/CPU load bit-exact "
                     f"({fact.get('tensors')} tensors); persisted with {fact.get('persist')}")
    one_g = facts.get("weights_1gib_align")
    if one_g:
        lines.append(f"  weights on devdax 1Gi align ({one_g['usable'] >> 30} GiB usable): "
                     f"safetensors at {[o >> 30 for o in one_g['safetensors_offsets']]} GiB; "
                     f"persisted with {one_g.get('persist')}")
    for fact in (facts.get("power_cut") or {}).values():
        lines.append(f"  power cut at {fact['point']}: {fact['state_after_power_cut']} -> "
                     f"{fact['outcome']}" + (f" (reused {fact['reused']})"
                                             if fact.get("reused") else ""))
    guest = facts.get("staging_bench")
    host = load_json(root / "host-staging-bench.json")
    if guest:
        line = (f"  staging into devdax in the guest: stage {guest['stage_GBps']:.3f} GB/s, "
                f"verify {guest['verify_GBps']:.3f} GB/s ({guest['bytes'] >> 20} MiB)")
        if host:
            line += (f"; host tmpfs file (emulated back end): stage {host['stage_GBps']:.3f}, "
                     f"verify {host['verify_GBps']:.3f} GB/s; guest/host "
                     f"{guest['stage_GBps'] / host['stage_GBps']:.3f} (stage), "
                     f"{guest['verify_GBps'] / host['verify_GBps']:.3f} (verify) under TCG")
        lines.append(line)
    return lines


def dax_lines(facts: dict) -> list[str]:
    """The hmem boots (test_guest_dax.py): the daxctl pool, CreateVolume/DeleteVolume
    medians next to ndctl's on the NVDIMM in the same boot, what the reboot did."""
    lines = []
    region = facts.get("hmem_region")
    if region:
        lines.append(f"  hmem region {region['path']} (dax{region['id']}): "
                     f"{region['size'] >> 20} MiB, target node {region['target_node']}, "
                     f"boot device {region['boot_device']} in devdax mode")
    if facts.get("no_setup_create"):
        lines.append(f"  without --dax-setup: {facts['no_setup_create'][:240]}")
    medians = facts.get("create_delete_medians")
    if medians:
        for op in ("CreateVolume", "DeleteVolume"):
            dax, nd = medians["daxctl"][op], medians["ndctl"][op]
            lines.append(f"  {op} 64Mi median of 5: daxctl on soft-reserved memory "
                         f"{dax:.3f} s, ndctl on NVDIMM {nd:.3f} s, ratio daxctl/ndctl "
                         f"{dax / nd:.2f} (same boot, TCG)")
    for r in facts.get("capacity_during_start_scrub") or []:
        lines.append(f"  GetCapacity around a create at start #{r['start']} (fail points "
                     f"{r['failpoints']}; start-up scrub running at the first reading: "
                     f"{r['scrub_running_at_first']}): {r['first'] >> 20} MiB, then "
                     f"{r['second'] >> 20} MiB"
                     + (f", {r['polled_until_idle']} more until idle, at most "
                        f"{r['polled_max'] >> 20} MiB" if r.get("polled_max") else "")
                     + f"; region free with the volume {r['region_free_with_volume'] >> 20} MiB")
    core = facts.get("core_workflow")
    if core:
        lines.append(f"  core workflow on {core['device']} (NUMA {core['numa_node']}): a new "
                     f"volume over the deleted one's memory ({core['reuse_device']}, same "
                     f"memory: {core['reuse_same_memory']}) read zeros")
    if "old_bytes_survived_reboot" in facts:
        lines.append(f"  after the reboot, before the driver: the old volume's bytes still in "
                     f"memory: {facts['old_bytes_survived_reboot']}")
    for line in facts.get("reboot_log") or []:
        lines.append(f"  driver log: {line.strip()[:300]}")
    cond = facts.get("reboot_condition")
    if cond:
        lines.append(f"  volume condition: abnormal={cond['abnormal']}: {cond['message'][:240]}")
    if facts.get("reboot_zeroed"):
        lines.append(f"  recreated volume read all zeros (same memory as before: "
                     f"{facts.get('reboot_same_memory')})")
    if facts.get("reboot_load_refused"):
        lines.append(f"  load before the re-stage: {facts['reboot_load_refused'][:200]}")
    side = facts.get("reboot_sidecar")
    if side:
        lines.append(f"  sidecar after the reboot: {side['first']} ({side['bytes']} bytes), "
                     f"warm restart: {side['warm']}")
    return lines


def cxl_lines(facts: dict) -> list[str]:
    """The CXL boots (test_guest_cxl.py): regions, pools, medians, what the reboot kept."""
    lines = []
    for _, r in sorted((facts.get("regions_created") or {}).items()):
        lines.append(f"  {r['argv']}: {r['region']} {r['decode_state']} in {r['seconds']} s")
    for made in facts.get("regions_created_by_driver") or []:
        lines.append(f"  the driver (--dax-setup=reconfigure) created {made}")
    nd, ram = facts.get("pmem_nd_region"), facts.get("ram_dax_region")
    if nd:
        lines.append(f"  CXL pmem: nd region {nd['dev']} on bus CXL, {nd['size'] >> 20} MiB, "
                     f"numa_node {nd['numa_node']}, target_node {nd['target_node']}")
    if ram:
        lines.append(f"  CXL ram: {ram['path']}, {ram['size'] >> 20} MiB, target node "
                     f"{ram['target_node']} (CPU nodes {ram['cpu_nodes']}), "
                     f"{ram['boot_device']} came up {ram['boot_mode']}")
    if facts.get("ram_placement"):
        lines.append(f"  placement: {facts['ram_placement']}")
    if facts.get("no_region_create"):
        lines.append(f"  before any region: {facts['no_region_create'][:240]}")
    for media, core in sorted((facts.get("cxl_core_workflow") or {}).items()):
        lines.append(f"  core workflow {media}: {core['device']} in {core['pool']} "
                     f"(NUMA {core['numa_node']}), reuse read zeros")
    medians = facts.get("cxl_create_delete_medians")
    if medians:
        for op in ("CreateVolume", "DeleteVolume"):
            dax, nd_s = medians["daxctl"][op], medians["ndctl"][op]
            lines.append(f"  {op} 64Mi median of 3: daxctl on CXL ram {dax:.3f} s, ndctl on "
                         f"CXL pmem {nd_s:.3f} s, ratio {dax / nd_s:.2f} (same boot, TCG)")
    if "namespaces_after_reboot" in facts:
        lines.append(f"  pmem region created again: namespaces from the LSA "
                     f"{facts['namespaces_after_reboot']}")
    if "pmem_marker_survived" in facts:
        lines.append(f"  pmem volume after the reboot: marker read back "
                     f"{facts['pmem_marker_survived']}, model verified and loaded "
                     f"{facts.get('pmem_model_survived', False)}")
    return lines


def summarise_crash_boot(d: Path) -> tuple[dict, list[str], bool]:
    """The boot that ends in a power cut: fine when the host killed it as planned."""
    plan = load_json(d / "crash-plan.json").get("namespaces") or {}
    killed = (d / "killed").exists()
    boot = (d / "boot_seconds").read_text().strip() if (d / "boot_seconds").exists() else "?"
    ok = killed and bool(plan)
    lines = [f"[{d.name}] {'PASS' if ok else 'FAIL'}: {len(plan)} stages in flight, QEMU "
             f"{'SIGKILLed by the host' if killed else 'NOT killed'} after {boot} s"]
    if not ok:
        lines.append(f"  see {d / 'console.log'}")
    for name, e in sorted(plan.items()):
        lines.append(f"  {name}: {e['point']} (expect {e['expect']})")
    return {"config": d.name, "ok": ok, "killed": killed, "plan": plan}, lines, ok


def summarise_config(d: Path) -> tuple[dict, list[str], bool]:
    if d.name == "crash":
        return summarise_crash_boot(d)
    rc_text = (d / "rc").read_text().strip() if (d / "rc").exists() else "missing"
    boot = (d / "boot_seconds").read_text().strip() if (d / "boot_seconds").exists() else "?"
    junit = d / "junit.xml"
    cases = junit_cases(junit) if junit.exists() else []
    facts = load_json(d / "facts.json")
    latency = load_json(d / "latency.json")
    ok = rc_text == "0" and bool(cases) and not any(
        c["outcome"] in ("failed", "error") for c in cases)
    lines = [f"[{d.name}] {'PASS' if ok else 'FAIL'}: QEMU boot to power-off {boot} s, "
             f"guest exit {rc_text}, {len(cases)} tests"]
    if not junit.exists():
        lines.append(f"  no JUnit report: see {d / 'console.log'} and {d / 'init.log'}")
    for c in cases:
        line = f"  {c['outcome'].upper():7} {c['name']} ({c['seconds']:.1f} s)"
        if c["outcome"] != "passed":
            first = c["message"].splitlines()[0] if c["message"] else ""
            line += f": {first[:300]}"
        lines.append(line)
    for flavour, res in sorted((facts.get("csi_sanity") or {}).items()):
        if "skipped" in res and isinstance(res["skipped"], str):
            lines.append(f"  csi-sanity {flavour}: not run: {res['skipped']}")
        else:
            access = res.get("access_type", "mount")
            lines.append(f"  csi-sanity {flavour}: {res['passed']} passed, {res['skipped']} "
                         f"skipped, {res['pending']} pending, {res['failed']} failed "
                         f"({res['seconds']} s, volume {res['volume_size'] / (1 << 20):g} MiB, "
                         f"access type {access})")
    lines += fsdax_lines(facts)
    lines += weights_lines(facts, d.parent)
    lines += dax_lines(facts)
    lines += cxl_lines(facts)
    ops = latency.get("operations") or {}
    if ops:
        lines.append(f"  latency ({latency.get('note', '')}):")
        width = max(len(op) for op in ops)
        for op, v in ops.items():
            lines.append(f"    {op:{width}}  n={v['n']:<3} median {v['median_s']:7.3f} s  "
                         f"min {v['min_s']:7.3f}  max {v['max_s']:7.3f}")
    if facts.get("driver_start_seconds") is not None:
        lines.append(f"  driver start to serving: {facts['driver_start_seconds']:.1f} s")
    lines += share_lines(facts.get("ndctl_share_64Mi") or {})
    report = {"config": d.name, "ok": ok, "guest_exit": rc_text, "boot_seconds": boot,
              "tests": cases, "csi_sanity": facts.get("csi_sanity"), "latency": ops,
              "create_delete_medians": facts.get("create_delete_medians")}
    return report, lines, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated configurations of this run (default: all)")
    ap.add_argument("--total-seconds", default="")
    args = ap.parse_args()
    root = Path(args.results)
    reports, all_ok = [], True
    print("=" * 78)
    print("e2e-vm summary (QEMU TCG guest, Debian kernel, real libnvdimm + ndctl)")
    for name in args.configs.split(","):
        d = root / name
        if not d.is_dir():
            print(f"[{name}] FAIL: no results directory {d}")
            all_ok = False
            continue
        report, lines, ok = summarise_config(d)
        reports.append(report)
        all_ok &= ok
        print("\n".join(lines))
    if not reports:
        print(f"no configuration ran (nothing under {root})")
        all_ok = False
    total = f", total wall time {args.total_seconds} s" if args.total_seconds else ""
    print(f"e2e-vm: {'PASSED' if all_ok else 'FAILED'}{total}")
    print("=" * 78)
    (root / "summary.json").write_text(json.dumps(
        {"ok": all_ok, "total_seconds": args.total_seconds, "configs": reports}, indent=1) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
