"""Fail points: let crash-safety tests kill the driver between two steps.

Why in the product: the only honest test of "a SIGKILL between writing the record and
calling ndctl loses nothing" is to SIGKILL the real process at that exact point. The
points are named in ``CSI_PMEM_FAILPOINTS`` (comma separated); when unset, ``hit`` is a
dictionary lookup and nothing else.
"""

from __future__ import annotations

import os
import signal

_ACTIVE = frozenset(p.strip() for p in os.environ.get("CSI_PMEM_FAILPOINTS", "").split(",")
                    if p.strip())

CREATE_AFTER_RECORD = "create-after-record"
CREATE_AFTER_NAMESPACE = "create-after-namespace"
DELETE_AFTER_RECORD = "delete-after-record"
DELETE_AFTER_ERASE = "delete-after-erase"
DELETE_AFTER_DESTROY = "delete-after-destroy"
PUBLISH_AFTER_RECORD = "publish-after-record"
PUBLISH_AFTER_MOUNT = "publish-after-mount"
PUBLISH_AFTER_SOCKET = "publish-after-socket"
UNPUBLISH_AFTER_UMOUNT = "unpublish-after-umount"
STAGE_AFTER_MKFS = "stage-after-mkfs"
ALL = (CREATE_AFTER_RECORD, CREATE_AFTER_NAMESPACE, DELETE_AFTER_RECORD, DELETE_AFTER_ERASE,
       DELETE_AFTER_DESTROY, PUBLISH_AFTER_RECORD, PUBLISH_AFTER_MOUNT, PUBLISH_AFTER_SOCKET,
       UNPUBLISH_AFTER_UMOUNT)
# Fail points on the fsdax paths (tested by the fsdax crash tests, not the devdax ones).
FSDAX = (STAGE_AFTER_MKFS, PUBLISH_AFTER_RECORD, PUBLISH_AFTER_MOUNT, UNPUBLISH_AFTER_UMOUNT)


def hit(name: str) -> None:
    """SIGKILL this process if fail point ``name`` is active."""
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
