"""e2e/cluster/mkimage.py, which writes the cluster tier's docker-archive images.

Why here: the workload image is made with ``--from`` the archive ``make image`` writes;
if its layers were not copied byte for byte, containerd would store the driver image
twice and the workload pods would run other bytes than the driver. The cluster tier
would only notice as a slow import or a confusing pod failure.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

MKIMAGE = Path(__file__).resolve().parents[2] / "e2e" / "cluster" / "mkimage.py"


def layer(path: Path, name: str, data: bytes) -> Path:
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return path


def mkimage(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(MKIMAGE), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def read(archive: Path) -> tuple[dict, dict, list[bytes]]:
    with tarfile.open(archive) as t:
        (entry,) = json.load(t.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(t.extractfile(entry["Config"]))  # type: ignore[arg-type]
        layers = [t.extractfile(m).read() for m in entry["Layers"]]  # type: ignore[union-attr]
    return entry, config, layers


def test_from_copies_layers_and_environment(tmp_path: Path) -> None:
    a = layer(tmp_path / "a.tar", "etc/a", b"base")
    b = layer(tmp_path / "b.tar", "opt/b", b"app")
    base = tmp_path / "base.tar"
    assert mkimage("-o", base, "--tag", "localhost/t/base:1", "--layer", a, "--layer", b,
                   "--env", "PATH=/opt/bin:/usr/bin", "--user", "0:0",
                   "--entrypoint", '["serve"]').returncode == 0
    extra = layer(tmp_path / "c.tar", "tmp/c", b"extra")
    out = tmp_path / "workload.tar"
    proc = mkimage("-o", out, "--tag", "localhost/t/workload:1", "--from", base,
                   "--layer", extra, "--user", "1000:1000", "--entrypoint", "[]",
                   "--cmd", '["python3"]')
    assert proc.returncode == 0, proc.stderr

    _, base_cfg, base_layers = read(base)
    entry, cfg, layers = read(out)
    assert entry["RepoTags"] == ["localhost/t/workload:1"]
    assert layers == [*base_layers, extra.read_bytes()]
    assert cfg["rootfs"]["diff_ids"] == [
        *base_cfg["rootfs"]["diff_ids"], "sha256:" + hashlib.sha256(extra.read_bytes()).hexdigest()]
    assert cfg["config"]["Env"] == ["PATH=/opt/bin:/usr/bin"]  # inherited
    assert cfg["config"]["User"] == "1000:1000"
    assert cfg["config"]["Entrypoint"] == [] and cfg["config"]["Cmd"] == ["python3"]
    # The source archive is untouched and still readable.
    assert read(base)[2] == base_layers


def test_needs_a_layer_or_a_base(tmp_path: Path) -> None:
    proc = mkimage("-o", tmp_path / "x.tar", "--tag", "localhost/t/x:1")
    assert proc.returncode == 2
    assert "give --from or at least one --layer" in proc.stderr
    assert "Traceback" not in proc.stderr
