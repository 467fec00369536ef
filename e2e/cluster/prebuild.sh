#!/usr/bin/env bash
# Start the cluster tiers' Go builds (build.sh: Kubernetes, etcd, the sidecars, the
# storage suite, containerd 2.x and the NRI plugin) in the background, at the lowest CPU
# and I/O priority, and return at once. `make test` runs this first.
#
# Why: on a fresh machine those builds take most of an hour on 2 cores, and the tiers
# before them (the host tests, the QEMU guest) leave CPU idle: tests wait on gRPC, mounts
# and a TCG guest that runs one test at a time. At nice 19 the builds take only what the
# tiers leave, and when a tier that needs a binary gets there, build.sh waits for the
# build of that target (a lock per target) and finds it cached. Warm, every target is a
# check of its cache, done in seconds. No apt here (build.sh debs stays in the
# foreground: dpkg's lock) and no helm (make check builds it).
#
# Usage: e2e/cluster/prebuild.sh      Log: build/prebuild.log; PID: build/prebuild.pid
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
mkdir -p "${repo}/build"
log="${repo}/build/prebuild.log"
command -v go >/dev/null || { echo "prebuild: no go on PATH; the tiers build in the" \
  "foreground" >&2; exit 0; }
setsid nice -n 19 ionice -c 3 bash -c '
  for t in k8s provisioner etcd sidecars suite containerd nri; do
    s=$(date +%s)
    if bash "$1/build.sh" "$t" >/dev/null; then r=ok; else r=FAILED; fi
    echo "prebuild: $t $r in $(( $(date +%s) - s )) s"
  done' prebuild "${here}" > "${log}" 2>&1 < /dev/null &
echo $! > "${repo}/build/prebuild.pid"
echo "prebuild: cluster builds started in the background (pid $!, log ${log})" >&2
