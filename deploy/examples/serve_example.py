"""A vLLM-style server entrypoint that takes its weights from a csi-pmem volume.

Why an example and not a library feature: every server builds its model its own way.
What they share is the step this script shows: the staging sidecar has made sure the
volume holds the wanted revision (the pod's serving container starts only after its
/readyz said so), so the server maps the volume read-only, loads the tensors straight
into GPU memory with ``csi_pmem.loader`` (no read() into host buffers, no safetensors
file on disk), and hands the resulting ``{name: tensor}`` dict to its model:

- Hugging Face transformers: build the model on the ``meta`` device, then
  ``model.load_state_dict(weights, assign=True)`` adopts the loaded tensors as the
  parameters (no second copy). See :func:`into_transformers`.
- vLLM: every model class has ``load_weights(Iterable[tuple[str, Tensor]])``, which
  maps checkpoint names onto its fused parameters (qkv, gate_up) and shards them for
  tensor parallelism. A custom model loader (``--load-format``) can feed it these
  tensors instead of reading files; see :func:`into_vllm` and docs/sidecar.md for what
  needs an upstream hook.

Config and tokenizer files were staged beside the weights and are read from the
volume too (:func:`read_volume_file`).

    python serve_example.py --volume /models --model llama --device cuda:0 --port 8000
    python serve_example.py --volume vol.img --model llama --device cpu \
        --framework numpy --exit        # CI: no torch, no GPU

Only the standard library and ``csi_pmem`` are imported at start; torch, transformers
and vllm only by the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from csi_pmem.loader import ModelView, open_model, open_volume, start_load


def read_volume_file(view: ModelView, name: str) -> bytes:
    """A staged auxiliary file (config.json, tokenizer.json) straight from the mapping."""
    f = view.file(name)
    return bytes(view.volume.view(f.offset, f.length))


def load_weights(volume: str, model: str | None, device: str,
                 framework: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(weights, config.json or {}, what happened). The mapping stays open as long as
    the tensors do (CPU views) or until the copy is done (GPU)."""
    started = time.monotonic()
    view = open_model(open_volume(volume), model)
    try:
        config = json.loads(read_volume_file(view, "config.json"))
    except KeyError:
        config = {}
    handle = start_load(view, device, framework=framework)
    # A server would build its modules here while the copy runs: handle.files[shard]
    # and handle.tensors[name] are futures that resolve as the data lands.
    weights = handle.result()  # also waits for checksum verification
    info = {"model": view.model.label(), "tensors": len(weights), "bytes": handle.nbytes,
            "device": device, "path": handle.path, "numa_node": view.volume.numa_node,
            "seconds": round(time.monotonic() - started, 3),
            "gbps": round(handle.gbps or 0.0, 2)}
    return weights, config, info


def into_transformers(weights: dict[str, Any], config: dict[str, Any]) -> Any:
    """A transformers model whose parameters ARE the loaded tensors (no copy)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # strict=False: checkpoints usually omit a tied lm_head; whatever is still on the
    # meta device after tie_weights() is really missing.
    _, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise SystemExit(f"checkpoint does not match the architecture: missing "
                         f"{still_meta[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def vllm_weights_iterator(weights: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """What vLLM's ``Model.load_weights`` consumes: (checkpoint name, tensor) pairs."""
    yield from weights.items()


def into_vllm(model: Any, weights: dict[str, Any]) -> Iterable[str]:
    """Inside a vLLM model loader: hand the tensors to the model's own name mapping
    (fused qkv/gate_up, tensor-parallel slicing). Returns the parameters it filled."""
    return model.load_weights(vllm_weights_iterator(weights))


class _Info(BaseHTTPRequestHandler):
    info: dict[str, Any] = {}

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/v1/models"):
            body = json.dumps({"object": "list", "data": [{"id": self.info["model"],
                                                           "object": "model",
                                                           "csi_pmem": self.info}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())
        else:
            self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--volume", default="/models", help="the PMEM volume's mount directory")
    p.add_argument("--model", default=None, help="model name on the volume")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--framework", choices=("torch", "numpy"), default="torch")
    p.add_argument("--transformers", action="store_true",
                   help="build a transformers model from config.json and adopt the weights")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--exit", action="store_true", help="load, print a summary, exit")
    args = p.parse_args(argv)

    weights, config, info = load_weights(args.volume, args.model, args.device,
                                         args.framework)
    info["config"] = config
    if args.transformers:
        model = into_transformers(weights, config)
        info["parameters"] = sum(t.numel() for t in model.parameters())
    print(json.dumps(info), flush=True)
    if args.exit:
        return 0
    _Info.info = info
    server = ThreadingHTTPServer(("", args.port), _Info)
    print(f"serving model info on :{args.port} (a real server would serve inference)",
          file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
