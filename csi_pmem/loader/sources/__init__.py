"""Where a model is staged from: a directory, or an S3-compatible object store.

A directory is whatever the pod mounts: a read-only PVC, a Kubernetes image volume
(an OCI image of the model files), a host path. ``s3://bucket/prefix/`` is read with
boto3 (:mod:`.s3`), imported only when such a source is used, so the loader keeps
importing without it.

Every caller (staging, repair, the fingerprint, the sidecar) uses :func:`scan` and
:func:`open_file`, which pick the source kind from the location's form: staging's
resume, checksums and commit are the same for both.
"""

from __future__ import annotations

import os

from csi_pmem.loader.sources.base import (
    Reader,
    SourceChangedError,
    SourceError,
    SourceUnreachableError,
)
from csi_pmem.weights.layout import SourceFile

__all__ = ["Reader", "SourceChangedError", "SourceError", "SourceUnreachableError",
           "check_location", "default_name", "default_threads", "is_s3", "open_file",
           "scan"]

S3_SCHEME = "s3://"


def is_s3(location: str) -> bool:
    return location.startswith(S3_SCHEME)


def check_location(location: str) -> str:
    """``location`` when its form is valid (an ``s3://`` URL names a bucket), else
    :class:`SourceError` saying how to write it; reads nothing."""
    if is_s3(location) or location.lower().startswith("s3:"):
        from csi_pmem.loader.sources import s3

        s3.split(location)
    return location


def scan(location: str) -> list[SourceFile]:
    """The files of the source at ``location`` (not yet checked for a model)."""
    if is_s3(location):
        from csi_pmem.loader.sources import s3

        return s3.scan(location)
    from csi_pmem.loader.sources import local

    return local.scan(location)


def open_file(src: SourceFile) -> Reader:
    """A reader for one listed file; close it when done."""
    if is_s3(src.path):
        from csi_pmem.loader.sources import s3

        return s3.ObjectReader(src)
    from csi_pmem.loader.sources import local

    return local.FileReader(src)


def default_name(location: str) -> str:
    """The model name when none is given: the directory's name, or the prefix's last
    component (the bucket's name for a whole bucket)."""
    if is_s3(location):
        parts = [p for p in location[len(S3_SCHEME):].split("/") if p]
        return parts[-1] if parts else location
    return os.path.basename(os.path.normpath(location))


def default_threads(location: str, cores: int) -> int:
    """Copy threads: one per core for files (the copy is a memory copy), a fixed 16 for
    an object store (each thread mostly waits for the network; more GETs in flight than
    that gain little from one client, whatever the node's core count)."""
    if is_s3(location):
        from csi_pmem.loader.sources import s3

        return s3.THREADS
    return cores
