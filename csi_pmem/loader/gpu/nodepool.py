"""One connection to the node's GPU copy service for a whole batched load, and device
allocations it fills again and again (the protocol's slots).

Why: a batched load (:mod:`csi_pmem.loader.batches`, vLLM's format) makes dozens of
loads of a few hundred MB. Each one on its own (:func:`.nodecopy.load_node`) connected,
made and exported a fresh allocation, and had the service import and map it, then
unmapped both sides when the server let go of it: on an H100 the first copy of a batch
landed 6-7 ms after it started, and the load ran at 0.83 of the link
(docs/inference.md). Here the load keeps one connection and a few allocations, each
sent once; a batch takes a free one of its size (or makes one), and its tensors are
views that give it back when the last of them goes.

The bound holds: the pool's allocations are freed (and the service told to let go)
before a new one would take the pool past ``cap``, the bound the batched load
computed, and a free allocation is reused only if it is at most a quarter (plus one
grain) larger than the batch, so that a big tensor's allocation does not serve a small
batch while the next one needs memory of its own. Where the busy allocations (some
larger than their batches) and a new one would still pass the cap, the batch waits
briefly for one to come back, and says so if it must go over.

A slot is reused only after every read of it that this process queued (the server's
copies into its parameters, the checksum kernels) has finished: the service's copies
run in another process, which a stream of this one does not order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from csi_pmem.gpucopy import protocol
from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu import nodecopy
from csi_pmem.loader.gpu.nodecopy import NodeCopyError, NodeLoader, Session, note_fallback
from csi_pmem.loader.gpu.registered import DIRECT_CHUNK
from csi_pmem.loader.gpu.targets import CopyPlan, FileTarget, torch_module, unfinished
from csi_pmem.sizes import MiB, describe_size

log = logging.getLogger(__name__)

GRAIN = 2 * MiB  # the slack a reused allocation may have beyond a quarter
CAP_WAIT = 0.05  # seconds a batch waits for a slot to come back rather than pass the cap
FORGET_WAIT = 2.0  # seconds a batch waits for the service to let go of a slot


class Allocation(Protocol):
    """What the pool needs of device memory: :class:`.nodecopy.ExportableAllocation`,
    or a memfd in tests (the service's fake copier writes into one)."""

    uuid: str
    size: int

    @property
    def address(self) -> int: ...

    def export_fd(self, index: int = 0) -> int: ...

    def synchronize(self) -> None: ...

    def free(self) -> None: ...


class Slot:
    def __init__(self, index: int, alloc: Allocation):
        self.index, self.alloc = index, alloc
        self.known = False  # the service holds it (its fd was sent)
        self.busy = True
        self.used = False  # filled at least once: reads of it may still be queued

    @property
    def size(self) -> int:
        return self.alloc.size


class Lease:
    """A batch's hold on a slot, seen by torch through the CUDA array interface: the
    tensors made over it keep it alive, and the slot is free once the last one goes."""

    def __init__(self, pool: NodePool, slot: Slot, nbytes: int):
        self._pool, self.slot, self.nbytes = pool, slot, nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1",
                "data": (self.slot.alloc.address, False), "version": 3, "strides": None}

    def __del__(self) -> None:
        self._pool.give_back(self.slot)


class NodePool:
    """A connection and its slots, for the loads of one batched load (``cap``: the most
    device memory its allocations may hold at once). Raises :class:`NodeCopyError`
    when the service is not reachable; ``failed`` says why it stopped serving."""

    def __init__(self, path: str, ordinal: int, cap: int, *,
                 sizes: Sequence[int] = (),
                 allocate: Callable[[int], Allocation] | None = None,
                 timeout: float = 30.0):
        self.path, self.cap, self.timeout = path, cap, timeout
        self.sizes = sorted(set(sizes))  # the batch sizes the load will ask for
        self.allocate = allocate or (lambda n: nodecopy.ExportableAllocation(ordinal, n))
        self.session = Session(path, timeout)
        # Waiters time out, the reader waits; a send that blocks (a service that stopped
        # reading) fails after ``timeout``, as a non-blocking socket would not.
        self.session.sock.settimeout(None)
        self.session.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                     struct.pack("ll", int(timeout),
                                                 int(timeout % 1 * 1e6)))
        self.slots: list[Slot] = []
        self.made = self.reused = self.let_go = 0
        self.failed: NodeCopyError | None = None
        self.report: dict[str, Any] | None = None
        self._lock = threading.RLock()
        self._returned: queue.SimpleQueue[Slot] = queue.SimpleQueue()  # given back
        self._send = threading.Lock()
        self._making = threading.Lock()  # one slot made (and others let go) at a time
        self._making_bytes = 0  # the slot being made, counted as held
        self._progress = threading.Condition()
        self._sent = self._done = 0
        self._forgotten: set[int] = set()  # slots the service said it let go of
        self._closed = self._ended = False
        # Called with the count landed as it grows, and with None once it never will
        # (failed or ended): from the reader thread, or the thread that failed the pool.
        self.watchers: list[Callable[[int | None], None]] = []
        self.greeted = threading.Event()  # the hello was read (or the reader stopped)
        self._reader = threading.Thread(target=self._read, name="node-copy-progress",
                                        daemon=True)
        self._reader.start()

    # -- slots ------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> Slot:
        """A slot of at least ``nbytes`` for this caller alone (busy until its lease
        goes, or :meth:`give_back`). Where the busy slots and a new one would pass the
        cap (a reused slot may be larger than its batch), it waits up to
        :data:`CAP_WAIT` seconds for one to come back, then goes over and says so. A
        new slot also waits for another batch making one (:meth:`_new`)."""
        deadline: float | None = None
        while True:
            wait = False
            with self._lock:
                self._check()
                self._drain()
                slot = self._reusable(nbytes)
                if slot is None:
                    in_use = self._in_use()
                    over = in_use + self._size_for(nbytes, in_use) > self.cap
                    if over and (deadline is None or time.monotonic() < deadline):
                        deadline = deadline or time.monotonic() + CAP_WAIT
                        wait = True
            if wait:
                assert deadline is not None
                with contextlib.suppress(queue.Empty):  # a slot given back wakes this
                    self._returned.put(self._returned.get(
                        timeout=max(deadline - time.monotonic(), 0)))
                continue
            if slot is None:
                slot = self._new(nbytes)  # or one given back meanwhile
            break
        if slot.used:
            try:
                slot.alloc.synchronize()  # the reads of its last batch have finished
            except Exception as exc:
                self.give_back(slot)
                raise NodeCopyError(f"cannot reuse a device allocation ({exc})") from exc
        return slot

    def _in_use(self) -> int:
        """The busy slots' bytes, and the one being made (lock held)."""
        return sum(s.size for s in self.slots if s.busy) + self._making_bytes

    def _reusable(self, nbytes: int) -> Slot | None:
        """Take the smallest free slot that fits ``nbytes`` within the reuse margin and
        the cap (lock held)."""
        in_use = self._in_use()
        fits = [s for s in self.slots if not s.busy and nbytes <= s.size
                <= nbytes + nbytes // 4 + GRAIN and in_use + s.size <= self.cap]
        if not fits:
            return None
        slot = min(fits, key=lambda s: s.size)
        slot.busy = True
        self.reused += 1
        return slot

    def _new(self, nbytes: int) -> Slot:
        """Make a slot, one caller at a time: free slots that would take the pool past
        its cap are let go on both sides first, and a second batch must not allocate
        while the memory of a slot the first let go of is still held by the service
        (a 1 GiB bound peaked at 1350 MiB on an H100 when two batches made their slots
        at once). A slot that came back meanwhile is reused instead."""
        with self._making:
            gone: list[Slot] = []
            with self._lock:
                self._check()
                self._drain()
                slot = self._reusable(nbytes)
                if slot is not None:
                    return slot
                in_use = self._in_use()
                want = self._size_for(nbytes, in_use)
                if in_use + want > self.cap:
                    log.info("the batches hold %s of device memory beyond the %s they "
                             "were counted at", describe_size(in_use + want - self.cap),
                             describe_size(self.cap))
                free = sorted((s for s in self.slots if not s.busy), key=lambda s: -s.size)
                total = sum(s.size for s in self.slots)
                while free and (total + want > self.cap
                                or len(self.slots) - len(gone) >= protocol.MAX_SLOTS):
                    gone.append(free.pop(0))
                    total -= gone[-1].size
                for g in gone:
                    self.slots.remove(g)
                self.let_go += len(gone)
                index = min(set(range(protocol.MAX_SLOTS + 1))
                            - {s.index for s in self.slots})
                if index >= protocol.MAX_SLOTS:
                    raise NodeCopyError(f"all {protocol.MAX_SLOTS} slots of the GPU copy "
                                        "service connection are in use")
                # Counted as held while it is made: a batch reusing a slot meanwhile
                # must see it.
                self._making_bytes = want
            try:
                for g in gone:  # both sides let go before the new one is made
                    self._forget(g)
                with self._lock:
                    self._check()  # failed or closed while it waited: allocate nothing
                return self._make(index, want)
            finally:
                with self._lock:
                    self._making_bytes = 0

    def _size_for(self, nbytes: int, in_use: int) -> int:
        """The size of a new slot for a batch of ``nbytes``: the largest of the load's
        batch sizes that could reuse it, where that fits the cap beside ``in_use``.

        Why: batches of near sizes (306 and 338 MiB in a Llama-3-8B load) otherwise
        make a slot of the first size, then let it go for the larger one: three times
        on an H100, each 5-8 ms in which the link idled."""
        fits = [s for s in self.sizes if nbytes <= s <= nbytes + nbytes // 4 + GRAIN
                and in_use + s <= self.cap]
        return max(fits, default=nbytes)

    def _make(self, index: int, nbytes: int) -> Slot:
        try:
            alloc = self.allocate(nbytes)
        except NodeCopyError:
            raise
        except Exception as exc:  # no cuda-python, an allocation error
            raise nodecopy.allocation_failed(exc) from exc
        slot = Slot(index, alloc)
        with self._lock:
            self.slots.append(slot)
            self.made += 1
        return slot

    def give_back(self, slot: Slot) -> None:
        """The slot's batch is gone. From a lease's finaliser, which may run in any
        thread at any allocation (a cycle collected): it never raises, and takes the
        pool's (reentrant) lock only once the pool is closed, when no thread sends."""
        if self._closed or self.failed is not None:
            # Whoever takes it out of the pool frees it (one call under the GIL: no
            # lock needed); shed() or a new slot's let-go may have taken it already.
            try:
                self.slots.remove(slot)
            except ValueError:
                return
            slot.busy = False
            with contextlib.suppress(Exception):
                slot.alloc.free()
            return
        self._returned.put(slot)
        if self._closed:  # closed meanwhile: close() may have drained already
            self.shed()

    def _drain(self) -> None:
        """Mark the slots given back free (lock held)."""
        while True:
            try:
                self._returned.get_nowait().busy = False
            except queue.Empty:
                return

    def shed(self) -> None:
        """Free every free slot (the pool is spent or closed)."""
        with self._lock:
            self._drain()
            for slot in [s for s in list(self.slots) if not s.busy]:
                try:
                    self.slots.remove(slot)
                except ValueError:  # give_back() took it out, and frees it
                    continue
                with contextlib.suppress(Exception):
                    slot.alloc.free()

    def spend(self, exc: NodeCopyError) -> None:
        """Stop serving: the loads after this one go the per-load way."""
        self._fail(exc)
        self.shed()

    def lease(self, slot: Slot, nbytes: int) -> Lease:
        return Lease(self, slot, nbytes)

    def _forget(self, slot: Slot) -> None:
        """Let go of a slot on both sides (taken out of the pool, not under its lock),
        and wait until the service has: the memory is freed only once both sides let
        go, and the caller allocates next."""
        # A slot let go of is free: its batch landed, so the hello was read before. A
        # service whose hello does not say it answers is not waited for.
        wait = slot.known and self.session.acks_forget
        if slot.known:
            if wait:
                with self._progress:
                    self._forgotten.discard(slot.index)
            try:
                with self._send:
                    protocol.send(self.session.sock, protocol.forget(slot.index))
            except OSError:  # the connection is gone, and the service let go with it
                wait = False
        slot.alloc.free()  # waits for what this process still queued on it
        if wait:
            with self._progress:
                if not self._progress.wait_for(
                        lambda: slot.index in self._forgotten or self.failed is not None
                        or self._ended, FORGET_WAIT):
                    log.info("the GPU copy service did not let go of a slot of %s "
                             "within %.0f s; allocating beside it",
                             describe_size(slot.size), FORGET_WAIT)

    # -- copies -----------------------------------------------------------------------

    def submit(self, slot: Slot, copies: Sequence[protocol.Copy]) -> tuple[int, int]:
        """Send the copies into ``slot``; the range of the connection's copy count
        they take, for :meth:`progress`."""
        with self._send:
            self._check()
            try:
                fd = None if slot.known else slot.alloc.export_fd()
            except Exception as exc:  # out of fds, a driver error
                raise NodeCopyError(f"cannot export device memory for the node's GPU "
                                    f"copy service ({exc})") from exc
            request = protocol.CopyRequest(slot.alloc.uuid, slot.size, tuple(copies),
                                           slot.index, fd is not None)
            # Counted before it goes: the service may report it before send returns.
            start = self._sent
            self._sent += len(copies)
            try:
                protocol.send(self.session.sock, request.to_json(),
                              [] if fd is None else [fd])
            except OSError as exc:
                self._reader.join(1.0)  # it may read why the service closed
                self._fail(NodeCopyError(f"the GPU copy service connection failed: {exc}",
                                         self._done))
                raise NodeCopyError(str(self.failed), self._done) from None
            finally:
                if fd is not None:
                    os.close(fd)
            slot.known = slot.used = True
            return start, self._sent

    def progress(self, start: int, end: int) -> Iterator[int]:
        """Yield how many of the copies ``[start, end)`` have landed, as that grows,
        until all have; NodeCopyError if the service fails or goes silent."""
        seen = 0
        while seen < end - start:
            with self._progress:
                def moved(seen: int = seen) -> bool:
                    return (self._done - start > seen or self.failed is not None
                            or self._ended)

                if not self._progress.wait_for(moved, self.timeout):
                    self._fail(NodeCopyError(
                        f"the GPU copy service at {self.path} sent no progress in "
                        f"{self.timeout:.0f} s", max(self._done - start, 0)))
                if self._done - start > seen:
                    seen = min(self._done - start, end - start)
                elif self.failed is not None:
                    raise NodeCopyError(str(self.failed), max(self._done - start, 0))
                else:
                    raise NodeCopyError(f"the GPU copy service at {self.path} ended the "
                                        "connection early", max(self._done - start, 0))
            yield seen

    def _read(self) -> None:
        try:
            try:
                self.session.hello()
            finally:
                self.greeted.set()
            while (doc := self.session.reader.read()) is not None:
                self.session.reader.close_fds()
                if "error" in doc:
                    raise NodeCopyError(f"the GPU copy service refused: {doc['error']}")
                if doc.get("ok"):
                    self.report = doc
                    return
                gone = doc.get("forgot")
                if isinstance(gone, int) and not isinstance(gone, bool):
                    with self._progress:
                        self._forgotten.add(gone)
                        self._progress.notify_all()
                    continue
                k = doc.get("done")
                if isinstance(k, int) and not isinstance(k, bool):
                    with self._progress:
                        moved = self._done < k <= self._sent
                        if moved:
                            self._done = k
                            self._progress.notify_all()
                    if moved:
                        self._tell(k)
            if not self._closed:
                raise NodeCopyError(f"the GPU copy service at {self.path} closed the "
                                    "connection")
        except NodeCopyError as exc:
            self._fail(exc)
        except (OSError, protocol.ProtocolError) as exc:
            if not self._closed:
                self._fail(NodeCopyError(f"the GPU copy service connection failed: {exc}"))
        finally:
            with self._progress:
                self._ended = True
                self._progress.notify_all()
            self._tell(None)

    def _tell(self, landed: int | None) -> None:
        for watch in list(self.watchers):
            watch(landed)

    @property
    def landed(self) -> int:
        """How many of the connection's copies have landed."""
        return self._done

    def _fail(self, exc: NodeCopyError) -> None:
        with self._progress:
            first = self.failed is None
            if first:
                self.failed = exc
            self._progress.notify_all()
        if first and not self._closed:  # nothing more goes either way
            with contextlib.suppress(OSError):
                self.session.sock.shutdown(socket.SHUT_RDWR)
        if first:
            self._tell(None)

    def _check(self) -> None:
        if self.failed is not None:
            raise NodeCopyError(str(self.failed))
        if self._closed:
            raise NodeCopyError("the batched load's connection is closed")

    def close(self) -> None:
        """End the connection (the service lets go of every slot) and free the free
        slots; a busy one is freed when its last tensor goes."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.session.sock.shutdown(socket.SHUT_WR)
        self._reader.join(self.timeout)
        with contextlib.suppress(OSError):  # a silent service: wake the reader
            self.session.sock.shutdown(socket.SHUT_RDWR)
        self.session.close()
        self.shed()
        log.debug("node copy pool: %d allocation(s) made, %d reused, %d let go",
                  self.made, self.reused, self.let_go)


def load_pooled(pool: NodePool, loader: NodeLoader, targets: list[FileTarget],
                finish: Callable[[FileTarget, str], None]) -> list[FileTarget] | None:
    """Fill one file's tensors from a pool slot. Returns None when the service did,
    else the targets (finished tensors left out) that still need copying in-pod (the
    pool is then spent: its later loads go the per-load way)."""
    torch = torch_module()
    t0 = time.monotonic()
    plan = CopyPlan(targets, lambda ps, i, seq: planning.direct_chunks(
        ps, DIRECT_CHUNK, [], i, seq), finish)
    try:
        if len(targets) != 1:
            raise NodeCopyError(f"a pooled load is one file, not {len(targets)}")
        target = targets[0]
        slot = pool.acquire(target.size)
        lease = pool.lease(slot, target.size)  # gives the slot back if anything fails
        t_slot = time.monotonic()
        start, end = pool.submit(slot, [protocol.Copy(c.pieces[0].src, c.dst, c.nbytes)
                                        for c in plan.chunks])
        target.attach(torch.as_tensor(lease, device=loader.device)[:target.size])
        del lease
        plan.ready(0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("node copy: %s in slot %d (%s) after %.2f ms, sent at %.2f ms",
                      target.name, slot.index, describe_size(slot.size),
                      (t_slot - t0) * 1e3, (time.monotonic() - t0) * 1e3)
        reported = 0
        for k in pool.progress(start, end):
            for c in plan.chunks[reported:k]:
                plan.done(c)
            reported = k
    except NodeCopyError as exc:
        pool.spend(exc)
        note_fallback(loader, pool.path, exc)
        return unfinished(targets)
    log.debug("node copy: %s landed at %.2f ms", targets[0].name,
              (time.monotonic() - t0) * 1e3)
    loader.node_copy_refused = None
    return None
