"""Test helper: real, throw-away cgroups that look like kubelet pod cgroups.

Why this exists: the dax.sock server authenticates peers by the pod UID in their
``/proc/<pid>/cgroup``, and the whole devdax design rests on a device cgroup denying
open() while an fd passed over a unix socket still maps. Both are kernel behaviour, so the
tests put real processes into real cgroups instead of faking ``/proc``.

Supports the cgroup v1 ``devices`` hierarchy (deny via ``devices.deny``) and the v2
unified hierarchy (deny via an eBPF ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, which is how
runc does it on v2; there is no ``devices.*`` file there). On hybrid hosts both exist and
both work: cgroup-BPF programs attach to the unified hierarchy regardless of v1 mounts.

Every cgroup lives under ``csi-pmem-test-<pid>-<random>`` at the hierarchy root and
:meth:`CgroupTree.cleanup` removes it leaf-first after moving any leftover process back
to the cgroup it came from. Trees of test runs that died are swept on the next run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Self

PREFIX = "csi-pmem-test-"


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1: the v1 "devices" hierarchy; 2: the unified hierarchy
    mount: str  # where it is mounted
    root: str  # the mount's root within the hierarchy (mountinfo field 4), usually "/"


def hierarchies() -> dict[int, Hierarchy]:
    """The cgroup hierarchies that can control devices, by version."""
    found: dict[int, Hierarchy] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            fstype, superopts = rfields[0], rfields[2].split(",")
            mount = fields[4].replace("\\040", " ")
            if fstype == "cgroup" and "devices" in superopts:
                found.setdefault(1, Hierarchy(1, mount, fields[3]))
            elif fstype == "cgroup2":
                found.setdefault(2, Hierarchy(2, mount, fields[3]))
    return found


def current_cgroup(hierarchy: Hierarchy, pid: int | str = "self") -> str:
    """The cgroup path of ``pid`` in ``hierarchy`` as /proc/<pid>/cgroup shows it."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if hierarchy.version == 2 and hid == "0":
                return path
            if hierarchy.version == 1 and "devices" in controllers.split(","):
                return path
    raise LookupError(f"pid {pid} has no cgroup in the v{hierarchy.version} hierarchy")


@dataclass
class Cgroup:
    hierarchy: Hierarchy
    path: str  # filesystem path of the cgroup directory
    rel: str  # the path within the hierarchy, as /proc/<pid>/cgroup shows it

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def add(self, pid: int) -> None:
        with open(self.procs_file, "w") as f:
            f.write(str(pid))

    def procs(self) -> list[int]:
        with open(self.procs_file) as f:
            return [int(x) for x in f.read().split()]

    def deny_device(self, kind: str, major: int, minor: int) -> None:
        """Deny every access (read, write, mknod) to one device to members of this cgroup."""
        if kind not in ("b", "c"):
            raise ValueError("kind is 'b' (block) or 'c' (character)")
        if self.hierarchy.version == 1:
            with open(os.path.join(self.path, "devices.deny"), "w") as f:
                f.write(f"{kind} {major}:{minor} rwm")
        else:
            _attach_bpf_device_deny(self.path, kind, major, minor)


@dataclass
class CgroupTree:
    """Creates cgroups under one unique base directory and removes them all again."""

    hierarchy: Hierarchy
    base: str = field(default="")
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        sweep_stale(self.hierarchy)
        if not self.base:
            self.base = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"

    def create(self, *parts: str) -> Cgroup:
        """mkdir -p ``<base>/<parts...>`` and return the leaf."""
        rel_parts = [self.base, *parts]
        path = self.hierarchy.mount
        for part in rel_parts:
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"bad cgroup name {part!r}")
            path = os.path.join(path, part)
            if not os.path.isdir(path):
                os.mkdir(path)
                self._created.append(path)
        rel = os.path.join(self.hierarchy.root, *rel_parts)
        return Cgroup(self.hierarchy, path, rel)

    def cleanup(self) -> None:
        """Move stragglers out and rmdir leaf-first; raise only if something stays."""
        home = os.path.join(self.hierarchy.mount, os.path.relpath(
            current_cgroup(self.hierarchy), self.hierarchy.root))
        errors = []
        for path in sorted(self._created, key=lambda p: p.count("/"), reverse=True):
            try:
                _remove_cgroup(path, home)
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        self._created.clear()
        if errors:
            raise RuntimeError("could not remove test cgroups: " + "; ".join(errors))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _remove_cgroup(path: str, home: str) -> None:
    # A process that just exited can keep a cgroup busy for a moment (EBUSY) until it
    # is fully released; a live straggler is moved home rather than killed.
    deadline = time.monotonic() + 5
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        with contextlib.suppress(OSError):
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:
                with contextlib.suppress(OSError), open(
                        os.path.join(home, "cgroup.procs"), "w") as f:
                    f.write(pid)
        time.sleep(0.05)


def sweep_stale(hierarchy: Hierarchy) -> None:
    """Remove test trees left by test processes that no longer exist (e.g. SIGKILLed)."""
    try:
        names = os.listdir(hierarchy.mount)
    except OSError:
        return
    home = os.path.join(hierarchy.mount, os.path.relpath(
        current_cgroup(hierarchy), hierarchy.root))
    for name in names:
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
            continue
        top = os.path.join(hierarchy.mount, name)
        dirs = [root for root, _, _ in os.walk(top)]
        for path in sorted(dirs, key=lambda p: p.count("/"), reverse=True):
            with contextlib.suppress(OSError):
                _remove_cgroup(path, home)


# -- cgroup v2: device control is an eBPF program attached to the cgroup ---------------

_BPF_PROG_LOAD = 5
_BPF_PROG_ATTACH = 8
_BPF_PROG_TYPE_CGROUP_DEVICE = 15
_BPF_CGROUP_DEVICE = 6
_BPF_DEVCG_DEV_BLOCK = 1
_BPF_DEVCG_DEV_CHAR = 2
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
_ATTR_SIZE = 128  # larger than the fields we set; the kernel wants the tail zeroed


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _device_deny_program(dev_type: int, major: int, minor: int) -> list[bytes]:
    """Return 0 (deny) for one device, 1 (allow) for everything else.

    The context is struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor},
    where access_type's low 16 bits are the device type.
    """
    ldx_w, and_k, jne_k, mov_k, exit_ = 0x61, 0x57, 0x55, 0xB7, 0x95
    return [
        _insn(ldx_w, dst=2, src=1, off=0),  # r2 = ctx->access_type
        _insn(and_k, dst=2, imm=0xFFFF),  # r2 = device type
        _insn(jne_k, dst=2, off=6, imm=dev_type),  # other type: allow
        _insn(ldx_w, dst=3, src=1, off=4),  # r3 = ctx->major
        _insn(jne_k, dst=3, off=4, imm=major),
        _insn(ldx_w, dst=4, src=1, off=8),  # r4 = ctx->minor
        _insn(jne_k, dst=4, off=2, imm=minor),
        _insn(mov_k, dst=0, imm=0),  # deny
        _insn(exit_),
        _insn(mov_k, dst=0, imm=1),  # allow
        _insn(exit_),
    ]


def _bpf(cmd: int, attr: bytes) -> int:
    nr = _NR_BPF.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf syscall number unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr, _ATTR_SIZE)
    ret = libc.syscall(nr, cmd, buf, _ATTR_SIZE)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _attach_bpf_device_deny(cgroup_path: str, kind: str, major: int, minor: int) -> None:
    dev_type = _BPF_DEVCG_DEV_BLOCK if kind == "b" else _BPF_DEVCG_DEV_CHAR
    insns = _device_deny_program(dev_type, major, minor)
    code = ctypes.create_string_buffer(b"".join(insns))
    license_ = ctypes.create_string_buffer(b"Apache-2.0")
    log_buf = ctypes.create_string_buffer(16384)
    attr = struct.pack("<IIQQIIQ", _BPF_PROG_TYPE_CGROUP_DEVICE, len(insns),
                       ctypes.addressof(code), ctypes.addressof(license_),
                       1, len(log_buf), ctypes.addressof(log_buf))
    try:
        prog_fd = _bpf(_BPF_PROG_LOAD, attr)
    except OSError as exc:
        raise OSError(exc.errno, f"loading the device program failed: {exc.strerror}: "
                                 f"{log_buf.value.decode(errors='replace')}") from exc
    try:
        cgroup_fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Without BPF_F_ALLOW_MULTI; the attachment lives as long as the cgroup.
            _bpf(_BPF_PROG_ATTACH, struct.pack(
                "<IIII", cgroup_fd, prog_fd, _BPF_CGROUP_DEVICE, 0))
        finally:
            os.close(cgroup_fd)
    finally:
        os.close(prog_fd)
