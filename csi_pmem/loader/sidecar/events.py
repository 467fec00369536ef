"""The sidecar's log events and the one error class of its own.

Why a module: every job of the sidecar (lock, space, staging, probes, the process) says
what it does as an event, a message plus machine-readable fields on the one logger
``csi_pmem.loader.sidecar``; the JSON format is the project's (:mod:`csi_pmem.logs`).
"""

from __future__ import annotations

import logging
from typing import Any

from csi_pmem.weights.errors import LoaderError

log = logging.getLogger("csi_pmem.loader.sidecar")


class SourceError(LoaderError):
    """The model source is missing, empty or not valid safetensors."""


def event(msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """One log line: a message plus machine-readable fields (JSON mode shows both)."""
    log.log(level, msg, extra={"fields": fields})
