"""The whole engine on the CPU: `LLM(model=<volume>, load_format="csi-pmem",
hf_config_path=<exported config>)` generates the same greedy tokens as vLLM reading
the safetensors files. Each engine runs in a fresh process (engine_run.py): the engine
core and worker are processes of their own that find the plugin through the entry
point, as under `vllm serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tiny

from csi_pmem.loader import export_config

HERE = Path(__file__).resolve().parent


def generate(*args: str) -> list[int]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([sys.executable, str(HERE / "engine_run.py"), *args],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("TOKENS ")]
    return json.loads(line.removeprefix("TOKENS "))


def test_engine_generates_the_same_tokens(tmp_path):
    src = tiny.llama_dir(tmp_path / "src", hidden=256)
    vol = tiny.stage_dir(src, tmp_path / "published")
    export_config(vol, str(tmp_path / "config"))
    want = generate(str(src), "safetensors")
    got = generate(str(vol), "csi-pmem", str(tmp_path / "config"))
    assert len(want) == 8
    assert got == want
