#!/usr/bin/env bash
# Kubernetes' external storage e2e suite (test/e2e/storage/external) against the chart on
# a running cluster test bed: e2e.test through ginkgo, one run per test-driver manifest
# here (devdax.yaml, fsdax-block.yaml, fsdax-fs.yaml), as the suite's README and
# csi-driver-host-path's CI do it:
#   1. the parallel specs: ginkgo --procs N, skipping [Serial], [Disruptive] and
#      [Feature:...] by their tags ([Slow] ones run: about N minutes here);
#   2. the [Serial] specs of the same manifest, one at a time (--procs 1), after the
#      parallel ones (Serial specs may assume nothing else runs, e.g. volume limits).
# [Disruptive] specs restart kubelet or the node (not possible on this shared host: the
# test bed's kubelet is not a service the suite can restart), and [Feature:...] specs need optional cluster
# features (snapshots, VolumeAttributesClass, SELinux); none of them run, and summary.py
# lists each with that reason. The suite's own skips (capabilities the manifest does not
# claim) are listed with the suite's message, and so are the specs not-applicable.yaml
# names for a manifest (not run, each with the reason).
#
# Usage: suite.sh CLUSTER_ENV IMAGES_ENV SUITE_BIN_DIR RESULTS_DIR
#   (up.sh's cluster.env, images.sh's env file, build.sh suite's bin dir)
# Env: E2E_STORAGE_PROCS      parallel ginkgo processes (default 4)
#      E2E_STORAGE_MANIFESTS  manifests to run (default "devdax fsdax-block fsdax-fs")
#      E2E_STORAGE_FOCUS      an extra regex every spec must match (narrowing, e.g.
#                             "provisioning"); the summary then says so
# Writes RESULTS_DIR/<manifest>-{parallel,serial}.xml (junit), <manifest>-*.log,
# summary.json and summary.txt (per manifest: ran, passed, failed, skipped; every
# failure and skip with its spec name and reason).
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${here}/../../.." && pwd)"
cluster_env="${1:?usage: suite.sh CLUSTER_ENV IMAGES_ENV SUITE_BIN_DIR RESULTS_DIR}"
images_env="${2:?usage: suite.sh CLUSTER_ENV IMAGES_ENV SUITE_BIN_DIR RESULTS_DIR}"
sbin="${3:?usage: suite.sh CLUSTER_ENV IMAGES_ENV SUITE_BIN_DIR RESULTS_DIR}"
results="${4:?usage: suite.sh CLUSTER_ENV IMAGES_ENV SUITE_BIN_DIR RESULTS_DIR}"
procs="${E2E_STORAGE_PROCS:-4}"
manifests="${E2E_STORAGE_MANIFESTS:-devdax fsdax-block fsdax-fs}"
extra_focus="${E2E_STORAGE_FOCUS:-}"
[[ "${procs}" =~ ^[1-9][0-9]*$ ]] || { echo "suite.sh: E2E_STORAGE_PROCS must be a positive integer, not ${procs}" >&2; exit 2; }
for m in ${manifests}; do
  [[ -f "${here}/${m}.yaml" ]] || { echo "suite.sh: no manifest ${here}/${m}.yaml" >&2; exit 2; }
done
log() { echo "storage-e2e: [$(date +%T)] $*" >&2; }
# shellcheck disable=SC1090
. "${cluster_env}"
# shellcheck disable=SC1090
. "${images_env}"
export KUBECONFIG
export PATH="${sbin}:${BIN_DIR}:${PATH}"
mkdir -p "${results}"
rm -f "${results}"/*.xml "${results}"/*-parallel.log "${results}"/*-serial.log \
  "${results}"/summary.* "${results}"/driver.log "${results}"/helm-install*.log
timings="${results}/suite-timings.txt"   # run.sh owns timings.txt
: > "${timings}"

# ---------------------------------------------------------------- images
t=$(date +%s)
images=$(bash "${here}/images.sh" "${sbin}" "${DRIVER_IMAGE_ARCHIVE}")
# Every node's containerd (CONTAINERD_SOCK for node A, NODE_B_CONTAINERD_SOCK where the
# test bed has node B).
socks=$(sed -n 's/^\(NODE_[A-Z0-9]*_\)\{0,1\}CONTAINERD_SOCK=//p' "${cluster_env}" | sort -u)
while read -r ref archive; do
  for s in ${socks}; do
    ctr --address "${s}" -n k8s.io images import "${archive}" > /dev/null
    # The list first, then grep: "ctr images ls -q | grep -q" under pipefail fails when
    # grep exits at its match while ctr still writes its next line (SIGPIPE, 141); that
    # failed a CI run with the image in place.
    have=$(ctr --address "${s}" -n k8s.io images ls -q)
    grep -qxF "${ref}" <<<"${have}" \
      || { log "${ref} not in ${s} after the import"; exit 1; }
  done
  log "image ${ref} imported ($(basename "${archive}"))"
done <<<"${images}"
echo "images $(( $(date +%s) - t ))" >> "${timings}"

# ---------------------------------------------------------------- the chart
# As test_cluster.py installs it (emulated back end, two 2 GiB NUMA pools), with the
# chart's default capacity poll. On a two-node test bed (NODE_B_NAME in cluster.env) as
# test_two_nodes.py installs it: release csi-pmem pinned to node A with the classes,
# release csi-pmem-b pinned to node B (its own kubelet and state directories, one 4 GiB
# pool on NUMA node 1, no CSIDriver and no classes of its own). Then the suite's topology
# specs have two values of csi-pmem.io/node to choose from, and its pods land on either
# node, as kube-scheduler places them.
t=$(date +%s)
img() { echo --set "$1.image.repository=${2%:*}" --set "$1.image.tag=${2##*:}" \
  --set "$1.image.pullPolicy=Never"; }
releases=(csi-pmem)
pin=()
if [[ -n "${NODE_B_NAME:-}" ]]; then
  releases+=(csi-pmem-b)
  pin=(--set-json "nodeSelector={\"kubernetes.io/hostname\":\"${NODE_NAME}\"}")
fi
install() {  # RELEASE KUBELET_DIR STATE_DIR ARGS...
  local rel=$1 kdir=$2 sdir=$3; shift 3
  # shellcheck disable=SC2046
  helm install "${rel}" "${repo}/charts/csi-pmem" --namespace csi-pmem --create-namespace \
    -f "${repo}/charts/csi-pmem/ci/emulated-values.yaml" \
    --set "kubeletDir=${kdir}" --set "stateDir=${sdir}" \
    --set driver.logFormat=text \
    $(img driver "${DRIVER_IMAGE}") $(img provisioner "${PROVISIONER_IMAGE}") \
    $(img registrar "${REGISTRAR_IMAGE}") $(img livenessProbe "${LIVENESSPROBE_IMAGE}") \
    "$@" --wait --timeout 5m > "${results}/helm-install-${rel}.log" 2>&1 \
    || { cat "${results}/helm-install-${rel}.log" >&2; return 1; }
}
install csi-pmem "${KUBELET_DIR}" "${STATE_DIR}" "${pin[@]}"
if [[ -n "${NODE_B_NAME:-}" ]]; then
  install csi-pmem-b "${NODE_B_KUBELET_DIR}" "${NODE_B_STATE_DIR}" \
    --set-json "nodeSelector={\"kubernetes.io/hostname\":\"${NODE_B_NAME}\"}" \
    --set-json 'backend.emulated.regions=[{"numaNode":1,"size":"4Gi"}]' \
    --set csiDriver.create=false --set storageClasses.default.create=false \
    --set storageClasses.fsdax.create=false --set-json 'storageClasses.perNuma=[]'
fi
nodes=$(( ${#releases[@]} ))
registered() {  # every node's kubelet has the driver
  [[ $(kubectl get csinode -o jsonpath='{range .items[*]}{.spec.drivers[*].name}{"\n"}{end}' \
    | grep -cx csi-pmem.io) -ge ${nodes} ]]
}
for _ in $(seq 120); do registered && break; sleep 1; done
registered || { log "the driver did not register with every kubelet (${nodes}) in 120 s"; exit 1; }
echo "install $(( $(date +%s) - t ))" >> "${timings}"
log "chart installed (${releases[*]}), driver registered on ${nodes} node(s)"

uninstall() {
  kubectl -n csi-pmem logs -l app.kubernetes.io/name=csi-pmem --all-containers --prefix \
    --tail=-1 > "${results}/driver.log" 2>&1 || true
  for rel in "${releases[@]}"; do
    helm uninstall "${rel}" --namespace csi-pmem --wait --timeout 2m >/dev/null 2>&1 || true
  done
}
trap uninstall EXIT

# ---------------------------------------------------------------- the suite
# ginkgo MANIFEST PHASE PROCS FOCUS SKIP
run_ginkgo() {
  local m=$1 phase=$2 p=$3 focus=$4 skip=$5
  local t0; t0=$(date +%s)
  log "${m} ${phase}: ginkgo --procs ${p} --focus '${focus}' --skip '${skip}'"
  local rc=0
  ginkgo --procs "${p}" --timeout 40m --no-color --silence-skips \
    --focus "${focus}" ${skip:+--skip "${skip}"} \
    --output-dir "${results}" --junit-report "${m}-${phase}.xml" \
    "${sbin}/e2e.test" -- \
    -kubeconfig "${KUBECONFIG}" -provider skeleton -kubelet-root-dir "${KUBELET_DIR}" \
    -storage.testdriver "${here}/${m}.yaml" \
    -node-os-distro debian -allowed-not-ready-nodes 0 \
    > "${results}/${m}-${phase}.log" 2>&1 || rc=$?
  echo "${m}-${phase} $(( $(date +%s) - t0 ))" >> "${timings}"
  log "${m} ${phase}: rc ${rc} in $(( $(date +%s) - t0 )) s (log ${results}/${m}-${phase}.log)"
  tail -3 "${results}/${m}-${phase}.log" >&2
  return 0   # summary.py judges from the junit files
}
tags='\[Disruptive\]|\[Feature:'
for m in ${manifests}; do
  name=$(sed -n 's/^  Name: *//p' "${here}/${m}.yaml")
  # fsdax-block.yaml: the Block patterns only (fsdax-fs.yaml runs the Filesystem ones on
  # the same class).
  # fsdax-fs.yaml: the others (same class; the Block patterns run once, above).
  mfocus=""; [[ "${m}" == fsdax-block ]] && mfocus='.*\(block volmode\)'
  mskip=""; [[ "${m}" == fsdax-fs ]] && mskip='|\(block volmode\)'
  focus="External.Storage \[Driver: ${name//./\\.}\]${mfocus}"
  [[ -n "${extra_focus}" ]] && focus+=".*(${extra_focus})"
  # Specs that do not apply to this manifest's volumes (not-applicable.yaml, with why).
  na=$("${repo}/.venv/bin/python" "${here}/summary.py" --results "${results}" --skip-regex "${m}")
  run_ginkgo "${m}" parallel "${procs}" "${focus}" "\[Serial\]|${tags}${mskip}${na:+|${na}}"
  run_ginkgo "${m}" serial 1 "${focus}.*\[Serial\]|\[Serial\].*${focus}" \
    "${tags}${mskip}${na:+|${na}}"
done

"${repo}/.venv/bin/python" "${here}/summary.py" --results "${results}" --extra-focus "${extra_focus}" \
  ${manifests}
