"""Log formats for every process of the project: the driver (``csi-pmem serve``), the GPU
copy service and the staging sidecar (``csi-pmem-weights sidecar``).

Why one module: log collectors in a cluster parse the JSON lines without per-process
rules only when every process writes the same keys. One JSON object per line:

- ``ts``: when, RFC 3339 in UTC with milliseconds (``2025-01-31T12:00:00.123Z``);
- ``level``: ``debug``, ``info``, ``warning``, ``error`` or ``critical``;
- ``logger``: the logger's name (``csi_pmem.rpc``, ``csi_pmem.loader.sidecar``);
- ``msg``: the message;
- then the record's fields: what the caller passed with ``extra=`` (the RPC log's
  ``rpc``, ``code``, ``seconds``, ``request``), and the entries of an ``extra={"fields":
  {...}}`` dict, for names a LogRecord reserves (the sidecar's events);
- ``exc``: the traceback, when the record has one.

Text mode is for humans: ``TIME LEVEL LOGGER: MESSAGE`` plus the fields as ``key=value``.
Standard library only: the sidecar runs in inference pods without the driver's
dependencies.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "fields"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The caller's fields of ``record``: its ``extra=`` attributes and ``fields`` dict."""
    found = {k: v for k, v in vars(record).items() if k not in _STD}
    found.update(getattr(record, "fields", None) or {})
    return found


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the keys in the module docstring."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        doc.update(record_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE key=value ...``; the RPC log's request as JSON."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.exc_info:  # the base class appended the traceback: fields go before it
            text, sep, tb = text.partition("\n")
        else:
            sep = tb = ""
        fields = getattr(record, "fields", None) or {}
        tail = " ".join(f"{k}={v}" for k, v in fields.items())
        request = getattr(record, "request", None)
        if request:
            tail += (" " if tail else "") + f"request={json.dumps(request, default=str)}"
        return text + (f" {tail}" if tail else "") + sep + tb


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``--log-format``: ``json`` or ``text``."""
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
