"""Tensor-parallel ranks through ``--load-format csi-pmem``'s rank-slice path, with
vLLM's own Llama class and weight loaders, on the CPU: TP=2 and TP=4 ranks as separate
processes (gloo), each against vLLM's default loader at the same rank.

What it shows: every rank's parameters equal vLLM's own (so the union of the ranks is
the checkpoint, bit for bit, as vLLM cuts it), each rank's slices go through the copier
(none copied by torch behind its back), and a rank reads about 1/TP of the model; the
same through the node's copy service (its fake copier), and with a copy that fails
there; a damaged chunk fails the rank that owns its check.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny
from safetensors import safe_open

from csi_pmem.driver.daxsock import DaxSocketServer
from csi_pmem.gpucopy import protocol
from csi_pmem.gpucopy.copier import FakeCopier
from csi_pmem.gpucopy.link import ServiceLink
from csi_pmem.gpucopy.service import CopyService
from csi_pmem.loader import export_config, open_model, open_volume
from csi_pmem.weights.image import IMAGE_NAME

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-tp")
    # 8 KV heads over 8 query heads: TP=4 splits them (the tiny default has 2).
    src = tiny.llama_dir(base / "src", hidden=128, kv_heads=4)
    vol = tiny.stage_dir(src, base / "published")
    export_config(vol, str(base / "config"))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        nbytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    return {"src": src, "vol": vol, "cfg": base / "config", "nbytes": nbytes, "base": base}


@contextlib.contextmanager
def copy_service(vol: Path, copier: FakeCopier) -> Iterator[CopyService]:
    """The node's side for a directory volume, as deployed: ``gpu.sock`` in it, answered
    by the socket server that forwards to the copy service (its fake copier)."""
    image = str(vol / IMAGE_NAME)
    control = str(vol.parent / f".{vol.name}-gpu-copy.sock")
    service = CopyService(control, copier, poll_seconds=0.05, client_timeout=10).start()
    link = ServiceLink(control, timeout=5)
    meta = {"volume_id": "csi-tp", "usable_size": os.path.getsize(image),
            "align": 2 << 20, "numa_node": 0, "device": image}
    dax = DaxSocketServer()
    dax.serve(str(vol / protocol.SOCKET_NAME), meta,
              lambda: os.open(image, os.O_RDONLY | os.O_CLOEXEC), pod_uid=None,
              forward=lambda conn, fd: link.forward(meta, conn, fd))
    try:
        yield service
    finally:
        dax.close()
        service.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(vol / protocol.SOCKET_NAME)


def ranks(staged, size: int, vol=None, node: bool = False) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), os.environ.get("PYTHONPATH", "")]), VLLM_HOST_IP="127.0.0.1",
        OMP_NUM_THREADS="1", VLLM_DIST_IDENT=f"csi-pmem-tp-{port}",
        CSI_PMEM_TP_NODE="1" if node else "0",
        # A directory volume's source is its image file: the socket is named.
        CSI_PMEM_GPU_COPY=str(Path(vol or staged["vol"]) / protocol.SOCKET_NAME)
        if node else "off")
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "tp_rank.py"), str(r), str(size), str(port),
         str(staged["src"]), str(vol or staged["vol"]), str(staged["cfg"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(size)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RANK ")]
        assert p.returncode == 0 and lines, stderr[-3000:]
        out.append(json.loads(lines[-1][5:]))
    return sorted(out, key=lambda r: r["rank"])


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_equals_vllms_own_loader_and_reads_its_share(staged, size):
    got = ranks(staged, size)
    for r in got:
        assert r["error"] is None, r
        assert r["mismatches"] == [], r
        assert r["params"] > 10
        assert r["elsewhere"] == 0, r  # every slice went through the copier
        # Its slices, and the replicated norms: about 1/size of the model, never all.
        assert r["copied"] < staged["nbytes"] / size * 1.1, r
        assert r["copied"] > staged["nbytes"] / size * 0.9, r
    # Between them the ranks read the model about once.
    total = sum(r["copied"] for r in got)
    assert staged["nbytes"] * 0.99 < total < staged["nbytes"] * 1.1


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_through_the_copy_service_equals_vllms_own_loader(staged, tmp_path,
                                                                   size):
    """The node path: every slice vLLM's loaders cut (row ranges, and stretches of every
    row: one 2D copy each) is copied by the service into the rank's slots and out into
    its parameters; the ranks equal vLLM's default loader, and read 1/TP."""
    vol = tiny.stage_dir(staged["src"], tmp_path / "published")
    copier = FakeCopier()
    with copy_service(vol, copier) as service:
        got = ranks(staged, size, vol=vol, node=True)
    for r in got:
        assert r["error"] is None and r["mismatches"] == [], r
        assert r["path"] == "rank-node-slices" and r["refused"] is None, r
        assert r["elsewhere"] == 0, r
        # Every slice went through the service (small=0), and landed.
        assert r["node_copied"] == r["copied"], r
        assert staged["nbytes"] / size * 0.9 < r["copied"] < staged["nbytes"] / size * 1.1
    assert service.served == size and copier.outstanding == 0


def test_a_copy_service_that_fails_mid_load_costs_no_bytes(staged, tmp_path):
    """A copy fails on the device after some have landed: the rank copies again what
    did not land, through pinned buffers, says why, and still equals vLLM's own."""
    vol = tiny.stage_dir(staged["src"], tmp_path / "published")
    with copy_service(vol, FakeCopier(fail_at=7)):
        got = ranks(staged, 2, vol=vol, node=True)
    for r in got:
        assert r["error"] is None and r["mismatches"] == [], r
        assert r["elsewhere"] == 0, r
    failed = [r for r in got if r["refused"]]
    assert len(failed) == 1 and "fake fault" in failed[0]["refused"], got
    assert 0 < failed[0]["node_copied"] < failed[0]["copied"], failed


def test_a_damaged_chunk_fails_the_rank_that_checks_it(staged, tmp_path):
    vol = tmp_path / "damaged"
    src_vol = tiny.stage_dir(staged["src"], vol)
    with open_volume(str(src_vol), writable=True) as v:
        f = open_model(v).file("model.safetensors")
        v.view(f.offset + f.length // 2, 1)[0] ^= 0x01
    got = ranks(staged, 2, vol=src_vol)
    failed = [r for r in got if r["error"]]
    assert len(failed) == 1, got  # one chunk: one rank owns its check
    assert "do not match their staged checksums" in failed[0]["error"]


def test_a_tensor_of_the_wrong_shape_fails_the_ranks_with_vllms_error(staged, tmp_path):
    """vLLM's weight loader refuses it mid-load on the rank whose cut falls outside it,
    while that rank's share of the checks is hashing: the rank reports vLLM's error and
    its process does not crash (ranks() asserts exit 0 for every rank)."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    import shutil

    shutil.copytree(staged["src"], src)
    weights = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] // 2)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    vol = tiny.stage_dir(src, tmp_path / "published")
    got = ranks(staged, 2, vol=vol)
    failed = [r for r in got if r["error"]]
    assert [r["rank"] for r in failed] == [1], got
    assert "exceeds dimension size" in failed[0]["error"]
