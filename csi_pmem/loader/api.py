"""The load API: ``start_load`` (futures per file and per tensor) and the blocking
``load_safetensors`` / ``load_numpy`` built on it.

Why futures: an inference server can start building layers as their weights land, and
overlap loading with everything else it does at start-up; ``LoadHandle.verified``
lets checksum verification run beside the copy instead of before it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from csi_pmem.loader.cpu import WRITES, numpy_view, resolve_writes, torch_view

# gpu.verify imports no torch at module level. It is imported here, with the loader, and
# not inside start_load: there, the import was most of the 4.5-7.3 ms that setting up
# the check took inside a verified node-path load of 0.25 s in fresh processes.
from csi_pmem.loader.gpu import verify as gpuverify
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.weights import checksum
from csi_pmem.weights.errors import ChecksumError, LoaderError
from csi_pmem.weights.stformat import TensorInfo
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)

CPU_VIEW = "cpu-view"


def _future() -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_running_or_notify_cancel()  # results are pushed, never cancelled
    return fut


class LoadHandle:
    """Futures of one load.

    ``tensors[name]`` and ``files[file]`` resolve as data lands (a file's future gives
    its ``{name: tensor}``); ``done`` gives everything; ``verified`` resolves to None or
    raises :class:`ChecksumError`. :meth:`result` waits for both.
    """

    def __init__(self, view: ModelView, selection: dict[str, list[TensorInfo]], device: str):
        self.view = view
        self.device = device
        self.tensors = {t.name: _future() for ts in selection.values() for t in ts}
        self.files = {f: _future() for f in selection}
        self.done: Future[dict[str, Any]] = _future()
        self.verified: Future[None] = _future()
        self.nbytes = sum(t.nbytes for ts in selection.values() for t in ts)
        self.path: str | None = None
        self.started = time.monotonic()
        self.seconds: float | None = None

    @property
    def gbps(self) -> float | None:
        return None if not self.seconds else self.nbytes / self.seconds / 1e9

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        tensors = self.done.result(timeout)
        self.verified.result(timeout)
        return tensors

    def drop(self) -> None:
        """Forget the loaded tensors once the load is done: a consumer that owns them
        from here (a batched load, :mod:`csi_pmem.loader.batches`) frees their device
        memory when it lets them go, not when this handle is collected."""
        if not self.done.done():
            raise RuntimeError("drop() before the load is done")
        self.tensors.clear()
        self.files.clear()
        if self.done.exception() is None:
            self.done.result().clear()

    def _tensor(self, name: str, value: Any) -> None:
        self.tensors[name].set_result(value)

    def _file(self, name: str, tensors: dict[str, Any]) -> None:
        self.files[name].set_result(tensors)

    def _finish(self, path: str) -> None:
        self.path = path
        self.seconds = time.monotonic() - self.started
        self.done.set_result({n: f.result() for n, f in self.tensors.items()})

    def _fail(self, exc: BaseException) -> None:
        for fut in [*self.tensors.values(), *self.files.values(), self.done]:
            if not fut.done():
                fut.set_exception(exc)


_loaders: dict[str, Any] = {}
_loaders_lock = threading.Lock()


def default_loader(device: str) -> Any:
    """One shared :class:`GpuLoader` per device (buffers are allocated once)."""
    from csi_pmem.loader.gpu.loader import GpuLoader

    with _loaders_lock:
        loader = _loaders.get(device)
        if loader is None:
            loader = _loaders[device] = GpuLoader(device)
        return loader


def damaged(view: ModelView, bad: list[checksum.Mismatch]) -> ChecksumError:
    """The error of a load whose chunks ``bad`` do not match: what to do about it."""
    return ChecksumError(
        f"{len(bad)} chunk(s) of model {view.model.label()} on {view.volume.source} do "
        f"not match their staged checksums, first: {bad[0]}. The volume copy is "
        "damaged; stage the model again")


class _Verification:
    """Joins the parts of one load's verification (host chunks, device files) into
    ``handle.verified``: None once every part passed, else :class:`ChecksumError`."""

    def __init__(self, handle: LoadHandle, parts: int):
        self.handle, self.left = handle, parts
        self.bad: list[checksum.Mismatch] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._lock = threading.Lock()
        if parts == 0:
            handle.verified.set_result(None)

    def part(self, bad: list[checksum.Mismatch], error: BaseException | None) -> None:
        with self._lock:
            self.bad += bad
            self.error = self.error or error
            self.left -= 1
            if self.left:
                return
        view = self.handle.view
        exc = self.error
        if exc is None and self.bad:
            exc = damaged(view, self.bad)
        if exc is not None:
            # DEBUG: the caller gets it from handle.verified (or result()); logged at
            # ERROR too, an unconfigured program would print it twice.
            log.debug("verification failed: %s", exc)
            self.handle.verified.set_exception(exc)
        else:
            log.debug("verified in %.3f s", time.monotonic() - self.started)
            self.handle.verified.set_result(None)


def _verify_on_host(joined: _Verification, view: ModelView,
                    selection: dict[str, list[TensorInfo]], threads: int | None) -> None:
    ranges = {}
    for fname, tensors in selection.items():
        f = view.file(fname)
        # The header bytes were trusted to build the views: verify them too.
        ranges[fname] = [(f.offset, view.headers[fname].data_start)] + [
            (t.offset, t.offset + max(t.nbytes, 1)) for t in tensors]
    chunks = checksum.model_chunks(view.model, [view.file(f) for f in selection], ranges)
    # Every allowed CPU: hashing is the slow part of a host-verified load.
    fut = checksum.start_verify(view.volume, chunks,
                                threads=threads or len(os.sched_getaffinity(0)))
    fut.add_done_callback(lambda f: joined.part(
        [] if f.exception() else f.result(), f.exception()))


def verify_share(view: ModelView, part: int, parts: int,
                 threads: int | None = None) -> Future[None]:
    """Check share ``part`` of ``parts`` of the model's staged chunks (those whose index
    in the model is ``part`` modulo ``parts``) on the host, in the background.

    Why: tensor-parallel ranks each read only their slices, so none of them reads every
    chunk; split this way, the ranks of one engine check every chunk exactly once
    between them, and an engine starts only when all of its ranks loaded. The future
    raises :class:`ChecksumError` naming the damaged chunks.
    """
    if not 0 <= part < parts:
        raise LoaderError(f"share {part} of {parts} does not exist")
    chunks = checksum.model_chunks(view.model, [view.file(f) for f in view.headers])
    mine = chunks[part::parts]
    cpus = len(os.sched_getaffinity(0))
    done: Future[None] = Future()
    done.set_running_or_notify_cancel()

    def finish(f: Future[list[checksum.Mismatch]]) -> None:
        exc = f.exception()
        if exc is None and f.result():
            exc = damaged(view, f.result())
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    checksum.start_verify(view.volume, mine, threads=threads or max(1, cpus // parts)) \
        .add_done_callback(finish)
    return done


def _close_when_done(handle: LoadHandle, gpu: Any) -> None:
    """Unmap a volume this load opened once data and verification are done.

    Views handed out keep the mapping alive until they are freed (Volume.close), and a
    loader must not keep a registration of a mapping nobody can load from again.

    The callbacks hold the handle weakly. A future keeps its callbacks, so a strong
    reference would make a cycle (handle, future, callback, handle) through which the
    handle's tensors, and so the mapping, outlive the caller's last reference until the
    garbage collector happens to run: an fsdax mount then stays busy after its last
    user let go. Whoever resolves the last future holds the handle while it does.
    """
    lock = threading.Lock()
    closed = [False]
    ref = weakref.ref(handle)

    def maybe_close(_: Future[Any]) -> None:
        h = ref()
        if h is None:
            return
        with lock:
            if closed[0] or not (h.done.done() and h.verified.done()):
                return
            closed[0] = True
        if gpu is not None:
            gpu.release(h.view.volume)
        h.view.volume.close()

    handle.done.add_done_callback(maybe_close)
    handle.verified.add_done_callback(maybe_close)


def _need_torch(device: str) -> None:
    """torch is an extra (``loader`` is numpy only): say which, not a traceback."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        extra = "torch" if device == "cpu" else "gpu"
        raise LoaderError(
            f"loading torch tensors (device={device!r}) needs torch, which is not "
            f"installed ({exc}): pip install 'csi-pmem[{extra}]', or load numpy arrays "
            "with load_numpy() / framework='numpy'") from exc


def start_load(volume: Volume | ModelView | str | os.PathLike[str], device: str = "cpu", *,
               model: str | None = None, names: Iterable[str] | None = None,
               predicate: Callable[[str], bool] | None = None, verify: bool = True,
               verify_threads: int | None = None, loader: Any = None,
               framework: str = "torch", prefault: bool = False,
               writes: str = "auto") -> LoadHandle:
    """Start loading a staged model; returns at once with a :class:`LoadHandle`.

    ``volume``: a published volume directory, a devdax device, an fsdax block device or
    a file path (also a file on an fsdax file system; mapped read-only for this load,
    unmapped once its views are freed), an open
    :class:`Volume` (keep it open across loads: that is what makes a registered mapping
    pay), or a :class:`ModelView`. ``names``/``predicate`` pick a
    subset (tensor parallelism). ``device="cpu"`` gives views of the mapping (torch, or
    numpy with ``framework="numpy"``); ``"cuda"``/``"cuda:N"`` copies through ``loader``
    (default: one shared :class:`~csi_pmem.loader.gpu.GpuLoader` per device). fsdax
    files and block devices always take the bounce path (``handle.path``); why is in
    ``handle.view.volume.registration_refused_reason``. ``writes`` says what a write
    into a CPU tensor does (:mod:`csi_pmem.loader.cpu`): by default it lands in a
    private copy of its page (file volumes), or the tensors are copies (devdax);
    ``"readonly"`` gives zero-copy views that kill the process if written.
    """
    if writes not in WRITES:
        raise LoaderError(f"writes={writes!r} is not one of {', '.join(WRITES)}")
    if device != "cpu":
        if not device.startswith("cuda"):
            raise LoaderError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if framework != "torch":
            raise LoaderError(f"device {device!r} needs framework='torch'")
        if writes != "auto":
            raise LoaderError(f"writes={writes!r} is for CPU loads: tensors on "
                              f"{device!r} are the process's own copies")
    if framework == "torch":
        _need_torch(device)
    owned = not isinstance(volume, Volume | ModelView)
    view = volume if isinstance(volume, ModelView) else open_model(volume, model)
    selection = view.select(names, predicate)
    handle = LoadHandle(view, selection, device)
    gpu = None if device == "cpu" else (loader or default_loader(device))
    if owned:
        _close_when_done(handle, gpu)
    on_data = None
    if verify:
        t_plan = time.monotonic()
        plans = {}
        if gpu is not None:
            plans = {f: p for f, ts in selection.items()
                     if (p := gpuverify.device_plan(view, f, ts)) is not None}
        host = {f: ts for f, ts in selection.items() if f not in plans}
        joined = _Verification(handle, (1 if host else 0) + (1 if plans else 0))
        if host:
            _verify_on_host(joined, view, host, verify_threads)
        if plans:
            assert gpu is not None  # device plans exist only for GPU loads
            verifier = gpuverify.DeviceVerifier(view, plans, gpu.device, joined.part)
            on_data = verifier.submit

            def stop_verifier(f: Future[Any]) -> None:
                exc = f.exception()
                if exc is not None:
                    verifier.fail(exc)

            handle.done.add_done_callback(stop_verifier)
        log.debug("verification of %d file(s) on the device and %d on the host set up in "
                  "%.2f ms", len(plans), len(host), (time.monotonic() - t_plan) * 1e3)
    else:
        handle.verified.set_result(None)
    if prefault:
        for fname in selection:
            f = view.file(fname)
            view.volume.prefault(f.offset, f.length)

    if device == "cpu":
        make = numpy_view if framework == "numpy" else torch_view
        try:
            mode = resolve_writes(view.volume, writes, framework)
            for fname, tensors in selection.items():
                got = {t.name: make(view.volume, t, mode) for t in tensors}
                for name, value in got.items():
                    handle._tensor(name, value)
                handle._file(fname, got)
            handle._finish(CPU_VIEW)
        except BaseException as exc:
            handle._fail(exc)
            raise
        return handle

    assert gpu is not None  # the CPU returned above

    def run() -> None:
        try:
            path = gpu.load(view, selection, handle._tensor, handle._file, on_data)
            handle._finish(path)
            log.info("loaded %d tensors (%.2f GB) to %s in %.3f s (%.1f GB/s, %s path)",
                     len(handle.tensors), handle.nbytes / 1e9, device, handle.seconds,
                     handle.gbps or 0.0, path)
        except BaseException as exc:
            log.debug("loading to %s failed: %s", device, exc)  # raised to the caller
            handle._fail(exc)

    threading.Thread(target=run, name="load", daemon=True).start()
    return handle


def load_safetensors(volume: Volume | ModelView | str | os.PathLike[str],
                     device: str = "cpu", **kw: Any) -> dict[str, Any]:
    """Load a staged model as ``{name: torch.Tensor}`` (see :func:`start_load`)."""
    return start_load(volume, device, **kw).result()


def load_numpy(volume: Volume | ModelView | str | os.PathLike[str],
               **kw: Any) -> dict[str, Any]:
    """``{name: numpy.ndarray}`` views of the mapping; bf16/fp8 come back as raw uint
    views (see ``TensorInfo.dtype`` through :func:`open_model` for the logical type)."""
    return start_load(volume, "cpu", framework="numpy", **kw).result()
