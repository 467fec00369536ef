"""The wanted revision: ``--revision``, or the fingerprint of the source tree.

Why the fingerprint is not computed here: ``csi-pmem-weights stage`` records the same
one (:mod:`csi_pmem.loader.fingerprint`) when it is given no ``--revision``, so a model
staged by either is found staged by the other. What the sample reads and what it misses:
the package docstring, :mod:`csi_pmem.loader.sidecar`.
"""

from __future__ import annotations

from csi_pmem.loader.fingerprint import FINGERPRINTS, fingerprint
from csi_pmem.weights.layout import SourceFile

__all__ = ["FINGERPRINTS", "fingerprint", "wanted"]


def wanted(given: str | None, sources: list[SourceFile], mode: str,
           threads: int | None = None) -> tuple[str, str]:
    """(the revision to stage, where it came from: what ``/status`` shows)."""
    if given:
        return given, "--revision"
    return fingerprint(sources, mode, threads), f"fingerprint ({mode})"
