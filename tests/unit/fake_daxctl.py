"""A fake kernel behind the Runner interface: what ``daxctl`` and ``cxl`` would print and do.

Why a model and not replayed outputs: the daxctl back end's identity, recovery and set-up
depend on what the kernel does between commands (device numbers are reused, ranges are
first-fit and may be discontiguous, a reboot empties every region, a busy region refuses
to go offline). The JSON follows ndctl's ``daxctl/json.c`` (keys ``path``, ``id``,
``size``, ``available_size`` only when non-zero, ``align``, ``devices[]`` with
``chardev``, ``size``, ``target_node``, ``align``, ``mode``, ``state: "disabled"``,
``mappings[]`` of ``page_offset``, ``start``, ``end``, ``size``); stderr texts follow
``daxctl/device.c``. Each device is a sparse file under ``dev_root``, so a driver over
this fake can open, map and erase it like ``/dev/daxX.Y``; the file outlives the device
(and a reboot), as memory keeps its bytes, so what was not erased shows up again.

Checked against the real thing (kernel 6.1, daxctl 76.1, the VM tier's hmem boot,
e2e/vm/test_guest_dax.py): a region always has its ``daxN.0`` (the kernel's boot-time
device, or a size-0 seed); ``reconfigure-device -s 0`` keeps the device at size 0,
disabled, and ``--idle`` lists it without ``mappings``; ``create-device`` makes a new
device under the lowest free number above it (``daxN.0`` is never reused) and no other
idle device appears; ``available_size`` is absent when nothing is free.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

from csi_pmem.errors import CommandError

MiB = 1 << 20


class FakeDaxKernel:
    def __init__(self, dev_root: Path, proc_root: Path) -> None:
        self.dev_root, self.proc_root = Path(dev_root), Path(proc_root)
        self.dev_root.mkdir(parents=True, exist_ok=True)
        self.regions: dict[int, dict[str, Any]] = {}
        self.calls: list[list[str]] = []
        self.fail: dict[str, CommandError] = {}  # subcommand -> error
        self.busy = False  # reconfigure --mode=devdax cannot offline the memory (EBUSY)
        self.cxl: tuple[list, list] | None = None  # (memdevs, regions) or no cxl tool
        self.new_boot()

    # -- set-up ---------------------------------------------------------------------
    def new_boot(self) -> None:
        (self.proc_root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
        (self.proc_root / "sys/kernel/random/boot_id").write_text(f"{uuid.uuid4()}\n")

    def add_region(self, rid: int, size: int, target_node: int = 0, *,
                   path: str | None = None, boot_device: str | None = None,
                   align: int = 2 * MiB) -> None:
        base = (rid + 1) << 36
        self.regions[rid] = {"id": rid, "path": path or f"/platform/hmem.{rid}",
                             "size": size, "align": align, "target_node": target_node,
                             "base": base, "devices": {}, "boot_device": boot_device}
        self._boot_device(rid)

    def _boot_device(self, rid: int) -> None:
        r = self.regions[rid]
        if r["boot_device"]:
            self._make(rid, 0, [(r["base"], r["base"] + r["size"] - 1)], r["boot_device"])
        else:  # the region's seed: daxN.0 at size 0, disabled
            r["devices"][0] = {"ranges": [], "mode": "devdax", "enabled": False,
                               "align": r["align"]}

    def reboot(self) -> None:
        """Volatile memory: every device is gone, the kernel's boot device is back."""
        for rid, r in self.regions.items():
            for inst in list(r["devices"]):
                self._remove(rid, inst)
            self._boot_device(rid)
        self.new_boot()

    # -- the model ----------------------------------------------------------------------
    def _free_ranges(self, rid: int) -> list[tuple[int, int]]:
        r = self.regions[rid]
        used = sorted(m for d in r["devices"].values() for m in d["ranges"])
        free, at = [], r["base"]
        for start, end in used:
            if start > at:
                free.append((at, start - 1))
            at = max(at, end + 1)
        if at < r["base"] + r["size"]:
            free.append((at, r["base"] + r["size"] - 1))
        return free

    def available(self, rid: int) -> int:
        return sum(e - s + 1 for s, e in self._free_ranges(rid))

    def _make(self, rid: int, inst: int, ranges: list[tuple[int, int]], mode: str,
              align: int = 2 * MiB) -> None:
        size = sum(e - s + 1 for s, e in ranges)
        self.regions[rid]["devices"][inst] = {"ranges": ranges, "mode": mode,
                                              "enabled": True, "align": align}
        path = self.dev_root / f"dax{rid}.{inst}"
        # Memory keeps its bytes: a device made again under the same number (the kernel
        # reuses numbers, first-fit ranges) shows what the last one left there.
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.truncate(size)

    def _remove(self, rid: int, inst: int) -> None:
        self.regions[rid]["devices"].pop(inst, None)

    def _seed(self, rid: int) -> int:
        taken = set(self.regions[rid]["devices"])
        return next(i for i in range(1, 1 << 16) if i not in taken)

    def _dev(self, chardev: str) -> tuple[int, int, dict] | None:
        rid, inst = (int(x) for x in chardev.removeprefix("dax").split("."))
        d = self.regions.get(rid, {}).get("devices", {}).get(inst)
        return (rid, inst, d) if d is not None else None

    def _dev_json(self, rid: int, inst: int, d: dict | None, mappings: bool) -> dict:
        r = self.regions[rid]
        out: dict[str, Any] = {"chardev": f"dax{rid}.{inst}",
                               "size": sum(e - s + 1 for s, e in d["ranges"]) if d else 0,
                               "target_node": r["target_node"],
                               "align": d["align"] if d else 2 * MiB,
                               "mode": d["mode"] if d else "devdax"}
        if d and d["mode"] == "system-ram":
            out.update(online_memblocks=4, total_memblocks=4, movable=True)
        if not d or not d["enabled"]:
            out["state"] = "disabled"
        if d and d["ranges"] and mappings:
            out["mappings"] = []
            offset = 0
            for s, e in d["ranges"]:
                out["mappings"].append({"page_offset": offset, "start": s, "end": e,
                                        "size": e - s + 1})
                offset += (e - s + 1) // 4096
        return out

    # -- the Runner interface ------------------------------------------------------------
    def run_json(self, argv: list[str], timeout: float = 60.0) -> Any:
        out = self.run(argv, timeout=timeout).stdout
        import json
        return json.loads(out) if out.strip() else []

    def run(self, argv: list[str], timeout: float = 60.0, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        import json
        self.calls.append(list(argv))
        tool, sub = Path(argv[0]).name, argv[1]
        if sub in self.fail:
            raise self.fail[sub]
        if tool == "cxl":
            if self.cxl is None:
                raise CommandError(list(argv), 127, "No such file or directory",
                                   message="cannot be started (No such file or directory)")
            doc = self.cxl[0] if "--memdevs" in argv else self.cxl[1]
            return subprocess.CompletedProcess(argv, 0, json.dumps(doc) if doc else "", "")
        handler = getattr(self, "_" + sub.replace("-", "_"))
        result = handler(list(argv))
        stdout, stderr = result if isinstance(result, tuple) else (result, "")
        return subprocess.CompletedProcess(argv, 0, stdout, stderr)

    def _error(self, argv: list[str], text: str) -> CommandError:
        return CommandError(argv, 1, text)

    def _list(self, argv: list[str]) -> str:
        import json
        mappings, idle = "--mappings" in argv, "--idle" in argv
        out = []
        for rid, r in sorted(self.regions.items()):
            region: dict[str, Any] = {"path": r["path"], "id": rid, "size": r["size"],
                                      "align": r["align"]}
            avail = self.available(rid)
            if avail and "/ndbus" not in r["path"]:
                region["available_size"] = avail
            # Size-0 devices (a seed, a device shrunk to 0) only with --idle.
            devs = [self._dev_json(rid, i, d, mappings) for i, d in sorted(r["devices"].items())
                    if idle or d["ranges"]]
            if devs:
                region["devices"] = devs
            out.append(region)
        return json.dumps(out) if out else ""

    def _create_device(self, argv: list[str]) -> str:
        import json
        rid = int(argv[argv.index("-r") + 1])
        size = int(argv[argv.index("-s") + 1])
        align = int(argv[argv.index("-a") + 1])
        r = self.regions[rid]
        if "/ndbus" in r["path"] or size > self.available(rid):
            raise self._error(argv, "error creating devices: No space left on device\n"
                                    "created 0 devices\n")
        if size % max(align, r["align"]):
            raise self._error(argv, "error creating devices: Invalid argument\n"
                                    "created 0 devices\n")
        ranges, need = [], size
        for s, e in self._free_ranges(rid):  # first fit, discontiguous when it must be
            take = min(need, e - s + 1)
            ranges.append((s, s + take - 1))
            need -= take
            if not need:
                break
        inst = self._seed(rid)
        self._make(rid, inst, ranges, "devdax", align)
        return json.dumps([self._dev_json(rid, inst, r["devices"][inst], False)]), \
            "created 1 device\n"

    def _disable_device(self, argv: list[str]) -> tuple[str, str]:
        found = self._dev(argv[2])
        if found is None:
            raise self._error(argv, "error disabling device: No such device or address\n")
        _rid, _inst, d = found
        if d["mode"] == "system-ram":
            raise self._error(argv, f"{argv[2]}: status operations are only applicable in "
                                    "devdax mode\nerror disabling device: No such device "
                                    "or address\n")
        d["enabled"] = False
        return "", "disabled 1 device\n"

    def _destroy_device(self, argv: list[str]) -> tuple[str, str]:
        found = self._dev(argv[2])
        if found is None:
            raise self._error(argv, "error destroying devices: No such device or address\n")
        rid, inst, d = found
        if d["enabled"] and "--force" not in argv and "-f" not in argv:
            raise self._error(argv, f"{argv[2]} is active, specify --force for deletion\n")
        self._remove(rid, inst)
        return "", "destroyed 1 device\n"

    def _reconfigure_device(self, argv: list[str]) -> tuple[str, str]:
        chardev = argv[-1]
        found = self._dev(chardev)
        if found is None:
            raise self._error(argv, "error reconfiguring devices: No such device\n")
        _rid, _inst, d = found
        if "--mode=devdax" in argv:
            if d["mode"] == "system-ram" and self.busy:
                raise self._error(argv, f"{chardev}: failed to offline memory: Device or "
                                        "resource busy\nerror reconfiguring devices: Device "
                                        "or resource busy\nreconfigured 0 devices\n")
            d["mode"], d["enabled"] = "devdax", True
        elif "-s" in argv:
            if d["enabled"]:
                raise self._error(argv, "error reconfiguring devices: Device or resource "
                                        "busy\n")
            if int(argv[argv.index("-s") + 1]) == 0:
                d["ranges"] = []  # the kernel keeps the device, at size 0 (idle)
        return "", "reconfigured 1 device\n"

    def writes(self) -> list[list[str]]:
        return [c for c in self.calls if c[1] != "list"]
