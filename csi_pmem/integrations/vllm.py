"""vLLM's ``--load-format csi-pmem``: the plugin entry point.

Why a load format: vLLM's own loaders read safetensors files from ``--model``; a
csi-pmem volume holds one mapping with an index instead. vLLM lets an installed package
add a format through the ``vllm.general_plugins`` entry point (pyproject.toml), which
vLLM calls in every process it starts, before it parses a model; :func:`register`
then registers :class:`~csi_pmem.integrations.vllm_loader.CsiPmemModelLoader`.

The format's settings (volume, model, verify) are read by the loader, from
:mod:`csi_pmem.integrations.vllm_settings` (docs/inference.md).

This module imports no vLLM at import time: it is what the entry point names, which
vLLM imports in each of its processes. The loader, which needs vLLM and torch, is
imported by :func:`register` only, and it never imports this module back: what both
need (the format's name) is in ``vllm_settings``.
"""

from __future__ import annotations

from csi_pmem.integrations.vllm_settings import LOAD_FORMAT

__all__ = ["LOAD_FORMAT", "register"]

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``csi-pmem`` load format
    (once per process; vLLM calls plugins again in each process it starts)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from csi_pmem.integrations.vllm_loader import CsiPmemModelLoader

    register_model_loader(LOAD_FORMAT)(CsiPmemModelLoader)
    _registered = True
