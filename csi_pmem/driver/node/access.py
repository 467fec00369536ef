"""What a NodeStage/NodePublish request asks of a volume, once the servicer checked it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Access:
    """What a NodeStage/NodePublish request asks for, already validated."""

    kind: str  # BLOCK or MOUNT
    fs_type: str = ""
    mount_flags: tuple[str, ...] = ()
