"""A model source that is a directory: a PVC, an image volume, a host path, a download.

Why ``preadv`` straight into the destination: one copy, from the page cache into the
volume's mapping, with no intermediate buffer; ``preadv`` releases the GIL, so several
chunks copy in parallel on staging's threads.

Why each chunk's source pages are dropped from the page cache once copied
(``POSIX_FADV_DONTNEED``): the cache a read fills is charged to the reader's memory
cgroup, so a staging container with a small limit reading a model larger than it was
pushed to its limit (the cluster tier saw a 256Mi pod at exactly 256Mi while staging
1 GiB, reclaiming all the way), and the node's cache filled with a copy of a model that
the volume already holds. A source is read once; the hint is a no-op on tmpfs.
"""

from __future__ import annotations

import contextlib
import os

from csi_pmem.loader.sources.base import SourceChangedError, SourceError
from csi_pmem.weights.layout import KIND_AUX, KIND_SAFETENSORS, SourceFile
from csi_pmem.weights.stformat import read_header_file


def scan(src_dir: str) -> list[SourceFile]:
    """Every regular file under ``src_dir`` (symlinks followed, as in a Hugging Face
    snapshot), hidden names skipped; safetensors headers are validated up front."""
    if not os.path.isdir(src_dir):
        missing = "does not exist" if not os.path.exists(src_dir) else "is not a directory"
        raise SourceError(f"source {src_dir} {missing}")
    found = []
    for root, dirs, files in os.walk(src_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for fname in sorted(files):
            if fname.startswith("."):
                continue
            path = os.path.join(root, fname)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                if os.path.islink(path):  # a snapshot's link into a blob store
                    raise SourceError(
                        f"{path} is a symbolic link to {os.readlink(path)}, which does not "
                        "exist (in an image or a copied snapshot, links must be relative "
                        "and point inside it)") from None
                raise
            if not os.path.isfile(path):
                continue
            name = os.path.relpath(path, src_dir).replace(os.sep, "/")
            kind = KIND_SAFETENSORS if fname.endswith(".safetensors") else KIND_AUX
            if kind == KIND_SAFETENSORS:
                read_header_file(path)
            found.append(SourceFile(name, path, st.st_size, st.st_mtime_ns, kind))
    return found


class FileReader:
    """A source file, open once for every chunk of it."""

    def __init__(self, src: SourceFile):
        self.src = src
        self.fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)

    def readinto(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n <= 0:
                raise SourceChangedError(f"{self.src.path} became shorter while it was "
                                         "being staged")
            got += n
        with contextlib.suppress(OSError):  # a hint: a file system may not take it
            os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise SourceChangedError(f"{self.src.path} became shorter while it was read")
        return data

    def check_unchanged(self) -> None:
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != (self.src.size, self.src.mtime_ns):
            raise SourceChangedError(f"{self.src.path} changed while it was being staged; "
                                     "run stage again once the source is complete")

    def close(self) -> None:
        os.close(self.fd)
