"""benchmarks/profile_ab.py's configuration syntax: parsed as documented, refused with a
message that shows the right form (the GPU part runs only on a GPU host)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_ab  # noqa: E402


def test_a_config_is_label_env_and_args():
    label, env, args = profile_ab.parse_config(
        "torch 16|CSI_PMEM_BOUNCE_COPY=torch GLIBC_TUNABLES=a=b|--no-verify --buffers 16")
    assert label == "torch 16"
    assert env == {"CSI_PMEM_BOUNCE_COPY": "torch", "GLIBC_TUNABLES": "a=b"}
    assert args == ["--no-verify", "--buffers", "16"]
    assert profile_ab.parse_config("plain||") == ("plain", {}, [])


@pytest.mark.parametrize("bad", ["no-bars", "|X=1|", "a|NOVALUE|", "a|b|c|d"])
def test_a_bad_config_is_a_usage_error(bad):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_ab.py"),
                        "/nonexistent", "--config", bad], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "LABEL|ENV|ARGS" in r.stderr or "NAME=VALUE" in r.stderr
    assert "Traceback" not in r.stderr


def test_one_load_reads_profile_loads_total(tmp_path, monkeypatch):
    """The rate is profile_load.py's own total (volume, model, loader, verified load), and
    a failed load is reported with its exit code and stderr, not a traceback."""
    fake = tmp_path / "profile_load.py"
    fake.write_text("import json, os, sys\n"
                    "if os.environ.get('FAIL'): sys.exit('no GPU here')\n"
                    "print('debug line')\n"
                    "assert '--no-node' in sys.argv and os.environ['CSI_PMEM_GPU_COPY'] == 'off'\n"
                    "assert '--trace' not in sys.argv\n"
                    "print(json.dumps({'path': 'bounce', 'bytes': 10**9, 'gbps_total': 40.0,\n"
                    "                  'phases_ms': {'load': 20.0}}))\n")
    monkeypatch.setattr(profile_ab, "PROFILE", fake)
    r = profile_ab.one("/vol", {}, ["--no-verify"], timeout=30)
    assert r == {"returncode": 0, "path": "bounce", "gb_s": 40.0, "total_ms": 25.0,
                 "phases_ms": {"load": 20.0}}
    bad = profile_ab.one("/vol", {"FAIL": "1"}, [], timeout=30)
    assert bad["returncode"] == 1 and "no GPU here" in bad["error"]


def test_a_traced_node_load_passes_the_trace_and_keeps_the_service_on(tmp_path, monkeypatch):
    """``--node`` loads use the copy service (no --no-node, CSI_PMEM_GPU_COPY unset), and a
    traced load hands profile_load.py its trace path and keeps the device summary."""
    fake = tmp_path / "profile_load.py"
    fake.write_text("import json, os, sys\n"
                    "assert '--no-node' not in sys.argv and 'CSI_PMEM_GPU_COPY' not in os.environ\n"
                    "trace = sys.argv[sys.argv.index('--trace') + 1]\n"
                    "print(json.dumps({'path': 'node', 'bytes': 10**9, 'gbps_total': 50.0,\n"
                    "                  'phases_ms': {}, 'device': {'trace': trace}}))\n")
    monkeypatch.setattr(profile_ab, "PROFILE", fake)
    monkeypatch.delenv("CSI_PMEM_GPU_COPY", raising=False)
    r = profile_ab.one("/dir", {}, [], timeout=30, trace="/t/x.json", node=True)
    assert r["path"] == "node" and r["device"] == {"trace": "/t/x.json"}


def test_a_logged_load_keeps_its_debug_lines(tmp_path, monkeypatch):
    """``--log-dir``: profile_load.py runs with --log and its stderr is kept per load."""
    fake = tmp_path / "profile_load.py"
    fake.write_text("import json, sys\n"
                    "assert '--log' in sys.argv\n"
                    "print('DEBUG bounce load: plan of 3 chunks', file=sys.stderr)\n"
                    "print(json.dumps({'path': 'bounce', 'bytes': 10**9, 'gbps_total': 40.0,\n"
                    "                  'phases_ms': {}}))\n")
    monkeypatch.setattr(profile_ab, "PROFILE", fake)
    log = tmp_path / "a-1.log"
    r = profile_ab.one("/vol", {}, [], timeout=30, log=str(log))
    assert r["returncode"] == 0
    assert "plan of 3 chunks" in log.read_text()
