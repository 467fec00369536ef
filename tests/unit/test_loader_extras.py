"""What `pip install 'csi-pmem[loader]'` (numpy, no torch) gets: numpy loads work, torch
loads say which extra to install; and the extras match what the code imports."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from csi_pmem.loader import LoaderError, load_numpy, load_safetensors, start_load

import loader_models as lm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_torch(monkeypatch):
    """torch cannot be imported, as in a loader-only install (None in sys.modules makes
    every `import torch` raise ImportError), whatever this venv holds."""
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)


@pytest.fixture
def volume(tmp_path):
    src = tmp_path / "src"
    lm.save_numpy_model(src, lm.numpy_tensors())
    return lm.staged_volume(src, tmp_path / "vol")


def test_cpu_load_without_torch_names_the_extra(no_torch, volume):
    with pytest.raises(LoaderError) as err:
        load_safetensors(volume, device="cpu")
    msg = str(err.value)
    assert "pip install 'csi-pmem[torch]'" in msg and "load_numpy" in msg, msg


def test_gpu_load_without_torch_names_the_gpu_extra(no_torch, volume):
    with pytest.raises(LoaderError, match=r"pip install 'csi-pmem\[gpu\]'"):
        start_load(volume, "cuda:0")


def test_numpy_load_needs_no_torch(no_torch, volume):
    got = load_numpy(volume)
    assert got.keys() == lm.numpy_tensors().keys()


def test_extras_match_the_imports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(extra):
        return {r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0]
                .strip() for r in extras[extra]}

    assert "numpy" in names("loader") and not names("loader") & {"torch", "safetensors"}
    assert names("torch") == {"csi-pmem", "torch"} and "csi-pmem[loader]" in extras["torch"]
    assert "csi-pmem[torch]" in extras["gpu"] and "cuda-bindings" in names("gpu")
    assert "csi-pmem[torch]" in extras["vllm"] and "vllm" in names("vllm")
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"csi_pmem": "csi_pmem.integrations.vllm:register"}
    licence = (REPO / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (REPO / "csi_pmem" / "py.typed").exists()


def test_the_loader_never_imports_safetensors():
    """The reason `loader` dropped it: no module of the loader or the store imports it."""
    hits = [str(p) for d in ("loader", "weights", "integrations")
            for p in (REPO / "csi_pmem" / d).rglob("*.py")
            if "import safetensors" in p.read_text() or "from safetensors" in p.read_text()]
    assert hits == []
