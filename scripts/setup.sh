#!/usr/bin/env bash
# Set up everything the driver and its tests need on a fresh Debian 12 machine:
# system packages (util-linux for mount/losetup/blkid, e2fsprogs and xfsprogs for fsdax
# file systems, libudev for pyudev, libpmem for durable stores into device-dax), a virtual
# environment in .venv with the project and its driver, test and dev extras, pip's cache
# kept in ~/.cache/pip between runs. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v losetup >/dev/null || need_apt+=(util-linux)
command -v mount >/dev/null || need_apt+=(mount)
# fsdax file systems: blkid (probe), mkfs.ext4 and mkfs.xfs.
command -v blkid >/dev/null || need_apt+=(util-linux)
command -v mkfs.ext4 >/dev/null || need_apt+=(e2fsprogs)
command -v mkfs.xfs >/dev/null || need_apt+=(xfsprogs)
# The cache listing first: "ldconfig -p | grep -q" under pipefail fails when grep exits
# at its match while ldconfig still writes (SIGPIPE), and would ask apt for nothing.
libs=$(ldconfig -p 2>/dev/null || true)
grep -q 'libudev.so.1 ' <<<"${libs}" || need_apt+=(libudev1)
# PMDK's libpmem: the weight loader persists stores into device-dax with pmem_persist.
grep -q 'libpmem.so.1 ' <<<"${libs}" || need_apt+=(libpmem1)
python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# A C compiler and libc's headers: the install builds the loader's native bounce loop
# (setup.py; tests/unit/test_loader_native.py fails without it).
command -v gcc >/dev/null || need_apt+=(gcc)
[ -f /usr/include/pthread.h ] || need_apt+=(libc6-dev)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing system packages: ${need_apt[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  else
    echo "setup: missing system packages: ${need_apt[*]} (run as root or install them)" >&2
    exit 1
  fi
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python >= 3.11 is required ($("$PY" --version))" >&2
  exit 1
fi
# setup.py and the C source: the editable install compiles the loader's native bounce
# loop in place (csi_pmem/loader/gpu/_native/bounce.c), so a change to either reinstalls.
stamp=.venv/.installed-$(cat pyproject.toml setup.py csi_pmem/loader/gpu/_native/bounce.c | sha256sum | cut -c1-16)
# Said before each step: on a fresh clone they take about a minute together, and pip -q
# prints nothing but setuptools' warnings meanwhile.
if [ ! -f "$stamp" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating the virtual environment .venv ($("$PY" --version))"
    "$PY" -m venv .venv
  fi
  echo "setup: upgrading pip in .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  echo "setup: installing csi-pmem[driver,test,dev] into .venv (editable, builds the" \
    "loader's native bounce loop; about a minute on a fresh clone, setuptools may warn)"
  .venv/bin/python -m pip install -q -e '.[driver,test,dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
echo "setup: ready ($(.venv/bin/python --version), $(.venv/bin/python -c 'import grpc; print("grpcio", grpc.__version__)'))"
