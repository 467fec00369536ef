"""Loop devices, through ``losetup`` (argv, timeouts, JSON listing).

Why: two parts of the driver need block devices that the kernel enforces: the emulated
back end turns backing files into real block devices (fsdax emulation, device-cgroup
tests), and a read-only fsdax Block publication is a read-only loop device over the
namespace, since binding a device node onto a read-only mount does not stop anyone
from writing to the device. Several loop devices may sit on one backing file or device
(two read-only publications of one volume), so listings are keyed by loop device.
Callers reach these through :class:`csi_pmem.driver.host.mounter.HostMounter` (a fake
in unit tests).
"""

from __future__ import annotations

import logging

from csi_pmem.driver.host.runner import Runner
from csi_pmem.errors import CommandError, Unavailable

log = logging.getLogger(__name__)
TIMEOUT = 30


def devices(runner: Runner) -> dict[str, str]:
    """{loop device: the file or device it is attached to} for every attached loop."""
    out = runner.run_json(["losetup", "--list", "--json", "--output", "NAME,BACK-FILE"],
                          timeout=TIMEOUT)
    found = out.get("loopdevices", []) if isinstance(out, dict) else []
    return {d["name"]: d["back-file"].removesuffix(" (deleted)") for d in found
            if d.get("back-file")}


def attach(runner: Runner, path: str, *, readonly: bool = False,
           sizelimit: int | None = None) -> str:
    argv = ["losetup", "--find", "--show"]
    if readonly:
        argv.append("--read-only")
    if sizelimit is not None:
        argv += ["--sizelimit", str(sizelimit)]
    try:
        res = runner.run([*argv, path], timeout=TIMEOUT)
    except CommandError as exc:
        raise Unavailable(
            f"cannot attach {path} to a loop device ({exc.stderr.strip() or exc}): the "
            "driver needs loop devices (/dev/loop-control) for this; run it with access "
            "to the host's /dev") from exc
    device = res.stdout.strip()
    log.info("attached %s to %s%s", path, device, " read-only" if readonly else "")
    return device


def detach(runner: Runner, device: str) -> None:
    runner.run(["losetup", "--detach", device], timeout=TIMEOUT)
    log.info("detached %s", device)
