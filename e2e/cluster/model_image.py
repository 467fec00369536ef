"""The small model of the image-volume scenario (test_image_volume.py), and its image.

Why: Kubernetes image volumes (``volumes[].image``, GA in 1.36) are one way users ship
models (KServe's ModelCar and ModelPack images). The scenario mounts an OCI image holding
this model into the staging sidecar as its source and checks what the loader returns
against the bytes defined here, so the model must be the same on every machine: every
tensor's bytes come from SHAKE-256 of its name (no numpy, no random generator whose
stream could change between versions), the safetensors files are written by hand (the
format is a length, a JSON header and the raw bytes), and the layer tarball has fixed
owners, modes and times.

The image is laid out as a Hugging Face snapshot copied with its links, in the
ModelCar convention (the model below ``/models``):

    /models/config.json
    /models/tokenizer_config.json
    /models/model.safetensors.index.json
    /models/model-00001-of-00002.safetensors       a regular file
    /models/model-00002-of-00002.safetensors  ->  ../blobs/<sha256>   (relative link)
    /models/.gitattributes                          hidden: the sidecar skips it
    /blobs/<sha256>                                 the second shard's bytes

Every entry belongs to root (0:0), files 0644 and directories 0755, as `COPY` in an image
build makes them; the pods read them as uid 1000.

Usage: model_image.py layer OUT.tar      the image's one layer (images.sh)
       model_image.py expected           what the loader must return, as JSON
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sys
import tarfile

MODEL = "tiny"          # the name the sidecar stages it under (--name)
SOURCE = "models"       # the model's directory in the image
MTIME = 1700000000      # every entry's mtime (the sidecar's fingerprint ignores mtimes)

# (shard, tensor name, safetensors dtype, shape); 5.0 MiB of tensor data in all.
TENSORS: list[tuple[int, str, str, tuple[int, ...]]] = [
    (1, "model.embed_tokens.weight", "F16", (1024, 512)),          # 1 MiB
    (1, "model.layers.0.mlp.up_proj.weight", "F32", (512, 512)),   # 1 MiB
    (1, "model.layers.0.input_layernorm.weight", "F32", (512,)),
    (2, "model.layers.1.mlp.up_proj.weight", "BF16", (1024, 1024)),  # 2 MiB
    (2, "model.layers.1.input_layernorm.weight", "F32", (512,)),
    (2, "model.norm.weight", "F16", (512,)),
    (2, "lm_head.weight", "F16", (512, 1024)),                     # 1 MiB
    (2, "model.layers.1.attn.scale", "F32", ()),                   # a scalar
]
ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "I64": 8}
SHARDS = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
CONFIG = {"architectures": ["CsiPmemE2ETiny"], "model_type": "csi-pmem-e2e-tiny",
          "hidden_size": 512, "num_hidden_layers": 2, "vocab_size": 1024,
          "torch_dtype": "float16"}
TOKENIZER_CONFIG = {"model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def tensor_bytes(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    return hashlib.shake_256(f"csi-pmem-e2e-model/{name}".encode()).digest(nbytes(dtype, shape))


def safetensors_file(shard: int) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = []
    offset = 0
    for s, name, dtype, shape in TENSORS:
        if s != shard:
            continue
        blob = tensor_bytes(name, dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        data.append(blob)
        offset += len(blob)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(data)


def json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def files() -> dict[str, bytes]:
    """{path in the model directory: bytes} of what the sidecar must stage."""
    shards = {SHARDS[s]: safetensors_file(s) for s in SHARDS}
    index = {"metadata": {"total_size": sum(nbytes(d, sh) for _, _, d, sh in TENSORS)},
             "weight_map": {name: SHARDS[s] for s, name, _, _ in TENSORS}}
    return {"config.json": json_bytes(CONFIG),
            "tokenizer_config.json": json_bytes(TOKENIZER_CONFIG),
            "model.safetensors.index.json": json_bytes(index), **shards}


def expected() -> dict[str, object]:
    """What a load of the staged model must give: every tensor's dtype, shape and the
    SHA-256 of its bytes, and the SHA-256 of every staged file."""
    return {"model": MODEL,
            "tensors": {name: {"dtype": dtype, "shape": list(shape),
                               "sha256": hashlib.sha256(tensor_bytes(name, dtype, shape))
                               .hexdigest()}
                        for _, name, dtype, shape in TENSORS},
            "files": {path: hashlib.sha256(data).hexdigest()
                      for path, data in sorted(files().items())}}


def write_layer(out: str) -> None:
    """The image's layer: a plain tar, entries sorted, owned by root, fixed times."""
    content = files()
    linked = SHARDS[2]
    blob = hashlib.sha256(content[linked]).hexdigest()
    entries: list[tuple[str, str, bytes | str]] = [   # (path, kind, data or link target)
        ("blobs", "dir", b""), (f"blobs/{blob}", "file", content.pop(linked)),
        (SOURCE, "dir", b""), (f"{SOURCE}/{linked}", "link", f"../blobs/{blob}"),
        (f"{SOURCE}/.gitattributes", "file", b"*.safetensors filter=lfs diff=lfs\n"),
    ]
    entries += [(f"{SOURCE}/{path}", "file", data) for path, data in content.items()]
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path, kind, data in sorted(entries):
            info = tarfile.TarInfo(path)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = MTIME
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "link":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, str(data)
                tar.addfile(info)
            else:
                assert isinstance(data, bytes)
                info.mode, info.size = 0o644, len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["layer"] and len(argv) == 2:
        write_layer(argv[1])
    elif argv == ["expected"]:
        print(json.dumps(expected(), indent=2, sort_keys=True))
    else:
        print(__doc__.rsplit("Usage: ", 1)[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
