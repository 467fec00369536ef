"""The wrapper every RPC runs in: timing, per-request logging, error translation.

Why a decorator rather than an interceptor: it sees the servicer's method name and the
parsed request, can strip secrets before logging, and turns every exception into a
status through the one table in :mod:`csi_pmem.driver.servicers.status` — so no RPC can return
UNKNOWN or leak a traceback to the CO.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf import json_format

from csi_pmem.csi import csi_pb2
from csi_pmem.driver.servicers.status import GO_CODE_NAMES, status_for
from csi_pmem.errors import InvalidArgument

log = logging.getLogger("csi_pmem.rpc")
QUIET = {"Probe", "NodeGetCapabilities", "GetPluginInfo", "GetPluginCapabilities",
         "ControllerGetCapabilities", "NodeGetInfo"}

# The status message travels percent-encoded in an HTTP/2 trailer, and clients drop
# trailers above 8-16 KiB, reporting RESOURCE_EXHAUSTED ("Stream removed") instead of
# our code. Messages quote request fields (names, ids, paths, tokens), so they are
# bounded; the log keeps the whole text.
MAX_MESSAGE_BYTES = 1024

# Observer hook: (full method name, Go-style code name, seconds), as csi-lib-utils
# labels its operation histograms ("/csi.v1.Controller/CreateVolume", "OutOfRange").
# Metrics register here.
observers: list[Callable[[str, str, float], None]] = []


def _full_methods() -> dict[str, str]:
    """Every CSI method's gRPC path by its short name (the servicer method's name).
    The spec's method names are unique across its services; checked here."""
    out: dict[str, str] = {}
    for service in csi_pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            assert m.name not in out, f"CSI method {m.name} is in two services"
            out[m.name] = f"/{service.full_name}/{m.name}"
    return out


FULL_METHODS = _full_methods()


def redact(request) -> dict:
    """The request as a dict with every secrets map emptied (fields marked csi_secret)."""
    try:
        data = json_format.MessageToDict(request, preserving_proto_field_name=True)
    except Exception:  # pragma: no cover - logging must never fail a call
        return {}
    for key in ("secrets", "controller_publish_secrets", "node_stage_secrets",
                "node_publish_secrets"):
        if key in data:
            data[key] = "***stripped***"
    return data


def rpc(method: Callable) -> Callable:
    name = method.__name__
    full_name = FULL_METHODS[name]  # a KeyError here: not a CSI method

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        start = time.monotonic()
        code = grpc.StatusCode.OK
        message = ""
        try:
            return method(self, request, context)
        except Exception as exc:  # translated below; never escapes as UNKNOWN
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", name)
        finally:
            seconds = time.monotonic() - start
            for observe in observers:
                observe(full_name, GO_CODE_NAMES[code], seconds)
            level = logging.DEBUG if name in QUIET and code == grpc.StatusCode.OK \
                else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s -> %s%s", name, code.name, f": {message}" if message else "",
                        extra={"rpc": name, "code": code.name, "seconds": round(seconds, 6),
                               "request": redact(request)})
        context.abort(code, clip(message))

    return wrapper


def clip(message: str) -> str:
    """``message`` cut to MAX_MESSAGE_BYTES of UTF-8, marked when it was cut."""
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    return (data[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")
            + " [... truncated; the driver log has the whole message]")


def require(request, *fields: str) -> None:
    """INVALID_ARGUMENT naming the first of ``fields`` the request leaves empty.

    Why one helper: presence is the servicer's job (the core gets complete requests),
    and every RPC must say it the same way. A message field counts as present when it
    is set, a repeated one when it has an entry, a scalar when it is not its default.
    """
    for name in fields:
        field = request.DESCRIPTOR.fields_by_name[name]
        if field.is_repeated:
            present = len(getattr(request, name)) > 0
        elif field.message_type is not None:
            present = request.HasField(name)
        else:
            present = bool(getattr(request, name))
        if not present:
            verb = "are" if field.is_repeated else "is"
            raise InvalidArgument(f"{name} {verb} required")
