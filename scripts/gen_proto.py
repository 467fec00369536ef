"""Generate (or check) the CSI gRPC stubs in csi_pmem/csi from proto/csi.proto.

Why a script: the stubs must import each other as ``csi_pmem.csi.csi_pb2``, which
protoc only does when the proto sits at that path on its include path. We stage the
vendored proto under a temporary tree shaped like the package, run grpc_tools.protoc,
and either write the result (``--write``) or compare it with what is committed
(``--check``, run in CI so nobody edits generated code by hand).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "csi.proto"
OUT = ROOT / "csi_pmem" / "csi"
GENERATED = ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py")


def generate(dest: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "csi_pmem" / "csi"
        staged.mkdir(parents=True)
        shutil.copy(PROTO, staged / "csi.proto")
        include = Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main([
            "protoc", f"-I{tmp}", f"-I{include}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
            str(staged / "csi.proto"),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        dest.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(staged / name, dest / name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate csi_pmem/csi")
    mode.add_argument("--check", action="store_true", help="fail if csi_pmem/csi is stale")
    args = ap.parse_args()
    if args.write:
        generate(OUT)
        print(f"wrote {', '.join(GENERATED)} to {OUT.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in GENERATED
                 if (Path(tmp) / n).read_bytes() != (OUT / n).read_bytes()]
    if stale:
        print(f"generated stubs differ from proto/csi.proto: {stale}; "
              "run `make proto` and commit the result", file=sys.stderr)
        return 1
    print("generated CSI stubs match proto/csi.proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
