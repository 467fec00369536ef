#!/usr/bin/env bash
# make e2e-cluster: build (cached) -> images (cached) -> up -> pytest -> down.
# down.sh runs on every exit path (success, test failure, Ctrl-C, a failed step).
#
# Usage: e2e/cluster/run.sh [--keep] [--storage-e2e] [-- PYTEST_ARGS...]
#   --keep         leave the cluster running after the tests (down.sh later, by hand)
#   --storage-e2e  run Kubernetes' external storage e2e suite (storage-e2e/suite.sh)
#                  instead of test_cluster.py; all results (logs, timings) then go to
#                  $E2E_RESULTS/storage-e2e (default build/e2e-cluster/storage-e2e)
# Env: CSI_PMEM_CACHE (binary and image cache), E2E_ROOT (default /tmp/csi-pmem-e2e),
#      E2E_RESULTS (default build/e2e-cluster): junit.xml, results.json, timings, logs,
#      E2E_NODES (default 2): 2 runs test_cluster.py and test_memory_backend.py on
#      node A, then test_two_nodes.py on both, then test_node_crash.py (kills node B;
#      down.sh cleans up after it); 1 brings up node A alone and runs test_cluster.py
#      and test_memory_backend.py only.
#      E2E_NRI=1: containerd 2.x with NRI (build.sh containerd nri) and test_nri.py and
#      test_image_volume.py too.
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
cd "${repo}"
keep=0
storage=0
pytest_args=()
while (($#)); do
  case "$1" in
    --keep) keep=1 ;;
    --storage-e2e) storage=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
export E2E_ROOT="${E2E_ROOT:-/tmp/csi-pmem-e2e}"
export E2E_NODES="${E2E_NODES:-2}"
# test_memory_backend.py installs a release of its own (backend.type memory) on node A
# once test_cluster.py's is gone, and uninstalls it before test_two_nodes.py's.
tests=("${here}/test_cluster.py" "${here}/test_memory_backend.py")
[[ "${E2E_NODES}" == 1 ]] || tests+=("${here}/test_two_nodes.py")
results="${E2E_RESULTS:-${repo}/build/e2e-cluster}"
((storage)) && results="${E2E_RESULTS:-${repo}/build/e2e-cluster}/storage-e2e"
mkdir -p "${results}"
rm -rf "${results}/driver-logs" "${results}/results.json" "${results}/junit.xml" \
  "${results}/results-two-nodes.json"
export E2E_LOG_DIR="${results}/logs"
timings="${results}/timings.txt"
: > "${timings}"
t0=$(date +%s)
step() { echo "$1 $(( $(date +%s) - $2 ))" >> "${timings}"; }

[[ "$(id -u)" == 0 ]] || { echo "run.sh: run as root" >&2; exit 1; }
# One test bed per host: the bridge, ports and chains are fixed names.
exec 9> /tmp/csi-pmem-e2e-cluster.lock
flock -n 9 || { echo "run.sh: another e2e-cluster run holds /tmp/csi-pmem-e2e-cluster.lock" >&2
                exit 1; }
# The Kubernetes client for the tests (the e2e extra).
.venv/bin/python -c 'import kubernetes as k, sys; sys.exit(int(k.__version__.split(".")[0]) >= 37)' \
  2>/dev/null \
  || .venv/bin/python -m pip install -q -e '.[e2e]'

s=$(date +%s); bindir=$(bash "${here}/build.sh" all | tail -1)
((storage)) && suitebin=$(bash "${here}/build.sh" suite | tail -1)
step build "${s}"
if [[ "${E2E_NRI:-0}" == 1 ]]; then
  s=$(date +%s)
  E2E_CONTAINERD_BIN=$(bash "${here}/build.sh" containerd | tail -1)
  E2E_NRI_BIN="$(bash "${here}/build.sh" nri | tail -1)/csi-pmem-nri"
  export E2E_CONTAINERD_BIN E2E_NRI_BIN
  step build-nri "${s}"
  # containerd 2.x: also image volumes (the model image of images.sh) as the source.
  tests+=("${here}/test_nri.py" "${here}/test_image_volume.py")
fi
# Last: it leaves node B dead with a pod on it, for the tear-down to clean up.
[[ "${E2E_NODES}" == 1 ]] || tests+=("${here}/test_node_crash.py")
s=$(date +%s); images_env=$(bash "${here}/images.sh" "${bindir}" | tail -1); step images "${s}"

cleanup() {
  local rc=$?
  if ((keep)); then
    echo "run.sh: cluster left running (--keep): KUBECONFIG=${E2E_ROOT}/admin.kubeconfig;" \
      "stop it with E2E_ROOT=${E2E_ROOT} ${here}/down.sh" >&2
  else
    local s; s=$(date +%s)
    bash "${here}/down.sh" || rc=1
    step down "${s}"
  fi
  step total "${t0}"
  echo "run.sh: timings (s):" $(tr '\n' ' ' < "${timings}") >&2
  exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

s=$(date +%s); cluster_env=$(bash "${here}/up.sh" "${bindir}" "${images_env}" | tail -1)
step up "${s}"
s=$(date +%s)
if ((storage)); then
  ((${#pytest_args[@]} == 0)) || { echo "run.sh: --storage-e2e takes no pytest arguments" \
    "(narrow it with E2E_STORAGE_FOCUS)" >&2; exit 2; }
  bash "${here}/storage-e2e/suite.sh" "${cluster_env}" "${images_env}" "${suitebin}" \
    "${results}" || rc=$?
  step tests "${s}"
  exit "${rc:-0}"
fi
E2E_CLUSTER_ENV="${cluster_env}" E2E_RESULTS="${results}" \
  .venv/bin/python -m pytest -p no:cacheprovider -q -ra --durations=0 \
  --junitxml "${results}/junit.xml" "${tests[@]}" ${pytest_args[@]+"${pytest_args[@]}"} \
  || rc=$?
step tests "${s}"
exit "${rc:-0}"
