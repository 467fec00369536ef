"""The loader stands alone: what an inference pod's ``pip install csi-pmem[loader]`` gets.

Why fresh interpreters with a blocking import finder: this venv has the driver's
dependencies installed, so an import of grpc slipped into the loader would pass every
other test. Here grpc, google.protobuf, prometheus_client and pyudev (the ``driver``
extra) raise ImportError as in a loader-only install; the loader, the sidecar and
``csi-pmem-weights`` must work, and ``csi-pmem serve``/``volume`` must say in one line
what to install. The same rule is enforced statically by import-linter (``make lint``,
``[tool.importlinter]`` in pyproject.toml); this proves it at run time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DRIVER_EXTRA = ("grpc", "google.protobuf", "prometheus_client", "pyudev")

# Installed first in every child: the driver extra cannot be imported.
BLOCK = f"""
import importlib.abc, sys
BLOCKED = {DRIVER_EXTRA!r}
def _blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)
class NoDriverExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, NoDriverExtra())
for _m in [m for m in sys.modules if _blocked(m)]:
    del sys.modules[_m]
"""

# The common layer the loader may use (standard library only), the weight store and
# the copy service's pod-side half; nothing else of csi_pmem outside csi_pmem.loader.
LOADER_MAY_IMPORT = {"csi_pmem", "csi_pmem.errors", "csi_pmem.sizes", "csi_pmem.mountinfo",
                     "csi_pmem.logs", "csi_pmem.failpoints", "csi_pmem.daxclient",
                     "csi_pmem.cmdline", "csi_pmem.fdpass", "csi_pmem.durable", "csi_pmem.numa",
                     "csi_pmem.gpucopy", "csi_pmem.gpucopy.protocol", "csi_pmem.gpucopy.cuda",
                     "csi_pmem.gpucopy.copier"}
# The weight store, imported whole: the loader and the copy service share it.
WEIGHTS = "csi_pmem.weights"
# What the loader's GPU paths need and CI may lack; nothing else may be missing.
OPTIONAL = {"torch", "cuda"}


def run_blocked(body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + body], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


def test_the_blocker_blocks():
    """Without this the other tests here could not fail: grpc must really be gone."""
    proc = run_blocked("import grpc\n")
    assert proc.returncode == 1 and "No module named 'grpc' (blocked)" in proc.stderr
    proc = run_blocked("from google.protobuf import json_format\n")
    assert proc.returncode == 1 and "(blocked)" in proc.stderr


def test_every_loader_module_imports_without_the_driver_extra():
    body = f"""
import importlib, json, pkgutil
import csi_pmem.loader, csi_pmem.loader.sidecar, csi_pmem.weights
names = sorted(m.name for pkg in (csi_pmem.loader, csi_pmem.weights)
               for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
skipped = {{}}
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in {sorted(OPTIONAL)!r}:
            raise
        skipped[name] = exc.name
print(json.dumps({{"names": names, "skipped": skipped,
                  "loaded": sorted(m for m in sys.modules if m.startswith("csi_pmem"))}}))
"""
    proc = run_blocked(body)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for needed in ("csi_pmem.loader.sidecar.cli", "csi_pmem.loader.sidecar.revision",
                   "csi_pmem.loader.staging", "csi_pmem.weights.volume"):
        assert needed in doc["names"] and needed not in doc["skipped"], needed
    outside = {m for m in doc["loaded"]
               if not m.startswith(("csi_pmem.loader", WEIGHTS))}
    assert outside <= LOADER_MAY_IMPORT, sorted(outside - LOADER_MAY_IMPORT)


def test_csi_pmem_weights_runs_without_the_driver_extra():
    body = """
from csi_pmem.loader import cli as weights_cli
for argv in (["--help"], ["sidecar", "--help"], ["stage", "--help"]):
    try:
        weights_cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
    else:
        raise AssertionError(f"{argv}: --help did not exit")
"""
    proc = run_blocked(body)
    assert proc.returncode == 0, proc.stderr
    assert "usage: csi-pmem-weights" in proc.stdout and "--verify-on-start" in proc.stdout


@pytest.mark.parametrize("argv", [["serve"], ["volume", "list"]])
def test_the_driver_cli_without_the_driver_extra_says_what_to_install(argv):
    body = f"""
import runpy
sys.argv = ["csi-pmem", *{argv!r}]
runpy.run_module("csi_pmem", run_name="__main__")
"""
    proc = run_blocked(body)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"csi-pmem: {argv[0]} needs the driver"), lines
    assert "pip install 'csi-pmem[driver]'" in lines[0]


def test_the_driver_cli_help_needs_no_driver_extra():
    proc = run_blocked("""
import runpy
sys.argv = ["csi-pmem", "--help"]
runpy.run_module("csi_pmem", run_name="__main__")
""")
    assert proc.returncode == 0 and "usage: csi-pmem" in proc.stdout, proc.stderr


def test_the_driver_dependencies_are_an_extra_with_capped_majors():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == [], "the loader-only install must bring no driver deps"
    extras = project["optional-dependencies"]
    driver = {r.split(">")[0].split("<")[0].split("=")[0]: r for r in extras["driver"]}
    assert set(driver) == {"grpcio", "protobuf", "prometheus-client", "pyudev",
                           "pyyaml", "argcomplete"}, driver  # the last two: `volume -o`, TAB
    assert "<2" in driver["grpcio"] and "<8" in driver["protobuf"], driver
    for name in ("loader", "gpu", "gpu-copy"):
        assert not {"grpcio", "protobuf"} & {r.split(">")[0] for r in extras[name]}, name


def test_the_sidecar_metrics_say_what_to_install_without_prometheus_client():
    """prometheus-client is in the loader extra, imported only at a scrape: without it the
    sidecar still imports and serves its probes, and /metrics says what to install."""
    body = """
from csi_pmem.loader.sidecar import metrics
from csi_pmem.loader.sidecar.status import Status
code, ctype, text = metrics.render(Status(model="m").snapshot)
print(code, text.decode().strip())
"""
    proc = run_blocked(body)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("501 ") and "pip install 'csi-pmem[loader]'" in proc.stdout


def test_importing_the_loader_and_sidecar_does_not_import_prometheus_client():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, csi_pmem.loader, csi_pmem.loader.sidecar, "
         "csi_pmem.loader.cli; print('prometheus_client' in sys.modules)"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_the_loader_extra_serves_the_sidecar_metrics():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("prometheus-client") for d in extras["loader"]), extras["loader"]
