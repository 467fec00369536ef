"""Messages of the GPU copy service: JSON lines, with fds attached (SCM_RIGHTS).

Why JSON lines over unix sockets, as ``dax.sock``: both ends are ours, the messages are
small and rare (a load is one request), and fd passing needs a unix socket anyway.
Standard library only: the loader in the pod imports this module.

Two conversations:

- Node plugin -> service, on the service's control socket (one message, one reply):
  ``prepare`` (volume metadata + the volume's fd: map it, register its staged models),
  ``release`` (unregister and unmap, before the namespace may go away), ``client``
  (metadata + the volume's fd + an authenticated client connection to serve).
- Service <-> pod, on that client connection: the service speaks first (``hello``: the
  GPUs it can copy to; a pod may send its first request before it reads it); the pod
  sends one or more ``copy`` requests, each with one allocation's fd, then shuts down
  its sending side; the service answers
  ``{"done": k}`` lines as the first k copies (counted over all requests, in order)
  have landed (always one at the end of each request), then ``{"ok": true, ...}`` or
  ``{"error": ...}``.

Slots: a request may name a ``slot`` (0 to ``MAX_SLOTS - 1``). Sent with an fd, the
service keeps that allocation under the slot for the rest of the connection (letting go
of one it held there); sent without, it copies into the allocation it holds there, of
the same size. Such a request says which (``"fd": true`` when it carries one): the fds
of a stream socket arrive with the bytes of a receive, which may hold several messages,
so the service takes them in order, as many as each message says it carries.
``{"op": "forget", "slot": s}`` lets go of one, and the service answers
``{"forgot": s}`` once it has (at once where no copy into it is queued, else after
them; its hello says ``"forgot": true``): the device memory is freed only once both
sides let go, so a pod waits for it before it allocates anew. Why slots: a batched load
(vLLM's) makes dozens of requests of a few hundred MB into memory it frees and makes
again; each fresh allocation cost the pod ``cuMemCreate`` and an export, and the
service an import and a mapping, about 3-6 ms per batch on an H100 while the link
waited. A pod reuses a slot only once its own reads of it (the server's copies into
its parameters) have finished, and the service orders a slot's copies on one stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from csi_pmem.fdpass import recv_with_fds

PROTOCOL = 1
SERVICE = "csi-pmem-gpu-copy"
SOCKET_NAME = "gpu.sock"  # next to dax.sock in a published devdax volume
MAX_LINE = 8 << 20  # a copy list of 100k entries fits
MAX_VOLUME = 1 << 56  # 64 PiB: far past any namespace, well inside what mmap takes
MAX_FDS = 4

OP_PREPARE = "prepare"
OP_RELEASE = "release"
OP_CLIENT = "client"
OP_COPY = "copy"
OP_FORGET = "forget"
MAX_SLOTS = 16


class ProtocolError(Exception):
    """A malformed or refused message; ``str(e)`` is what the peer is told."""


@dataclass(frozen=True)
class Copy:
    """Copy ``nbytes`` from volume offset ``src`` to allocation offset ``dst``; with
    ``rows`` > 1, ``rows`` rows of ``nbytes // rows`` bytes each, one every ``pitch``
    bytes of the volume from ``src``, packed one after the other at ``dst``.

    Why rows: a tensor-parallel rank of a row-parallel layer takes a stretch of every
    row of the checkpoint tensor (``narrow(1, ...)``); one request row by row would be
    thousands of copies of a few KB, while the copy engine moves such a 2D region in
    one (``cuMemcpy2DAsync``).
    """

    src: int
    dst: int
    nbytes: int
    rows: int = 1
    pitch: int = 0

    @property
    def width(self) -> int:
        """Bytes per row."""
        return self.nbytes // self.rows

    @property
    def end(self) -> int:
        """One past the last volume byte read."""
        return self.src + (self.rows - 1) * self.pitch + self.width

    def to_json(self) -> list[int]:
        if self.rows == 1:
            return [self.src, self.dst, self.nbytes]
        return [self.src, self.dst, self.nbytes, self.rows, self.pitch]


@dataclass(frozen=True)
class CopyRequest:
    gpu: str
    size: int
    copies: tuple[Copy, ...]
    slot: int | None = None
    fresh: bool = False  # with a slot: this request's fd is the slot's allocation

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def to_json(self) -> dict[str, Any]:
        doc = {"op": OP_COPY, "gpu": self.gpu, "size": self.size,
               "copies": [c.to_json() for c in self.copies]}
        if self.slot is not None:
            doc["slot"] = self.slot
            doc["fd"] = self.fresh
        return doc


def forget(slot: int) -> dict[str, Any]:
    """The message that lets go of the allocation held under ``slot``."""
    return {"op": OP_FORGET, "slot": slot}


def parse_slot(doc: dict[str, Any]) -> int | None:
    slot = doc.get("slot")
    if slot is None:
        return None
    if not _uint(slot) or slot >= MAX_SLOTS:
        raise ProtocolError(f"invalid slot {slot!r}: slots are 0 to {MAX_SLOTS - 1}")
    return int(slot)


def _uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_copy_request(doc: Any, volume_size: int) -> CopyRequest:
    """Check a pod's request against the volume and its own allocation size.

    The service reads only ``[0, volume_size)`` of the volume whose socket the pod
    connected to, and writes only ``[0, size)`` of the memory the pod handed over;
    the size itself is checked when the allocation is mapped (a short one fails).
    """
    if not isinstance(doc, dict) or doc.get("op") != OP_COPY:
        raise ProtocolError("expected a copy request")
    gpu, size, copies = doc.get("gpu"), doc.get("size"), doc.get("copies")
    if not isinstance(gpu, str) or not gpu:
        raise ProtocolError("the copy request names no GPU (its UUID, GPU-...)")
    if not isinstance(size, int) or not _uint(size) or size == 0:
        raise ProtocolError(f"the copy request has an invalid allocation size {size!r}")
    if not isinstance(copies, list):
        raise ProtocolError("the copy request has no copy list")
    out = []
    for i, entry in enumerate(copies):
        if not (isinstance(entry, list) and len(entry) in (3, 5) and all(map(_uint, entry))):
            raise ProtocolError(f"copy #{i} is not [src, dst, nbytes] or [src, dst, nbytes, "
                                "rows, pitch] of non-negative integers")
        src, dst, n, rows, pitch = entry if len(entry) == 5 else (*entry, 1, 0)
        if rows == 0 or n % rows or (rows > 1 and pitch < n // rows):
            raise ProtocolError(f"copy #{i} has {rows} rows of {n} bytes in all, every "
                                f"{pitch} bytes: rows must be at least 1, divide the bytes, "
                                "and not overlap")
        c = Copy(src, dst, n, rows, pitch if rows > 1 else 0)
        if c.end > volume_size:
            raise ProtocolError(f"copy #{i} reads [{src}, {c.end}), outside the volume of "
                                f"{volume_size} bytes")
        if dst + n > size:
            raise ProtocolError(f"copy #{i} writes [{dst}, {dst + n}), outside the "
                                f"allocation of {size} bytes")
        out.append(c)
    return CopyRequest(gpu, size, tuple(out), parse_slot(doc), doc.get("fd") is True)


def encode(doc: dict[str, Any]) -> bytes:
    line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    if len(line) > MAX_LINE:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_LINE}")
    return line


def send(sock: socket.socket, doc: dict[str, Any], fds: Iterable[int] = ()) -> None:
    line = encode(doc)
    fds = list(fds)
    sent = socket.send_fds(sock, [line], fds) if fds else sock.send(line)
    if sent < len(line):
        sock.sendall(line[sent:])


class Reader:
    """Reads JSON lines (and the fds that came with them) from one socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self.fds: list[int] = []

    def read(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream. Raises ProtocolError for a
        malformed one, TimeoutError / OSError as the socket does.

        The socket's timeout bounds the whole message, not each receive: a peer that
        sends a byte now and then must not hold a connection (and its thread) forever.
        """
        timeout = self.sock.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        scanned = 0
        try:
            while (end := self._buf.find(b"\n", scanned)) < 0:
                scanned = len(self._buf)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("timed out")
                    self.sock.settimeout(left)
                data, fds = self._recv()
                self.fds += fds
                if len(self.fds) > MAX_FDS:
                    raise ProtocolError("too many file descriptors")
                if not data:
                    if self._buf:
                        raise ProtocolError("the peer closed the connection mid-message")
                    return None
                self._buf += data
                if len(self._buf) > MAX_LINE:
                    raise ProtocolError("message too long")
        finally:
            if deadline is not None:
                self.sock.settimeout(timeout)
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"not a JSON message: {exc}") from exc
        except RecursionError as exc:  # json nests by recursion: '[' * 100000
            raise ProtocolError("not a JSON message: nested too deeply") from exc
        if not isinstance(doc, dict):
            raise ProtocolError("a message must be a JSON object")
        return doc

    def _recv(self) -> tuple[bytes, list[int]]:
        data, fds, _ = recv_with_fds(self.sock, 1 << 20, MAX_FDS)
        return data, fds

    def take_fds(self, count: int | None = None) -> list[int]:
        """The fds received so far (``count``: the first ``count`` of them, which the
        next message said it carries; fewer if fewer came)."""
        if count is None:
            fds, self.fds = self.fds, []
        else:
            fds, self.fds = self.fds[:count], self.fds[count:]
        return fds

    def close_fds(self) -> None:
        for fd in self.take_fds():
            with contextlib.suppress(OSError):
                os.close(fd)


def volume_meta(doc: dict[str, Any]) -> dict[str, Any]:
    """The volume fields of a node plugin message, checked."""
    vid, size = doc.get("volume_id"), doc.get("usable_size")
    if not isinstance(vid, str) or not vid or "/" in vid:
        raise ProtocolError(f"invalid volume_id {vid!r}")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_VOLUME:
        raise ProtocolError(f"invalid usable_size {size!r}")
    align = doc.get("align") or 2 << 20
    if not _uint(align) or align & (align - 1):
        raise ProtocolError(f"invalid align {align!r}")
    node = doc.get("numa_node")
    return {"volume_id": vid, "usable_size": size, "align": align,
            "numa_node": node if _uint(node) else None,
            "device": str(doc.get("device") or "")}
