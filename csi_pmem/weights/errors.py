"""Errors of the weight loader, one class per thing a user can act on.

Why not :mod:`csi_pmem.errors`: those classes are the driver's, one per gRPC status a CO
acts on; a loader user (an inference pod, ``csi-pmem-weights``) acts on other things
(a volume too small, a model not committed, a checksum). Every message says what is
wrong and what to do; the CLI prints ``str(e)`` and exits non-zero.
"""

from __future__ import annotations


class LoaderError(Exception):
    """Base of every error the loader raises on purpose."""


class VolumeError(LoaderError):
    """The volume cannot be opened or mapped as asked."""


class ReadOnlyVolumeError(VolumeError):
    """A write (staging) was asked of a volume that is published or opened read-only."""


class AlignmentError(VolumeError):
    """A size or offset breaks the devdax alignment rules (docs/design.md §3)."""


class LayoutError(LoaderError):
    """The on-volume index is missing, corrupt, truncated or inconsistent."""


class NoModelError(LayoutError):
    """The volume holds no committed model (never staged, or staging was interrupted)."""


class ChecksumError(LoaderError):
    """Data on the volume does not match the checksums recorded when it was staged."""


class VolumeTooSmallError(LoaderError):
    """The model does not fit in the volume; carries the bytes needed and available."""

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available


class SafetensorsFormatError(LoaderError):
    """A safetensors file (source or staged) is not well formed."""

