"""The driver's domain exceptions, one class per gRPC status a user can act on.

Standard library only: the common layer (sizes, mounts, runner) raises these, and the
loader imports that layer, so this module must not import grpc. The one table that maps
these classes to status codes lives beside the servicers (:mod:`csi_pmem.driver.servicers.status`).
Everything the driver raises on purpose is a subclass of :class:`CsiPmemError`; anything
else is a bug and becomes INTERNAL there.
"""

from __future__ import annotations

import errno


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


def from_os_error(exc: OSError, doing: str, *, fs: str = "", needs: str = "") -> CsiPmemError:
    """The domain error for ``exc``, which the caller got while ``doing`` something.

    Why a helper and not an OSError row in the status table: the errno alone says what
    is short (space, a quota, descriptors, memory, a permission), but only the caller
    knows where and for what, and an operator needs both to act. So each call site
    passes its context and this keeps the advice per errno the same everywhere:

    - ``doing`` names the operation, the path and the volume ("cannot save the record of
      volume X in the state directory /var/lib/csi-pmem");
    - ``fs`` is the path whose file system a full, over-quota or read-only error is about
      (default: the file name in ``exc``);
    - ``needs`` says what the operation puts there, so the operator knows what to make
      room for.

    Errors no operator can fix from the message alone (EIO, and whatever is not listed
    here) stay :class:`BackendError` (INTERNAL), still with the kernel's words and path.
    """
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    why = f"{exc.strerror or exc} [{name}]"
    where = fs or paths_of(exc) or "its path"
    also = f": {needs}" if needs else ""
    if code == errno.ENOSPC:
        return ResourceExhausted(
            f"{doing}: the file system holding {where} is full ({why}); free space on "
            f"it{also}")
    if code == errno.EDQUOT:
        return ResourceExhausted(
            f"{doing}: the disk quota on the file system holding {where} is used up "
            f"({why}); raise the quota or free space there{also}")
    if code == errno.EROFS:
        return FailedPrecondition(
            f"{doing}: the file system holding {where} is read-only ({why}); mount it "
            f"read-write{also}")
    if code in (errno.EACCES, errno.EPERM):
        return FailedPrecondition(
            f"{doing}: {why} on {paths_of(exc) or where}; the driver must run as root with "
            "CAP_SYS_ADMIN (a privileged container) and be allowed to write there (check its "
            "securityContext, the directory's owner and mode, and SELinux/AppArmor labels)")
    if code == errno.EMFILE:
        return ResourceExhausted(
            f"{doing}: the driver is out of file descriptors ({why}); raise its open-file "
            "limit (LimitNOFILE, ulimit -n, or the container runtime's nofile limit)")
    if code == errno.ENFILE:
        return ResourceExhausted(
            f"{doing}: the node is out of file descriptors ({why}); raise fs.file-max "
            "(sysctl) or stop what holds them")
    if code == errno.ENOMEM:
        return ResourceExhausted(
            f"{doing}: out of memory ({why}); raise the driver container's memory limit or "
            "free memory on the node")
    hint = "; the kernel log (dmesg) says why" if code == errno.EIO else ""
    path = paths_of(exc)
    return BackendError(f"{doing}: {why}" + (f" on {path}" if path and path not in doing
                                                 else "") + hint)


def paths_of(exc: OSError) -> str:
    """The path(s) an OSError names, as text ("" when it names none)."""
    names = [n for n in (exc.filename, exc.filename2) if n is not None]
    return " -> ".join(n.decode(errors="replace") if isinstance(n, bytes) else str(n)
                       for n in names)
