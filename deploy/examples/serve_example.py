"""A server entrypoint that takes its weights from a csi-pmem volume.

Why an example: every server builds its model its own way. What they share is the step
this script shows: the staging sidecar has made sure the volume holds the wanted
revision (the pod's serving container starts only after its /readyz said so), so the
server maps the volume read-only, loads the tensors straight into GPU memory with
``csi_pmem.loader`` (no read() into host buffers, no safetensors file on disk), and
hands the resulting ``{name: tensor}`` dict to its model:

- Hugging Face transformers (``--transformers``): ``csi_pmem.loader.build_on_meta``
  builds the model from the staged ``config.json`` on the ``meta`` device and
  ``fill_transformers`` adopts the loaded tensors as its parameters (no second copy),
  ties the embeddings and initializes the buffers no checkpoint holds (the rotary
  ``inv_freq``). ``csi_pmem.loader.load_transformers`` does all of it in one call.
- vLLM needs no script: ``vllm serve <volume> --load-format csi-pmem`` (the ``vllm``
  extra; docs/inference.md).

Config and tokenizer files were staged beside the weights and are read from the
volume too (``csi_pmem.loader.read_aux``).

    python serve_example.py --volume /models --model llama --device cuda:0 --port 8000
    python serve_example.py --volume vol.img --model llama --device cpu \
        --framework numpy --exit        # CI: no torch, no GPU

Only the standard library and ``csi_pmem`` are imported at start; torch and
transformers only when a path needs them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from csi_pmem.loader import (
    LoaderError,
    build_on_meta,
    fill_transformers,
    open_model,
    open_volume,
    read_aux,
    start_load,
)


def load_weights(volume: str, model: str | None, device: str,
                 framework: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(weights, config.json or {}, what happened). The mapping stays open as long as
    the tensors do (CPU views) or until the copy is done (GPU)."""
    started = time.monotonic()
    view = open_model(open_volume(volume), model)
    try:
        config = json.loads(read_aux(view, "config.json"))
    except LoaderError:
        config = {}  # staged without one: fine for --framework numpy
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
    return fill_transformers(build_on_meta(config), weights)


class _Info(BaseHTTPRequestHandler):
    info: ClassVar[dict[str, Any]] = {}

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

    try:
        weights, config, info = load_weights(args.volume, args.model, args.device,
                                             args.framework)
        info["config"] = config
        if args.transformers:
            model = into_transformers(weights, config)
            info["parameters"] = sum(t.numel() for t in model.parameters())
    except LoaderError as exc:
        print(f"serve_example: error: {exc}", file=sys.stderr)
        return 1
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
