"""Node-plugin side of ``dax.sock``: hand the devdax fd to the pod that owns the volume.

Why this exists: device cgroups are checked at open() and mknod() only (docs/design.md §2),
so an fd opened by the node plugin and passed over a unix socket (SCM_RIGHTS) can be
mmapped by a pod whose device cgroup denies the device. That makes this server the
authorisation point for devdax volumes: it checks who connected (SO_PEERCRED, then the
peer's ``/proc/<pid>/cgroup`` must name the pod the volume was published to) and only
then sends the fd, O_RDONLY for read-only publishes (the opener decides that).

One daemon thread runs a ``selectors`` loop over every listening socket: a node can have
hundreds of published volumes, and a thread per socket would be hundreds of idle threads.
The protocol is server-speaks-first (one JSON line plus the fd, then close), so a client
can never make the loop wait for its input; sends carry a short timeout as a backstop.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from csi_pmem import fdpass
from csi_pmem.fdpass import unix_address

log = logging.getLogger(__name__)

Opener = Callable[[], int]
EventHook = Callable[[str, str], None]
# Instead of sending the fd: hand the authenticated connection and the fd elsewhere
# (gpu.sock -> the GPU copy service). Runs in a thread of its own; raising tells the
# client why, as an error line.
Forward = Callable[[socket.socket, int], None]

# struct ucred from <sys/socket.h>: pid_t, uid_t, gid_t.
_UCRED = struct.Struct("iII")
# Linux >= 6.5; not yet a named constant in Python 3.11's socket module.
_SO_PEERPIDFD = 77
# Bound the work one wake-up does for one socket so a flood on one volume cannot starve
# the others; the selector reports the socket again if more connections are queued.
_ACCEPT_BATCH = 64
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_EXHAUSTED_PAUSE = 0.05

EVENT_SERVED = "served"
EVENT_REFUSED = "refused"
EVENT_ERROR = "error"


@dataclass
class _Endpoint:
    path: str
    sock: socket.socket
    inode: tuple[int, int]
    line: bytes
    opener: Opener
    pod_uid: str | None
    forward: Forward | None = None


@dataclass(frozen=True)
class _Job:
    """What one accepted connection needs, copied so serve() may replace it meanwhile."""

    path: str
    line: bytes
    opener: Opener
    pod_uid: str | None
    forward: Forward | None = None


def pod_uid_in_cgroups(cgroup_text: str, pod_uid: str) -> bool:
    """True when some line of a ``/proc/<pid>/cgroup`` names the pod ``pod_uid``.

    The kubelet puts the pod UID into one path component: ``pod<uid>`` with the cgroupfs
    driver, ``kubepods[-<qos>]-pod<uid with _ for ->.slice`` with the systemd driver.
    Matching whole components (rather than a plain substring) keeps a pod UID that is
    a prefix of another component from matching.
    """
    wanted = {f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}"}
    for line in cgroup_text.splitlines():
        # "hierarchy-id:controllers:path"; the path itself may contain ':'.
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for component in parts[2].split("/"):
            component = component.removesuffix(".slice")
            if component in wanted:
                return True
            if any(component.endswith("-" + w) for w in wanted):
                return True
    return False


class DaxSocketServer:
    """Serves ``dax.sock`` for every published devdax volume from one selector thread.

    ``served``, ``refused`` and ``failed`` count connections; ``on_event(kind, path)``
    (kind: ``"served"``, ``"refused"`` or ``"error"``) is called for each from the loop
    thread and must be quick; its exceptions are logged and ignored.
    """

    def __init__(self, *, proc_root: str = "/proc", send_timeout: float = 2.0,
                 on_event: EventHook | None = None, name: str = "dax-socket-server"):
        self.proc_root = proc_root
        self.send_timeout = send_timeout
        self.on_event = on_event
        self.served = 0
        self.refused = 0
        self.failed = 0
        self._exhausted_logged = -1e9  # when running out of fds was last logged
        self._lock = threading.Lock()
        self._endpoints: dict[str, _Endpoint] = {}
        self._closed = False
        self._selector = selectors.DefaultSelector()
        # serve()/stop() run in gRPC threads; the wake-up pair makes the loop re-enter
        # select() with the new registrations (epoll would not need it, poll/select would).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------------

    def serve(self, path: str, metadata: dict[str, Any], opener: Opener, *,
              pod_uid: str | None, mode: int = 0o666, gid: int | None = None,
              forward: Forward | None = None) -> None:
        """Listen on ``path`` and answer each authorised peer with metadata and a new fd.

        Idempotent: serving a path that is already served replaces metadata, opener and
        pod UID in place (the socket stays). A stale socket file from a previous driver
        process is replaced; any other file at ``path`` is an error. With ``gid`` the
        socket is group-owned by it and loses its "other" permission bits (0666 -> 0660).
        ``opener()`` must return a fresh fd on every call; the server closes it after
        sending. With ``forward``, an authorised connection and a fresh fd go to
        ``forward(conn, fd)`` in a thread of its own instead (the server closes both
        afterwards).
        """
        if pod_uid is not None and (not pod_uid or "/" in pod_uid):
            raise ValueError(f"invalid pod UID {pod_uid!r}")
        # Serialise now: a metadata dict that is not JSON must fail the publish, not
        # every later connection.
        line = (json.dumps(metadata, separators=(",", ":"), sort_keys=True) + "\n").encode()
        if len(line) > 16 * 1024:
            raise ValueError(f"metadata for {path} is too large ({len(line)} bytes)")
        path = os.path.abspath(path)
        if gid is not None:
            mode &= 0o770
        with self._lock:
            if self._closed:
                raise RuntimeError("DaxSocketServer is closed")
            endpoint = self._endpoints.get(path)
            if endpoint is not None and _inode(path) == endpoint.inode:
                endpoint.line, endpoint.opener, endpoint.pod_uid = line, opener, pod_uid
                endpoint.forward = forward
                _set_permissions(path, mode, gid)
                log.debug("dax socket %s: metadata updated", path)
                return
            if endpoint is not None:
                # Our socket file was removed or replaced behind our back (e.g. the tmpfs
                # was remounted): the old listener is unreachable, start over.
                log.warning("dax socket %s was replaced on disk; listening again", path)
                self._drop(endpoint)
            sock, inode = _listen(path, mode, gid)
            endpoint = _Endpoint(path, sock, inode, line, opener, pod_uid, forward)
            self._selector.register(sock, selectors.EVENT_READ, endpoint)
            self._endpoints[path] = endpoint
        self._wake()
        log.info("serving dax socket %s (pod %s)", path, pod_uid or "any")

    def stop(self, path: str) -> None:
        """Stop serving ``path`` and remove its socket file; unknown paths are fine."""
        path = os.path.abspath(path)
        with self._lock:
            endpoint = self._endpoints.pop(path, None)
            if endpoint is not None:
                self._drop(endpoint)
                _unlink_own_socket(endpoint)
            elif fdpass.socket_state(path) == fdpass.STALE:
                # Left by an earlier node plugin process; a live one may own it now.
                _unlink_socket(path)
        self._wake()

    def paths(self) -> list[str]:
        """Socket paths currently served."""
        with self._lock:
            return sorted(self._endpoints)

    def close(self) -> None:
        """Stop serving everything and end the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for endpoint in list(self._endpoints.values()):
                self._drop(endpoint)
                try:
                    _unlink_own_socket(endpoint)
                except OSError as exc:
                    # A sealed (read-only) publication keeps its socket file; nobody
                    # listens on it now, so the next driver replaces it as stale.
                    log.debug("dax socket %s stays on disk: %s", endpoint.path, exc)
            self._endpoints.clear()
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _drop(self, endpoint: _Endpoint) -> None:
        """Unregister and close one listener; caller holds the lock."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(endpoint.sock)
        endpoint.sock.close()

    def _wake(self) -> None:
        # A full pipe already guarantees a wake-up.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        while True:
            try:
                events = self._selector.select()
            except (OSError, ValueError):
                if self._closed:
                    return
                log.exception("dax socket loop: select failed")
                continue
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_r.recv(4096)
                    continue
                try:
                    self._accept(key.data)
                except Exception:  # the loop serves every volume: it must survive bugs
                    log.exception("dax socket %s: unexpected error", key.data.path)
            if self._closed:
                return

    def _accept(self, endpoint: _Endpoint) -> None:
        accepted: list[tuple[socket.socket, _Job]] = []
        exhausted = False
        with self._lock:
            # stop() may have raced with select(); its socket may even be closed.
            if self._endpoints.get(endpoint.path) is not endpoint:
                return
            job = _Job(endpoint.path, endpoint.line, endpoint.opener, endpoint.pod_uid,
                       endpoint.forward)
            for _ in range(_ACCEPT_BATCH):
                try:
                    conn, _ = endpoint.sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    # ECONNABORTED and friends concern one client only. Out of fds or
                    # memory, the pending connection stays readable and select() would
                    # spin: back off, and say so once in a while, not 20,000 times a second.
                    exhausted = exc.errno in _EXHAUSTED
                    now = time.monotonic()
                    if not exhausted or now - self._exhausted_logged >= 10:
                        log.warning("dax socket %s: accept failed: %s", endpoint.path, exc)
                        if exhausted:
                            self._exhausted_logged = now
                    break
                accepted.append((conn, job))
        for conn, job in accepted:
            try:
                self._handle(conn, job)
            except Exception:  # one client's bug: the others in the batch are served
                log.exception("dax socket %s: unexpected error", job.path)
                conn.close()
        if exhausted:
            time.sleep(_EXHAUSTED_PAUSE)

    def _handle(self, conn: socket.socket, job: _Job) -> None:
        forwarded = False
        try:
            conn.settimeout(self.send_timeout)
            pid, uid, gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if job.pod_uid is not None:
                refusal, cgroups = self._authorize(conn, pid, job.pod_uid)
                if refusal is not None:
                    log.warning(
                        "dax socket %s: refused peer pid=%d uid=%d gid=%d: %s; cgroups: %s",
                        job.path, pid, uid, gid, refusal, cgroups or "-")
                    # Counted before the reply: whoever reads the refusal sees it counted.
                    # Once: a peer gone before the reply is not an error besides.
                    self._count(EVENT_REFUSED, job.path)
                    with contextlib.suppress(OSError):
                        self._send_error(conn, refusal)
                    return
            try:
                fd = job.opener()
                if not isinstance(fd, int) or fd < 0:
                    raise TypeError(f"opener returned {fd!r} instead of a file descriptor")
            except Exception as exc:
                log.exception("dax socket %s: opening the device failed", job.path)
                self._count(EVENT_ERROR, job.path)
                with contextlib.suppress(OSError):
                    self._send_error(conn, f"the node plugin could not open the volume's "
                                           f"device: {exc}; see the csi-pmem node plugin log")
                return
            if job.forward is not None:
                try:
                    threading.Thread(target=self._forward, args=(conn, fd, job),
                                     name="forward", daemon=True).start()
                except RuntimeError as exc:  # out of threads: this client only
                    os.close(fd)
                    log.error("dax socket %s: cannot start a thread: %s", job.path, exc)
                    self._count(EVENT_ERROR, job.path)
                    with contextlib.suppress(OSError):
                        self._send_error(conn, f"the node plugin cannot start a thread "
                                               f"({exc}); try again")
                    return
                forwarded = True
                return
            try:
                sent = socket.send_fds(conn, [job.line], [fd])
                if sent < len(job.line):
                    conn.sendall(job.line[sent:])
            finally:
                os.close(fd)
            log.debug("dax socket %s: served pid=%d uid=%d", job.path, pid, uid)
            self._count(EVENT_SERVED, job.path)
        except OSError as exc:
            # The peer went away or stalled past the send timeout: its problem, not ours.
            log.warning("dax socket %s: serving a client failed: %s", job.path, exc)
            self._count(EVENT_ERROR, job.path)
        finally:
            if not forwarded:
                conn.close()

    def _forward(self, conn: socket.socket, fd: int, job: _Job) -> None:
        assert job.forward is not None
        try:
            job.forward(conn, fd)
            self._count(EVENT_SERVED, job.path)
        except Exception as exc:
            log.warning("dax socket %s: handing the client over failed: %s", job.path, exc)
            with contextlib.suppress(OSError):
                self._send_error(conn, str(exc))
            self._count(EVENT_ERROR, job.path)
        finally:
            os.close(fd)
            conn.close()

    def _authorize(self, conn: socket.socket, pid: int,
                   pod_uid: str) -> tuple[str | None, str]:
        """Return (refusal message or None, the peer's cgroups for the log)."""
        if pid <= 0:
            return ("the node plugin cannot identify the connecting process (SO_PEERCRED "
                    "pid 0: the client's pid namespace is not visible to the node plugin); "
                    "the node plugin must run with hostPID: true"), ""
        pidfd = _peer_pidfd(conn)
        try:
            try:
                with open(os.path.join(self.proc_root, str(pid), "cgroup")) as f:
                    cgroups = f.read()
            except OSError as exc:
                return (f"the node plugin cannot read the cgroups of the connecting process "
                        f"(pid {pid}: {exc.strerror}); the node plugin needs hostPID: true "
                        f"and the host's /proc"), ""
            if pidfd is not None and not _alive(pidfd):
                # The pid may have been reused between connect() and our read.
                return "the connecting process exited before it could be authenticated", ""
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if not pod_uid_in_cgroups(cgroups, pod_uid):
            return (f"this volume is published to pod {pod_uid} and the connecting process "
                    f"(pid {pid}) is not in that pod's cgroup; connect from a container of "
                    f"the pod that mounts the volume"), cgroups.strip().replace("\n", "; ")
        return None, ""

    def _send_error(self, conn: socket.socket, message: str) -> None:
        conn.sendall((json.dumps({"error": message}) + "\n").encode())

    def _count(self, kind: str, path: str) -> None:
        if kind == EVENT_SERVED:
            self.served += 1
        elif kind == EVENT_REFUSED:
            self.refused += 1
        else:
            self.failed += 1
        if self.on_event is not None:
            try:
                self.on_event(kind, path)
            except Exception:
                log.exception("dax socket on_event hook failed")


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _unlink_socket(path: str) -> None:
    """Remove ``path`` if it is a socket; never touch anything else."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_own_socket(endpoint: _Endpoint) -> None:
    """Remove the endpoint's socket file unless another process has re-bound the path.

    During a surge rollout the new node plugin may serve the path before the old one
    shuts down; removing the new socket would cut the pod off.
    """
    if _inode(endpoint.path) == endpoint.inode:
        _unlink_socket(endpoint.path)


def _set_permissions(path: str, mode: int, gid: int | None) -> None:
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)


def _listen(path: str, mode: int, gid: int | None) -> tuple[socket.socket, tuple[int, int]]:
    # A socket left behind by an earlier node plugin process (a crash or SIGKILL skips
    # stop()) is replaced; one that a live process serves, or any other file, is not.
    fdpass.claim(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        with unix_address(path) as address:
            sock.bind(address)
        bound = True
        # Not yet listening, so nobody can connect before the permissions are final.
        _set_permissions(path, mode, gid)
        inode = _inode(path)
        assert inode is not None
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        if bound:
            with contextlib.suppress(OSError):
                _unlink_socket(path)
        raise
    return sock, inode


def _peer_pidfd(conn: socket.socket) -> int | None:
    """A pidfd for the peer (Linux >= 6.5), to detect pid reuse; None if unsupported."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        return None


def _alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except OSError:
        # EPERM and the like still prove the process exists.
        return True
    return True
