"""The weights workflow as a user runs it, for the VM tier's guests.

Why a module of its own: the main configuration runs it on volumes the driver
published (devdax through ``dax.sock``, fsdax ext4/xfs image files) and the crash
configurations run it on namespaces that survived a power cut; both need the same
``csi-pmem-weights`` invocations and the same bit-exact checks. Every command is a
fresh ``csi-pmem-weights`` process, and every failure must be a one-line error, never
a traceback.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from csi_pmem.loader import load_numpy, open_volume
from csi_pmem.loader.cli import EXIT_MISMATCH
from csi_pmem.weights import layout

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import loader_models as lm  # noqa: E402


def cli(*args: Any, rc: int | None = 0, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``csi-pmem-weights ARGS`` in a fresh process; check its exit status (None:
    any) and that it never printed a traceback."""
    proc = subprocess.run([sys.executable, "-m", "csi_pmem.loader.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert "Traceback" not in proc.stderr, f"csi-pmem-weights {args}: {proc.stderr}"
    if rc is not None:
        assert proc.returncode == rc, (f"csi-pmem-weights {' '.join(map(str, args))} exited "
                                       f"{proc.returncode}, not {rc}:\n{proc.stdout}\n"
                                       f"{proc.stderr}")
    return proc


def make_model(directory: Path, big_mib: int = 0, shards: int = 3) -> Path:
    """A small sharded safetensors model with config files (deterministic: the crash
    configurations build it again after the reboot); ``big_mib`` adds one shard of that
    many MiB so a stage takes long enough to be cut in the middle."""
    if directory.exists():
        shutil.rmtree(directory)
    lm.sharded_model(directory, shards=shards)
    (directory / "config.json").write_text(json.dumps({"model_type": "vm-test"}))
    if big_mib:
        lm.large_model(directory / "big", big_mib * lm.MiB)
        for f in (directory / "big").iterdir():
            f.rename(directory / f"big-{f.name}")
        (directory / "big").rmdir()
    return directory


def assert_loads_bit_exact(volume: str, model: Path, name: str | None = None) -> int:
    """Load every tensor on the CPU (views of the mapping) and compare the raw bytes
    with what safetensors itself reads from the source; returns the tensor count."""
    got = load_numpy(volume, **({"model": name} if name else {}))
    ref = lm.reference(model)
    assert sorted(got) == sorted(ref)
    for key, arr in ref.items():
        assert got[key].tobytes() == arr.tobytes(), f"{key} differs"
    # The views keep the mapping (and so an fsdax file system's mount) busy until they
    # are collected: drop them before the caller unpublishes.
    del got
    released(volume)
    return len(ref)


def write_every_byte(arrays: dict[str, Any]) -> int:
    """Writes 0xA5 into every byte of every array and returns the bytes written; in a
    function of its own so that no array (a loop variable) outlives it and keeps the
    volume mapped."""
    total = 0
    for arr in arrays.values():
        arr.reshape(-1).view("u1")[:] = 0xA5
        total += arr.nbytes
    return total


def cpu_writes(volume: str, model: Path, name: str) -> dict[str, Any]:
    """What a write into a CPU-loaded array does here, with the real kernel.

    A devdax volume (a device, or ``dax.sock``) cannot be mapped copy-on-write, so
    ``writes="private"`` is refused with that reason, and ``writes="copy"`` gives
    writable copies. Any other volume (an fsdax image on a ``-o dax`` file system) gets
    private views: every byte written lands in this process's pages. Either way a
    fresh load afterwards is bit-exact: no write reached the volume.
    """
    import mmap
    import stat

    from csi_pmem.weights.errors import LoaderError

    devdax = os.path.exists(os.path.join(volume, "dax.sock")) or \
        stat.S_ISCHR(os.stat(volume).st_mode)
    with open_volume(volume) as v:
        reason = v.private_refused_reason
    fact: dict[str, Any] = {"devdax": devdax, "private_refused_reason": reason}
    if devdax:
        assert reason and "devdax" in reason, reason
        if stat.S_ISCHR(os.stat(volume).st_mode):
            fd = os.open(volume, os.O_RDONLY)
            try:
                mmap.mmap(fd, 2 << 20, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
                fact["kernel_map_private"] = "allowed"
            except OSError as exc:
                fact["kernel_map_private"] = f"refused: {exc}"
            finally:
                os.close(fd)
            assert fact["kernel_map_private"].startswith("refused"), fact
        try:
            load_numpy(volume, model=name, writes="private")
            raise AssertionError("writes='private' on devdax was not refused")
        except LoaderError as exc:
            fact["private_load"] = str(exc)
            assert "devdax" in str(exc), exc
        mode = "copy"
    else:
        assert reason is None, reason
        mode = "private"
    fact["written"] = write_every_byte(load_numpy(volume, model=name, writes=mode))
    fact["mode"] = mode
    fact["bit_exact_after_writes"] = assert_loads_bit_exact(volume, model, name)
    return fact


def released(volume: str, timeout: float = 60) -> None:
    """Wait until this process maps no file below ``volume`` (a published target).

    Why: NodeUnpublishVolume's umount of an fsdax target failed once in this tier with
    "target is busy". A load's futures and their callbacks formed a reference cycle
    holding the tensors, and one gc.collect() did not free it while the host check's
    thread still held it. The loader no longer makes that cycle
    (api._close_when_done); the thread still lets go a moment after the load's
    result() returned, hence a wait, which also checks that nothing else maps the
    volume.
    """
    prefix = os.path.realpath(volume) + "/"
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        held = sorted(p for p in lm.mapped_files() if p.startswith(prefix))
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still mapped by the test after {timeout:.0f} s: {held}")
        time.sleep(0.05)


def persisted_with(stage_stdout: str) -> str:
    m = re.search(r"^persisted with (.*)$", stage_stdout, re.M)
    assert m, f"stage printed no persistence line:\n{stage_stdout}"
    return m.group(1)


def first_weight_offset(volume: str, name: str) -> int:
    """Volume offset of a byte inside the first safetensors file's data."""
    with open_volume(volume) as v:
        model = layout.read_index(v).select(name)
        f = next(f for f in model.files if f.kind == layout.KIND_SAFETENSORS)
        return f.offset + f.length - 1


def verified(volume: str, name: str) -> bool:
    """``verify`` (its JSON, -o json) passed and checked model ``name``."""
    doc = json.loads(cli("verify", volume, "-q", "-o", "json").stdout)
    return doc["ok"] and name in [m["model"] for m in doc["models"]]


def flip_byte(volume: str, offset: int) -> None:
    with open_volume(volume, writable=True) as v:
        v.buffer[offset] ^= 0xFF
        v.persist(offset, 1)


def workflow(volume: str, model: Path, work: Path, *, name: str = "m") -> dict[str, Any]:
    """stage, verify, ls, export byte-identical, CPU load bit-exact, restage (nothing
    copied), a flipped byte caught by verify and repaired by a restage; returns what
    the closing report needs (the persist primitive, counts)."""
    out = cli("stage", model, volume, "--name", name, "-q", "-o", "table").stdout
    fact: dict[str, Any] = {"persist": persisted_with(out), "stage": out.splitlines()[0]}
    assert verified(volume, name)
    assert name in cli("ls", volume).stdout
    export = work / f"export-{name}"
    shutil.rmtree(export, ignore_errors=True)
    cli("export", volume, export, "--model", name, "-q")
    assert lm.tree_digest(export) == lm.tree_digest(model), "export differs from the source"
    fact["tensors"] = assert_loads_bit_exact(volume, model, name)
    fact["cpu_writes"] = cpu_writes(volume, model, name)
    again = cli("stage", model, volume, "--name", name, "-q", "-o", "table").stdout
    assert "already staged" in again and "nothing copied" in again, again
    off = first_weight_offset(volume, name)
    flip_byte(volume, off)
    bad = cli("verify", volume, "-q", "-o", "table", rc=EXIT_MISMATCH).stdout
    assert "bad chunk" in bad, bad
    # stage copies again only the damaged chunk, and says how many bytes it copied.
    repair = cli("stage", model, volume, "--name", name, "-q", "-o", "table").stdout
    assert repair.startswith("repaired ") and ": 1 chunk of 1 file, " in repair, repair
    fact["repair"] = repair.splitlines()[0]
    assert verified(volume, name)
    return fact


def bad_inputs(volume: str, work: Path) -> list[str]:
    """The loader's refusals on this volume: each a one-line error and a non-zero exit."""
    seen = []
    no_weights = work / "no-weights"
    no_weights.mkdir(exist_ok=True)
    (no_weights / "config.json").write_text("{}")
    for args, expect in (
        (("stage", work / "no-such-model", volume, "--name", "x"), "does not exist"),
        (("export", volume, work / "x-out", "--model", "no-such-model"), "no-such-model"),
        (("verify", volume, "--model", "no-such-model"), "no-such-model"),
        (("stage", no_weights, volume, "--name", "x"), "no *.safetensors"),
        (("ls", work / "missing-volume"), "does not exist"),
    ):
        proc = cli(*args, rc=None)
        assert proc.returncode != 0, args
        err = proc.stderr.strip()
        assert err.startswith("csi-pmem-weights: error:") and expect in err, (args, err)
        seen.append(err.splitlines()[0])
    return seen


def sidecar_once(volume: str, model: Path, name: str) -> dict[str, Any]:
    proc = cli("sidecar", "--volume", volume, "--source", model, "--name", name, "--once",
               "--listen", "127.0.0.1:0", "--log-format", "text")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def sidecar_first_and_warm(volume: str, model: Path, name: str = "side") -> dict[str, Any]:
    first = sidecar_once(volume, model, name)
    assert first["action"] == "staged" and first["bytes_copied"] == first["bytes"] > 0, first
    warm = sidecar_once(volume, model, name)
    assert warm["action"] == "already-staged" and warm["bytes_copied"] == 0, warm
    return {"first": {k: first.get(k) for k in ("action", "bytes", "startup_seconds")},
            "warm": {k: warm.get(k) for k in ("action", "bytes_copied", "startup_seconds")}}


def env_without_csi() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CSI_PMEM_")}
