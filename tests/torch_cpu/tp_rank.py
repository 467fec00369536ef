"""Run by test_vllm_tp.py, one process per tensor-parallel rank: vLLM's own Llama class
at rank RANK of SIZE (gloo), loaded once by vLLM's default safetensors loader and once
by ``--load-format csi-pmem`` through the rank-slice path (its device pointed at
the CPU, where vLLM's CPU build keeps the parameters); prints one line "RANK <json>": the
parameters that differ, the bytes the copier moved, the bytes torch copied from the
views itself, and the error of our load if it failed."""

import json
import sys

import torch
from test_vllm import engine_config, load
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

from csi_pmem.integrations import vllm_loader
from csi_pmem.integrations.vllm import LOAD_FORMAT
from csi_pmem.loader.gpu import slices


def main() -> None:
    rank, size, port = (int(x) for x in sys.argv[1:4])
    src, vol, cfg = sys.argv[4:7]
    vc = engine_config(src, "safetensors", tensor_parallel_size=size,
                       distributed_executor_backend="mp")
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                     backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(size, 1)
    _, want = load(vc)
    copiers = []
    real = slices.RankCopier

    def on_cpu(model):  # the rank's "GPU" is the CPU its parameters are on
        return torch.device("cpu")

    def counting(device, r, n, **kw):
        copiers.append(real(device, r, n, **kw))
        return copiers[-1]

    vllm_loader._device = on_cpu
    slices.RankCopier = counting
    out = {"rank": rank, "error": None}
    try:
        _, got = load(engine_config(vol, LOAD_FORMAT, hf_config_path=cfg,
                                    tensor_parallel_size=size,
                                    distributed_executor_backend="mp"))
        out["mismatches"] = [n for n in want if not torch.equal(want[n], got[n])]
        out["params"] = len(got)
    except Exception as exc:  # reported to the test, which expects it or not
        out["error"] = f"{type(exc).__name__}: {exc}"
    if copiers:
        out["copied"], out["elsewhere"] = copiers[0].copied, copiers[0].elsewhere
        out["copies"] = copiers[0].copies
    print("RANK", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
