"""The node side of volumes: one publisher per device mode, behind one interface.

Why: a devdax volume reaches a pod as a directory with ``dax.sock`` (:mod:`.devdax`), an
fsdax volume as a block device or a mounted file system (:mod:`.fsdax`); everything
else about a node operation is shared and lives in :class:`csi_pmem.driver.core.Driver`,
which applies it once before dispatching: target path checks, the volume's in-flight
slot, the access-mode policy (one writer for SINGLE_NODE_SINGLE_WRITER) and marking a
publication as being unpublished. A reader finds each mode's whole story in its module.
"""

from __future__ import annotations

from typing import Protocol

from csi_pmem.driver.host.filesystems import Usage
from csi_pmem.driver.node.access import Access, PublishRequest
from csi_pmem.driver.state import VolumeRecord


class NodePublisher(Protocol):
    def stage(self, rec: VolumeRecord, path: str, access: Access) -> None: ...

    def unstage(self, rec: VolumeRecord, path: str) -> None: ...

    def publish(self, rec: VolumeRecord, request: PublishRequest) -> None:
        """Publish ``rec`` as ``request`` asks; the core already applied the shared policy
        and cleared ``request.staging`` unless the volume is fsdax."""

    def owns(self, rec: VolumeRecord, target: str) -> bool:
        """Whether ``target`` is (or was being made) a publication of ``rec`` here."""

    def unpublish(self, rec: VolumeRecord, target: str) -> None: ...

    def usage(self, rec: VolumeRecord, path: str) -> Usage | None:
        """File system usage at ``path``; None for a raw device (reported whole)."""

    def reconcile(self, rec: VolumeRecord) -> None:
        """Finish, re-serve or drop what a restart or crash left of ``rec``'s stages and
        publications, trusting mountinfo."""


__all__ = ["Access", "NodePublisher", "PublishRequest"]
