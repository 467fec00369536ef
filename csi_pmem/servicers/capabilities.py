"""Validation of CSI volume capabilities, shared by the controller and node services.

Why shared: CreateVolume, ValidateVolumeCapabilities and NodePublishVolume must refuse
the same things with the same words, above all a Block access type on a devdax class
(DESIGN.md 1.1: kubelet loop-attaches every block volume and loop rejects character
devices, so the pod would hang in ContainerCreating forever).
"""

from __future__ import annotations

from csi_pmem.csi import csi_pb2
from csi_pmem.errors import InvalidArgument

Mode = csi_pb2.VolumeCapability.AccessMode
SUPPORTED_MODES = {Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_READER_ONLY,
                   Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER}
READ_ONLY_MODES = {Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY}
BLOCK_ON_DEVDAX = (
    "volumeMode: Block is not possible for a devdax volume: kubelet attaches every block "
    "volume to a loop device and the loop driver rejects the devdax character device, so "
    "the pod would never start. Use volumeMode: Filesystem (the default): the volume "
    "directory holds volume.json and dax.sock, which hands the pod the open device")


def problem(cap: csi_pb2.VolumeCapability) -> str | None:
    """Why ``cap`` cannot be served, or None when it can."""
    kind = cap.WhichOneof("access_type")
    if kind is None:
        return "volume capability needs an access type (mount)"
    if kind == "block":
        return BLOCK_ON_DEVDAX
    if cap.mount.fs_type not in ("", "devdax"):
        return (f"fsType {cap.mount.fs_type!r} does not apply to devdax volumes (there is no "
                "file system on the device); leave fsType empty")
    if cap.access_mode.mode == Mode.UNKNOWN:
        return "volume capability needs an access mode"
    if cap.access_mode.mode not in SUPPORTED_MODES:
        name = mode_name(cap)
        return (f"access mode {name} is not supported: a persistent-memory volume lives on one "
                "node; use ReadWriteOnce or ReadWriteOncePod")
    return None


def require_valid(caps) -> None:
    if not caps:
        raise InvalidArgument("volume_capabilities are required")
    for cap in caps:
        why = problem(cap)
        if why:
            raise InvalidArgument(why)


def mode_name(cap: csi_pb2.VolumeCapability) -> str:
    # proto3 enums are open: a newer CO can send a mode this proto does not name.
    mode = cap.access_mode.mode
    return Mode.Mode.Name(mode) if mode in Mode.Mode.values() else f"{mode} (unknown)"
