"""The ``csi-pmem`` model loader vLLM runs in each worker (built against vLLM 0.32).

Why ``model.load_weights``: every vLLM model class maps checkpoint names onto its own
parameters (fused qkv and gate_up, renamed layers, tied embeddings) and each parameter's
weight loader slices the whole checkpoint tensor for its tensor-parallel rank. So this
loader only hands it ``(name, tensor)`` pairs, in volume order. Which tensors:

- A rank alone on its GPU (tensor-parallel size 1, parameters on a CUDA device): CUDA
  tensors from :class:`~csi_pmem.loader.batches.BatchedLoad`, batch by batch, each
  batch through the path ``load_safetensors`` takes (the node's GPU copy service where
  the volume has ``gpu.sock``, else the in-pod pinned bounce), so vLLM's copies into
  its parameters are device-to-device and the load holds at most ``gpu_budget`` bytes
  of device memory beyond them (docs/inference.md has the measured speeds).
- One of several tensor-parallel ranks on GPUs: views of the volume that each rank's
  weight loaders narrow to their slice as usual, and whose ``copy_`` into the rank's
  parameter moves only the slice: through the node's GPU copy service where the volume
  has ``gpu.sock`` (a plain or 2D copy into a ring of a few slots within ``gpu_budget``,
  then a device copy on the server's stream: :mod:`csi_pmem.loader.gpu.rankslots`),
  else through pinned buffers (:mod:`csi_pmem.loader.gpu.slices`). A CUDA stream of
  whole tensors would make every rank read the whole model over its host link. Each
  rank checks a share of the staged chunks (``index % size == rank``), so the engine
  checks every chunk once and no rank hashes the whole model.
- Otherwise (vLLM's CPU build): zero-copy views of the volume on the CPU, from
  :func:`~csi_pmem.loader.start_load` (copy-on-write where the volume allows it,
  read-only on devdax: vLLM only copies from them).

The staged checksums are checked beside the copy and a mismatch fails the start before
anything is served. The log line says which path the load took.

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
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from csi_pmem.integrations.vllm_settings import LOAD_FORMAT, Settings, settings
from csi_pmem.loader.api import CPU_VIEW, LoadHandle, start_load, verify_share
from csi_pmem.loader.auxfiles import read_aux
from csi_pmem.loader.batches import BatchedLoad
from csi_pmem.loader.gpu import rankslots, slices
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.sizes import human_size
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
        started = time.monotonic()
        device = _device(model)
        rank, size = _rank() if device is not None else (0, 1)
        checks: Any = None
        try:
            _check_config(view, getattr(model_config, "hf_config_path", None)
                          or model_config.model)
            if size > 1:
                assert device is not None  # CPU ranks take CPU views
                copier, share = _rank_load(model, view, s, device, rank, size)
                checks = share
                loaded = copier.loaded
                if share is not None:
                    share.result()  # ChecksumError: this rank's chunks are damaged
                count, nbytes, path = copier.copies, copier.copied, copier.path
                where = copier.describe()
            elif device is not None:
                batched = BatchedLoad(view, str(device), budget=s.gpu_budget,
                                      verify=s.verify)
                checks = batched
                loaded = model.load_weights(iter(batched))
                batched.verified()  # ChecksumError: the volume copy is damaged
                count, nbytes, path = (sum(len(b) for b in batched.batches),
                                       batched.nbytes, batched.path)
                where = (f"{device} (batches of up to {human_size(batched.limit)}, "
                         f"at most {human_size(batched.bound)} held)")
            else:
                # vLLM's weight loaders copy from these tensors into its own
                # parameters: zero-copy views, private where the volume allows it, and
                # read-only on devdax rather than a second copy of the model in RAM.
                writes = "private" if view.volume.private_refused_reason is None \
                    else "readonly"
                handle = start_load(view, "cpu", verify=s.verify, writes=writes)
                checks = handle
                loaded = model.load_weights(_pairs(handle))
                handle.verified.result()  # ChecksumError: the volume copy is damaged
                count, nbytes, path = len(handle.tensors), handle.nbytes, CPU_VIEW
                where = "the CPU (views of the mapping; vLLM copies each rank's slice)"
        finally:
            _settle(checks)  # never unmap under the checksum threads
            view.volume.close()  # views still held keep the mapping until freed
        seconds = time.monotonic() - started
        log.info("loaded %d tensors (%.2f GB) of model %s from %s to %s in %.2f s "
                 "(%.1f GB/s, %s path%s)", count, nbytes / 1e9, view.model.label(),
                 s.volume, where, seconds, nbytes / 1e9 / max(seconds, 1e-9), path,
                 ", verified" if s.verify else "")
        _check_loaded(model, loaded, model_config, view)


def _device(model: torch.nn.Module) -> torch.device | None:
    """The parameters' CUDA device, or None when they are on the CPU (vLLM's CPU build:
    CPU views)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    index = param.device.index
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def _rank() -> tuple[int, int]:
    """(rank, size) of this worker's tensor-parallel group; (0, 1) alone."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no parallel state: a model built outside an engine
        return 0, 1


def _rank_load(model: torch.nn.Module, view: ModelView, s: Settings, device: torch.device,
               rank: int, size: int) -> tuple[slices.RankCopier, Future[Any] | None]:
    """One rank's load: its weight loaders cut the views, the copier moves the slices."""
    share = verify_share(view, rank, size) if s.verify else None
    writes = "private" if view.volume.private_refused_reason is None else "readonly"
    handle = start_load(view, "cpu", verify=False, writes=writes)
    copier = rankslots.rank_copier(view.volume, device, rank, size, writes, s.gpu_budget)
    try:
        with slices.active(copier):
            copier.loaded = model.load_weights(
                (name, slices.wrap(t)) for name, t in _pairs(handle))
    except BaseException:
        if share is not None:
            share.exception()  # the caller unmaps the volume: not under the hashing
        raise
    finally:
        copier.finish()
    return copier, share


def _settle(checks: Any) -> None:
    if isinstance(checks, BatchedLoad):
        checks.settle()
    elif isinstance(checks, Future):
        checks.exception()
    elif checks is not None:
        checks.verified.exception()


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
