"""The copy engine behind the service, as an interface, and its fake for tests.

Why an interface: CI has no GPU, and the service's protocol, authentication, bounds
checks, timeouts and failure handling are most of its code. The fake keeps the same
contract with real file descriptors: a pod's "allocation" is a memfd that both sides
map, so a wrong fd, a short allocation or a copy past its end fail the same way, and
bytes really move. :mod:`.cuda` is the implementation that drives the GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

# (host address, offset in the target, bytes, rows, the rows' pitch on the host): rows
# of bytes // rows each, packed in the target (protocol.Copy says why)
HostCopy = tuple[int, int, int, int, int]


class CopyError(Exception):
    """A copy that cannot be done; ``str(e)`` is what the pod is told."""


class Target(Protocol):
    gpu: str
    size: int

    def close(self) -> None: ...


class Copier(Protocol):
    name: str

    def gpus(self) -> list[str]:
        """UUIDs of the GPUs this copier can write to."""

    def register(self, address: int, length: int) -> None:
        """Make host memory a DMA source (pinned); raises CopyError."""

    def unregister(self, address: int) -> None: ...

    def open_target(self, fd: int, size: int, gpu: str) -> Target:
        """Import a pod's exported allocation and map ``size`` bytes of it; raises
        CopyError when the fd is not one, the allocation is smaller than ``size`` or
        lives on another GPU than ``gpu``. Does not take ownership of ``fd``."""

    def enqueue(self, target: Target, copies: Sequence[HostCopy]) -> list[Any]:
        """Queue the copies into ``target`` without waiting; one token per copy, for
        :meth:`wait`. Raises CopyError."""

    def wait(self, token: Any) -> None:
        """Block until the copy of ``token`` (and every one queued before it into the
        same target) has landed; raises CopyError. The token is spent either way."""

    def discard(self, token: Any) -> None:
        """Spend a token that will not be waited for (a copy before it failed, or the
        pod went away): whatever it holds goes back or is freed. Its copy may still
        run; closing its target waits for that. Never raises."""


FAKE_GPU = "GPU-00000000-0000-0000-0000-00000000fa4e"


class FakeTarget:
    def __init__(self, fd: int, size: int, gpu: str, copier: FakeCopier | None = None):
        self.gpu, self.size = gpu, size
        self.mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        self._copier = copier

    def close(self) -> None:
        copier, self._copier = self._copier, None
        if copier is not None:
            with copier._lock:
                copier.open_targets -= 1
        self.address = 0
        try:
            self.mapping.close()
        except BufferError:  # pragma: no cover - nothing exports it
            pass


class FakeCopier:
    """memcpy into a memfd "allocation"; ``delay`` seconds per copy (for timeout and
    kill-mid-copy tests); ``fail_at``: the copy (counted from 1 over the copier's life)
    whose wait fails, as a faulted copy engine's would. ``outstanding`` counts tokens
    not yet spent by :meth:`wait` or :meth:`discard` (the CUDA copier's are events, so
    one left over is a leak); ``open_targets`` the pods' allocations it holds mapped (a
    real one's device memory stays allocated until the service lets go of it too)."""

    name = "fake"

    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.delay = delay
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.outstanding = 0
        self.open_targets = 0
        self._waited = 0
        self._lock = threading.Lock()

    def gpus(self) -> list[str]:
        return [FAKE_GPU]

    def register(self, address: int, length: int) -> None:
        with self._lock:
            if address in self.registered:
                raise CopyError(f"host memory at {address:#x} is already registered")
            self.registered[address] = length

    def unregister(self, address: int) -> None:
        with self._lock:
            self.registered.pop(address, None)

    def open_target(self, fd: int, size: int, gpu: str) -> FakeTarget:
        if gpu not in self.gpus():
            raise CopyError(f"this node's copy service cannot reach GPU {gpu}")
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise CopyError(f"the allocation fd is not usable: {exc.strerror}") from exc
        # An exported allocation here is a memfd, as only cuMemCreate's fds are for
        # CUDA: a file's fd (the volume's own, say) is as foreign as a pipe's.
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            link = ""
        if not stat.S_ISREG(st.st_mode) or not link.startswith("/memfd:"):
            raise CopyError("the fd sent is not an exported GPU allocation")
        if st.st_size < size:
            raise CopyError(f"the allocation is {st.st_size} bytes, smaller than the "
                            f"{size} bytes the request names")
        try:
            target = FakeTarget(fd, size, gpu, self)
        except OSError as exc:  # opened read-only: not writable, as CUDA would refuse
            raise CopyError(f"the allocation cannot be mapped writable: {exc.strerror}") \
                from exc
        with self._lock:
            self.open_targets += 1
        return target

    def enqueue(self, target: Target, copies: Sequence[HostCopy]) -> list[Any]:
        assert isinstance(target, FakeTarget), "a target of another copier"
        for i, (_, dst, n, _, _) in enumerate(copies):
            if dst + n > target.size:
                raise CopyError(f"copy #{i} ends past the allocation")
        # Like a copy engine, the bytes move later: when waited for.
        with self._lock:
            self.outstanding += len(copies)
        return [(target, c) for c in copies]

    def wait(self, token: Any) -> None:
        target, (src, dst, n, rows, pitch) = token
        with self._lock:
            self.outstanding -= 1
            self._waited += 1
            failing = self._waited == self.fail_at
        if self.delay:
            time.sleep(self.delay)
        if failing:
            raise CopyError("a copy failed on the device (fake fault)")
        width = n // rows
        for r in range(rows):
            ctypes.memmove(target.address + dst + r * width, src + r * pitch, width)

    def discard(self, token: Any) -> None:
        with self._lock:
            self.outstanding -= 1
