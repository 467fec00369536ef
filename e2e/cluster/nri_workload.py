"""What the NRI scenarios' restricted pods run (test_nri.py; ConfigMap at /e2e).

Why a script of its own beside workload.py (whose pattern, regions and RESULT line it
reuses): these pods use the device node the NRI plugin added, by the path volume.json
names, with plain open/mmap as an unmodified program would, and compare it with what
dax.sock hands out.

Usage: nri_workload.py devwrite SEED | devread SEED | devro SEED | devhold SEED SECONDS
                       | nodev [TYPE MAJOR MINOR] | write SEED (workload.py's, dax.sock)
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import sys
import time

from workload import CHUNK, pattern, regions, result, try_open, write

from csi_pmem.daxclient import map_volume

VOLUME = os.environ.get("E2E_VOLUME", "/data")


def meta() -> dict:
    with open(os.path.join(VOLUME, "volume.json")) as f:
        return json.load(f)


def facts(path: str) -> dict[str, object]:
    st = os.stat(path)
    kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else "other"
    return {"type": kind, "uid": st.st_uid, "gid": st.st_gid,
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "rdev": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"}


def who() -> dict[str, object]:
    return {"uid": os.getuid(), "gid": os.getgid()}


def map_device(path: str, size: int, writable: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


def mismatched(mm: mmap.mmap, seed: str, size: int) -> list[int]:
    return [off for off in regions(size)
            if mm[off:off + CHUNK] != pattern(f"{seed}@{off}", CHUNK)]


def devwrite(seed: str) -> int:
    """open(O_RDWR) the node volume.json names, map it, write the pattern, msync."""
    md = meta()
    node = md.get("device_node")
    if not node:
        result(ok=False, action="devwrite", meta=md, error="volume.json has no device_node")
        return 1
    path, size = node["path"], int(md["usable_size"])
    f = facts(path)
    mm = map_device(path, size, writable=True)
    for off in regions(size):
        mm[off:off + CHUNK] = pattern(f"{seed}@{off}", CHUNK)
    mm.flush()
    bad = mismatched(mm, seed, size)
    mm.close()
    result(ok=not bad, action="devwrite", meta=md, device=f, mismatched_offsets=bad, **who())
    return 0 if not bad else 1


def devread(seed: str) -> int:
    """The same bytes through the device path and through dax.sock."""
    md = meta()
    path, size = md["device_node"]["path"], int(md["usable_size"])
    dev = map_device(path, size, writable=False)
    _, sock = map_volume(VOLUME, writable=False)
    same = all(dev[off:off + CHUNK] == sock[off:off + CHUNK] for off in regions(size))
    bad_dev, bad_sock = mismatched(dev, seed, size), mismatched(sock, seed, size)
    dev.close()
    sock.close()
    ok = same and not bad_dev and not bad_sock
    result(ok=ok, action="devread", meta=md, device=facts(path), same_bytes=same,
           mismatched_device=bad_dev, mismatched_socket=bad_sock, **who())
    return 0 if ok else 1


def devro(seed: str) -> int:
    """A read-only claim: O_RDONLY works and reads the data; O_RDWR and O_WRONLY fail."""
    md = meta()
    path, size = md["device_node"]["path"], int(md["usable_size"])
    out: dict[str, object] = {"action": "devro", "meta": md, "device": facts(path), **who()}
    out["open_rdonly"] = try_open(path, os.O_RDONLY)
    out["open_rdwr"] = try_open(path, os.O_RDWR)
    out["open_wronly"] = try_open(path, os.O_WRONLY)
    mm = map_device(path, size, writable=False)
    out["mismatched_offsets"] = mismatched(mm, seed, size)
    mm.close()
    out["ok"] = (out["open_rdonly"] == "allowed" and out["open_rdwr"] == "EPERM"
                 and out["open_wronly"] == "EPERM" and not out["mismatched_offsets"])
    result(**out)
    return 0 if out["ok"] else 1


def devhold(seed: str, seconds: str) -> int:
    """Map the node rw, write the pattern, and keep checking the mapping (and opening
    the node again) while the test restarts the plugin; one line per tick."""
    md = meta()
    path, size = md["device_node"]["path"], int(md["usable_size"])
    mm = map_device(path, size, writable=True)
    for off in regions(size):
        mm[off:off + CHUNK] = pattern(f"{seed}@{off}", CHUNK)
    print("HOLDING", flush=True)
    ticks, failures = 0, []
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        ticks += 1
        mm[CHUNK + 4096:CHUNK + 4104] = ticks.to_bytes(8, "little")
        bad = mismatched(mm, seed, size)
        reopen = try_open(path, os.O_RDWR)
        if bad or reopen != "allowed":
            failures.append({"tick": ticks, "mismatched": bad, "reopen": reopen})
        time.sleep(0.2)
    mm.close()
    result(ok=not failures, action="devhold", ticks=ticks, failures=failures[:5],
           device=facts(path), **who())
    return 0 if not failures else 1


def nodev(kind: str = "", major: str = "", minor: str = "") -> int:
    """No csi-pmem device node here, and no way to make one of the host's device."""
    names = sorted(os.listdir("/dev"))
    found = [n for n in names if n.startswith("dax") or n == "csi-pmem"]
    out: dict[str, object] = {"action": "nodev", "dev": names, "found": found, **who()}
    if major:
        try:
            os.mknod("/tmp/dax", 0o600 | (stat.S_IFBLK if kind == "b" else stat.S_IFCHR),
                     os.makedev(int(major), int(minor)))
            out["mknod"] = "allowed"
            out["open_mknod"] = try_open("/tmp/dax", os.O_RDONLY)
        except OSError as exc:
            out["mknod"] = errno.errorcode.get(exc.errno, str(exc.errno))
    out["ok"] = not found and out.get("mknod", "EPERM") == "EPERM"
    result(**out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    actions = {"devwrite": devwrite, "devread": devread, "devro": devro,
               "devhold": devhold, "nodev": nodev, "write": write}
    sys.exit(actions[sys.argv[1]](*sys.argv[2:]))
