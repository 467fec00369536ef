"""What a NodeStage/NodePublish request asks of a volume, once the servicer checked it.

Why: the servicer reads the CSI request (its VolumeCapability, volume context and
paths) once and hands the layers below one checked value each, instead of loose
parameters that every level lists in its own order: :class:`Access` for a stage,
:class:`PublishRequest` for a publish.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Access:
    """What a NodeStage/NodePublish request asks for, already validated."""

    kind: str  # BLOCK or MOUNT
    fs_type: str = ""
    mount_flags: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PublishRequest:
    """One NodePublishVolume request, validated by the servicer.

    Why one value: the core applies the shared policy to it (target paths, the single
    writer, the staging path, normalising with :func:`dataclasses.replace`) and hands it
    on whole to the device mode's publisher, which reads what it needs; a parameter added
    here reaches every level without a signature changing at each. Keyword-only, so no
    caller depends on an order.

    ``access`` is always present: the servicer builds it from the request's
    VolumeCapability, which CSI requires, so no publisher has to ask for it. An fsdax
    publication reads it to choose between a block device and a file system, and a file
    system also needs ``staging`` (the core clears it for every other volume); a devdax
    publication is the same tmpfs whatever it says.
    """

    target: str  # target_path, checked by the core
    readonly: bool  # the request's readonly, or a read-only access mode
    access: Access
    staging: str = ""  # staging_target_path: only an fsdax file system reads it
    mount_group: int | None = None  # volume_mount_group, a numeric gid
    pod_uid: str | None = None  # csi.storage.k8s.io/pod.uid, None when kubelet sent none
    access_mode: str = ""  # the VolumeCapability's access mode, e.g. SINGLE_NODE_WRITER
