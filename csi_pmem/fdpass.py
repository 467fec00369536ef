"""Who owns a unix socket file: nobody (stale), a live listener, or not a socket at all.

Why: a socket file outlives the process that bound it (a SIGKILL skips every cleanup),
so a restarted driver must replace the stale ones it finds. But a second driver on the
same node, a surge rollout or a second ``make run`` finds live sockets at the same
paths, and unlinking one cuts every client off from the process still serving it:
kubelet from ``csi.sock``, pods from ``dax.sock`` and ``gpu.sock``. A connect() tells
the two apart: a stale socket refuses it (ECONNREFUSED), a live one does not.

Standard library only (the common layer), so that the node's GPU copy service, the
driver's socket server and its gRPC endpoint share one rule.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

from csi_pmem.daxclient import unix_address

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
