"""Client side of the ``dax.sock`` protocol: get the open fd of a devdax volume.

Why this exists: a devdax volume is not a device node inside the pod. The pod's device
cgroup would refuse open() of ``/dev/daxX.Y`` anyway, so the node plugin opens the device
itself and hands the open fd to an authenticated peer over a unix socket in the published
volume directory (device cgroups are checked only at open()/mknod(), never at mmap, read,
write or page faults; see docs/design.md §2). This module is that peer's half: the CLI, the
weight loader and the tests use it inside the pod.

The protocol is one message from server to client: a JSON object terminated by ``\\n``
with the fd attached via SCM_RIGHTS, or ``{"error": "..."}`` without an fd. The client
sends nothing. Keys the server may add later are passed through untouched.

Standard library only; in particular this must not import grpc (it runs in user pods).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
from typing import Any

from csi_pmem.fdpass import close_all, recv_with_fds, unix_address

SOCKET_NAME = "dax.sock"
METADATA_FILE = "volume.json"

# A metadata line is a few hundred bytes; anything near this is a protocol error, and the
# cap keeps a confused peer from making us buffer without bound.
MAX_LINE = 64 * 1024

# The server sends exactly one fd; room for a few more lets us see (and close) extras
# instead of the kernel silently dropping them.
_MAX_FDS = 4


class DaxSocketError(Exception):
    """The volume's fd could not be obtained; ``str(e)`` says why and what to do.

    ``server_message`` holds the node plugin's own refusal text when it refused.
    """

    def __init__(self, message: str, *, server_message: str | None = None):
        super().__init__(message)
        self.server_message = server_message


def socket_path(volume_dir_or_socket: str) -> str:
    """The socket of a published volume, given its directory or the socket itself."""
    if os.path.isdir(volume_dir_or_socket):
        return os.path.join(volume_dir_or_socket, SOCKET_NAME)
    return volume_dir_or_socket


def _connect_error(path: str, exc: OSError) -> DaxSocketError:
    if isinstance(exc, FileNotFoundError):
        return DaxSocketError(
            f"{path} does not exist: is the csi-pmem volume mounted at "
            f"{os.path.dirname(path) or '.'}? (pass the volume's mount directory or its "
            f"{SOCKET_NAME})")
    if isinstance(exc, ConnectionRefusedError):
        return DaxSocketError(
            f"nothing is listening on {path}: the csi-pmem node plugin on this node is not "
            "running or has not re-served this volume since it restarted; retry in a few "
            "seconds, and check the node plugin's log if it persists")
    if isinstance(exc, PermissionError):
        return DaxSocketError(
            f"permission denied connecting to {path}: the socket is restricted to the "
            "volume's mount group; run the container with that group (pod fsGroup or "
            "supplementalGroups)")
    if isinstance(exc, TimeoutError):
        return DaxSocketError(f"timed out connecting to {path}")
    if exc.errno == errno.ENOTSOCK or exc.errno == errno.ENOTDIR:
        return DaxSocketError(f"{path} is not a unix socket; is this a csi-pmem devdax volume?")
    return DaxSocketError(f"cannot connect to {path}: {exc}")


def open_volume(volume_dir_or_socket: str, timeout: float = 10) -> tuple[dict[str, Any], int]:
    """Connect to a volume's ``dax.sock``; return its metadata and the device fd.

    The caller owns the fd (close-on-exec, O_RDONLY when the volume was published
    read-only) and must close it. Raises :class:`DaxSocketError` with an actionable
    message when the socket is missing or dead, the node plugin refused the peer, or the
    reply carried no fd.
    """
    path = socket_path(volume_dir_or_socket)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        try:
            with unix_address(path) as address:
                sock.connect(address)
        except OSError as exc:
            raise _connect_error(path, exc) from exc

        data = b""
        while b"\n" not in data:
            try:
                chunk, got, flags = recv_with_fds(sock, MAX_LINE, _MAX_FDS)
            except TimeoutError as exc:
                raise DaxSocketError(
                    f"timed out after {timeout:g} s waiting for the node plugin's reply on "
                    f"{path}") from exc
            except OSError as exc:
                raise DaxSocketError(f"reading from {path} failed: {exc}") from exc
            fds.extend(got)
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise DaxSocketError(
                    f"the reply on {path} carried more file descriptors than expected; "
                    "is this the csi-pmem node plugin?")
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_LINE:
                raise DaxSocketError(f"the reply on {path} is not a csi-pmem metadata line")

        line, newline, _ = data.partition(b"\n")
        if not newline:
            raise DaxSocketError(
                f"the node plugin closed {path} without a complete reply; check its log")
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise DaxSocketError(f"the reply on {path} is not valid JSON: {exc}") from exc
        if not isinstance(reply, dict):
            raise DaxSocketError(f"the reply on {path} is not a JSON object")
        if "error" in reply:
            message = str(reply["error"])
            raise DaxSocketError(
                f"the csi-pmem node plugin refused {path}: {message}", server_message=message)
        if not fds:
            raise DaxSocketError(
                f"the node plugin sent metadata but no file descriptor on {path}")
        fd = fds.pop(0)
        return reply, fd
    finally:
        # Anything still in the list is unexpected (extra fds, or an error after receipt).
        close_all(fds)
        sock.close()


def map_volume(volume_dir_or_socket: str, writable: bool | None = None,
               timeout: float = 10) -> tuple[dict[str, Any], mmap.mmap]:
    """Map a whole devdax volume MAP_SHARED from offset 0.

    ``writable=None`` maps writable exactly when the volume is not read-only. Asking for a
    writable mapping of a read-only volume raises instead of handing back a mapping
    whose first store would SIGSEGV. The fd is closed; the mapping keeps the device open.
    """
    metadata, fd = open_volume(volume_dir_or_socket, timeout=timeout)
    try:
        readonly = bool(metadata.get("readonly", False))
        if writable is None:
            writable = not readonly
        if writable and readonly:
            raise DaxSocketError(
                f"volume {metadata.get('volume_id', '?')} is published read-only; "
                "map it with writable=False (or publish it read-write)")
        try:
            length = int(metadata["usable_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DaxSocketError(
                f"metadata from {socket_path(volume_dir_or_socket)} has no valid "
                f"usable_size: {metadata!r}") from exc
        if length <= 0:
            raise DaxSocketError(f"volume usable_size is {length}; nothing to map")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot, offset=0)
        except OSError as exc:
            raise DaxSocketError(
                f"mmap of {length} bytes of volume {metadata.get('volume_id', '?')} "
                f"({metadata.get('device', '?')}) failed: {exc}") from exc
        return metadata, mapping
    finally:
        os.close(fd)
