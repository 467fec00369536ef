"""Validation of CSI volume capabilities, shared by the controller and node services.

Why shared: CreateVolume, ValidateVolumeCapabilities, GetCapacity, NodeStageVolume and
NodePublishVolume must refuse the same things with the same words, above all a Block
access type on a devdax class (docs/design.md §1: kubelet loop-attaches every block volume
and loop rejects character devices, so the pod would hang in ContainerCreating forever).
What is valid depends on the device mode: fsdax volumes are block devices and take
Block, or a Filesystem access type with ext4 or xfs.
"""

from __future__ import annotations

from csi_pmem.csi import csi_pb2
from csi_pmem.driver.host import filesystems
from csi_pmem.driver.params import DEVDAX, FSDAX
from csi_pmem.errors import InvalidArgument

Mode = csi_pb2.VolumeCapability.AccessMode
SUPPORTED_MODES = {Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_READER_ONLY,
                   Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER}
READ_ONLY_MODES = {Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY}
BLOCK_ON_DEVDAX = (
    "volumeMode: Block is not possible for a devdax volume: kubelet attaches every block "
    "volume to a loop device and the loop driver rejects the devdax character device, so "
    "the pod would never start. Use volumeMode: Filesystem (the default): the volume "
    "directory holds volume.json and dax.sock, which hands the pod the open device; or "
    "use a StorageClass with deviceMode: fsdax for a raw block device")
FSDAX_FS_TYPES = ("ext4", "xfs")
DEFAULT_FS_TYPE = filesystems.DEFAULT_FS_TYPE


def fs_type(cap: csi_pb2.VolumeCapability) -> str:
    """The file system an fsdax mount capability asks for (ext4 when unset)."""
    return cap.mount.fs_type or DEFAULT_FS_TYPE


def named_fs_type(caps: list[csi_pb2.VolumeCapability]) -> str:
    """The file system CreateVolume's mount capabilities name ("" when none does);
    two different ones are INVALID_ARGUMENT: one volume holds one file system."""
    named = sorted({c.mount.fs_type for c in caps if c.HasField("mount") and c.mount.fs_type})
    if len(named) > 1:
        raise InvalidArgument(f"volume_capabilities name different file systems "
                              f"({', '.join(named)}); a volume holds one")
    return named[0] if named else ""


def problem(cap: csi_pb2.VolumeCapability, device_mode: str = DEVDAX) -> str | None:
    """Why ``cap`` cannot be served on a ``device_mode`` volume, or None when it can."""
    kind = cap.WhichOneof("access_type")
    if kind is None:
        return "volume capability needs an access type (mount or block)"
    if device_mode == FSDAX:
        if kind == "mount" and fs_type(cap) not in FSDAX_FS_TYPES:
            return (f"fsType {cap.mount.fs_type!r} is not supported for fsdax volumes: use "
                    f"{' or '.join(FSDAX_FS_TYPES)} (file systems that can be mounted with "
                    "-o dax), or volumeMode: Block for the raw device")
    elif kind == "block":
        return BLOCK_ON_DEVDAX
    elif cap.mount.fs_type not in ("", "devdax"):
        return (f"fsType {cap.mount.fs_type!r} does not apply to devdax volumes (there is no "
                "file system on the device); leave fsType empty, or use a StorageClass with "
                "deviceMode: fsdax for ext4/xfs with -o dax")
    if cap.access_mode.mode == Mode.UNKNOWN:
        return "volume capability needs an access mode"
    if cap.access_mode.mode not in SUPPORTED_MODES:
        name = mode_name(cap)
        return (f"access mode {name} is not supported: a persistent-memory volume lives on one "
                "node; use ReadWriteOnce or ReadWriteOncePod")
    return None


def require_valid(caps, device_mode: str = DEVDAX) -> None:
    if not caps:
        raise InvalidArgument("volume_capabilities are required")
    for cap in caps:
        why = problem(cap, device_mode)
        if why:
            raise InvalidArgument(why)


def mode_name(cap: csi_pb2.VolumeCapability) -> str:
    # proto3 enums are open: a newer CO can send a mode this proto does not name.
    mode = cap.access_mode.mode
    return Mode.Mode.Name(mode) if mode in Mode.Mode.values() else f"{mode} (unknown)"
