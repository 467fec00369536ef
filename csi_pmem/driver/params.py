"""StorageClass parameters: the one place that knows their names, values and defaults.

Why a module: CreateVolume, GetCapacity and ValidateVolumeCapabilities all receive the
same parameter map and must agree on what it means. Unknown keys are refused (a typo
in a StorageClass should fail loudly, not silently give a default), except keys with
the ``csi.storage.k8s.io/`` prefix that external-provisioner adds (PVC name and
namespace), which are kept for labels and logs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import DEVDAX_ALIGNS, format_bytes

DEVICE_MODE = "deviceMode"
NUMA_NODE = "numaNode"
ALIGN = "align"
ERASE_ON_DELETE = "eraseOnDelete"
MEDIA = "media"
VALID_KEYS = (DEVICE_MODE, NUMA_NODE, ALIGN, ERASE_ON_DELETE, MEDIA)
# What a node restart may do to the volume's pool (backends.base.Pool.media): persistent
# (NVDIMM, CXL pmem: contents survive), volatile (soft-reserved, CXL ram, memory-backed
# emulated pools: the volume comes back empty), or any pool.
MEDIA_ANY = "any"
MEDIA_VALUES = ("persistent", "volatile", MEDIA_ANY)
DEVDAX, FSDAX = "devdax", "fsdax"
DEVICE_MODES = (DEVDAX, FSDAX)
# Keys that only mean something for one device mode: a class that sets them for the
# other mode is a mistake worth an error, not a silently ignored setting.
DEVDAX_ONLY = (ALIGN,)
# fsdax namespaces use the kernel's default PMD alignment: file systems with -o dax map
# huge pages when extents are 2 MiB aligned, and 1 GiB is not supported for fsdax.
FSDAX_ALIGN = DEVDAX_ALIGNS["2Mi"]
CO_PREFIX = "csi.storage.k8s.io/"
_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


@dataclass(frozen=True)
class VolumeParams:
    """Resolved parameters of one volume or StorageClass."""

    device_mode: str = DEVDAX
    numa_node: int | None = None  # None means "auto": the driver picks the pool
    align: int = DEVDAX_ALIGNS["2Mi"]
    erase_on_delete: bool = True
    media: str = MEDIA_ANY
    co_labels: Mapping[str, str] = field(default_factory=dict, compare=False)

    def accepts_media(self, media: str) -> bool:
        """Whether a pool of ``media`` (persistent or volatile) may hold this volume."""
        return self.media == MEDIA_ANY or self.media == media

    def compatible_with(self, stored: Mapping[str, str], numa_node: int | None,
                        media: str | None = None) -> list[str]:
        """How a volume created with the parameters ``stored`` (its record's map) and
        placed on ``numa_node`` differs from these; empty when it satisfies them.

        Why one rule: CreateVolume's idempotency check and ValidateVolumeCapabilities
        must agree. ``numaNode: auto`` accepts any node; a number must be the node the
        volume is on (also when it was created with auto and landed there). ``media``
        likewise: ``any`` accepts any; a kind must be the media of the volume's pool
        (``media``, when the caller knows it), else the one its class asked for.
        """
        want = self.to_dict()
        have: dict[str, str | None] = dict(stored)
        have[NUMA_NODE] = have.get(NUMA_NODE) if numa_node is None else str(numa_node)
        if self.numa_node is None:
            want.pop(NUMA_NODE)
        if self.media == MEDIA_ANY:
            want.pop(MEDIA, None)
        elif media is not None:
            have[MEDIA] = media
        return [f"{k}: the volume's {have.get(k)!r}, requested {v!r}"
                for k, v in want.items() if have.get(k) != v]

    def to_dict(self) -> dict:
        out = {
            DEVICE_MODE: self.device_mode,
            NUMA_NODE: "auto" if self.numa_node is None else str(self.numa_node),
            ALIGN: format_bytes(self.align),
            ERASE_ON_DELETE: "true" if self.erase_on_delete else "false",
        }
        if self.media != MEDIA_ANY:  # records of "any" volumes stay as they always were
            out[MEDIA] = self.media
        return out


def parse(parameters: Mapping[str, str]) -> VolumeParams:
    """Validate a StorageClass parameter map; raise InvalidArgument naming the fix."""
    unknown = sorted(k for k in parameters if k not in VALID_KEYS and not k.startswith(CO_PREFIX))
    if unknown:
        raise InvalidArgument(
            f"unknown StorageClass parameter(s) {', '.join(map(repr, unknown))}; "
            f"valid parameters are {', '.join(VALID_KEYS)}")
    mode = parameters.get(DEVICE_MODE, DEVDAX)
    if mode not in DEVICE_MODES:
        raise InvalidArgument(
            f"invalid deviceMode {mode!r}; valid values: devdax (a character device handed "
            "out through dax.sock) or fsdax (a block device: volumeMode Block, or ext4/xfs "
            "mounted with -o dax)")
    if mode == FSDAX:
        misplaced = [k for k in DEVDAX_ONLY if k in parameters]
        if misplaced:
            raise InvalidArgument(
                f"parameter(s) {', '.join(misplaced)} apply to deviceMode devdax only; "
                "fsdax volumes always use the 2Mi alignment: remove them from the "
                "StorageClass")
        align = FSDAX_ALIGN
    else:
        align = _align(parameters.get(ALIGN, "2Mi"))
    return VolumeParams(
        device_mode=mode,
        numa_node=_numa(parameters.get(NUMA_NODE, "auto")),
        align=align,
        erase_on_delete=_bool(ERASE_ON_DELETE, parameters.get(ERASE_ON_DELETE, "true")),
        media=_media(parameters.get(MEDIA, MEDIA_ANY)),
        co_labels={k: v for k, v in parameters.items() if k.startswith(CO_PREFIX)},
    )


def _numa(value: str) -> int | None:
    text = str(value).strip()
    if text.lower() == "auto":
        return None
    if not text.isdecimal() or not text.isascii():
        raise InvalidArgument(
            f"invalid numaNode {value!r}: use 'auto' or a non-negative integer such as \"0\"")
    # Any non-negative integer is well-formed: a node this node lacks is no error of the
    # class (GetCapacity 0, CreateVolume RESOURCE_EXHAUSTED). Only absurd lengths are
    # refused, before int() would (it rejects strings of thousands of digits).
    digits = text.lstrip("0") or "0"
    if len(digits) > 18:
        raise InvalidArgument(f"invalid numaNode {value!r}: out of range for a NUMA node id")
    return int(digits)


def _media(value: str) -> str:
    text = str(value).strip().lower()
    if text not in MEDIA_VALUES:
        raise InvalidArgument(
            f"invalid media {value!r}: use persistent (NVDIMM or CXL persistent memory: "
            "contents survive a node restart), volatile (soft-reserved or CXL volatile "
            "memory, memory-backed emulated pools: the volume comes back empty after a "
            "node restart) or any (the default)")
    return text


def _align(value: str) -> int:
    text = str(value).strip()
    if text not in DEVDAX_ALIGNS:
        raise InvalidArgument(
            f"invalid align {value!r}: devdax volumes support {' or '.join(DEVDAX_ALIGNS)}")
    return DEVDAX_ALIGNS[text]


def _bool(key: str, value: str) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"invalid {key} {value!r}: use \"true\" or \"false\"")
