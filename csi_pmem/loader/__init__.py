"""Zero-copy weight loading from csi-pmem volumes.

Why: the point of a PMEM (or other DAX) volume in an inference pod is to move model
weights to the GPU as fast as the host link allows, with no read()+malloc copies, and
to keep them resident on the node across pod restarts. This package stages safetensors
models onto a volume (:mod:`.staging`, with a checksummed index: :mod:`.layout`), maps
the volume however it reaches the pod (:mod:`.volume`), and loads tensors as views of
the mapping (CPU) or through pinned bounce buffers / a registered mapping (GPU,
:mod:`.gpu`). torch and numpy are imported only when a path needs them.

    from csi_pmem.loader import load_safetensors, open_volume
    vol = open_volume("/models")                  # the pod's mount of the PVC
    weights = load_safetensors(vol, device="cuda:0")

Servers: :func:`load_transformers` builds a transformers model from the staged config
and adopts the weights (:mod:`.transformers`); vLLM gets ``--load-format csi-pmem``
(:mod:`csi_pmem.integrations.vllm`); :func:`export_config` writes the staged config and
tokenizer files to a directory (docs/inference.md).
"""

from csi_pmem.loader.api import (
    LoadHandle,
    default_loader,
    load_numpy,
    load_safetensors,
    start_load,
)
from csi_pmem.loader.auxfiles import export_config, read_aux
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.loader.staging import export, stage, verify
from csi_pmem.loader.transformers import build_on_meta, fill_transformers, load_transformers
from csi_pmem.weights.errors import (
    AlignmentError,
    ChecksumError,
    LayoutError,
    LoaderError,
    NoModelError,
    ReadOnlyVolumeError,
    SafetensorsFormatError,
    VolumeError,
    VolumeTooSmallError,
)
from csi_pmem.weights.volume import Volume, open_volume

__all__ = [
    "AlignmentError", "ChecksumError", "LayoutError", "LoadHandle", "LoaderError",
    "ModelView", "NoModelError", "ReadOnlyVolumeError", "SafetensorsFormatError", "Volume",
    "VolumeError", "VolumeTooSmallError", "build_on_meta", "default_loader", "export",
    "export_config", "fill_transformers", "load_numpy", "load_safetensors",
    "load_transformers", "open_model", "open_volume", "read_aux", "stage", "start_load",
    "verify",
]
