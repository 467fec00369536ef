"""The GPU paths (torch, imported lazily): the node's copy service, registered mappings,
bounce buffers.

Why several (docs/design.md §3, docs/gpu-copy-service.md), in the order a load tries them:
- Node (:mod:`.nodecopy`): where the volume directory has ``gpu.sock``, the node's copy
  service fills exportable allocations from a mapping it registered at publish time.
  What it does not finish is copied by the paths below, with one warning.
- Registered (:mod:`.registered`): the model's ranges of the mapping are registered
  with CUDA in pieces; copies then run at link speed with no CPU work. Registration
  costs about 0.03 s/GB on 2 MiB pages and 0.06-0.1 s/GB on 4 KiB pages, so
  ``mode="auto"`` registers whole from the ``auto_register_after``-th load of the same
  open :class:`Volume` (or call :meth:`GpuLoader.register` ahead of time).
- Hybrid: the first load of a large-page mapping (devdax, huge tmpfs, hugetlbfs) faults
  pieces in from the loader's threads and registers them one by one, queueing each
  piece's copies right after it (optionally with bounce buffers from the back,
  :class:`.chunks.MeetInTheMiddle`). Pieces registered stay registered for later loads.
- Bounce (:mod:`.bounce`, :mod:`.pipeline`): pinned buffers allocated once per loader,
  filled by memcpy threads on the volume's NUMA node and drained by one CUDA stream.
  Works for any mapping and is the first load of a 4 KiB-page one; costs CPU and memory
  bandwidth (each byte is read, written, read again). With driver-call copies and the native
  loop built (:mod:`.native`), the same buffers, stream and events are driven by native
  threads that need no GIL; otherwise by the Python pipeline.

Never registered, whatever the mode: a volume whose ``registration_refused_reason`` is
set when it is opened (:func:`.volume.registration_refusal`: a file on a file system
mounted ``-o dax``, where the kernel refuses the long-term pins, or a block device,
whose mapping is page cache). Those loads go straight to bounce buffers, say why once
per mapping in the log and in :attr:`GpuLoader.registration_refused_reason`. A
registration that fails anyway (``cudaHostRegister`` returns an error or raises) does
not fail the load: one warning, the load and later loads of that mapping use bounce
buffers (in ``mode="auto"`` the loader stops registering altogether).

Device placement: one device buffer per file, tensors are views into it (see
:func:`.chunks.place`), so a whole-file load is a stream of large transfers.

This module is the choice of path and the loader that runs it (with the registered and
hybrid paths, which share its registrations); the node path's load is in
:mod:`.nodecopy`, the pinned buffers and copy back ends in :mod:`.bounce`, the device
buffers per file and the plan that reports tensors as they land in :mod:`.targets`.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from csi_pmem.loader.gpu import chunks as planning
from csi_pmem.loader.gpu import native, nodecopy, nodepool
from csi_pmem.loader.gpu.bounce import TorchBackend, run_native
from csi_pmem.loader.gpu.pipeline import BouncePipeline
from csi_pmem.loader.gpu.registered import (
    DIRECT_CHUNK,
    Pending,
    Registration,
    RegistrationError,
    copy_direct,
    queue_copies,
    register_pieces,
    report_landed,
)
from csi_pmem.loader.gpu.targets import CopyPlan, FileTarget, allocate, load_bytes, torch_module
from csi_pmem.loader.model import ModelView
from csi_pmem.numa import node_cpus
from csi_pmem.sizes import MiB, round_up
from csi_pmem.weights.stformat import TensorInfo
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

# cuda-python's driver module is what the in-pod bounce copies (.bounce.DriverCopy) and
# the node path (.nodecopy) call. It is imported with this module, which imports torch's
# CUDA side anyway, and not inside the first load: a fresh process that imported it there
# paid for the import in the load itself (the in-pod load measured 323-326 ms in
# bench_fresh.py against 292-302 ms in profile_load.py, which imported it first).
with contextlib.suppress(ImportError):
    from cuda.bindings import driver as _cuda_driver  # noqa: F401

BOUNCE = "bounce"
REGISTERED = "registered"
HYBRID = "hybrid"
NODE = "node"  # the node's GPU copy service did the copies (csi_pmem.gpucopy)
POPULATE_SLICE = 64 * MiB  # one madvise(MADV_POPULATE_*) call of the hybrid's prefault
# Registration piece of this loader (hybrid and registered loads alike, since CUDA
# refuses to register a range twice): 256 MiB let the first copies start after a few
# ms and moved 13 GB fastest in a fresh process on 2 MiB pages (H200 host, 32 MiB to
# 4 GiB tried).
HYBRID_STEP = 256 * MiB
AUTO = "auto"

TensorDone = Callable[[str, Any], None]
FileDone = Callable[[str, dict[str, Any]], None]
# (file, its device buffer, the buffer offset of its first tensor byte, and the volume
# byte range [start, end) of a tensor now on the device): for checks that read the
# bytes on the device as they land.
FileData = Callable[[str, Any, int, int, int], None]


def choose_path(mode: str, volume: Volume, loads: int, registered: bool,
                auto_register_after: int | None, refused: str | None = None
                ) -> tuple[str, str | None]:
    """The path of the ``loads``-th load of ``volume``'s mapping (counting this one),
    and why it cannot be the registered one (None when it could).

    ``registered``: pieces of the mapping are registered already; ``refused``: an
    earlier registration of this mapping failed. A volume carrying
    ``registration_refused_reason`` (fsdax file, block device) takes bounce buffers
    in every mode, also ``"registered"``.
    """
    reason = volume.registration_refused_reason or refused
    if reason is not None:
        return BOUNCE, reason
    if mode in (BOUNCE, HYBRID):
        return mode, None
    if mode == REGISTERED or registered or (
            auto_register_after is not None and loads >= auto_register_after):
        return REGISTERED, None
    # auto, a mapping not (yet) worth registering whole: bounce buffers. Registering
    # piece by piece as the copies go (hybrid) lost to them in fresh processes on the
    # H200 host even on 2 MiB pages (34-40 GB/s against 43-45): registration is serial
    # at 0.022 s/GB and holds a driver lock that stalls the copies other threads issue.
    return BOUNCE, None


_live_loaders: weakref.WeakSet[GpuLoader] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def _hook_exit() -> None:
    """Register :func:`_close_at_exit` once, after torch is imported (see there)."""
    global _exit_hooked
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_close_at_exit)
            _exit_hooked = True


def _close_at_exit() -> None:
    """Close every loader while the interpreter is still whole.

    Why: a process that exits with mappings still registered and memcpy threads parked
    in CUDA calls tears them down during finalization, in whatever order modules and
    the CUDA runtime go away; that is where a fresh process used to abort (SIGABRT)
    after a registered load. atexit handlers run last-registered first, and this one
    is registered by the first loader, after torch was imported, so it runs before
    torch's own.
    """
    for loader in list(_live_loaders):
        try:
            if not loader.close(timeout=30):
                log.warning("a load to %s still runs at exit; not closing its loader",
                            loader.device)
        except Exception as exc:  # never turn an exit into a traceback
            log.debug("closing %s at exit: %s", loader.device, exc)


class GpuLoader:
    """Loads onto one CUDA device; keep it: buffers, threads and registrations persist.

    Defaults come from fresh processes on H200 hosts (16 cores, 13 GB model, the native
    bounce loop): 12 memcpy threads and 32 x 4 MiB pinned buffers. On a host whose
    memcpy bound the load they moved a 2 MiB-page mapping 3-5% faster than 24 x 8 MiB
    (best and median, verified and not; 128 MiB of buffers fits its 300 MiB L3, which
    may let the copy engine read them from cache: inferred, not measured); on a faster
    host 4 and 8 MiB buffers were level.
    Buffers of 2 MiB, 12 x 8 MiB and 16 threads were slower; registering pieces from the
    front with bounce buffers from the back too. docs/loader-benchmark.md has the runs.
    ``last_path`` is the path of the last load; ``registration_refused_reason`` says why
    that load could not use a registered mapping (None when it could).
    """

    def __init__(self, device: str | Any = "cuda", *, buffers: int = 32,
                 buffer_size: int = 4 * MiB, threads: int = 12, mode: str = AUTO,
                 auto_register_after: int | None = 2, node_copy: bool = True,
                 register_step: int = HYBRID_STEP, hybrid_bounce: bool = False):
        torch = torch_module()
        if mode not in (AUTO, BOUNCE, REGISTERED, HYBRID):
            raise ValueError(f"mode must be {AUTO}, {BOUNCE}, {REGISTERED} or {HYBRID}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"GpuLoader needs a cuda device, not {device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.nbuffers, self.buffer_size, self.threads = buffers, buffer_size, threads
        self.mode = mode
        self.auto_register_after = auto_register_after
        self.register_step = register_step  # bytes per cudaHostRegister call
        self.hybrid_bounce = hybrid_bounce  # bounce buffers from the back in hybrid loads
        # Use the node's GPU copy service when the volume offers one (gpu.sock).
        self.node_copy = node_copy
        self.node_copy_refused: str | None = None  # why the last load could not use it
        self.node_warned: set[str] = set()
        self._backend: TorchBackend | None = None
        self._pipelines: dict[int | None, BouncePipeline] = {}
        self._populate_pool: ThreadPoolExecutor | None = None
        self._registrations: dict[int, Registration] = {}
        self._loads: dict[int, int] = {}
        # Mappings inside one_load: [how many one_loads are open, the path they pinned].
        self._parts: dict[int, list[Any]] = {}
        self._pools: dict[int, nodepool.NodePool] = {}  # a one_load's node connection
        self.last_pool: nodepool.NodePool | None = None  # the last one closed (its counts)
        self._refused: dict[int, str] = {}  # mappings whose registration failed
        self._lock = threading.Lock()
        self.last_path: str | None = None
        self.registration_refused_reason: str | None = None
        self._arena: Any = None
        _live_loaders.add(self)
        _hook_exit()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the memcpy threads, unregister every mapping, free the pinned buffers.

        Returns False (closing nothing) when a load still runs after ``timeout`` s.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            for p in self._pipelines.values():
                p.close()
            self._pipelines.clear()
            if self._populate_pool is not None:
                self._populate_pool.shutdown(wait=True, cancel_futures=True)
                self._populate_pool = None
            for r in self._registrations.values():
                r.close()
            self._registrations.clear()
            if self._backend is not None:
                self._backend.close()
            self._backend = None
            return True
        finally:
            self._lock.release()

    def __enter__(self) -> GpuLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(self, numa_node: int | None = None) -> None:
        """Allocate the pinned buffers and start the memcpy threads now rather than in
        the first load (pinned allocation costs about 0.4 s/GiB)."""
        with self._lock:
            self._pipeline(numa_node)

    def register(self, view: ModelView) -> Registration | None:
        """Register the model's ranges of the mapping now (e.g. while a server starts).

        Returns None, registering nothing, for a volume that must not be registered
        (``view.volume.registration_refused_reason``): its loads use bounce buffers.
        """
        reason = view.volume.registration_refused_reason
        if reason is not None:
            log.info("not registering %s: %s", view.volume.source, reason)
            return None
        with self._lock:
            reg = self._registration(view)
            for start, end in self._pieces(view):
                reg.ensure(start, end)
            return reg

    def release(self, volume: Volume) -> None:
        """Forget a mapping: unregister it and drop its load count (call before
        closing a volume this loader has loaded from, if the loader lives on)."""
        with self._lock:
            key = id(volume.mapping)
            self._loads.pop(key, None)
            self._refused.pop(key, None)
            self._parts.pop(key, None)
            reg = self._registrations.pop(key, None)
            if reg is not None:
                reg.close()

    def _registration(self, view: ModelView) -> Registration:
        key = id(view.volume.mapping)
        if key not in self._registrations:
            self._registrations[key] = Registration(view.volume)
        return self._registrations[key]

    def _pieces(self, view: ModelView, files: Iterable[str] | None = None
                ) -> list[tuple[int, int]]:
        vol = view.volume
        wanted = None if files is None else set(files)
        return register_pieces([(f.offset, min(vol.size, round_up(f.end, vol.align)))
                                for f in view.model.safetensors
                                if wanted is None or f.name in wanted], self.register_step)

    def _pipeline(self, numa_node: int | None) -> BouncePipeline:
        if self._backend is None:
            self._backend = TorchBackend(self.device, self.nbuffers, self.buffer_size)
        pipe = self._pipelines.get(numa_node)
        if pipe is None:
            cpus = node_cpus(numa_node)
            pipe = BouncePipeline(self._backend, self.nbuffers, self.buffer_size,
                                  max(1, min(self.threads, len(cpus))), cpus=cpus,
                                  memcpy=ctypes.memmove, thread_init=self._backend.thread_init)
            self._pipelines[numa_node] = pipe
        return pipe

    @contextlib.contextmanager
    def one_load(self, view: ModelView, cap: int | None = None,
                 sizes: Sequence[int] = ()) -> Iterator[None]:
        """Count the loads of ``view`` made inside as one load of its mapping, each on
        the path the first of them took; with ``cap`` (bytes), node-path loads of one
        file each share one connection to the service and reuse at most ``cap`` bytes
        of device memory (:mod:`.nodepool` says why); ``sizes``: the allocations they
        will ask for, so that a slot is made once for batches of near sizes.

        Why: a batched load (:mod:`csi_pmem.loader.batches`) is one load of the model
        made as many loads of a few hundred MB. Counted one by one, its second batch was
        already the mapping's second load, so every batch from there took the
        registered path and paid the registration of its own pages (serial, about
        0.022 s/GB) on its way to the device, to use them once. Bounce buffers, which
        a first load takes, pin nothing and were no slower for the batches on an H100
        (0.54 of the link either way, docs/inference.md).
        """
        key = id(view.volume.mapping)
        with self._lock:
            part = self._parts.setdefault(key, [0, None])
            part[0] += 1
            first = part[0] == 1
        if first and cap is not None and (node := self.node_socket(view)) is not None:
            try:
                self._pools[key] = nodepool.NodePool(node, self.device.index, cap,
                                                     sizes=sizes)
            except nodecopy.NodeCopyError as exc:  # the first batch says so, and why
                log.debug("no pooled connection: %s", exc)
        try:
            yield
        finally:
            pool = None
            with self._lock:
                open_ = self._parts.get(key)
                if open_ is not None:
                    open_[0] -= 1
                    if open_[0] <= 0:
                        del self._parts[key]
                        # Closed by the last one_load out: another load may share it.
                        pool = self._pools.pop(key, None)
            if pool is not None:
                pool.close()
                self.last_pool = pool

    def _choose(self, view: ModelView) -> str:
        key = id(view.volume.mapping)
        part = self._parts.get(key)
        if part is not None and part[1] is not None:
            return str(part[1])
        path = self._choose_anew(view, key)
        if part is not None:
            part[1] = path
        return path

    def _choose_anew(self, view: ModelView, key: int) -> str:
        loads = self._loads[key] = self._loads.get(key, 0) + 1
        path, reason = choose_path(self.mode, view.volume, loads, key in self._registrations,
                                   self.auto_register_after, self._refused.get(key))
        self.registration_refused_reason = reason
        if reason is not None and key not in self._refused and loads == 1:
            # Refused up front (fsdax file, block device): expected, said once per mapping.
            level = logging.WARNING if self.mode == REGISTERED else logging.INFO
            log.log(level, "%s; loading through pinned bounce buffers", reason)
        return path

    def _refuse(self, view: ModelView, exc: Exception) -> None:
        """A registration failed: say so once, and use bounce buffers from now on."""
        key = id(view.volume.mapping)
        log.warning("%s; loading through pinned bounce buffers instead (slower than a "
                    "registered mapping, and busy memcpy threads)", exc)
        self._refused[key] = self.registration_refused_reason = str(exc)
        if key in self._parts:
            self._parts[key][1] = BOUNCE
        reg = self._registrations.pop(key, None)
        if reg is not None:
            reg.close()  # nothing registered yet; releases its export of the mapping
        if self.mode == AUTO:
            self.auto_register_after = None  # do not try (and warn) for every mapping

    def reserve(self, view: ModelView, names: Iterable[str] | None = None) -> int:
        """Allocate the device memory of the next load of ``view`` now; return its size.

        Fresh device memory costs about 2.3 ms/GB on an H200 (34 ms for 14.7 GB) the
        first time it is written, whether or not the allocation happened earlier: the
        cost is in committing the pages, so the reservation is also written once (a
        device memset, ~5 ms). A server that knows its model can reserve while it does
        other start-up work (CUDA context, tokenizer, graph capture); the next load then
        only copies. The reservation is consumed by that load: its tensors are views
        into it.
        """
        torch = torch_module()
        sizes = [planning.place(tensors)[1] for tensors in view.select(names).values()]
        nbytes = load_bytes(sizes)
        arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        arena.zero_()
        torch.cuda.synchronize(self.device)
        with self._lock:
            self._arena = arena
        return nbytes

    def _allocate(self, targets: list[FileTarget]) -> None:
        """Device memory for the targets that have none yet (the node path or a refused
        registration may have attached it), from the reservation if there is one."""
        if any(t.buffer is None for t in targets):
            arena, self._arena = self._arena, None
            allocate(targets, self.device, arena)

    def node_socket(self, view: ModelView) -> str | None:
        """The node copy service's socket a load of ``view`` tries first, if any."""
        return nodecopy.service_socket(view.volume) if self.node_copy else None

    def load(self, view: ModelView, selection: dict[str, list[TensorInfo]],
             on_tensor: TensorDone, on_file: FileDone,
             on_data: FileData | None = None) -> str:
        """Copy ``selection`` to the device; callbacks fire as tensors and files land
        (``on_data`` right after each ``on_tensor``).

        Returns the path used: ``"node"``, ``"bounce"``, ``"registered"`` or ``"hybrid"``.

        Node-path loads run outside the loader's lock, so several can be in flight: they
        share none of its buffers, registrations or threads, and a batched load
        (:mod:`.batches`) makes its next request while the service copies the one
        before. What they leave to the pod (the service refused) takes the lock.
        """
        targets = []
        for fname, tensors in selection.items():
            placements, size = planning.place(tensors)
            targets.append(FileTarget(fname, {t.name: t for t in tensors}, placements,
                                      size, first_dst=placements[0].dst if placements
                                      else 0))
        left = {t.name: len(t.placements) for t in targets}

        def finish(target: FileTarget, name: str) -> None:
            on_tensor(name, target.finish(name))
            if on_data is not None:
                info = target.infos[name]
                on_data(target.name, target.buffer, target.first_dst, info.offset,
                        info.offset + info.nbytes)
            left[target.name] -= 1
            if left[target.name] == 0:
                on_file(target.name, dict(target.tensors))

        node = self.node_socket(view)
        if node is not None:
            pool = self._pools.get(id(view.volume.mapping))
            if pool is not None and pool.failed is None and len(targets) == 1:
                remaining = nodepool.load_pooled(pool, self, targets, finish)
            else:
                remaining = nodecopy.load_node(self, view, targets, finish, node)
            if remaining is None:
                self.last_path = NODE
                return NODE
            targets = remaining
        with self._lock:
            path = self._choose(view)
            if path == HYBRID:
                refused = self._load_hybrid(view, targets, finish)
                if refused is not None:
                    self._refuse(view, refused)
            if path == REGISTERED:
                try:
                    self._load_registered(view, targets, finish)
                except RegistrationError as exc:
                    self._refuse(view, exc)
                    path = BOUNCE
            if path == BOUNCE:
                self._load_bounce(view, targets, finish)
            self.last_path = path
            return path

    def _load_bounce(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None]) -> None:
        torch = torch_module()
        steps = [time.monotonic()]
        self._allocate(targets)
        steps.append(time.monotonic())
        pipe = self._pipeline(view.volume.numa_node)
        backend = self._backend
        assert backend is not None
        backend.targets = [t.buffer for t in targets]
        try:
            # The device buffers were allocated on the current stream; order ours after it.
            backend.stream.wait_stream(torch.cuda.current_stream(self.device))
            steps.append(time.monotonic())
            lib = native.library() if backend.driver_copy is not None else None
            if lib is None:
                plan = CopyPlan(targets, lambda ps, i, seq: planning.bounce_chunks(
                    ps, self.buffer_size, i, seq), finish)
            else:  # the native loop's own layout, cut by the library (no Chunk objects)
                plan = CopyPlan.of_flat(targets, native.plan_bounce(
                    [t.placements for t in targets], [b.data_ptr() for b in backend.targets],
                    self.buffer_size, lib), finish)
            plan.ready()
            steps.append(time.monotonic())
            # Everything here comes before the first byte moves: say what each part cost.
            log.debug("bounce load: device memory %.2f ms, buffers and stream %.2f ms, plan "
                      "of %d chunks %.2f ms", (steps[1] - steps[0]) * 1e3,
                      (steps[2] - steps[1]) * 1e3, len(plan),
                      (steps[3] - steps[2]) * 1e3)
            if lib is None:
                pipe.run(plan.chunks, view.volume.address, plan.done)
            else:
                run_native(lib, backend, view, plan, pipe.threads, self.buffer_size)
        finally:
            backend.targets = []

    def _load_hybrid(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None]) -> RegistrationError | None:
        """Registration from the front, bounce buffers from the back (see
        :class:`.chunks.MeetInTheMiddle`). Returns the registration error that stopped
        the front side before it registered anything (the mapping is then treated as
        refused), else None."""
        torch = torch_module()
        # One run of at most a bounce buffer each, never across a piece edge: every
        # chunk suits both sides.
        registration, pieces, plan = self._direct_plan(view, targets, finish,
                                                       self.buffer_size)
        plan.ready()
        starts = [p[0] for p in pieces]
        by_piece: list[list[planning.Chunk]] = [[] for _ in pieces]
        for c in sorted(plan.chunks, key=lambda c: c.pieces[0].src):
            by_piece[bisect.bisect_right(starts, c.pieces[0].src) - 1].append(c)
        sides = planning.MeetInTheMiddle(by_piece)
        on_done = plan.done

        alloc_stream = torch.cuda.current_stream(self.device)
        outcome: dict[str, BaseException] = {}
        populated = self._populate_ahead(view.volume, pieces, by_piece)
        front = threading.Thread(
            target=self._register_front,
            args=(registration, pieces, by_piece, sides, [t.buffer for t in targets],
                  alloc_stream, on_done, outcome, populated), name="register", daemon=True)
        front.start()
        try:
            if self.hybrid_bounce:
                pipe = self._pipeline(view.volume.numa_node)
                assert self._backend is not None
                self._backend.targets = [t.buffer for t in targets]
                self._backend.stream.wait_stream(alloc_stream)
                pipe.run(sides.take, view.volume.address, on_done)
            front.join()
            if sides.left:  # pieces the front side gave back (or left, without bounce)
                pipe = self._pipeline(view.volume.numa_node)
                assert self._backend is not None
                self._backend.targets = [t.buffer for t in targets]
                self._backend.stream.wait_stream(alloc_stream)
                pipe.run(sides.take, view.volume.address, on_done)
        finally:
            front.join()
            for futs in populated.values():
                for f in futs:
                    f.cancel()
            if self._backend is not None:
                self._backend.targets = []
        if "fatal" in outcome:
            raise outcome["fatal"]
        log.debug("hybrid load: %d of %d pieces registered and copied by the copy engine "
                  "(registration %.1f ms); bounce buffers %s", len(sides.front_pieces),
                  sum(1 for b in by_piece if b), registration.seconds * 1e3,
                  "on" if self.hybrid_bounce else "off")
        refused = outcome.get("refused")
        if refused is not None and not sides.front_pieces:
            assert isinstance(refused, RegistrationError)
            return refused
        if refused is not None:
            log.warning("%s; the rest of this load went through bounce buffers", refused)
        return None

    def _populate_ahead(self, volume: Volume, pieces: list[tuple[int, int]],
                        by_piece: list[list[planning.Chunk]]) -> dict[int, list[Any]]:
        """Fault the pieces in, front first, from the loader's threads (see
        :meth:`.volume.Volume.populate`); futures per piece index."""
        if self._populate_pool is None:
            self._populate_pool = ThreadPoolExecutor(self.threads,
                                                     thread_name_prefix="populate")
        out: dict[int, list[Any]] = {}
        for i, (start, end) in enumerate(pieces):
            if by_piece[i]:
                out[i] = [self._populate_pool.submit(volume.populate, o,
                                                     min(POPULATE_SLICE, end - o))
                          for o in range(start, end, POPULATE_SLICE)]
        return out

    def _register_front(self, registration: Registration, pieces: list[tuple[int, int]],
                        by_piece: list[list[planning.Chunk]],
                        sides: planning.MeetInTheMiddle, buffers: list[Any],
                        alloc_stream: Any, on_done: Callable[[planning.Chunk], None],
                        outcome: dict[str, BaseException],
                        populated: dict[int, list[Any]]) -> None:
        """The hybrid load's front side: wait until a piece is faulted in, register it,
        queue its copies, repeat."""
        torch = torch_module()
        pending: Pending = []
        try:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(alloc_stream)
            src = registration.source
            with torch.cuda.stream(stream):
                while (i := sides.claim_front()) is not None:
                    for f in populated.get(i, []):
                        with contextlib.suppress(Exception):
                            f.result()
                    try:
                        registration.ensure(*pieces[i])
                    except RegistrationError as exc:
                        sides.give_back(i)
                        outcome["refused"] = exc
                        break
                    queue_copies(by_piece[i], buffers, src, stream, pending)
                    if len(sides.front_pieces) == 1:
                        log.debug("hybrid load: first piece registered and queued")
                    report_landed(pending, on_done)
            report_landed(pending, on_done, wait=True)
        except BaseException as exc:  # relayed to the load thread, which raises it
            outcome["fatal"] = exc

    def _direct_plan(self, view: ModelView, targets: list[FileTarget],
                     finish: Callable[[FileTarget, str], None], limit: int
                     ) -> tuple[Registration, list[tuple[int, int]], CopyPlan]:
        """The registration, its pieces and the transfers (at most ``limit`` bytes,
        never across a piece edge) of a load straight from the mapping; device memory
        allocated where the node path did not attach it."""
        registration = self._registration(view)
        pieces = self._pieces(view, [t.name for t in targets])
        edges = sorted({e for p in pieces for e in p})
        self._allocate(targets)
        return registration, pieces, CopyPlan(targets, lambda ps, i, seq: planning.direct_chunks(
            ps, limit, edges, i, seq), finish)

    def _load_registered(self, view: ModelView, targets: list[FileTarget],
                         finish: Callable[[FileTarget, str], None]) -> None:
        registration, pieces, plan = self._direct_plan(view, targets, finish, DIRECT_CHUNK)
        # Raises RegistrationError before any tensor is reported when the first piece
        # is refused, so the caller can still switch to bounce buffers.
        copy_direct(registration, pieces, sorted(plan.chunks, key=lambda c: c.pieces[0].src),
                    [t.buffer for t in targets], self.device, plan.done)
        plan.ready()
