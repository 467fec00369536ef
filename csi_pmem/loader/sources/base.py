"""What every model source gives staging: a list of files, and a reader per file.

Why one interface: staging (its copy, resume, repair and commit), the fingerprint and
the sidecar do the same things whatever the model comes from, so they only ever see
:class:`~csi_pmem.weights.layout.SourceFile` entries and the :class:`Reader` that
:func:`csi_pmem.loader.sources.open_file` opens for one. A source only lists and reads;
checksums, persistence and the index stay staging's.
"""

from __future__ import annotations

from typing import Protocol

from csi_pmem.weights.errors import LoaderError


class SourceError(LoaderError):
    """The model source is missing, empty, not valid safetensors, refused us, or changed
    while read; the message names the source and what to do."""


class SourceChangedError(SourceError):
    """A source file or object changed while it was being staged."""


class SourceUnreachableError(SourceError):
    """The source's server did not answer, after the retries (worth a retry later)."""


class Reader(Protocol):
    """Reads one source file. Threads share it: every call is independent."""

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` (exactly ``len(view)``),
        or raise :class:`SourceError` (a short file, a changed object)."""

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``."""

    def check_unchanged(self) -> None:
        """Raise :class:`SourceChangedError` if the file is no longer the one listed."""

    def close(self) -> None:
        """Release what the reader holds (a file descriptor)."""
