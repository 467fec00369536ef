"""Unix sockets that pass file descriptors: addressing, receiving fds, owning a path.

Why one module: ``dax.sock`` (the driver's server, :mod:`csi_pmem.driver.daxsock`, and
its client, :mod:`csi_pmem.daxclient`), ``gpu.sock`` and the copy service's control
socket (:mod:`csi_pmem.gpucopy`) all bind or reach sockets at kubelet paths longer than
``sun_path`` holds, all collect SCM_RIGHTS fds, and all must tell a stale socket file
from a live one. Each did that with its own copy; a server borrowed its address helper
from its own client.

Who owns a socket file: nobody (stale), a live listener, or not a socket at all. A
socket file outlives the process that bound it (a SIGKILL skips every cleanup), so a
restarted driver must replace the stale ones it finds. But a second driver on the same
node, a surge rollout or a second ``make run`` finds live sockets at the same paths, and
unlinking one cuts every client off from the process still serving it: kubelet from
``csi.sock``, pods from ``dax.sock`` and ``gpu.sock``. A connect() tells the two apart:
a stale socket refuses it (ECONNREFUSED), a live one does not.

Standard library only (the common layer): pods import it through the loader.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import socket
import stat
from collections.abc import Iterator

# sun_path is 108 bytes including the terminating NUL. Kubelet publish targets
# (/var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount/dax.sock) are
# typically ~140 bytes, so the node plugin routinely needs the long-path workaround below.
SUN_PATH_MAX = 107


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """Yield an address for ``path`` that fits in sun_path, valid inside the block.

    Long paths are reached through ``/proc/self/fd/<dirfd>/<name>``: resolving the
    magic link lands in the real directory, so bind() creates the socket there and
    connect() finds it, without chdir() (which would race with other threads). A name
    too long even so is ENAMETOOLONG.
    """
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield path
        return
    directory, name = os.path.split(os.path.abspath(path))
    dirfd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        short = f"/proc/self/fd/{dirfd}/{name}"
        if len(os.fsencode(short)) > SUN_PATH_MAX:
            raise OSError(errno.ENAMETOOLONG,
                          f"socket name {name!r} is too long for a unix socket address", path)
        yield short
    finally:
        os.close(dirfd)


def recv_with_fds(sock: socket.socket, max_bytes: int,
                  max_fds: int) -> tuple[bytes, list[int], int]:
    """One recvmsg(): up to ``max_bytes`` of data and ``max_fds`` SCM_RIGHTS fds, the fds
    close-on-exec from the moment they arrive; (data, fds, msg flags).

    Not socket.recv_fds(): in Python 3.11 it ignores its flags argument, so
    MSG_CMSG_CLOEXEC would be dropped and a concurrent fork+exec could inherit the fd.
    More fds than ``max_fds`` set MSG_CTRUNC in the flags (the kernel closes the rest).
    """
    int_size = array.array("i").itemsize
    data, ancdata, flags, _ = sock.recvmsg(
        max_bytes, socket.CMSG_SPACE(max_fds * int_size), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % int_size])
    return data, list(fds), flags


def close_all(fds: list[int]) -> None:
    """Close every fd of ``fds``; one already closed is no error."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


ABSENT, STALE, LIVE, NOT_SOCKET = "absent", "stale", "live", "not a socket"


def socket_state(path: str) -> str:
    """:data:`ABSENT`, :data:`STALE`, :data:`LIVE` or :data:`NOT_SOCKET` for ``path``."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return NOT_SOCKET
    except FileNotFoundError:
        return ABSENT
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        with unix_address(path) as address:
            probe.connect(address)
    except ConnectionRefusedError:
        return STALE
    except FileNotFoundError:
        return ABSENT  # removed between lstat and connect
    except OSError:
        # EAGAIN (a full backlog) and the like: someone is listening.
        return LIVE
    finally:
        probe.close()
    return LIVE


class SocketInUse(OSError):
    """Another process listens on the path; it is never unlinked from under it."""


def claim(path: str) -> None:
    """Make ``path`` free to bind: remove a stale socket left by a dead process.

    Raises :class:`SocketInUse` (EADDRINUSE) when a process listens on it, and
    FileExistsError when something other than a socket is there; neither is touched.
    """
    state = socket_state(path)
    if state == LIVE:
        raise SocketInUse(errno.EADDRINUSE,
                          "another process listens on this socket; it is left alone", path)
    if state == NOT_SOCKET:
        raise FileExistsError(errno.EEXIST,
                              "exists and is not a socket; refusing to replace it", path)
    if state == STALE:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
