"""Which dax device belongs to which volume: the daxctl back end's identity records.

Why: an ndctl namespace carries its volume id as its alt-name, in the label area, so
the kernel itself says which namespace is whose. A dax device has no name, label or
uuid (``daxctl/json.c`` prints none): ``dax0.3`` is just the fourth device the region
handed out, and the kernel reuses a destroyed device's number (an IDA). So the back end
keeps, beside the driver's state, one record per device it made
(``<state-dir>/daxctl-devices.json``)::

    name -> {region, chardev, size, align, mappings: [[start, end], ...], boot_id, seq}

and a device is recognised as ``name``'s only while all of these hold:

- ``boot_id`` is this boot's (``/proc/sys/kernel/random/boot_id``): a dax device never
  outlives a boot, so after a node restart every record is stale and the volume is lost
  (the driver's volatile recovery carves it again, :mod:`csi_pmem.driver.recovery`);
- a device ``chardev`` exists in ``region``, in devdax mode, of exactly ``size`` bytes;
- its physical ranges (``daxctl list --mappings``) are the recorded ones, when both
  sides know them (a device destroyed by hand and another made under the same number
  usually lands elsewhere; one of the same size over the very same ranges, made by
  hand within the same boot, cannot be told apart: do not carve these regions by
  hand);
- no later record (a higher ``seq``) claims the same device.

Crash safety: a create first writes a *pending* record (no ``chardev``) naming the
devices the region already had (``before``). A device that appears in that region
afterwards, of the requested size, not in ``before`` and claimed by no other record, is
the one the interrupted create made: it is adopted, so a crash between ``daxctl
create-device`` and the record leaks nothing and strands nothing. A destroy drops the
record only after ``daxctl destroy-device`` succeeded.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from csi_pmem.driver.backends.daxctl_listing import DaxDevice, DaxRegion
from csi_pmem.driver.state import write_atomic
from csi_pmem.errors import from_os_error

log = logging.getLogger(__name__)

DEVDAX = "devdax"


class DeviceRecords:
    """The records, in memory and (when ``path`` is given) in one JSON file.

    Callers hold the back end's write lock around every change; reads copy."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._seq = 0
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                self._entries = {str(k): dict(v) for k, v in doc.get("devices", {}).items()}
            except (OSError, ValueError, AttributeError) as exc:
                # Not one device is known as ours then: every volume reads as lost and
                # is carved again (volatile), the unknown devices stay untouched.
                log.error("%s is unreadable (%s): the daxctl back end knows none of its "
                          "devices; fix or remove the file", self.path, exc)
            self._seq = max((int(e.get("seq", 0)) for e in self._entries.values()), default=0)

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._entries.items()}

    def put(self, name: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._seq += 1
            self._entries[name] = {**entry, "seq": self._seq}
            self._save()

    def drop(self, *names: str) -> None:
        with self._lock:
            if not any(n in self._entries for n in names):
                return
            for n in names:
                self._entries.pop(n, None)
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        doc = json.dumps({"devices": self._entries}, sort_keys=True, indent=1).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(self.path, doc)
        except OSError as exc:
            raise from_os_error(exc, f"cannot save the daxctl device records {self.path}") \
                from exc


def record(device: DaxDevice, boot: str, **extra: Any) -> dict[str, Any]:
    """The record of a device just made (see the module docstring)."""
    return {"region": device.region, "chardev": device.chardev, "size": device.size,
            "align": device.align, "mappings": [list(m) for m in device.mappings],
            "boot_id": boot, **extra}


def pending(region: DaxRegion, size: int, align: int, boot: str, **extra: Any) -> dict:
    return {"region": region.id, "chardev": "", "size": size, "align": align,
            "mappings": [], "boot_id": boot,
            # Sized devices only: create-device sizes the region's idle seed, which
            # may well be listed already (at size 0).
            "before": sorted(d.chardev for d in region.devices if d.size > 0), **extra}


def _same(entry: dict[str, Any], device: DaxDevice) -> bool:
    if device.mode != DEVDAX or device.size != int(entry.get("size", -1)):
        return False
    if device.region != int(entry.get("region", -2)):
        return False
    recorded = [tuple(m) for m in entry.get("mappings") or []]
    return not recorded or not device.mappings or list(device.mappings) == recorded


def match(entries: dict[str, dict[str, Any]], regions: Iterable[DaxRegion],
          boot: str) -> dict[str, DaxDevice]:
    """name -> its device, for every record whose device is there (module docstring)."""
    by_dev = {d.chardev: d for r in regions for d in r.devices if d.size > 0}
    by_region: dict[int, list[DaxDevice]] = {}
    for d in by_dev.values():
        by_region.setdefault(d.region, []).append(d)
    out: dict[str, DaxDevice] = {}
    owner: dict[str, tuple[int, str]] = {}  # chardev -> (seq, name)
    live = {n: e for n, e in entries.items() if boot and e.get("boot_id") == boot}
    for name, entry in sorted(live.items(), key=lambda kv: int(kv[1].get("seq", 0))):
        if not entry.get("chardev"):
            continue
        dev = by_dev.get(str(entry["chardev"]))
        if dev is not None and _same(entry, dev):
            previous = owner.get(dev.chardev)
            if previous is not None:  # a stale record of a reused number: the later wins
                out.pop(previous[1], None)
            owner[dev.chardev] = (int(entry.get("seq", 0)), name)
            out[name] = dev
    for name, entry in live.items():
        if entry.get("chardev"):
            continue
        before = set(entry.get("before") or [])
        found = [d for d in by_region.get(int(entry.get("region", -1)), [])
                 if d.chardev not in before and d.chardev not in owner and _same(entry, d)]
        if len(found) == 1:
            out[name] = found[0]
            owner[found[0].chardev] = (int(entry.get("seq", 0)), name)
        elif len(found) > 1:  # ambiguous: claim none, touch none, say so
            log.error("dax devices %s all look like the one an interrupted create of %s "
                      "made; destroy the ones not in use by hand ('daxctl disable-device "
                      "X; daxctl destroy-device X')", ", ".join(d.chardev for d in found),
                      name)
    return out
