"""What the unprivileged test pods run (mounted from a ConfigMap at /e2e/workload.py).

Why a script of its own: every scenario of test_cluster.py needs the same few things
done from inside a restricted pod through csi_pmem.daxclient (get the fd over dax.sock,
map it, write or verify a pattern, try what a read-only publish must refuse), and a
result the test can read: the last line of the log is ``RESULT {json}``.

Usage: workload.py write SEED | read SEED | readonly SEED | hold SEED | info
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import time

from csi_pmem.daxclient import DaxSocketError, map_volume, open_volume

VOLUME = os.environ.get("E2E_VOLUME", "/data")
CHUNK = 1 << 20


def pattern(seed: str, n: int) -> bytes:
    block = hashlib.sha256(seed.encode()).digest() * 128  # 4 KiB
    return (block * (n // len(block) + 1))[:n]


def regions(size: int) -> list[int]:
    """Offsets checked: the start, the middle and the last MiB of the volume."""
    return sorted({0, (size // 2) & ~(CHUNK - 1), max(0, size - CHUNK)})


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def write(seed: str) -> int:
    meta, mm = map_volume(VOLUME)
    size = len(mm)
    for off in regions(size):
        mm[off:off + CHUNK] = pattern(f"{seed}@{off}", CHUNK)
    mm.flush()
    mm.close()
    result(ok=True, action="write", meta=meta, size=size, uid=os.getuid())
    return 0


def verify(mm: mmap.mmap, seed: str) -> list[int]:
    return [off for off in regions(len(mm))
            if mm[off:off + CHUNK] != pattern(f"{seed}@{off}", CHUNK)]


def read(seed: str) -> int:
    meta, mm = map_volume(VOLUME, writable=False)
    bad = verify(mm, seed)
    zero = all(b == 0 for b in mm[:4096])
    mm.close()
    result(ok=not bad, action="read", meta=meta, mismatched_offsets=bad, starts_zero=zero)
    return 0 if not bad else 1


def readonly(seed: str) -> int:
    """A read-only publish: reading works; every way of writing is refused."""
    out: dict[str, object] = {"action": "readonly"}
    meta, fd = open_volume(VOLUME)
    out["meta"] = meta
    with open(f"/proc/self/fdinfo/{fd}") as f:
        flags = int(f.read().split("flags:")[1].split()[0], 8)
    out["fd_flags_rdonly"] = (flags & os.O_ACCMODE) == os.O_RDONLY
    try:
        m = mmap.mmap(fd, CHUNK, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m.close()
        out["mmap_write"] = "allowed"
    except OSError as exc:
        out["mmap_write"] = f"refused: {exc.strerror}"
    try:
        os.pwrite(fd, b"x", 0)
        out["pwrite"] = "allowed"
    except OSError as exc:
        out["pwrite"] = f"refused: {exc.strerror}"
    os.close(fd)
    try:
        map_volume(VOLUME, writable=True)[1].close()
        out["map_volume_writable"] = "allowed"
    except DaxSocketError as exc:
        out["map_volume_writable"] = f"refused: {exc}"
    _, mm = map_volume(VOLUME)
    out["mismatched_offsets"] = verify(mm, seed)
    mm.close()
    # Opening the device by a path is impossible in the pod: there is none.
    out["device_in_pod"] = os.path.exists(str(meta.get("device", "/nonexistent")))
    out["ok"] = (meta.get("readonly") is True and out["fd_flags_rdonly"] is True
                 and str(out["mmap_write"]).startswith("refused")
                 and str(out["pwrite"]).startswith("refused")
                 and str(out["map_volume_writable"]).startswith("refused")
                 and not out["mismatched_offsets"])
    result(**out)
    return 0 if out["ok"] else 1


def hold(seed: str) -> int:
    """Keep the mapping and check it every second; also re-fetch the fd each time (a
    restarted driver must serve dax.sock again). One line per tick."""
    meta, mm = map_volume(VOLUME)
    for off in regions(len(mm)):
        mm[off:off + CHUNK] = pattern(f"{seed}@{off}", CHUNK)
    result(ok=True, action="hold-start", meta=meta)
    tick = 0
    while True:
        tick += 1
        bad = verify(mm, seed)
        # A store on every tick, outside the verified regions (volumes are >= 64 MiB).
        mm[CHUNK + 4096:CHUNK + 4104] = tick.to_bytes(8, "little")
        try:
            _, fd = open_volume(VOLUME, timeout=5)
            os.close(fd)
            reconnect = "ok"
        except DaxSocketError as exc:
            reconnect = f"failed: {exc}"
        print(json.dumps({"tick": tick, "t": time.time(), "mapping_ok": not bad,
                          "reconnect": reconnect}), flush=True)
        time.sleep(1)


def info() -> int:
    meta, fd = open_volume(VOLUME)
    os.close(fd)
    result(ok=True, action="info", meta=meta)
    return 0


def main(argv: list[str]) -> int:
    action = argv[0]
    seed = argv[1] if len(argv) > 1 else ""
    try:
        if action == "info":
            return info()
        return {"write": write, "read": read, "readonly": readonly, "hold": hold}[action](seed)
    except Exception as exc:  # the test reads the reason from the log
        result(ok=False, action=action, error=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
