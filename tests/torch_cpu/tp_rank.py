"""Run by test_vllm_tp.py, one process per tensor-parallel rank: vLLM's own Llama class
at rank RANK of SIZE (gloo), loaded once by vLLM's default safetensors loader and once
by ``--load-format csi-pmem`` through the rank-slice path (its device pointed at
the CPU, where vLLM's CPU build keeps the parameters); prints one line "RANK <json>": the
parameters that differ, the bytes the copier moved, the bytes torch copied from the
views itself, and the error of our load if it failed.

With ``CSI_PMEM_TP_NODE=1`` the rank's copier is the node path's
(:class:`~csi_pmem.loader.gpu.rankslots.NodeRankCopier`) against the copy service the
test runs (its fake copier: memfd "allocations" as slots, the CPU gate in place of the
GPU's wait), with small slots so that slices are cut into several copies."""

import json
import mmap
import os
import sys

import torch
from test_vllm import engine_config, load
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

from csi_pmem.gpucopy.copier import FAKE_GPU
from csi_pmem.integrations import vllm_loader
from csi_pmem.integrations.vllm import LOAD_FORMAT
from csi_pmem.loader import cpu
from csi_pmem.loader.gpu import nodecopy, rankslots, slices
from csi_pmem.loader.gpu.nodepool import NodePool
from csi_pmem.weights.mapping import buffer_address

SLOT = 64 * 1024


class Memfd:
    """A slot's memory: a memfd the fake copier maps as the CUDA one imports."""

    uuid = FAKE_GPU
    address = 0

    def __init__(self, nbytes: int):
        self.size = nbytes
        self.fd = os.memfd_create("tp-slot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)

    def export_fd(self, index: int = 0) -> int:
        return os.dup(self.fd)

    def synchronize(self) -> None:
        pass

    def free(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def node_copier(volume, device, rank, size, writes, budget):
    path = nodecopy.service_socket(volume)
    assert path is not None, f"no gpu.sock in {volume.source}"
    pool = NodePool(path, 0, 4 * SLOT, sizes=[SLOT], allocate=Memfd)
    assert pool.greeted.wait(10) and pool.session.copies_rows
    return rankslots.NodeRankCopier(
        device, rank, size, pool=pool, gate=rankslots.HostGate(pool),
        base=buffer_address(cpu.source(volume, writes)), span=volume.size,
        view=lambda lease: torch.frombuffer(lease.slot.alloc.map, dtype=torch.uint8),
        slot_size=SLOT, small=0)


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

    def node_counting(*a):
        copiers.append(node_copier(*a))
        return copiers[-1]

    vllm_loader._device = on_cpu
    slices.RankCopier = counting
    if os.environ.get("CSI_PMEM_TP_NODE") == "1":
        rankslots.rank_copier = node_counting
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
        out["path"] = copiers[0].path
        out["node_copied"] = getattr(copiers[0], "node_copied", None)
        out["refused"] = getattr(copiers[0], "refused", None)
    print("RANK", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
