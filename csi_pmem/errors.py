"""The driver's domain exceptions, one class per gRPC status a user can act on.

Standard library only: the common layer (sizes, mounts, runner) raises these, and the
loader imports that layer, so this module must not import grpc. The one table that maps
these classes to status codes lives beside the servicers (:mod:`csi_pmem.servicers.status`).
Everything the driver raises on purpose is a subclass of :class:`CsiPmemError`; anything
else is a bug and becomes INTERNAL there.
"""

from __future__ import annotations


class CsiPmemError(Exception):
    """Base of every error the driver raises on purpose. ``str(e)`` is shown to users."""


class InvalidArgument(CsiPmemError):
    """The request is malformed: the caller must change it."""


class NotFound(CsiPmemError):
    """The named volume (or other object) does not exist."""


class OutOfRange(CsiPmemError):
    """A size that no pool on this node could ever satisfy."""


class AlreadyExists(CsiPmemError):
    """An object with this name exists but is incompatible with the request."""


class ResourceExhausted(CsiPmemError):
    """Not enough free space (or label slots) now; another node or later may work."""


class SpaceBeingErased(ResourceExhausted):
    """The space a request needs is held by volumes deleted moments ago, still being
    erased in the background; it comes back when their erase is done."""


class FailedPrecondition(CsiPmemError):
    """The request is valid but the object is in a state that forbids it."""


class Aborted(CsiPmemError):
    """Another operation on the same volume is in flight; retry later."""


class Unavailable(CsiPmemError):
    """The back end cannot be used right now (e.g. label-less or misaligned regions)."""


class BackendError(CsiPmemError):
    """A back-end operation failed unexpectedly (ndctl error, I/O error)."""


class CommandError(BackendError):
    """An external command failed or timed out; carries argv, exit code and stderr."""

    def __init__(self, argv: list[str], returncode: int | None, stderr: str, message: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = message or (
            "timed out" if returncode is None else f"exited with status {returncode}")
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        super().__init__(f"{' '.join(argv[:3])} {detail}" + (f": {tail}" if tail else ""))
