"""Reading /proc/self/mountinfo: which file system is mounted where, with what options.

Why its own module: the driver (mounts.py) and the weight loader both need it, and the
loader runs in user pods without the driver's dependencies (grpc, prometheus-client);
this module is the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fstype: str
    source: str
    options: frozenset[str]
    dev: str = ""  # "major:minor" of the mounted file system
    root: str = "/"  # the path inside that file system that is mounted here

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _consistent_read(path: str, attempts: int = 3) -> str:
    """mountinfo is generated page by page; a concurrent mount can tear one read, so
    read until two reads agree (the same defence as Kubernetes' mount-utils)."""
    with open(path) as f:
        previous = f.read()
    for _ in range(attempts):
        with open(path) as f:
            current = f.read()
        if current == previous:
            return current
        previous = current
    return previous


def mountinfo(path: str = MOUNTINFO) -> list[MountInfo]:
    mounts = []
    # Split lines on "\n" and fields on single spaces only: the kernel escapes space,
    # tab, newline and backslash, but other whitespace (\x0b, \x1c, U+2028 ...) appears
    # raw inside paths, and str.split()/splitlines() would cut there.
    for line in _consistent_read(path).split("\n"):
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(" "), right.split(" ")
        if len(fields) < 6 or len(rfields) < 2:
            continue
        opts = set(fields[5].split(",")) | set(rfields[2].split(",") if len(rfields) > 2
                                              else [])
        mounts.append(MountInfo(_unescape(fields[4]), rfields[0], _unescape(rfields[1]),
                                frozenset(opts), dev=fields[2], root=_unescape(fields[3])))
    return mounts


def find(target: str, path: str = MOUNTINFO) -> MountInfo | None:
    """The top-most mount at ``target`` (the last one listed wins), or None."""
    found = None
    for m in mountinfo(path):
        if m.mount_point == target:
            found = m
    return found
