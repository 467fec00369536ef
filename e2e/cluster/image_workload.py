"""What the image-volume scenario's load container runs (test_image_volume.py; /e2e).

Why a script of its own: the test must see, from inside the restricted pod, both what
the image volume holds (the files as the kubelet and containerd mounted them: owner,
mode, links, read-only) and what the loader returns from the csi-pmem volume the
sidecar staged it into, hashed tensor by tensor, to compare both with the bytes
model_image.py defines. The last line of the log is ``RESULT {json}``.

Usage: image_workload.py load      (E2E_VOLUME: the claim, E2E_SOURCE: the model in
                                    the image volume, E2E_MODEL: the staged name)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

VOLUME = os.environ.get("E2E_VOLUME", "/models")
SOURCE = os.environ.get("E2E_SOURCE", "/source/models")
MODEL = os.environ.get("E2E_MODEL", "tiny")


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw, sort_keys=True), flush=True)


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def mount_of(path: str) -> dict[str, str]:
    """The mountinfo entry of the mount holding ``path`` (the longest mount point)."""
    best: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            mp, opts = fields[4], fields[5]
            if (path == mp or path.startswith(mp.rstrip("/") + "/")) and \
                    len(mp) >= len(best.get("mount_point", "")):
                fstype = right.split()[0]
                best = {"mount_point": mp, "options": opts, "fstype": fstype}
    return best


def source_tree(root: str) -> dict[str, dict[str, object]]:
    """Every entry below the image volume's root (hidden ones too), as the pod sees it."""
    out: dict[str, dict[str, object]] = {}
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(top, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            entry: dict[str, object] = {"uid": st.st_uid, "gid": st.st_gid,
                                        "mode": oct(stat.S_IMODE(st.st_mode))}
            if stat.S_ISLNK(st.st_mode):
                entry["link"] = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    entry["sha256"] = sha256(f.read())
            else:
                entry["kind"] = "dir" if stat.S_ISDIR(st.st_mode) else "other"
            out[rel] = entry
    return out


def write_refused(path: str) -> str:
    """What creating a file in the image volume gives: the errno's name, or "allowed"."""
    try:
        fd = os.open(os.path.join(path, "e2e-write-probe"), os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    os.close(fd)
    return "allowed"


def source_tensors(src: str) -> dict[str, str]:
    """SHA-256 of every tensor's bytes, read from the image's safetensors files with
    plain reads (the header parsed here, not by the loader)."""
    out = {}
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        for t, info in header.items():
            if t == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[t] = sha256(data[8 + n + a:8 + n + b])
    return out


def load() -> int:
    from csi_pmem.loader import load_numpy, open_model, read_aux
    from csi_pmem.loader.auxfiles import aux_files

    out: dict[str, object] = {"uid": os.getuid(), "gid": os.getgid()}
    image_root = os.path.dirname(SOURCE.rstrip("/"))
    out["source_mount"] = mount_of(SOURCE)
    out["source_tree"] = source_tree(image_root)
    out["source_write"] = write_refused(SOURCE)
    out["source_tensors"] = source_tensors(SOURCE)

    view = open_model(VOLUME, MODEL)
    out["volume_source"] = str(view.volume.source)
    out["revision"] = view.model.revision
    out["state"] = view.model.state
    out["staged_files"] = sorted(f.name for f in view.model.files)
    infos = {t.name: t for h in view.headers.values() for t in h.tensors.values()}
    arrays = load_numpy(view)
    out["tensors"] = {name: {"dtype": infos[name].dtype, "shape": list(infos[name].shape),
                             "sha256": sha256(arr.tobytes())}
                      for name, arr in sorted(arrays.items())}
    out["aux"] = {f.name: sha256(read_aux(view, f.name)) for f in aux_files(view)}
    p = subprocess.run(["csi-pmem-weights", "verify", VOLUME, "--model", MODEL],
                       capture_output=True, text=True, timeout=120)
    out["verify"] = {"rc": p.returncode, "out": (p.stdout + p.stderr)[-2000:]}
    same = {n: v["sha256"] for n, v in out["tensors"].items()} == out["source_tensors"]
    result(ok=same and p.returncode == 0, same_as_source=same, **out)
    return 0 if same and p.returncode == 0 else 1


def main(argv: list[str]) -> int:
    if argv == ["load"]:
        try:
            return load()
        except Exception as exc:  # the test reads the RESULT line, not a traceback
            result(ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
    print(__doc__.rsplit("Usage: ", 1)[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
