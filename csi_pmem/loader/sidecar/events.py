"""The sidecar's log events, and the error class of a bad source.

Why a module: every job of the sidecar (lock, space, staging, probes, the process) says
what it does as an event, a message plus machine-readable fields on the one logger
``csi_pmem.loader.sidecar``; the JSON format is the project's (:mod:`csi_pmem.logs`).
"""

from __future__ import annotations

import logging
from typing import Any

# The source's own error, raised by staging and the fingerprint too; re-exported.
from csi_pmem.loader.sources import SourceError

__all__ = ["SourceError", "event", "log"]

log = logging.getLogger("csi_pmem.loader.sidecar")


def event(msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """One log line: a message plus machine-readable fields (JSON mode shows both)."""
    log.log(level, msg, extra={"fields": fields})
