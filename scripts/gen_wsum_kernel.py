"""Compile csi_pmem/loader/gpu/_native/wsum_kernel.cu; write csi_pmem/loader/gpu/wsum_kernel.py.

Why compiled code in the repository: the loader runs in inference pods, which have the
GPU driver (libcuda, reached through cuda-python) and no CUDA toolkit. A cubin for the
GPU's architecture loads in well under a millisecond; PTX is compiled by the driver on
first use, which costs a fresh process milliseconds, so PTX is only the fallback for
GPUs without a cubin here. NVRTC runs on any machine, GPU or not:

    pip install "cuda-bindings>=12.8,<13" "nvidia-cuda-nvrtc-cu12==12.0.*"
    python scripts/gen_wsum_kernel.py

NVRTC 12.0 keeps the PTX (``compute_70``) and the cubins loadable by every CUDA 12
driver (a newer NVRTC writes a PTX version older drivers refuse).
tests/unit/test_wsum_kernel.py checks that the module matches the kernel's source.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "csi_pmem" / "loader" / "gpu" / "_native" / "wsum_kernel.cu"
OUT = ROOT / "csi_pmem" / "loader" / "gpu" / "wsum_kernel.py"
PTX_ARCH = "compute_70"
CUBIN_ARCHS = (80, 86, 89, 90)  # A100; A10/A40; L4/L40S; H100/H200


def compile_for(source: bytes, arch: str) -> tuple[bytes, str]:
    """(PTX or cubin, NVRTC version) of ``source`` for ``arch`` (compute_XY or sm_XY)."""
    from cuda.bindings import nvrtc

    def ok(result):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise SystemExit(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
        return rest[0] if len(rest) == 1 else rest

    major, minor = ok(nvrtc.nvrtcVersion())
    prog = ok(nvrtc.nvrtcCreateProgram(source, b"wsum_kernel.cu", 0, [], []))
    opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(log.decode(errors="replace"))
    if arch.startswith("sm_"):
        size = ok(nvrtc.nvrtcGetCUBINSize(prog))
        image = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, image))
    else:
        size = ok(nvrtc.nvrtcGetPTXSize(prog))
        image = b" " * size
        ok(nvrtc.nvrtcGetPTX(prog, image))
        image = image.rstrip(b"\0")
    return image, f"{major}.{minor}"


def main() -> int:
    source = SOURCE.read_bytes()
    ptx, version = compile_for(source, PTX_ARCH)
    cubins = {cc: base64.b64encode(compile_for(source, f"sm_{cc}")[0]).decode()
              for cc in CUBIN_ARCHS}
    lines = [
        '"""wsum_kernel.cu compiled (by scripts/gen_wsum_kernel.py: do not edit).',
        "",
        f"NVRTC {version}: PTX for {PTX_ARCH}, cubins for "
        + ", ".join(f"sm_{cc}" for cc in CUBIN_ARCHS) + ".",
        '"""',
        "",
        f'SOURCE_SHA256 = "{hashlib.sha256(source).hexdigest()}"',
        'KERNEL = "wsum64_ranges"',
        "BLOCK = 256  # threads per block: the kernel's __launch_bounds__",
        "",
        f"PTX = {ptx.decode()!r}",
        "",
        "# compute capability (major * 10 + minor) -> base64 of the cubin",
        "CUBINS = {",
        *(f"    {cc}: {text!r}," for cc, text in cubins.items()),
        "}",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT.relative_to(ROOT)} (PTX {len(ptx)} bytes, cubins "
          + ", ".join(f"sm_{cc}" for cc in CUBIN_ARCHS) + f"; NVRTC {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
