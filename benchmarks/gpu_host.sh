#!/usr/bin/env bash
# Prepare a lent GPU host for the GPU benchmarks and tests, in one step.
#
# Why: a GPU machine lent for benchmarks often starts bare, without network, and its
# time counts from its start. Each run needs the same three
# things first, and a forgotten one costs a run: the peers' wheels from .whl/
# (fetch_peer_wheels.sh) installed into /tmp/site, the loader's native bounce loop built
# from source (the repository runs from PYTHONPATH there, so no pip install builds it),
# and a tmpfs with 2 MiB pages at /mnt/h standing in for a devdax namespace.
#
# Usage (on the GPU host, in the repository root):
#   source benchmarks/gpu_host.sh
#   python3 benchmarks/bench_fresh.py --size-gb 14.7 --rounds 3 --timeout-s 60 \
#       --volume /dev/shm/csi-pmem-fresh/volume.img --volume /mnt/h/volume.img
# It exports PYTHONPATH (/tmp/site, the repository, benchmarks/) and prints one line per
# step. HUGE_TMPFS_SIZE (default 40G) sizes /mnt/h.
_gpu_host() {
  local root site=/tmp/site
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  if compgen -G "${root}/.whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "${site}" "${root}"/.whl/*.whl || return 1
    echo "gpu_host: peer wheels installed into ${site}: $(cd "${root}/.whl" && ls | tr '\n' ' ')"
  else
    echo "gpu_host: no .whl/ (benchmarks/fetch_peer_wheels.sh, carried to this host): the peers will be 'not installed'"
  fi
  gcc -O2 -std=gnu11 -shared -fPIC -o "${root}/csi_pmem/loader/gpu/_native/bounce.so" \
    "${root}/csi_pmem/loader/gpu/_native/bounce.c" -ldl -lpthread || return 1
  echo "gpu_host: native bounce loop built"
  mkdir -p /mnt/h
  if ! mountpoint -q /mnt/h; then
    mount -t tmpfs -o "size=${HUGE_TMPFS_SIZE:-40G},huge=always" tmpfs /mnt/h || return 1
  fi
  echo "gpu_host: /mnt/h: $(findmnt -no FSTYPE,OPTIONS /mnt/h)"
  export PYTHONPATH="${site}:${root}:${root}/benchmarks${PYTHONPATH:+:${PYTHONPATH}}"
  nvidia-smi -L 2>/dev/null | sed 's/^/gpu_host: /'
}
_gpu_host
