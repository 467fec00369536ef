"""Hugging Face transformers models whose parameters are the tensors loaded from the volume.

Why in the package: every server built on transformers needs the same three steps, and
each has a trap. The model is built from the ``config.json`` staged with the weights
(same revision, no second mount) on the ``meta`` device, so building it allocates
nothing; ``load_state_dict(assign=True)`` then adopts the loaded tensors as the
parameters (CPU: views of the read-only mapping, no copy at all; GPU: the loader's
copies, no second one). The traps:

- Tied weights: a checkpoint of a model with ``tie_word_embeddings`` omits
  ``lm_head.weight``; ``tie_weights`` shares the embedding, as ``from_pretrained`` does.
- Non-persistent buffers (the rotary embedding's ``inv_freq``, ``position_ids``) are in
  no checkpoint, so they stay on ``meta`` and the first forward fails. They are
  materialized on the CPU and initialized by the model's own ``_init_weights`` (the
  path ``from_pretrained`` takes in transformers 5), with every loaded tensor marked
  initialized so that nothing writes into the mapping.
- Anything still on ``meta`` after that is a checkpoint that does not match the
  architecture: a :class:`LoaderError` naming it, not a failure at the first request.

CPU-loaded parameters are read-only views: the model is for inference (a write faults).

    from csi_pmem.loader import load_transformers
    model = load_transformers("/models", device="cuda:0")
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
from typing import Any

from csi_pmem.loader.api import default_loader, start_load
from csi_pmem.loader.auxfiles import read_aux
from csi_pmem.loader.model import ModelView, open_model
from csi_pmem.weights.errors import LoaderError
from csi_pmem.weights.volume import Volume

log = logging.getLogger(__name__)


def _import_transformers() -> Any:
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        raise LoaderError(f"the transformers fill needs torch and transformers ({exc}); "
                          "pip install 'csi-pmem[torch]' transformers") from exc
    return transformers


def config_from_dict(config: dict[str, Any]) -> Any:
    """A ``PretrainedConfig`` from a parsed ``config.json``, as ``from_pretrained`` reads it."""
    transformers = _import_transformers()
    model_type = config.get("model_type")
    try:
        cls = transformers.AutoConfig.for_model(model_type).__class__
    except (ValueError, KeyError) as exc:
        raise LoaderError(f"config.json names model_type {model_type!r}, which this "
                          f"transformers {transformers.__version__} does not know") from exc
    return cls.from_dict(config)


def build_on_meta(config: Any, auto_class: Any = None) -> Any:
    """The model for ``config`` (a ``PretrainedConfig`` or a ``config.json`` dict), its
    parameters on the meta device (no memory); ``auto_class`` defaults to
    ``AutoModelForCausalLM``."""
    import torch

    transformers = _import_transformers()
    if isinstance(config, dict):
        config = config_from_dict(config)
    with torch.device("meta"):
        return (auto_class or transformers.AutoModelForCausalLM).from_config(config)


def fill_transformers(model: Any, weights: dict[str, Any]) -> Any:
    """Adopt ``weights`` (``{checkpoint name: tensor}``) as the parameters of ``model``
    (built by :func:`build_on_meta`), tie its weights, materialize the buffers no
    checkpoint holds; returns it in eval mode. Raises :class:`LoaderError` naming the
    parameters the checkpoint lacks."""
    import torch

    with torch.no_grad():
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if "missing_keys" in inspect.signature(model.tie_weights).parameters:
        # transformers 5: tie symmetrically, as from_pretrained does (the one present
        # in the checkpoint becomes the shared tensor).
        model.tie_weights(missing_keys=set(missing))
    else:
        model.tie_weights()
    still = [n for n, p in model.named_parameters() if p.is_meta]
    if still:
        shown = ", ".join(still[:5]) + (f" and {len(still) - 5} more" if len(still) > 5 else "")
        raise LoaderError(f"the checkpoint does not match {type(model).__name__}: no tensor "
                          f"for {shown}" + (f" (it has unexpected {', '.join(unexpected[:5])})"
                                            if unexpected else ""))
    if unexpected:
        log.warning("checkpoint tensors %s have no parameter in %s; ignored",
                    ", ".join(unexpected[:5]), type(model).__name__)
    _materialize_buffers(model)
    return model.eval()


def _materialize_buffers(model: Any) -> None:
    """Give the buffers that no checkpoint holds (still on meta) their initial values."""
    import torch

    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if not meta:
        return
    transformers = _import_transformers()
    try:
        init = importlib.import_module("transformers.initialization")
    except ImportError:
        init = None
    guard = getattr(init, "guard_torch_init_functions", None)
    if guard is None or model.is_custom_code():
        # Older transformers' (and custom code's) _init_weights write parameters in
        # place: into a read-only mapping that is a segfault, not an error.
        raise LoaderError(f"buffers {', '.join(meta[:5])} of {type(model).__name__} are in "
                          "no checkpoint and this transformers "
                          f"{transformers.__version__} cannot initialize them safely; "
                          "the fill needs transformers >= 5 and a model built into it")
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            t._is_hf_initialized = True  # loaded: initialization must skip it
    owners = []
    for name in meta:
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        module._buffers[attr] = torch.empty_like(module._buffers[attr], device="cpu")
        if parent not in owners:
            owners.append(parent)
    with torch.no_grad(), guard():
        for parent in owners:
            _init_owner(model, parent, transformers.PreTrainedModel)._init_weights(
                model.get_submodule(parent))
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise LoaderError(f"buffers {', '.join(left[:5])} of {type(model).__name__} are in "
                          "no checkpoint and its _init_weights left them unset")


def _init_owner(model: Any, path: str, base: type) -> Any:
    """The innermost PreTrainedModel holding the module at ``path``: its _init_weights
    is the one from_pretrained applies there (composite models have several)."""
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        candidate = model.get_submodule(".".join(parts[:i]))
        if isinstance(candidate, base):
            return candidate
    return model


def load_transformers(volume: Volume | ModelView | str | os.PathLike[str],
                      model: str | None = None, *, device: str = "cpu",
                      auto_class: Any = None, **load_kw: Any) -> Any:
    """A transformers model built from the staged ``config.json`` and filled with the
    staged weights (``device``, ``verify`` and the rest as :func:`start_load`; the
    model is built on meta while a GPU load copies). A volume given as a path is
    opened here and closed once loaded (CPU views keep their mapping until freed)."""
    owned = not isinstance(volume, Volume | ModelView)
    view = volume if isinstance(volume, ModelView) else open_model(volume, model)
    handle = None
    try:
        try:
            config = json.loads(read_aux(view, "config.json"))
        except ValueError as exc:
            raise LoaderError(f"config.json of model {view.model.label()} is not JSON: "
                              f"{exc}") from exc
        handle = start_load(view, device, **load_kw)
        meta_model = build_on_meta(config, auto_class)
        return fill_transformers(meta_model, handle.result())
    finally:
        if owned:
            if handle is not None and device != "cpu":
                handle.done.exception()  # never unmap under a copy still running
                (load_kw.get("loader") or default_loader(device)).release(view.volume)
            view.volume.close()
