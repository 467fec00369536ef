"""Write a docker-archive image (what `docker save` writes) from layer tarballs.

Why: there is no Docker engine and no registry here; containerd's `ctr images import`
reads this format. Layers are plain (uncompressed) tar files, so a layer's diff id is the
sha256 of the file itself, and two images that share a layer file share it in
containerd's content store too.

Usage: mkimage.py -o out.tar --tag NAME:TAG [--tag ...] --layer L1.tar [--layer L2.tar]
       [--entrypoint JSON] [--cmd JSON] [--env K=V]... [--user U] [--workdir D]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--tag", action="append", required=True)
    p.add_argument("--layer", action="append", required=True)
    p.add_argument("--entrypoint", default=None, help="JSON list")
    p.add_argument("--cmd", default=None, help="JSON list")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--user", default="")
    p.add_argument("--workdir", default="/")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args(argv)

    diff_ids = [sha256_file(layer) for layer in args.layer]
    cfg: dict = {"Env": args.env or
                 ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                 "WorkingDir": args.workdir}
    if args.entrypoint:
        cfg["Entrypoint"] = json.loads(args.entrypoint)
    if args.cmd:
        cfg["Cmd"] = json.loads(args.cmd)
    if args.user:
        cfg["User"] = args.user
    if args.label:
        cfg["Labels"] = dict(kv.split("=", 1) for kv in args.label)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "e2e/cluster/images.sh"}
                    for _ in diff_ids],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": args.tag,
                 "Layers": [f"{d}/layer.tar" for d in diff_ids]}]

    tmp = args.output + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        add_bytes(tar, config_name, config_bytes)
        for d, layer in zip(diff_ids, args.layer, strict=True):
            tar.add(layer, arcname=f"{d}/layer.tar")
        add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    os.replace(tmp, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
