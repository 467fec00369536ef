"""The one table that maps the driver's exceptions to gRPC status codes.

Why one table: servicers must never invent codes ad hoc, and an unexpected exception
must never surface as UNKNOWN with a traceback as the message. Everything the driver
raises on purpose is a subclass of :class:`csi_pmem.errors.CsiPmemError`; anything else
is a bug and becomes INTERNAL with a short, safe message (the traceback goes to the log).
An OSError that reached here untranslated is the last resort: the driver translates
them where it knows the path, the volume and what the operation needs
(:func:`csi_pmem.errors.from_os_error`); one that slips through still says the kernel's
words and the path, never only "see the log".
Why here and not in :mod:`csi_pmem.errors`: the table needs grpc, the exceptions must
not (the common layer below the loader raises them).
"""

from __future__ import annotations

import errno

import grpc

from csi_pmem.errors import (
    Aborted,
    AlreadyExists,
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    SpaceBeingErased,
    Unavailable,
    paths_of,
)

# The one table. Order does not matter: lookup walks the exception's MRO.
STATUS_CODES: dict[type[BaseException], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SpaceBeingErased: grpc.StatusCode.RESOURCE_EXHAUSTED,  # its message says so
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    BackendError: grpc.StatusCode.INTERNAL,
    # Last resort, after the context-ful translations: see the module docstring.
    OSError: grpc.StatusCode.INTERNAL,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Return the gRPC code and user-facing message for ``exc`` (INTERNAL by default)."""
    for klass in type(exc).__mro__:
        code = STATUS_CODES.get(klass)
        if code is not None:
            if klass is OSError and isinstance(exc, OSError):
                return code, os_error_message(exc)
            return code, str(exc) or klass.__name__
    return grpc.StatusCode.INTERNAL, (
        f"internal error ({type(exc).__name__}); see the driver log for details")


def os_error_message(exc: OSError) -> str:
    """What an untranslated OSError says: the kernel's words, the errno and the path."""
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    paths = paths_of(exc)
    where = f" on {paths}" if paths else ""
    return (f"unexpected error: {exc.strerror or exc} [{name}]{where} (the driver log has "
            "the operation that failed)")


# The codes as the Go gRPC library spells them (``codes.Code.String()``): what
# csi-lib-utils puts in ``grpc_status_code``, so our histogram joins with the sidecars'.
# Python says CANCELLED where Go says Canceled, so this is a table, not a case change.
GO_CODE_NAMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
