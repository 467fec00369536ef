"""A rename that survives a power cut: fsync the directory that holds the new name.

Why one helper: the driver's state records and the loader's image files are both made
as a temp file, fsynced and renamed into place, and a rename is only durable once its
directory is fsynced too; without that a power cut can bring back the old name or no
name at all. Standard library only (the common layer): the driver and the pod-side
loader both use it.
"""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the directory ``path``, so that names created or renamed in it persist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
