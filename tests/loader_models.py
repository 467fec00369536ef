"""Small synthetic safetensors models and volume files for the loader tests.

Why our own writer beside ``safetensors.numpy.save_file``: numpy cannot hold bf16 or
fp8, and the tests also need files the reference writer never produces (unaligned
tensor offsets, truncated headers).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np

MiB = 1 << 20


def write_raw(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
              metadata: dict[str, str] | None = None, pad_to: int = 8) -> Path:
    """Write a safetensors file from (dtype name, shape, raw bytes) in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % pad_to)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, data in tensors.values():
            f.write(data)
    return path


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def numpy_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """One tensor per dtype numpy and safetensors share, plus empty ones."""
    r = rng(seed)
    return {
        "f16": r.standard_normal((17, 5)).astype(np.float16),
        "f32": r.standard_normal((3, 4, 5)).astype(np.float32),
        "f64": r.standard_normal(7),
        "i8": r.integers(-128, 127, (33,), dtype=np.int8),
        "u8": r.integers(0, 255, (2, 9), dtype=np.uint8),
        "i16": r.integers(-999, 999, (11,), dtype=np.int16),
        "i32": r.integers(-2**31, 2**31 - 1, (6, 2), dtype=np.int32),
        "i64": r.integers(-2**62, 2**62, (5,), dtype=np.int64),
        "u16": r.integers(0, 60000, (4,), dtype=np.uint16),
        "bool": r.integers(0, 2, (3, 7)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0,), dtype=np.float32),
        "empty2d": np.zeros((4, 0), dtype=np.float16),
    }


def save_numpy_model(directory: Path, tensors: dict[str, np.ndarray],
                     name: str = "model.safetensors") -> Path:
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name), metadata={"format": "np"})
    return directory / name


def bf16_model(directory: Path, seed: int = 1) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """A file with bf16 and fp8 tensors (raw bytes) and an unaligned f32 tensor."""
    r = rng(seed)
    tensors = {
        "w_bf16": ("BF16", (8, 16), r.integers(0, 65535, 128, dtype=np.uint16).tobytes()),
        "w_fp8": ("F8_E4M3", (64,), r.integers(0, 255, 64, dtype=np.uint8).tobytes()),
        "odd_u8": ("U8", (3,), b"\x01\x02\x03"),
        # After 3 bytes: this f32 tensor sits at an offset that is not a multiple of 4.
        "unaligned_f32": ("F32", (5,), r.standard_normal(5).astype("<f4").tobytes()),
        "empty_bf16": ("BF16", (0, 3), b""),
    }
    directory.mkdir(parents=True, exist_ok=True)
    write_raw(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps({"model_type": "test"}))
    return tensors


def many_small_model(directory: Path, count: int = 2000) -> dict[str, np.ndarray]:
    r = rng(2)
    tensors = {f"layer.{i}.w": r.standard_normal(int(r.integers(0, 40))).astype(np.float32)
               for i in range(count)}
    save_numpy_model(directory, tensors)
    return tensors


def large_model(directory: Path, nbytes: int = 64 * MiB) -> dict[str, np.ndarray]:
    r = rng(3)
    tensors = {"big": r.integers(0, 2**31, nbytes // 4, dtype=np.int32).view(np.float32),
               "tail": np.arange(10, dtype=np.float32)}
    save_numpy_model(directory, tensors)
    return tensors


def sharded_model(directory: Path, shards: int = 3, per_shard: int = 4) -> dict[str, np.ndarray]:
    """A Hugging Face style sharded model: shards, an index json and config files."""
    from safetensors.numpy import save_file

    r = rng(4)
    directory.mkdir(parents=True, exist_ok=True)
    everything: dict[str, np.ndarray] = {}
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {f"layers.{s}.{j}.weight": r.standard_normal((64, 32 + j)).astype(np.float16)
                for j in range(per_shard)}
        save_file(part, str(directory / fname))
        everything.update(part)
        weight_map.update({k: fname for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(a.nbytes for a in everything.values())},
         "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": shards}))
    (directory / "tokenizer").mkdir()
    (directory / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    return everything


def volume_file(path: Path, size: int = 64 * MiB) -> Path:
    """A sparse file standing in for a devdax volume (size a multiple of 2 MiB)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def tree_digest(directory: Path) -> dict[str, bytes]:
    """Relative path -> content of every file below ``directory``."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def staged_volume(src: Path, path: Path, size: int = 64 * MiB, name: str = "m") -> Path:
    """Stage ``src`` into a fresh plain-file volume at ``path``."""
    from csi_pmem.loader import open_volume, stage

    volume_file(path, size)
    with open_volume(path, writable=True) as vol:
        stage(vol, str(src), name=name)
    return path


def can_make_loop_devices() -> bool:
    return os.geteuid() == 0 and shutil.which("losetup") is not None and \
        os.path.exists("/dev/loop-control")


@contextlib.contextmanager
def loop_device(backing: Path) -> Iterator[str]:
    """A loop block device over ``backing`` (root only; stands in for an fsdax
    ``/dev/pmemX.Y``), detached afterwards."""
    device = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                            capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True,
                       timeout=30)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextlib.contextmanager
def tmpfs(point: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``point`` (root only): a small file system
    that really runs out of space."""
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True,
                       timeout=30)


@contextlib.contextmanager
def read_only_bind(directory: Path, point: Path) -> Iterator[Path]:
    """``directory`` bind-mounted read-only at ``point`` (root only), as kubelet binds a
    read-only publish."""
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(directory), str(point)], check=True,
                   capture_output=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(point)], check=True,
                       capture_output=True, timeout=30)
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True,
                       timeout=30)


def fake_mountinfo(path: Path, mounts: list[tuple[str, str, str, str]],
                   dev_of: Path | None = None, dev: str = "254:0") -> Path:
    """Write a mountinfo file: (mount point, fstype, source, super options) per mount,
    under an ext4 root. Every listed mount gets ``dev_of``'s device (the file system
    the test's files really are on) or else ``dev``, the root another one."""
    if dev_of is not None:
        st = os.stat(dev_of)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    lines = ["20 1 254:77 / / rw,relatime shared:1 - ext4 /dev/vda rw"]
    for i, (point, fstype, source, options) in enumerate(mounts):
        lines.append(f"{30 + i} 20 {dev} / {point} rw,relatime shared:{2 + i} - "
                     f"{fstype} {source} {options}")
    path.write_text("\n".join(lines) + "\n")
    return path


def mapped_files() -> set[str]:
    """Paths of the files this process maps now (``/proc/self/maps``): what keeps a
    volume's file, and so its mount, in use."""
    with open("/proc/self/maps") as f:
        return {fields[5].rstrip("\n") for line in f
                if len(fields := line.split(None, 5)) == 6}


def reference(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the model's safetensors files, read by safetensors itself."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same(got: dict, ref: dict) -> None:
    """Same names, dtypes, shapes and bytes as ``ref`` (numpy arrays)."""
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


@contextlib.contextmanager
def shm_scratch(tmp_path: Path, prefix: str) -> Iterator[Path]:
    """A scratch directory on tmpfs when there is one (what an emulated volume lives on)."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    d = base / f"{prefix}-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def staging_interrupted_at(monkeypatch, prefix: str) -> Iterator[None]:
    """Within the block, staging raises KeyboardInterrupt on the first chunk of the
    file whose name starts with ``prefix`` (a stager killed mid-copy)."""
    from csi_pmem.loader import staging

    real = staging._copy_chunk

    def stop(volume, reader, entry, off, length, algo):
        if entry.name.startswith(prefix):
            raise KeyboardInterrupt
        return real(volume, reader, entry, off, length, algo)

    monkeypatch.setattr(staging, "_copy_chunk", stop)
    try:
        yield
    finally:
        monkeypatch.setattr(staging, "_copy_chunk", real)


def small_chunk_cli(chunk: int) -> str:
    """The code of a ``python -c`` child that is ``csi-pmem-weights`` with its stages
    planned in ``chunk``-byte checksum chunks: several per file of a tiny model, so
    that a test can stop a real stage between two chunks."""
    return f"""import sys
from csi_pmem.loader import cli, staging
real = staging.allocate
def allocate(*args, **kw):
    model = real(*args, **kw)
    model.chunk_size = {chunk}
    return model
staging.allocate = allocate
sys.exit(cli.main(sys.argv[1:]))
"""


def plan_small_chunks(monkeypatch, chunk: int) -> None:
    """In this process, stages are planned in ``chunk``-byte checksum chunks (what
    :func:`small_chunk_cli` does for a child)."""
    from csi_pmem.loader import staging

    real = staging.allocate

    def allocate(*args, **kw):
        model = real(*args, **kw)
        model.chunk_size = chunk
        return model

    monkeypatch.setattr(staging, "allocate", allocate)
