"""The settings of vLLM's ``--load-format csi-pmem``, read without vLLM.

Why a module of their own: both the entry point (:mod:`csi_pmem.integrations.vllm`,
which names the format) and the loader vLLM runs
(:mod:`csi_pmem.integrations.vllm_loader`, which reads the settings) need them, and
neither should import the other for it; here they import neither, nor vLLM, so the
settings are tested without vLLM.

Settings, from ``--model-loader-extra-config`` (JSON) first, then the environment, then
the default (docs/inference.md):

- ``volume`` / ``CSI_PMEM_VOLUME``: the volume (published directory, device or image
  file); default ``--model``, so ``vllm serve /models`` works when ``/models`` is the
  published volume (its config then comes from ``--hf-config-path``).
- ``model`` / ``CSI_PMEM_MODEL``: the model's name on the volume; default the only one.
- ``verify`` / ``CSI_PMEM_VERIFY`` (``true``/``false``): check every chunk against its
  staged checksum beside the load (default true; a mismatch fails the start).
- ``gpu_budget`` / ``CSI_PMEM_GPU_BUDGET``: a quantity (``1Gi``, ``512Mi``): the device
  memory a load to the GPU may hold beyond vLLM's parameters (default ``1Gi``; see
  :mod:`csi_pmem.loader.batches`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from csi_pmem.errors import InvalidArgument
from csi_pmem.sizes import parse_quantity
from csi_pmem.weights.errors import LoaderError

LOAD_FORMAT = "csi-pmem"
ENV_VOLUME = "CSI_PMEM_VOLUME"
ENV_MODEL = "CSI_PMEM_MODEL"
ENV_VERIFY = "CSI_PMEM_VERIFY"
ENV_GPU_BUDGET = "CSI_PMEM_GPU_BUDGET"
KEYS = ("volume", "model", "verify", "gpu_budget")
DEFAULT_GPU_BUDGET = "1Gi"


@dataclass(frozen=True)
class Settings:
    volume: str
    model: str | None
    verify: bool
    gpu_budget: int = 1 << 30


def _flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise LoaderError(f"{where} is {value!r}; use true or false")


def settings(extra: dict[str, Any] | None, model_path: str,
             env: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
    """The load's settings from vLLM's model-loader extra config, the environment and
    ``--model`` (see the module docstring); unknown keys are an error, not ignored."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise LoaderError(f"--model-loader-extra-config has unknown key(s) "
                          f"{', '.join(unknown)} for --load-format {LOAD_FORMAT}; "
                          f"known: {', '.join(KEYS)}")
    for key in ("volume", "model"):
        if key in extra and not (isinstance(extra[key], str) and extra[key]):
            raise LoaderError(f"--model-loader-extra-config {key!r} must be a non-empty "
                              f"string, not {extra[key]!r}")
    verify: Any = extra.get("verify", env.get(ENV_VERIFY, True))
    where = ("--model-loader-extra-config 'verify'" if "verify" in extra else ENV_VERIFY)
    return Settings(volume=extra.get("volume") or env.get(ENV_VOLUME) or model_path,
                    model=extra.get("model") or env.get(ENV_MODEL) or None,
                    verify=_flag(verify, where), gpu_budget=_budget(extra, env))


def _budget(extra: dict[str, Any], env: dict[str, str] | os._Environ[str]) -> int:
    where = ("--model-loader-extra-config 'gpu_budget'" if "gpu_budget" in extra
             else ENV_GPU_BUDGET)
    value = extra.get("gpu_budget", env.get(ENV_GPU_BUDGET, DEFAULT_GPU_BUDGET))
    try:
        budget = value if isinstance(value, int) and not isinstance(value, bool) \
            else parse_quantity(str(value))
    except InvalidArgument as exc:
        raise LoaderError(f"{where}: {exc}") from None
    if budget < 64 << 20:
        raise LoaderError(f"{where} is {value!r}; give at least 64Mi (the default is "
                          f"{DEFAULT_GPU_BUDGET})")
    return budget
