"""What the unprivileged test pods run (mounted from a ConfigMap at /e2e/workload.py).

Why a script of its own: every scenario of test_cluster.py needs the same few things
done from inside a restricted pod through csi_pmem.daxclient (get the fd over dax.sock,
map it, write or verify a pattern, try what a read-only publish must refuse), and a
result the test can read: the last line of the log is ``RESULT {json}``.

fsdax volumes need no dax.sock: a Block claim is a device node in the container
(volumeDevices, path $E2E_DEVICE), a Filesystem claim an ext4/xfs mount at $E2E_VOLUME;
the block* and fs* actions use them with plain open/read/write.

Usage: workload.py write SEED | read SEED | readonly SEED | hold SEED | info
                   | blockwrite SEED | blockread SEED | blockro SEED
                   | fswrite SEED | fsread SEED
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import stat
import struct
import sys
import time

from csi_pmem.daxclient import DaxSocketError, map_volume, open_volume

VOLUME = os.environ.get("E2E_VOLUME", "/data")
DEVICE = os.environ.get("E2E_DEVICE", "/dev/xvda")
CHUNK = 1 << 20
BLKROGET = 0x125E      # _IO(0x12, 94): 1 when the block device is read-only
FS_FILE_BYTES = 4 * CHUNK


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


# ------------------------------------------------------------------ fsdax: Block claims
def device_facts(path: str) -> dict[str, object]:
    """What the container sees of its device node (owner, mode, kind)."""
    st = os.stat(path)
    return {"block": stat.S_ISBLK(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "rdev": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"}


def device_size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)


def read_only_flag(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, BLKROGET, struct.pack("i", 0)))[0]


def verify_fd(fd: int, seed: str, size: int) -> list[int]:
    return [off for off in regions(size)
            if os.pread(fd, CHUNK, off) != pattern(f"{seed}@{off}", CHUNK)]


def try_open(path: str, flags: int) -> str:
    """"allowed", or the errno name open() failed with."""
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    os.close(fd)
    return "allowed"


def blockwrite(seed: str) -> int:
    facts = device_facts(DEVICE)
    who = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
    try:
        fd = os.open(DEVICE, os.O_RDWR)
    except OSError as exc:  # e.g. EACCES: the node is root's (see README, containerd)
        result(ok=False, action="blockwrite", device=facts,
               open_rdwr=errno.errorcode.get(exc.errno, str(exc.errno)), **who)
        return 1
    try:
        size = device_size(fd)
        for off in regions(size):
            os.pwrite(fd, pattern(f"{seed}@{off}", CHUNK), off)
        os.fsync(fd)
        bad = verify_fd(fd, seed, size)
        ro = read_only_flag(fd)
    finally:
        os.close(fd)
    result(ok=not bad and facts["block"] is True, action="blockwrite", device=facts,
           open_rdwr="allowed", size=size, read_only_flag=ro, mismatched_offsets=bad, **who)
    return 0 if not bad else 1


def blockread(seed: str) -> int:
    facts = device_facts(DEVICE)
    fd = os.open(DEVICE, os.O_RDONLY)
    try:
        size = device_size(fd)
        bad = verify_fd(fd, seed, size)
    finally:
        os.close(fd)
    result(ok=not bad, action="blockread", device=facts, size=size, mismatched_offsets=bad)
    return 0 if not bad else 1


def blockro(seed: str) -> int:
    """A read-only Block claim: opening for writing is refused (the device cgroup allows
    "r" only, and the driver publishes a read-only view), reading works."""
    out: dict[str, object] = {"action": "blockro", "device": device_facts(DEVICE)}
    out["open_rdwr"] = try_open(DEVICE, os.O_RDWR)
    out["open_wronly"] = try_open(DEVICE, os.O_WRONLY)
    fd = os.open(DEVICE, os.O_RDONLY)
    try:
        size = device_size(fd)
        out["size"] = size
        out["mismatched_offsets"] = verify_fd(fd, seed, size)
        out["read_only_flag"] = read_only_flag(fd)
    finally:
        os.close(fd)
    refused = ("EPERM", "EACCES", "EROFS")
    out["ok"] = (out["open_rdwr"] in refused and out["open_wronly"] in refused
                 and not out["mismatched_offsets"])
    result(**out)
    return 0 if out["ok"] else 1


# ------------------------------------------------------------------ fsdax: Filesystem claims
def mount_of(path: str) -> dict[str, object]:
    """The /proc/self/mountinfo entry of the mount at ``path``."""
    found: dict[str, object] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            fields, rest = left.split(), right.split()
            if fields[4] == path:  # the last one wins (a mount stacked on top)
                found = {"fstype": rest[0], "source": rest[1],
                         "mount_options": fields[5].split(","),
                         "super_options": rest[2].split(",") if len(rest) > 2 else []}
    if found:
        opts = [*found["mount_options"], *found["super_options"]]  # type: ignore[misc]
        found["dax"] = any(o in ("dax", "dax=always") for o in opts)
    return found


def fs_facts() -> dict[str, object]:
    st = os.stat(VOLUME)
    vfs = os.statvfs(VOLUME)
    return {"mount": mount_of(VOLUME), "dir_gid": st.st_gid,
            "dir_mode": oct(stat.S_IMODE(st.st_mode)), "uid": os.getuid(),
            "groups": sorted(os.getgroups()), "size": vfs.f_blocks * vfs.f_frsize}


def fswrite(seed: str) -> int:
    facts = fs_facts()
    path = os.path.join(VOLUME, f"{seed}.bin")
    with open(path, "wb") as f:
        f.write(pattern(seed, FS_FILE_BYTES))
        f.flush()
        os.fsync(f.fileno())
    os.makedirs(os.path.join(VOLUME, f"{seed}.d"), exist_ok=True)
    st = os.stat(path)
    with open(path, "rb") as f:
        same = f.read() == pattern(seed, FS_FILE_BYTES)
    result(ok=same, action="fswrite", file_uid=st.st_uid, file_gid=st.st_gid,
           files=sorted(os.listdir(VOLUME)), **facts)
    return 0 if same else 1


def fsread(seed: str) -> int:
    facts = fs_facts()
    path = os.path.join(VOLUME, f"{seed}.bin")
    with open(path, "rb") as f:
        same = f.read() == pattern(seed, FS_FILE_BYTES)
    result(ok=same, action="fsread", files=sorted(os.listdir(VOLUME)), **facts)
    return 0 if same else 1


ACTIONS = {"write": write, "read": read, "readonly": readonly, "hold": hold,
           "blockwrite": blockwrite, "blockread": blockread, "blockro": blockro,
           "fswrite": fswrite, "fsread": fsread}


def main(argv: list[str]) -> int:
    action = argv[0]
    seed = argv[1] if len(argv) > 1 else ""
    try:
        if action == "info":
            return info()
        return ACTIONS[action](seed)
    except Exception as exc:  # the test reads the reason from the log
        result(ok=False, action=action, error=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
