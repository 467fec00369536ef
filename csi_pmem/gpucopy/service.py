"""The GPU copy service process: keeps published volumes registered, serves copy requests.

Why its own process (a container of the node plugin's pod): a CUDA fault, a driver
hang or an out-of-memory in the copy path must not take down the CSI driver, which
owns every volume on the node; the service can crash and restart while publishing,
fd hand-out and provisioning go on, and a pod that finds it gone loads in-pod. It also
keeps CUDA and cuda-python out of the driver process.

Trust: only the node plugin talks to the control socket (mode 0600, root). The node
plugin authenticates every pod that connects to a volume's ``gpu.sock`` exactly as for
``dax.sock`` (peer credentials and the pod's cgroup) and then hands the connection over
with the volume's fd. So this process never decides who may read a volume: it reads
only the volume whose fd came with the connection, mapped read-only, and writes only
into the memory the pod exported, within the size it announced (checked when mapped).

Registrations follow the index: every committed safetensors file of a prepared volume
is registered once, when the volume is prepared (publish) and again whenever the
index generation changes (a model staged in the pod: polled every few seconds and
checked before each request). Ranges that left the index are unregistered once no copy
is running; a ``release`` (last unpublish, DeleteVolume) waits for running copies,
unregisters and unmaps, so the namespace can be destroyed.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from csi_pmem import fdpass
from csi_pmem.gpucopy import protocol
from csi_pmem.gpucopy.copier import Copier, CopyError, HostCopy
from csi_pmem.sizes import round_up
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.layout import index_heads, read_index
from csi_pmem.weights.mapping import buffer_address
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.005  # at most one "done" line per 5 ms (and always the last)
_END = object()  # in the waiter's queue: a request's copies end here
# (_CLOSE, target, slot): let go of a slot's target once its copies landed, and say so
# where the pod forgot the slot (``slot`` not None)
_CLOSE = object()
_LANDED = object()  # (_LANDED, target): one request's copies into target were waited for
SLOT_IDLE_TIMEOUT = 300.0  # seconds a pod holding slots may be silent between requests


def _device_key(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return (st.st_rdev, 0, 0) if stat.S_ISCHR(st.st_mode) else (0, st.st_dev, st.st_ino)


class VolumeState:
    """One prepared volume: its read-only mapping and the ranges registered."""

    def __init__(self, meta: dict[str, Any], fd: int, copier: Copier):
        self.meta, self.copier = meta, copier
        self.id = meta["volume_id"]
        self.size = meta["usable_size"]
        self.key = _device_key(fd)
        self.mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.address = buffer_address(self.mapping)
        self.volume = Volume(self.mapping, size=self.size, align=meta["align"],
                             numa_node=meta["numa_node"], writable=False,
                             source=f"volume {self.id}")
        self.registered: dict[int, int] = {}
        self.generation: int | None = None
        self._heads: bytes | None = None  # index_heads() at the last full read
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._stale: list[int] = []

    @property
    def registered_bytes(self) -> int:
        return sum(self.registered.values())

    def refresh(self) -> None:
        """Register the committed models' files if the index changed since last time."""
        with self._lock:
            if self._closed:
                return
            heads = index_heads(self.volume)
            if heads == self._heads:
                return  # no index write since the last read
            try:
                index = read_index(self.volume)
            except LoaderError as exc:  # a stage in progress, a torn read: next time
                log.debug("volume %s: index not readable now: %s", self.id, exc)
                return
            generation = None if index is None else index.generation
            if generation == self.generation:
                self._heads = heads
                return
            wanted: dict[int, int] = {}
            for model in [] if index is None else index.committed():
                for f in model.safetensors:
                    end = min(self.size, round_up(f.end, self.volume.align))
                    wanted[f.offset] = end - f.offset
            for off, n in list(self.registered.items()):
                if wanted.get(off) != n:
                    del self.registered[off]
                    self._stale.append(off)
            self._drop_stale()
            started, added = time.monotonic(), 0
            for off, n in sorted(wanted.items()):
                if off in self.registered:
                    continue
                try:
                    self.copier.register(self.address + off, n)
                except CopyError as exc:
                    log.warning("volume %s: %s; copies from it will be slower", self.id, exc)
                    continue
                self.registered[off] = n
                added += n
            self.generation = generation
            self._heads = heads
        if added:
            log.info("volume %s: registered %.2f GB in %.3f s (index generation %s)",
                     self.id, added / 1e9, time.monotonic() - started, generation)

    def _drop_stale(self) -> None:
        """Unregister ranges that left the index, once no copy reads them (lock held)."""
        if self._active:
            return
        for off in self._stale:
            self.copier.unregister(self.address + off)
        self._stale.clear()

    def host_copies(self, request: protocol.CopyRequest) -> list[HostCopy]:
        return [(self.address + c.src, c.dst, c.nbytes, c.rows, c.pitch)
                for c in request.copies]

    @contextlib.contextmanager
    def in_use(self):
        with self._lock:
            if self._closed:
                raise CopyError(f"volume {self.id} is being released on this node")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._drop_stale()
                    self._idle.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        with self._lock:
            self._closed = True
            if not self._idle.wait_for(lambda: self._active == 0, timeout):
                log.error("volume %s: %d copies still running after %.0f s; unmapping "
                          "anyway", self.id, self._active, timeout)
            for off in list(self.registered) + self._stale:
                self.copier.unregister(self.address + off)
            self.registered.clear()
            self._stale.clear()
        self.volume.close()


def _settle(wait_thread: threading.Thread, tokens: queue.SimpleQueue[Any],
            failure: list[BaseException], targets: list[Any]) -> None:
    """End one pod's copies: stop the waiter (the tokens it has not waited for are
    discarded) and close every target, which waits for the copies still queued into it.
    Idempotent."""
    if wait_thread.is_alive():
        failure.append(CopyError("connection closed"))
        tokens.put(None)
        wait_thread.join()
    for target in targets:
        target.close()
    targets.clear()


class CopyService:
    """Listens on the control socket; one thread per connection."""

    def __init__(self, socket_path: str, copier: Copier, *, poll_seconds: float = 2.0,
                 client_timeout: float = 30.0, max_clients: int = 32):
        self.socket_path = socket_path
        self.copier = copier
        self.poll_seconds = poll_seconds
        self.client_timeout = client_timeout
        # Each pod costs two threads and up to a message's buffer: bounded, so that a
        # pod opening connections cannot starve the others or the node.
        self.max_clients = max_clients
        self.clients = 0
        self.volumes: dict[str, VolumeState] = {}
        self.served = self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A stale socket of a dead service goes; a live service's stays (a second one
        # stops here with EADDRINUSE instead of cutting the first one's pods off).
        fdpass.claim(socket_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(socket_path)
        os.chmod(socket_path, 0o600)
        self._inode = os.lstat(socket_path).st_ino
        self._sock.listen(64)
        self._threads = [threading.Thread(target=self._accept, name="control", daemon=True),
                         threading.Thread(target=self._poll, name="poll", daemon=True)]

    def start(self) -> CopyService:
        for t in self._threads:
            t.start()
        log.info("GPU copy service listening on %s (%s copier, GPUs %s)", self.socket_path,
                 self.copier.name, ", ".join(self.copier.gpus()) or "none")
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.socket_path).st_ino == self._inode:  # ours, not a successor's
                os.unlink(self.socket_path)
        with self._lock:
            states, self.volumes = list(self.volumes.values()), {}
        for st in states:
            st.close(timeout=10)

    # -- control socket ---------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("control socket: accept failed")
                time.sleep(0.1)
                continue
            try:
                threading.Thread(target=self._control, args=(conn,), name="control-conn",
                                 daemon=True).start()
            except RuntimeError as exc:  # out of threads: this connection only
                log.error("control socket: cannot start a thread (%s); connection closed",
                          exc)
                conn.close()
                time.sleep(0.1)

    def _control(self, conn: socket.socket) -> None:
        reader = protocol.Reader(conn)
        client: socket.socket | None = None
        state: VolumeState | None = None
        try:
            conn.settimeout(10)
            doc = reader.read()
            if doc is None:
                return
            fds = reader.take_fds()
            try:
                op = doc.get("op")
                if op == protocol.OP_RELEASE:
                    self.release(str(doc.get("volume_id")))
                elif op in (protocol.OP_PREPARE, protocol.OP_CLIENT):
                    meta = protocol.volume_meta(doc)
                    need = 1 if op == protocol.OP_PREPARE else 2
                    if len(fds) != need:
                        raise protocol.ProtocolError(f"{op} needs {need} fd(s), got {len(fds)}")
                    state = self._volume(meta, fds.pop(0))
                    if op == protocol.OP_CLIENT:
                        # Popped only once it is a socket: else the finally closes it.
                        client = socket.socket(fileno=fds[0])
                        fds.pop(0)
                else:
                    raise protocol.ProtocolError(f"unknown operation {op!r}")
            finally:
                for fd in fds:
                    os.close(fd)
            protocol.send(conn, {"ok": True})
        except (protocol.ProtocolError, OSError, ValueError, OverflowError) as exc:
            log.warning("control socket: %s", exc)
            with contextlib.suppress(OSError, protocol.ProtocolError):
                protocol.send(conn, {"error": str(exc)})
            if client is not None:
                client.close()
            return
        finally:
            reader.close_fds()
            conn.close()
        if state is not None and client is None:
            threading.Thread(target=state.refresh, name="register", daemon=True).start()
        if state is not None and client is not None:
            self._client(state, client)

    def _volume(self, meta: dict[str, Any], fd: int) -> VolumeState:
        """The prepared state of a volume, mapping ``fd`` if new (closes ``fd``)."""
        try:
            with self._lock:
                st = self.volumes.get(meta["volume_id"])
                if st is not None and st.key == _device_key(fd):
                    return st
                fresh = VolumeState(meta, fd, self.copier)
                self.volumes[fresh.id] = fresh
        finally:
            os.close(fd)
        if st is not None:  # the same volume id on another device: a new namespace
            st.close()
        return fresh

    def release(self, volume_id: str) -> None:
        with self._lock:
            st = self.volumes.pop(volume_id, None)
        if st is not None:
            st.close()
            log.info("volume %s released", volume_id)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            with self._lock:
                states = list(self.volumes.values())
            for st in states:
                try:
                    st.refresh()
                except Exception:
                    log.exception("volume %s: refresh failed", st.id)

    # -- one pod ----------------------------------------------------------------------

    def _receive(self, reader: protocol.Reader, state: VolumeState,
                 tokens: queue.SimpleQueue[Any], targets: list[Any],
                 failure: list[BaseException], accepted: float,
                 let_go: Callable[[Any, int | None], None],
                 queued: Callable[[Any], None]) -> tuple[int, int, float]:
        """Read the pod's requests until it shuts its side down (or a copy failed),
        opening each allocation (or taking the one held in its slot) and queueing its
        copies at once, then a request's end. Returns the requests, their bytes and
        when the first arrived."""
        requests = total = 0
        started = accepted
        slots: dict[int, Any] = {}
        target: Any
        while not failure and (doc := reader.read()) is not None:
            # A slot's message says how many fds it carries; others carry all there are.
            slotted = doc.get("slot") is not None
            fds = reader.take_fds(int(doc.get("fd") is True) if slotted else None)
            try:
                if doc.get("op") == protocol.OP_FORGET:
                    if fds:
                        raise protocol.ProtocolError("a forget message carries no fd")
                    slot = protocol.parse_slot(doc)
                    if slot is None or slot not in slots:
                        raise protocol.ProtocolError(
                            f"forget names slot {slot}, which holds no allocation")
                    let_go(slots.pop(slot), slot)
                    continue
                if len(fds) != 1 and not (slotted and doc.get("fd") is not True):
                    raise protocol.ProtocolError(
                        f"a copy request carries exactly one fd (the exported "
                        f"allocation), not {len(fds)}")
                request = protocol.parse_copy_request(doc, state.size)
                held = slots.get(request.slot) if request.slot is not None else None
                if not fds and held is None:
                    raise protocol.ProtocolError(
                        f"the copy request names slot {request.slot}, which holds no "
                        "allocation on this connection (send its fd first)")
                if not fds and held is not None and held.size != request.size:
                    raise protocol.ProtocolError(
                        f"the copy request names slot {request.slot} with {request.size} "
                        f"bytes, but it holds an allocation of {held.size}")
                if not requests:
                    state.refresh()  # a model staged since the last poll
                    started = time.monotonic()
                arrived = time.monotonic()
                if fds:
                    target = self.copier.open_target(fds[0], request.size, request.gpu)
                    targets.append(target)
                    if request.slot is not None:
                        if held is not None:  # after the copies queued into it
                            let_go(held, None)
                        slots[request.slot] = target
                        # A pod that keeps its allocations is between batches while
                        # its server works: it may be silent longer than one message.
                        reader.sock.settimeout(max(self.client_timeout,
                                                   SLOT_IDLE_TIMEOUT))
                else:
                    target = held
                opened = time.monotonic()
                copies = self.copier.enqueue(target, state.host_copies(request))
                queued(target)
                for token in copies:
                    tokens.put(token)
                tokens.put((_LANDED, target))
                tokens.put(_END)
                log.debug("request %d: at %.1f ms, target %s in %.1f ms, %d copies "
                          "queued in %.1f ms", requests, (arrived - accepted) * 1e3,
                          "opened" if fds else f"of slot {request.slot}",
                          (opened - arrived) * 1e3, len(request.copies),
                          (time.monotonic() - opened) * 1e3)
            finally:
                for fd in fds:
                    os.close(fd)
            requests += 1
            total += request.nbytes
        return requests, total, started

    def _client(self, state: VolumeState, sock: socket.socket) -> None:
        """One pod, if fewer than ``max_clients`` are being served; else it is told the
        service is busy (its loader then loads in-pod)."""
        with self._lock:
            busy = self.clients >= self.max_clients
            if not busy:
                self.clients += 1
        if busy:
            self.failed += 1
            log.warning("volume %s: %d pods are being served already; one more refused",
                        state.id, self.max_clients)
            with contextlib.suppress(OSError, protocol.ProtocolError):
                sock.settimeout(1)
                protocol.send(sock, {"error": f"the GPU copy service is busy ({self.max_clients} "
                                              "pods loading at once on this node)"})
            sock.close()
            return
        try:
            self._serve(state, sock)
        finally:
            with self._lock:
                self.clients -= 1

    def _serve(self, state: VolumeState, sock: socket.socket) -> None:
        """One pod: hello, then copy requests until it shuts its side down.

        Each request carries one allocation (one fd). Its copies are queued as soon as
        it arrives, behind the previous request's, so a pod can send its first, small
        allocation at once and allocate the rest while the copy engine works. A waiter
        thread reports ``{"done": k}`` (k counts copies over all requests, in order);
        ``{"ok": true, ...}`` follows the last one. A forgotten slot is answered with
        ``{"forgot": s}`` once its allocation is let go of.
        """
        reader = protocol.Reader(sock)
        send_lock = threading.Lock()
        done = [0, 0.0]
        tokens: queue.SimpleQueue[Any] = queue.SimpleQueue()
        failure: list[BaseException] = []
        told: list[BaseException] = []  # failures the pod was told of already
        targets: list[Any] = []

        def send(doc: dict[str, Any]) -> None:
            with send_lock:
                protocol.send(sock, doc)

        # Requests whose copies into a target the waiter has not finished, per target:
        # a slot the pod forgets with none is let go of at once, not behind the copies
        # queued into its other slots (the pod allocates its next slot only then).
        pending: dict[Any, int] = {}
        pending_lock = threading.Lock()

        def queued(target: Any) -> None:
            with pending_lock:
                pending[target] = pending.get(target, 0) + 1

        def landed(target: Any) -> None:
            with pending_lock:
                if target in pending:  # closed only once none were in flight
                    pending[target] -= 1

        def close(target: Any, slot: int | None) -> None:
            with pending_lock:
                pending.pop(target, None)
            with contextlib.suppress(ValueError):
                targets.remove(target)
            target.close()
            if slot is not None:
                # The pod waits for this before it allocates anew: the memory is freed
                # only once both sides have let go (a 306 MiB slot let go of and a new
                # one made at once held both on an H100).
                with contextlib.suppress(OSError):
                    send({"forgot": slot})

        def let_go(target: Any, slot: int | None) -> None:
            with pending_lock:
                busy = pending.get(target, 0) > 0
            if busy:  # after the copies queued into it
                tokens.put((_CLOSE, target, slot))
            else:
                close(target, slot)

        def waiter() -> None:
            sent: float = 0  # the count last said
            while (token := tokens.get()) is not None:
                if isinstance(token, tuple) and token and token[0] is _CLOSE:
                    # Every copy queued into it before was waited for or discarded.
                    close(token[1], token[2])
                    continue
                if isinstance(token, tuple) and token and token[0] is _LANDED:
                    landed(token[1])
                    continue
                if token is _END:  # a request's last copy: said at once, however soon
                    if done[0] > sent and not failure:
                        with contextlib.suppress(OSError):
                            send({"done": done[0]})
                        sent, done[1] = done[0], time.monotonic()
                    continue
                if failure:  # never waited for: its event goes back or is freed
                    self.copier.discard(token)
                    continue
                try:
                    self.copier.wait(token)
                except CopyError as exc:
                    failure.append(exc)
                    # Told now, not after the pod's next message: a pod that keeps its
                    # connection (a batched load) is waiting for this request's
                    # progress. The receiving side is shut, so the reader stops too.
                    with contextlib.suppress(OSError, protocol.ProtocolError):
                        send({"error": str(exc), "done": done[0]})
                        told.append(exc)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RD)
                    continue
                done[0] += 1
                now = time.monotonic()
                if done[0] == 1:
                    log.debug("first copy done at %.1f ms", (now - accepted) * 1e3)
                if now - done[1] >= PROGRESS_INTERVAL:
                    with contextlib.suppress(OSError):
                        send({"done": done[0]})
                    sent, done[1] = done[0], now

        wait_thread = threading.Thread(target=waiter, name="copy-wait", daemon=True)
        accepted = time.monotonic()
        try:
            sock.settimeout(self.client_timeout)
            send({"service": protocol.SERVICE, "protocol": protocol.PROTOCOL,
                  "volume_id": state.id, "gpus": self.copier.gpus(),
                  "registered_bytes": state.registered_bytes, "forgot": True,
                  "rows": True})
            with state.in_use():
                try:
                    try:
                        wait_thread.start()
                    except RuntimeError as exc:  # out of threads: refuse this pod
                        raise CopyError(f"the GPU copy service cannot start a thread "
                                        f"({exc})") from exc
                    requests, total, started = self._receive(reader, state, tokens,
                                                             targets, failure, accepted,
                                                             let_go, queued)
                    tokens.put(None)
                    wait_thread.join()
                    if failure:
                        raise failure[0]
                    # Let go of the pod's allocations before it hears "ok": its device
                    # memory is freed only once both sides have, and a batched load's
                    # next batch is allocated as soon as the pod hears it. Released
                    # after the reply, one batch more stayed allocated (a 1 GiB budget
                    # peaked at 1.5 GiB on an H200).
                    _settle(wait_thread, tokens, failure, targets)
                except BaseException:
                    # Copies may still run: the one the waiter waits for, and those
                    # discarded behind a failure. Settle them while the volume is in
                    # use, so that a release cannot unmap what they read. A failed copy
                    # was told at once (the waiter says why), so a copy on another
                    # stream may land after the pod heard: into its allocation, still
                    # held here (its pages are not freed until both sides let go), and
                    # the bytes the pod's in-pod fallback writes there too.
                    _settle(wait_thread, tokens, failure, targets)
                    raise
            seconds = time.monotonic() - started
            send({"ok": True, "bytes": total, "requests": requests, "seconds": seconds,
                  "registered_bytes": state.registered_bytes})
            self.served += 1
            log.info("volume %s: copied %.2f GB in %d request(s) in %.3f s (%.1f GB/s)",
                     state.id, total / 1e9, requests, seconds,
                     total / 1e9 / max(seconds, 1e-9))
        except (protocol.ProtocolError, CopyError) as exc:
            self.failed += 1
            log.warning("volume %s: copy refused: %s", state.id, exc)
            if exc not in told:
                with contextlib.suppress(OSError, protocol.ProtocolError):
                    send({"error": str(exc), "done": done[0]})
        except OSError as exc:  # the pod went away or stalled
            self.failed += 1
            log.warning("volume %s: client connection failed: %s", state.id, exc)
        finally:
            _settle(wait_thread, tokens, failure, targets)
            reader.close_fds()
            sock.close()
