"""The pod's half of the node's GPU copy service (:mod:`csi_pmem.gpucopy`).

Why: in a freshly started pod, the node copies at link speed from a mapping it
registered long before, while the pod would first have to pin (register) or bounce
every byte itself. The pod allocates its device memory with the CUDA virtual memory
API (``cuMemCreate`` with a POSIX fd handle type, through cuda-python), exports it as
an fd, sends that fd and the copy list over the volume's ``gpu.sock``, and turns the
service's progress lines into finished tensors. The tensors are ordinary torch tensors,
views of that allocation, which is freed when the last of them is.

Anything that goes wrong (no ``gpu.sock``, no cuda-python, the service refusing, timing
out or dying mid-copy) raises :class:`NodeCopyError` with what was already done; the
GPU loader then copies the rest in-pod and says so once. ``CSI_PMEM_GPU_COPY=off``
turns the path off; ``CSI_PMEM_GPU_COPY=/path/gpu.sock`` names a socket explicitly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from csi_pmem.fdpass import unix_address
from csi_pmem.gpucopy import cuda as gpucuda
from csi_pmem.gpucopy import protocol
from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu.registered import DIRECT_CHUNK
from csi_pmem.loader.gpu.targets import CopyPlan, FileTarget, torch_module, unfinished
from csi_pmem.loader.model import ModelView
from csi_pmem.sizes import MiB, describe_size
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)
# gpucuda is imported with the loader rather than at the first allocation: importing it
# took 5 ms in a fresh process, which the first copy request then waited for. It needs
# no cuda-python until a driver call is made.

ENV = "CSI_PMEM_GPU_COPY"
# The first file of a node-path load goes out as a head of this size and the rest, each
# its own exportable allocation: the copies start after making and exporting 256 MiB,
# not a whole file, and 256 MiB (one copy, about 5 ms on the link) covers making the rest.
NODE_HEAD = 256 * MiB


class NodeCopyError(LoaderError):
    """The node's copy service did not (fully) serve a load; ``done`` copies landed."""

    def __init__(self, message: str, done: int = 0):
        super().__init__(message)
        self.done = done


def service_socket(volume: Volume) -> str | None:
    """The copy service socket for ``volume``, or None when there is none to try."""
    env = os.environ.get(ENV, "")
    if env == "off":
        return None
    if env and env != "auto":
        return env
    src = volume.source
    if not os.path.isdir(src):
        return None
    path = os.path.join(src, protocol.SOCKET_NAME)
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


class Session:
    """One connection to the service: its hello, then copy requests.

    The hello is read lazily: a pod connects and sends its first request at once, and
    reads the hello after it, so the first copy does not wait for the round trip through
    the node plugin's socket server to the service and back (the service sends its
    hello before it reads a request, and refuses a request for a GPU it cannot see).
    """

    def __init__(self, path: str, timeout: float = 30.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.gpus: list[str] | None = None  # known once the hello is read
        self.registered_bytes = 0
        self.acks_forget = False  # the service answers a forget once it let go
        self.copies_rows = False  # the service takes copies of rows (protocol.Copy)
        try:
            self.sock.settimeout(timeout)
            with unix_address(path) as address:
                self.sock.connect(address)
            self.reader = protocol.Reader(self.sock)
        except OSError as exc:
            self.close()
            raise NodeCopyError(f"the GPU copy service at {path} is not reachable: "
                                f"{exc}") from exc

    def hello(self) -> list[str]:
        """Read and check the service's hello (once); the GPUs it sees."""
        if self.gpus is None:
            try:
                hello = self._read()
            except (OSError, protocol.ProtocolError) as exc:
                raise NodeCopyError(f"the GPU copy service at {self.path} is not "
                                    f"reachable: {exc}") from exc
            if hello.get("service") != protocol.SERVICE:
                raise NodeCopyError(f"{self.path} is not a csi-pmem GPU copy service")
            self.gpus = list(hello.get("gpus") or [])
            self.registered_bytes = int(hello.get("registered_bytes") or 0)
            self.acks_forget = hello.get("forgot") is True
            self.copies_rows = hello.get("rows") is True
        return self.gpus

    def _read(self, done: int = 0) -> dict[str, Any]:
        doc = self.reader.read()
        self.reader.close_fds()  # the service never sends fds
        if doc is None:
            raise NodeCopyError(f"the GPU copy service at {self.path} closed the connection",
                                done)
        if "error" in doc:
            raise NodeCopyError(f"the GPU copy service refused: {doc['error']}", done)
        return doc

    def _refusal(self, done: int) -> None:
        """After the service closed on a request: raise what it said, if it said why.

        It answers a request it refuses with an error line and closes, so the pod's next
        request meets a closed socket; the line is still in this side's queue (behind
        the hello and any progress, which are skipped: the load has failed)."""
        with contextlib.suppress(OSError, protocol.ProtocolError):
            while (doc := self.reader.read()) is not None:
                self.reader.close_fds()
                if "error" in doc:
                    raise NodeCopyError(f"the GPU copy service refused: {doc['error']}",
                                        done)

    def copy(self, requests: Iterable[tuple[int, protocol.CopyRequest]],
             on_progress: Callable[[int], None]) -> dict[str, Any]:
        """Send each (allocation fd, request) as ``requests`` yields it (a generator may
        allocate the next one meanwhile: the service copies the ones already sent), then
        report progress: ``on_progress(k)`` as the first k copies, counted over all
        requests in order, have landed. Returns the service's final report."""
        done = total = 0
        try:
            for fd, request in requests:
                try:
                    protocol.send(self.sock, request.to_json(), [fd])
                except (BrokenPipeError, ConnectionResetError):
                    self._refusal(done)  # the reason, where the service gave one first
                    raise
                total += len(request.copies)
                self.hello()  # after the first request, so that it is on its way
            self.hello()
            self.sock.shutdown(socket.SHUT_WR)
            while True:
                doc = self._read(done)
                if doc.get("ok"):
                    if done < total:
                        on_progress(total)
                    return doc
                k = doc.get("done")
                if isinstance(k, int) and done < k <= total:
                    done = k
                    on_progress(k)
        except (OSError, protocol.ProtocolError) as exc:
            raise NodeCopyError(f"the GPU copy service connection failed: {exc}", done) \
                from exc

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            self.reader.close_fds()
        self.sock.close()


def request_copies(path: str, fd: int, gpu: str, size: int,
                   copies: Sequence[protocol.Copy], on_progress: Callable[[int], None],
                   timeout: float = 30.0) -> dict[str, Any]:
    """Connect, check the service sees ``gpu``, copy, close."""
    session = Session(path, timeout)
    try:
        if gpu not in session.hello():
            raise NodeCopyError(f"the node's GPU copy service cannot reach {gpu} (it "
                                f"sees {', '.join(session.hello()) or 'no GPU'})")
        return session.copy([(fd, protocol.CopyRequest(gpu, size, tuple(copies)))],
                            on_progress)
    finally:
        session.close()


def allocation_failed(exc: Exception) -> NodeCopyError:
    """What a pod is told when it cannot make an exportable allocation."""
    return NodeCopyError(f"cannot allocate exportable device memory ({exc}); install "
                         "cuda-bindings in the pod to use the node's GPU copy service")


class ExportableAllocation:
    """Device memory a pod can hand to the service: one reserved address range, backed
    by one or two physical allocations (``cuMemCreate`` with a POSIX fd handle type),
    each exported and copied into on its own; a torch tensor over the whole range
    through the CUDA array interface (which keeps this object alive until the tensor is
    gone).

    Why two parts: ``cuMemCreate`` and the export of a 5 GB file took 2-2.5 ms in fresh
    processes on the H200 host, and the copy engine waited for them. With ``head`` the
    first ``head`` bytes are a small allocation of their own, made and exported at once
    (:attr:`parts`); :meth:`map_part` makes the rest while the service copies into the
    head. A ``head`` that is not a multiple of the allocation granularity, or not
    smaller than the whole, gives one part.
    """

    def __init__(self, ordinal: int, nbytes: int, head: int | None = None):
        check, uuid_text = gpucuda.check, gpucuda.uuid_text

        cu = self._cu = gpucuda.driver()
        self._check = check
        self._ordinal = ordinal
        self.ptr = self._dev = self._ctx = None
        self.handles: list[Any] = []
        self._mapped: list[bool] = []
        check(cu, cu.cuInit(0), "cuInit")
        dev = check(cu, cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.uuid = uuid_text(bytes(check(cu, cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
                                    .bytes))
        # torch works in the primary context, so the allocation lives there too.
        ctx = self._ctx = check(cu, cu.cuDevicePrimaryCtxRetain(dev),
                                "cuDevicePrimaryCtxRetain")
        self._dev = dev
        check(cu, cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        prop = self._prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = \
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        gran = int(check(cu, cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self.size = -(-max(nbytes, 1) // gran) * gran
        #: (offset, bytes) of each physical allocation in the range, in order
        self.parts = [(0, self.size)]
        if head is not None and 0 < head < self.size and head % gran == 0:
            self.parts = [(0, head), (head, self.size - head)]
        self.handles = [None] * len(self.parts)
        self._mapped = [False] * len(self.parts)
        try:
            self.ptr = check(cu, cu.cuMemAddressReserve(self.size, gran, 0, 0),
                             "cuMemAddressReserve")
            self.map_part(0)
        except BaseException:
            self.free()
            raise

    def map_part(self, index: int) -> None:
        """Create part ``index``, map it at its offset and open it to this GPU (once)."""
        if self._mapped[index]:
            return
        cu, check = self._cu, self._check
        off, n = self.parts[index]
        if self.handles[index] is None:
            self.handles[index] = check(
                cu, cu.cuMemCreate(n, self._prop, 0),
                f"allocating {n} bytes of device memory (cuMemCreate)")
        at = cu.CUdeviceptr(self.address + off)
        check(cu, cu.cuMemMap(at, n, 0, self.handles[index], 0), "cuMemMap")
        self._mapped[index] = True
        gpucuda.grant_access(cu, at, n, self._ordinal)

    def map_all(self) -> None:
        for index in range(len(self.parts)):
            self.map_part(index)

    @property
    def address(self) -> int:
        assert self.ptr is not None, "the allocation is closed"
        return int(self.ptr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.address, False),
                "version": 3, "strides": None}

    def export_fd(self, index: int = 0) -> int:
        """An fd of part ``index`` for the service (mapped first if it is not yet)."""
        self.map_part(index)
        cu = self._cu
        fd = self._check(cu, cu.cuMemExportToShareableHandle(
            self.handles[index],
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle")
        return int(fd)

    def synchronize(self) -> None:
        """Wait for everything this process queued on the GPU (reads of this memory
        among it), from any thread."""
        cu = self._cu
        self._check(cu, cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._check(cu, cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        cu = getattr(self, "_cu", None)
        if cu is None:  # cuda-python was not importable
            return
        with contextlib.suppress(Exception):
            if self.ptr is not None:
                # Kernels still queued may read it; unmapping under them would fault.
                if self._ctx is not None:  # the thread a last view went in may have none
                    cu.cuCtxSetCurrent(self._ctx)
                cu.cuCtxSynchronize()
                for (off, n), mapped in zip(self.parts, self._mapped, strict=True):
                    if mapped:
                        cu.cuMemUnmap(cu.CUdeviceptr(int(self.ptr) + off), n)
                cu.cuMemAddressFree(self.ptr, self.size)
        for handle in self.handles:
            if handle is not None:
                with contextlib.suppress(Exception):
                    cu.cuMemRelease(handle)
        with contextlib.suppress(Exception):
            if self._dev is not None:
                cu.cuDevicePrimaryCtxRelease(self._dev)
        self.ptr = self._dev = None
        self.handles = [None] * len(self.handles)
        self._mapped = [False] * len(self._mapped)

    def __del__(self) -> None:
        self.free()


class NodeLoader(Protocol):
    """What the node path reads and sets on its loader (a :class:`.loader.GpuLoader`; this
    module must not import that one, which imports it): the device, why the last load
    could not use the service, and the sockets already warned about."""

    device: Any
    node_copy_refused: str | None
    node_warned: set[str]


def load_node(loader: NodeLoader, view: ModelView, targets: list[FileTarget],
              finish: Callable[[FileTarget, str], None],
              socket_path: str) -> list[FileTarget] | None:
    """Have the node's copy service fill exportable allocations, one per file.
    Returns None when it did, else the targets (finished tensors left out) that
    still need copying in-pod; says why once per socket.

    One allocation per file, each sent as soon as it exists, and the first file's
    head (:data:`NODE_HEAD`) sent before the rest of it is made: the first copies
    start after 256 MiB of ``cuMemCreate`` and export (a few ms for 13 GB would
    otherwise come before the first byte moves), and the rest is allocated while
    the copy engine works.
    """
    torch = torch_module()
    t0 = time.monotonic()
    try:
        session = Session(socket_path)
    except NodeCopyError as exc:
        note_fallback(loader, socket_path, exc)
        return targets
    log.debug("node copy: connected in %.1f ms", (time.monotonic() - t0) * 1e3)
    # The first file's head is an allocation of its own (ExportableAllocation says
    # why); its copies stop at the cut, so that each lands in one allocation.
    head = NODE_HEAD if targets and targets[0].size >= 2 * NODE_HEAD else None
    plan = CopyPlan(targets, lambda ps, i, seq: planning.direct_chunks(
        ps, DIRECT_CHUNK, [], i, seq, cuts=[head] if head and i == 0 else []), finish)
    by_target: list[list[planning.Chunk]] = [[] for _ in targets]
    for c in plan.chunks:
        by_target[c.target].append(c)
    order = [c for cs in by_target for c in cs]  # the order the service reports
    reported = [0]
    fds: list[int] = []

    def requests() -> Iterator[tuple[int, protocol.CopyRequest]]:
        for i, target in enumerate(targets):
            t = time.monotonic()
            try:
                alloc = ExportableAllocation(
                    loader.device.index, target.size, head if i == 0 else None)
            except Exception as exc:  # no cuda-python, an allocation error
                raise allocation_failed(exc) from exc
            if session.gpus is not None and alloc.uuid not in session.gpus:
                raise NodeCopyError(
                    f"the node's GPU copy service cannot reach {alloc.uuid} (it sees "
                    f"{', '.join(session.gpus) or 'no GPU'})")
            chunks = by_target[i]
            for part, (off, n) in enumerate(alloc.parts):
                try:
                    alloc.map_part(part)  # part 0 came with the allocation
                    t_alloc = time.monotonic()
                    fds.append(alloc.export_fd(part))
                except Exception as exc:
                    raise NodeCopyError(
                        f"cannot allocate or export device memory for the node's GPU "
                        f"copy service ({exc})") from exc
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("node copy: %s part %d (%s) allocated in %.2f ms, "
                              "exported in %.2f ms, sent at %.1f ms", target.name, part,
                              describe_size(n), (t_alloc - t) * 1e3,
                              (time.monotonic() - t_alloc) * 1e3,
                              (time.monotonic() - t0) * 1e3)
                # The request goes out first, so the copy engine starts while this
                # process makes the next part and the tensor views (no progress is
                # read before every request is sent, so no tensor is reported before
                # it has its view).
                mine = [c for c in chunks if off <= c.dst < off + n]
                if any(c.dst + c.nbytes > off + n for c in mine):
                    raise LoaderError(f"a copy of {target.name} crosses the end of "
                                      "its device allocation (a planning bug)")
                yield fds[-1], protocol.CopyRequest(alloc.uuid, n, tuple(
                    protocol.Copy(c.pieces[0].src, c.dst - off, c.nbytes) for c in mine))
                t = time.monotonic()
                # Sent: the message holds the allocation now. Closed here, while
                # the copies run: closing the fds after the last copy took 1.2-1.5
                # ms of the load's end.
                os.close(fds.pop())
            # Every part is mapped: the tensors keep the allocation alive from now on.
            t = time.monotonic()
            target.attach(torch.as_tensor(alloc, device=loader.device)[:target.size])
            plan.ready(i)
            log.debug("node copy: %s views made in %.2f ms", target.name,
                      (time.monotonic() - t) * 1e3)

    def progress(k: int) -> None:
        if not reported[0]:
            log.debug("node copy: first copies done at %.1f ms",
                      (time.monotonic() - t0) * 1e3)
        for c in order[reported[0]:k]:
            plan.done(c)
        reported[0] = k

    try:
        report = session.copy(requests(), progress)
        log.debug("node copy: %d request(s), %.1f ms in all (the service: %.1f ms)",
                  len(targets), (time.monotonic() - t0) * 1e3,
                  float(report.get("seconds", 0)) * 1e3)
    except NodeCopyError as exc:
        note_fallback(loader, socket_path, exc)
        return unfinished(targets)
    finally:
        t = time.monotonic()
        session.close()
        for fd in fds:  # what a failed request left
            os.close(fd)
        log.debug("node copy: connection closed in %.2f ms", (time.monotonic() - t) * 1e3)
    loader.node_copy_refused = None
    return None


def note_fallback(loader: NodeLoader, socket_path: str, exc: NodeCopyError) -> None:
    """Record why the service did not serve a load; warn once per socket."""
    loader.node_copy_refused = str(exc)
    level = logging.INFO if socket_path in loader.node_warned else logging.WARNING
    loader.node_warned.add(socket_path)
    log.log(level, "%s; loading in-pod instead", exc)
