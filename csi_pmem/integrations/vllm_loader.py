"""The ``csi-pmem`` model loader vLLM runs in each worker (built against vLLM 0.32).

Why ``model.load_weights``: every vLLM model class maps checkpoint names onto its own
parameters (fused qkv and gate_up, renamed layers, tied embeddings) and each parameter's
weight loader slices the whole checkpoint tensor for its tensor-parallel rank. So this
loader only hands it ``(name, tensor)`` pairs, file by file in volume order, from
:func:`~csi_pmem.loader.start_load` on the CPU: views of the read-only mapping, no copy
and no read(); vLLM's weight loaders then copy each rank's slice into its parameters
(on a GPU, straight from the mapping). The staged checksums are checked beside the copy
(``handle.verified``) and a mismatch fails the start before anything is served.

Then, like vLLM's default loader (its ``track_weights_loading``) but for every
parameter of an unquantized model: a parameter the volume's checkpoint did not fill is
an error naming it, never a model serving random weights. Quantized models get vLLM's
own check, which knows which parameters a quantization builds itself.

What breaks across vLLM versions (why the ``vllm`` extra pins a range): the
``BaseModelLoader`` interface (``download_model(model_config)``,
``load_weights(model, model_config)``, ``__init__(load_config)``), the place of
``register_model_loader`` (``vllm.model_executor.model_loader``), and
``LoadConfig.model_loader_extra_config``; all as of vLLM 0.32.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from csi_pmem.integrations.vllm_settings import LOAD_FORMAT, Settings, settings
from csi_pmem.loader.api import LoadHandle, start_load
from csi_pmem.loader.auxfiles import read_aux
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.weights.errors import LoaderError

log = logging.getLogger(__name__)


class CsiPmemModelLoader(BaseModelLoader):
    """``--load-format csi-pmem``: the weights come from a csi-pmem volume."""

    def _settings(self, model_config: Any) -> Settings:
        return settings(self.load_config.model_loader_extra_config, model_config.model)

    def _open(self, model_config: Any) -> tuple[Settings, ModelView]:
        s = self._settings(model_config)
        return s, open_model(s.volume, s.model)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: check that the volume holds the model, and that the
        config vLLM read is the one staged with it (same bytes)."""
        s, view = self._open(model_config)
        try:
            _check_config(view, getattr(model_config, "hf_config_path", None)
                          or model_config.model)
        finally:
            view.volume.close()
        log.info("model %s on %s", view.model.label(), s.volume)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        s, view = self._open(model_config)
        handle = None
        try:
            _check_config(view, getattr(model_config, "hf_config_path", None)
                          or model_config.model)
            handle = start_load(view, "cpu", verify=s.verify)
            loaded = model.load_weights(_pairs(handle))
            handle.verified.result()  # ChecksumError: the volume copy is damaged
        finally:
            if handle is not None:
                handle.verified.exception()  # never unmap under the checksum threads
            view.volume.close()  # views still held keep the mapping until freed
        log.info("loaded %d tensors (%.2f GB) of model %s from %s%s", len(handle.tensors),
                 handle.nbytes / 1e9, view.model.label(), s.volume,
                 ", verified" if s.verify else "")
        _check_loaded(model, loaded, model_config, view)


def _pairs(handle: LoadHandle) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) as each file lands, in volume order."""
    for fut in handle.files.values():
        yield from fut.result().items()


def _check_config(view: ModelView, config_dir: str) -> None:
    path = os.path.join(config_dir, "config.json")
    if not os.path.isfile(path):
        log.warning("%s does not exist: cannot check that vLLM's config is the one staged "
                    "with model %s", path, view.model.label())
        return
    staged = read_aux(view, "config.json")
    with open(path, "rb") as f:
        if f.read() != staged:
            raise LoaderError(
                f"{path} is not the config.json staged with model {view.model.label()} on "
                f"{view.volume.source}: write the staged files with `csi-pmem-weights "
                f"export-config {view.volume.source} {config_dir}` and point "
                "--hf-config-path and --tokenizer there")


def _check_loaded(model: torch.nn.Module, loaded: set[str] | None, model_config: Any,
                  view: ModelView) -> None:
    if loaded is None:  # a model class that does not report what it loaded
        log.warning("%s does not report its loaded weights; not checked",
                    type(model).__name__)
        return
    if model_config.quantization is not None:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        DefaultModelLoader.track_weights_loading(None, model, set(loaded), quantized=True)
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more"
                                          if len(missing) > 8 else "")
        raise LoaderError(f"--load-format {LOAD_FORMAT}: model {view.model.label()} on "
                          f"{view.volume.source} has no tensor for {len(missing)} "
                          f"parameter(s) of {type(model).__name__}: {shown}; the staged "
                          "checkpoint does not match the model's config")
