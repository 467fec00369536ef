"""The GPU path (torch, imported lazily): bounce buffers or a registered mapping.

Why two paths (DESIGN.md 1.3):
- Bounce: a few pinned buffers allocated once per loader, filled by memcpy threads on
  the volume's NUMA node and drained by one CUDA stream (see :mod:`.pipeline`). Costs
  CPU and memory bandwidth, needs nothing from the mapping, works for any volume.
- Registered: ``cudaHostRegister`` the model's ranges of the mapping once (about
  0.03 s/GiB with 2 MiB pages, 0.1 with 4 KiB), then the copy engine reads the volume
  directly with no CPU copy. Worth it only when the mapping is loaded from again, so
  ``mode="auto"`` registers a volume on its ``auto_register_after``-th load through the
  same loader. Registration is refused on fsdax files and some sandboxes; then we log a
  warning and use the bounce path, never silently.

Device placement: one device buffer per file; tensors are views into it (see
:func:`.plan.place`), so a whole-file load is a stream of full-buffer transfers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from csi_pmem.loader import plan as planning
from csi_pmem.loader.cpu import torch_dtype
from csi_pmem.loader.model import ModelView
from csi_pmem.loader.numa import node_cpus
from csi_pmem.loader.pipeline import BouncePipeline
from csi_pmem.loader.stformat import TensorInfo
from csi_pmem.loader.volume import MiB, Volume, format_size

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h).
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08
# Single registrations of 512 GiB and more fail on recent drivers (DESIGN.md 1.3).
REGISTER_CHUNK = 64 << 30
DIRECT_CHUNK = 256 * MiB

BOUNCE = "bounce"
REGISTERED = "registered"
AUTO = "auto"

TensorDone = Callable[[str, Any], None]


class RegistrationError(RuntimeError):
    pass


def _torch() -> Any:
    import torch

    return torch


class _TorchBackend:
    """Pinned buffers, their events and the copy stream of one device."""

    def __init__(self, device: Any, nbuffers: int, buffer_size: int):
        torch = _torch()
        self.device = device
        started = time.monotonic()
        self.buffers = [torch.empty(buffer_size, dtype=torch.uint8, pin_memory=True)
                        for _ in range(nbuffers)]
        self.addresses = [b.data_ptr() for b in self.buffers]
        self.events = [torch.cuda.Event() for _ in range(nbuffers)]
        self.stream = torch.cuda.Stream(device=device)
        self.targets: list[Any] = []
        log.debug("allocated %d pinned buffers of %s in %.3f s", nbuffers,
                  format_size(buffer_size), time.monotonic() - started)

    def thread_init(self) -> None:
        # Current device and stream are per thread in CUDA and torch.
        torch = _torch()
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def buffer_address(self, buf: int) -> int:
        return self.addresses[buf]

    def transfer(self, buf: int, chunk: planning.Chunk) -> None:
        dst = self.targets[chunk.target][chunk.dst:chunk.dst + chunk.nbytes]
        dst.copy_(self.buffers[buf][:chunk.nbytes], non_blocking=True)
        self.events[buf].record(self.stream)

    def wait(self, buf: int) -> None:
        self.events[buf].synchronize()


class Registration:
    """``cudaHostRegister``-ed ranges of one mapping, unregistered by :meth:`close`."""

    def __init__(self, volume: Volume, ranges: list[tuple[int, int]]):
        torch = _torch()
        self.volume = volume
        self.cudart = torch.cuda.cudart()
        flags = HOST_REGISTER_PORTABLE | (0 if volume.writable else HOST_REGISTER_READ_ONLY)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            # Holding this tensor keeps the mapping alive while it is registered.
            self.source = torch.frombuffer(volume.mapping, dtype=torch.uint8)
        self.addresses: list[int] = []
        self.boundaries: list[int] = []
        self.nbytes = 0
        started = time.monotonic()
        try:
            for start, end in ranges:
                for off in range(start, end, REGISTER_CHUNK):
                    length = min(REGISTER_CHUNK, end - off)
                    err = self.cudart.cudaHostRegister(volume.address + off, length, flags)
                    if int(err) != 0:
                        raise RegistrationError(
                            f"cudaHostRegister of {format_size(length)} at volume offset "
                            f"{off} failed: {_cuda_error(err)}")
                    self.addresses.append(volume.address + off)
                    self.boundaries += [off, off + length]
                    self.nbytes += length
        except BaseException:
            self.close()
            raise
        self.seconds = time.monotonic() - started
        log.info("registered %s of %s with CUDA in %.3f s (%.3f s/GiB)",
                 format_size(self.nbytes), volume.source, self.seconds,
                 self.seconds / max(self.nbytes / (1 << 30), 1e-9))

    def close(self) -> None:
        for addr in self.addresses:
            self.cudart.cudaHostUnregister(addr)
        self.addresses = []


def _cuda_error(err: Any) -> str:
    try:
        return f"{_torch().cuda.cudart().cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # older torch has no cudaGetErrorString binding
        return f"cudaError {int(err)}"


@dataclass
class FileTarget:
    """One file's device buffer, placements and tensor views."""

    name: str
    placements: list[planning.Placement]
    buffer: Any
    tensors: dict[str, Any] = field(default_factory=dict)


def device_tensor(buffer: Any, p: planning.Placement, t: TensorInfo) -> Any:
    """A view of ``t`` inside its file's device buffer, or a copy target of its own when
    the offset is not aligned for the dtype (files written without padding)."""
    torch = _torch()
    dtype = torch_dtype(t.dtype)
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dtype, device=buffer.device)
    raw = buffer[p.dst:p.dst + p.nbytes]
    if dtype is torch.uint8 and t.dtype != "U8":
        return raw  # sub-byte types, or a dtype this torch lacks: flat raw bytes
    if p.dst % dtype.itemsize:
        return None  # caller copies it after the transfer
    return raw.view(dtype).view(t.shape)


class GpuLoader:
    """Loads onto one CUDA device; reuse it: buffers, threads and registrations persist.

    ``threads`` memcpy threads are pinned to the CPUs of the volume's NUMA node;
    ``buffers`` pinned buffers of ``buffer_size`` bytes are allocated on first use.
    """

    def __init__(self, device: str | Any = "cuda", *, buffers: int = 12,
                 buffer_size: int = 32 * MiB, threads: int = 8, mode: str = AUTO,
                 auto_register_after: int | None = 3):
        torch = _torch()
        if mode not in (AUTO, BOUNCE, REGISTERED):
            raise ValueError(f"mode must be {AUTO}, {BOUNCE} or {REGISTERED}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"GpuLoader needs a cuda device, not {device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.nbuffers, self.buffer_size, self.threads = buffers, buffer_size, threads
        self.mode = mode
        self.auto_register_after = auto_register_after
        self._backend: _TorchBackend | None = None
        self._pipelines: dict[int | None, BouncePipeline] = {}
        self._registrations: dict[int, Registration] = {}
        self._loads: dict[int, int] = {}
        self._lock = threading.Lock()
        self.last_path: str | None = None

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            for p in self._pipelines.values():
                p.close()
            self._pipelines.clear()
            for r in self._registrations.values():
                r.close()
            self._registrations.clear()
            self._backend = None

    def __enter__(self) -> GpuLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, view: ModelView) -> Registration:
        """Register the model's safetensors ranges of the mapping (idempotent)."""
        key = id(view.volume.mapping)
        reg = self._registrations.get(key)
        if reg is None:
            vol = view.volume
            ranges = [(f.offset, min(vol.size, planning.round_up(f.end, vol.align)))
                      for f in view.model.safetensors]
            reg = Registration(vol, _merge(ranges))
            self._registrations[key] = reg
        return reg

    def prepare(self, numa_node: int | None = None) -> None:
        """Allocate the pinned buffers and start the memcpy threads now, not on the
        first load (pinned allocation costs about 0.4 s/GiB)."""
        with self._lock:
            self._pipeline(numa_node)

    def _pipeline(self, numa_node: int | None) -> BouncePipeline:
        if self._backend is None:
            self._backend = _TorchBackend(self.device, self.nbuffers, self.buffer_size)
        pipe = self._pipelines.get(numa_node)
        if pipe is None:
            cpus = node_cpus(numa_node)
            pipe = BouncePipeline(self._backend, self.nbuffers, self.buffer_size,
                                  max(1, min(self.threads, len(cpus))), cpus=cpus,
                                  memcpy=ctypes.memmove, thread_init=self._backend.thread_init)
            self._pipelines[numa_node] = pipe
        return pipe

    def _choose(self, view: ModelView) -> Registration | None:
        key = id(view.volume.mapping)
        self._loads[key] = self._loads.get(key, 0) + 1
        want = self.mode == REGISTERED or key in self._registrations or (
            self.mode == AUTO and self.auto_register_after is not None
            and self._loads[key] >= self.auto_register_after)
        if not want or self.mode == BOUNCE:
            return None
        try:
            return self.register(view)
        except RegistrationError as exc:
            log.warning("%s; loading through pinned bounce buffers instead (slower than "
                        "a registered mapping, and uses memcpy threads)", exc)
            if self.mode == AUTO:
                self.auto_register_after = None  # do not retry (and warn) every load
            return None

    # -- loading ----------------------------------------------------------------
    def load(self, view: ModelView, selection: dict[str, list[TensorInfo]],
             on_tensor: TensorDone, on_file: Callable[[str, dict[str, Any]], None]) -> str:
        """Copy ``selection`` to the device; callbacks fire as tensors/files complete.

        Returns the path used ("bounce" or "registered").
        """
        torch = _torch()
        with self._lock:
            registration = self._choose(view)
            path = REGISTERED if registration else BOUNCE
            self.last_path = path
            targets, chunks, completions, fixups = self._plan(view, selection, registration)
            left = {t.name: len(t.placements) for t in targets}
            infos = {t.name: t for ts in selection.values() for t in ts}

            def finish_tensor(target: FileTarget, name: str) -> None:
                if name in fixups:
                    raw = target.buffer[fixups[name].dst:fixups[name].dst + fixups[name].nbytes]
                    out = torch.empty(infos[name].shape, dtype=torch_dtype(infos[name].dtype),
                                      device=self.device)
                    out.view(-1).view(torch.uint8).copy_(raw)
                    torch.cuda.current_stream(self.device).synchronize()
                    target.tensors[name] = out
                on_tensor(name, target.tensors[name])
                left[target.name] -= 1
                if left[target.name] == 0:
                    on_file(target.name, dict(target.tensors))

            for target, completion in zip(targets, completions, strict=True):
                for name in completion.ready:
                    finish_tensor(target, name)

            def on_done(chunk: planning.Chunk) -> None:
                target = targets[chunk.target]
                for name in completions[chunk.target].done(chunk):
                    finish_tensor(target, name)

            if registration is not None:
                self._direct(registration, targets, chunks, on_done)
            else:
                pipe = self._pipeline(view.volume.numa_node)
                assert self._backend is not None
                self._backend.targets = [t.buffer for t in targets]
                # The device buffers were allocated on the current stream.
                self._backend.stream.wait_stream(torch.cuda.current_stream(self.device))
                try:
                    pipe.run(chunks, view.volume.address, on_done)
                finally:
                    self._backend.targets = []
            return path

    def _plan(self, view: ModelView, selection: dict[str, list[TensorInfo]],
              registration: Registration | None) -> tuple[
                  list[FileTarget], list[planning.Chunk], list[planning.Completion],
                  dict[str, planning.Placement]]:
        torch = _torch()
        targets, chunks, completions = [], [], []
        fixups: dict[str, planning.Placement] = {}
        for i, (fname, tensors) in enumerate(selection.items()):
            placements, size = planning.place(tensors)
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            target = FileTarget(fname, placements, buffer)
            by_name = {t.name: t for t in tensors}
            for p in placements:
                tensor = device_tensor(buffer, p, by_name[p.name])
                if tensor is None:
                    fixups[p.name] = p
                else:
                    target.tensors[p.name] = tensor
            if registration is None:
                file_chunks = planning.bounce_chunks(placements, self.buffer_size, i,
                                                     len(chunks))
            else:
                file_chunks = planning.direct_chunks(placements, DIRECT_CHUNK,
                                                     registration.boundaries, i, len(chunks))
            chunks += file_chunks
            completions.append(planning.Completion(placements, file_chunks))
            targets.append(target)
        if fixups:
            log.debug("%d tensors are misaligned in their files; copied once more on the "
                      "device", len(fixups))
        return targets, chunks, completions, fixups

    def _direct(self, registration: Registration, targets: list[FileTarget],
                chunks: list[planning.Chunk], on_done: Callable[[planning.Chunk], None]) -> None:
        torch = _torch()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        src = registration.source
        events = []
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for c in chunks:
                p = c.pieces[0]
                targets[c.target].buffer[c.dst:c.dst + c.nbytes].copy_(
                    src[p.src:p.src + p.nbytes], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        for c, ev in zip(chunks, events, strict=True):
            ev.synchronize()
            on_done(c)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]

