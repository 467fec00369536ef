"""Write a docker-archive image (what `docker save` writes) from layer tarballs.

Why: there is no Docker engine and no registry here; containerd's `ctr images import`
reads this format. Layers are plain (uncompressed) tar files, so a layer's diff id is the
sha256 of the file itself, and two images that share a layer file share it in
containerd's content store too.

Usage: mkimage.py -o out.tar --tag NAME:TAG [--tag ...] [--from ARCHIVE] [--layer L1.tar]...
       [--entrypoint JSON] [--cmd JSON] [--env K=V]... [--user U] [--workdir D]

--from starts from the layers and environment of another docker-archive (the workload
image is the driver image that `make image` built, run as another user): its layers are
copied byte for byte, so containerd stores them once for both images.
"""

from __future__ import annotations

import argparse
import copy
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
    p.add_argument("--from", dest="base", default=None, help="docker-archive to start from")
    p.add_argument("--layer", action="append", default=[])
    p.add_argument("--entrypoint", default=None, help="JSON list")
    p.add_argument("--cmd", default=None, help="JSON list")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--user", default="")
    p.add_argument("--workdir", default="/")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE")
    args = p.parse_args(argv)

    if not args.base and not args.layer:
        p.error("give --from or at least one --layer")
    base_layers: list[tuple[str, str]] = []  # (diff id, member of the --from archive)
    base_env: list[str] = []
    if args.base:
        with tarfile.open(args.base) as src:
            (entry,) = json.load(src.extractfile("manifest.json"))  # type: ignore[arg-type]
            base_cfg = json.load(src.extractfile(entry["Config"]))  # type: ignore[arg-type]
        base_ids = [d.removeprefix("sha256:") for d in base_cfg["rootfs"]["diff_ids"]]
        base_layers = list(zip(base_ids, entry["Layers"], strict=True))
        base_env = base_cfg.get("config", {}).get("Env") or []
    diff_ids = [d for d, _ in base_layers] + [sha256_file(layer) for layer in args.layer]
    cfg: dict = {"Env": args.env or base_env or
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
        if base_layers:
            with tarfile.open(args.base) as src:
                for d, member in base_layers:
                    data = src.extractfile(member)
                    info = copy.copy(src.getmember(member))  # the source's own entry stays
                    info.name = f"{d}/layer.tar"
                    tar.addfile(info, data)
        for d, layer in zip(diff_ids[len(base_layers):], args.layer, strict=True):
            tar.add(layer, arcname=f"{d}/layer.tar")
        add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    os.replace(tmp, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
