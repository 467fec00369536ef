#!/usr/bin/env bash
# Build (once) every binary the cluster test bed runs, from the Go module proxy, into a
# cache outside the repository keyed by the pinned versions (versions.sh) and the Go
# toolchain. A cold build of the Kubernetes binaries takes 15-25 minutes on 2 cores; a
# warm run only checks that the binaries are there.
#
# Usage: e2e/cluster/build.sh [all|k8s|etcd|provisioner|sidecars|helm|debs|containerd|nri|suite]...
#        (containerd, nri, suite: not part of all; suite is e2e.test, ginkgo and agnhost
#        for storage-e2e/suite.sh)
# Env:   CSI_PMEM_CACHE  cache root (default: $HOME/.cache/csi-pmem); binaries land in
#                        $CSI_PMEM_CACHE/cluster/<name>-<key>/bin
# Output: the last line of stdout is the path of a directory holding symlinks to all
#         binaries (the "bin dir" that up.sh and the tests put first on PATH); with one
#         target (e.g. containerd, nri, suite), that target's own bin directory.
#
# Why wrappers: k8s.io/kubernetes (and the CSI sidecars) replace their k8s.io/<staging>
# modules with ./staging paths or carry replace directives, so `go install mod@ver`
# refuses them. A wrapper module that requires the target and replaces every staging
# module with its published v0.36.x builds the same code.
# Why two sidecars are built from e2e/cluster/sidecars: the module proxy reachable here
# does not carry github.com/kubernetes-csi/node-driver-registrar or .../livenessprobe
# (every version, tag pseudo-version and @latest answers 403 "not available"), so the
# test bed builds small stand-ins that speak the same kubelet plugin-registration and
# CSI Probe APIs and take the same flags (see sidecars/README in e2e/cluster/README.md).
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.sh
. "${here}/versions.sh"

cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
cdir="${cache_root}/cluster"
mkdir -p "${cdir}"
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
gover="$(go env GOVERSION)"
log() { echo "build: $*" >&2; }

# Staging modules of k8s.io/kubernetes that the proxy carries (sample-cli-plugin is
# missing there and nothing needs it).
STAGING=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go
  cloud-provider cluster-bootstrap code-generator component-base component-helpers
  controller-manager cri-api cri-client cri-streaming csi-translation-lib
  dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator
  kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils
  pod-security-admission sample-apiserver sample-controller streaming)

key_of() { printf '%s\n' "$@" "${gover}" | sha256sum | cut -c1-12; }

# wrap_build NAME KEY STAGING_VERSION REQUIRE LDFLAGS PKG... : build PKGs inside a
# wrapper module that requires REQUIRE ("mod ver") into cluster/NAME-KEY/bin.
wrap_build() {
  local name=$1 key=$2 sv=$3 req=$4 ldflags=$5
  shift 5
  local out="${cdir}/${name}-${key}"
  if [[ -f "${out}/.done" ]]; then log "${name}: cached (${out})"; echo "${out}/bin"; return; fi
  local src="${cdir}/src/${name}-${key}"
  mkdir -p "${src}"
  {
    echo "module csipmem.local/wrap/${name}"
    echo
    echo "go ${gover#go}"
    echo
    echo "require ${req}"
    if [[ -n "${sv}" ]]; then
      echo
      echo "replace ("
      for m in "${STAGING[@]}"; do echo "	k8s.io/${m} => k8s.io/${m} ${sv}"; done
      echo ")"
    fi
  } > "${src}/go.mod"
  log "${name}: building $* (log ${src}/build.log)"
  local t0; t0=$(date +%s)
  rm -rf "${out}.tmp"; mkdir -p "${out}.tmp/bin"
  if ! (cd "${src}" && go build -trimpath -ldflags "${ldflags}" -o "${out}.tmp/bin/" "$@") \
      > "${src}/build.log" 2>&1; then
    tail -30 "${src}/build.log" >&2
    log "${name}: FAILED"
    return 1
  fi
  rm -rf "${out}"; mv "${out}.tmp" "${out}"
  echo "$(( $(date +%s) - t0 ))" > "${out}/build-seconds"
  touch "${out}/.done"
  log "${name}: built in $(cat "${out}/build-seconds") s"
  echo "${out}/bin"
}

build_k8s() {
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local v
  v="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    v+=" -X ${p}.gitVersion=${K8S_VERSION} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor}"
    v+=" -X ${p}.gitTreeState=clean -X ${p}.buildDate=1970-01-01T00:00:00Z"
  done
  wrap_build k8s "$(key_of "${K8S_VERSION}" "${K8S_STAGING_VERSION}")" \
    "${K8S_STAGING_VERSION}" "k8s.io/kubernetes ${K8S_VERSION}" "${v}" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kubectl
}

# Kubernetes' e2e suite (test/e2e as e2e.test, for the external storage tests), the
# ginkgo CLI that runs it in parallel, and agnhost (test/images/agnhost), the image the
# suite's pods run: all from the same k8s.io/kubernetes as the cluster, with the same
# GOFLAGS, -trimpath and CGO_ENABLED as build_k8s so the Go build cache's k8s.io
# packages are reused. ginkgo is built inside the same wrapper, so it is the version
# k8s.io/kubernetes requires (the CLI and the library in e2e.test must match).
build_suite() {
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local v="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    v+=" -X ${p}.gitVersion=${K8S_VERSION} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor}"
    v+=" -X ${p}.gitTreeState=clean -X ${p}.buildDate=1970-01-01T00:00:00Z"
  done
  local key; key=$(key_of suite "${K8S_VERSION}" "${K8S_STAGING_VERSION}")
  local out="${cdir}/suite-${key}"
  if [[ -f "${out}/.done" ]]; then log "suite: cached (${out})"; echo "${out}/bin"; return; fi
  local src="${cdir}/src/suite-${key}"
  mkdir -p "${src}"
  {
    echo "module csipmem.local/wrap/suite"
    echo
    echo "go ${gover#go}"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    for m in "${STAGING[@]}"; do echo "	k8s.io/${m} => k8s.io/${m} ${K8S_STAGING_VERSION}"; done
    echo ")"
  } > "${src}/go.mod"
  log "suite: building e2e.test, ginkgo, agnhost (log ${src}/build.log)"
  local t0; t0=$(date +%s)
  rm -rf "${out}.tmp"; mkdir -p "${out}.tmp/bin"
  if ! (cd "${src}" && go test -c -vet=off -trimpath -ldflags "${v}" -o "${out}.tmp/bin/e2e.test" \
          k8s.io/kubernetes/test/e2e &&
        go build -trimpath -ldflags "${v}" -o "${out}.tmp/bin/" \
          github.com/onsi/ginkgo/v2/ginkgo k8s.io/kubernetes/test/images/agnhost) \
      > "${src}/build.log" 2>&1; then
    tail -30 "${src}/build.log" >&2
    log "suite: FAILED"
    return 1
  fi
  rm -rf "${out}"; mv "${out}.tmp" "${out}"
  echo "$(( $(date +%s) - t0 ))" > "${out}/build-seconds"
  touch "${out}/.done"
  log "suite: built in $(cat "${out}/build-seconds") s"
  echo "${out}/bin"
}

build_etcd() {
  wrap_build etcd "$(key_of "${ETCD_VERSION}")" "" "go.etcd.io/etcd/server/v3 ${ETCD_VERSION}" \
    "-s -w" go.etcd.io/etcd/server/v3
  # The server module's main package builds as "server": name it.
  local d="${cdir}/etcd-$(key_of "${ETCD_VERSION}")/bin"
  [[ -x "${d}/etcd" ]] || mv "${d}/server" "${d}/etcd"
  echo "${d}"
}

build_provisioner() {
  wrap_build provisioner "$(key_of "${PROVISIONER_VERSION}" "${K8S_STAGING_VERSION}")" \
    "${K8S_STAGING_VERSION}" \
    "github.com/kubernetes-csi/external-provisioner/v6 ${PROVISIONER_VERSION}" \
    "-s -w -X main.version=${PROVISIONER_VERSION}" \
    github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner
}

# The stand-ins for node-driver-registrar and livenessprobe (module in sidecars/).
build_sidecars() {
  local key; key=$(cat "${here}"/sidecars/go.mod "${here}"/sidecars/*/*.go | key_of "$(cat)")
  local out="${cdir}/sidecars-${key}"
  if [[ -f "${out}/.done" ]]; then log "sidecars: cached (${out})"; echo "${out}/bin"; return; fi
  rm -rf "${out}.tmp"; mkdir -p "${out}.tmp/bin"
  local t0; t0=$(date +%s)
  log "sidecars: building"
  # go.sum is not kept in the repo: -mod=mod writes it into a scratch copy.
  local src="${cdir}/src/sidecars-${key}"
  rm -rf "${src}"; mkdir -p "${src}"; cp -r "${here}/sidecars/." "${src}/"
  (cd "${src}" && go build -trimpath -ldflags "-s -w" -o "${out}.tmp/bin/" ./...) >&2
  rm -rf "${out}"; mv "${out}.tmp" "${out}"
  echo "$(( $(date +%s) - t0 ))" > "${out}/build-seconds"; touch "${out}/.done"
  log "sidecars: built in $(cat "${out}/build-seconds") s"
  echo "${out}/bin"
}

build_helm() {
  local repo; repo="$(cd "${here}/../.." && pwd)"
  if [[ -x "${repo}/scripts/install-helm.sh" ]]; then
    # The chart's own installer (same cache root); its last stdout line is the binary.
    local b; b=$("${repo}/scripts/install-helm.sh" | tail -1)
    local d="${cdir}/helm-from-script"; mkdir -p "${d}/bin"
    ln -sfn "${b}" "${d}/bin/helm"; echo "${d}/bin"; return
  fi
  wrap_build helm "$(key_of "${HELM_VERSION}")" "" "helm.sh/helm/v3 ${HELM_VERSION}" \
    "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" helm.sh/helm/v3/cmd/helm
}

# containerd 2.x with NRI (E2E_NRI=1 in up.sh; "all" leaves it out, so the default test bed
# builds nothing more). No cgo: the btrfs snapshotter (the one cgo plugin) drops out by
# its build tag, which the test bed disables anyway; zfs and devmapper are left out too.
build_containerd() {
  wrap_build containerd "$(key_of "${CONTAINERD_VERSION}")" "" \
    "github.com/containerd/containerd/v2 ${CONTAINERD_VERSION}" \
    "-s -w -X github.com/containerd/containerd/v2/version.Version=${CONTAINERD_VERSION#v}" \
    -tags "no_zfs no_devmapper no_btrfs" \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr
}

# The csi-pmem NRI plugin (nri/ in the repository), keyed by its sources.
build_nri() {
  local repo; repo="$(cd "${here}/../.." && pwd)"
  local key; key=$(cat "${repo}"/nri/go.mod "${repo}"/nri/go.sum $(find "${repo}/nri" -name '*.go' | sort) \
    | key_of "$(cat)")
  local out="${cdir}/nri-${key}"
  if [[ -f "${out}/.done" ]]; then log "nri: cached (${out})"; echo "${out}/bin"; return; fi
  rm -rf "${out}.tmp"; mkdir -p "${out}.tmp/bin"
  local t0; t0=$(date +%s)
  log "nri: building"
  (cd "${repo}/nri" && go build -trimpath -ldflags "-s -w" -o "${out}.tmp/bin/" ./cmd/csi-pmem-nri) >&2
  rm -rf "${out}"; mv "${out}.tmp" "${out}"
  echo "$(( $(date +%s) - t0 ))" > "${out}/build-seconds"; touch "${out}/.done"
  log "nri: built in $(cat "${out}/build-seconds") s"
  echo "${out}/bin"
}

# Debian packages the test bed runs (containerd, runc, CNI plugins, image tools).
DEBS=(containerd runc containernetworking-plugins debootstrap buildah catatonit iproute2 conntrack
  iptables openssl util-linux kmod procps curl)
build_debs() {
  local missing=()
  for p in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "${p}" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("${p}")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2
  fi
  # Debian's containerd unit is never started here (no systemd); make sure no package
  # script left one running.
  echo /usr/bin
}

targets=("$@"); ((${#targets[@]})) || targets=(all)
[[ "${targets[*]}" == all ]] && targets=(debs sidecars etcd provisioner helm k8s)
bindir="${cdir}/bin-$(key_of "$(cat "${here}/versions.sh")" \
  "$(cat "${here}"/sidecars/go.mod "${here}"/sidecars/*/*.go 2>/dev/null)")"
t_all=$(date +%s)
dirs=()
for t in "${targets[@]}"; do
  # One build of a target at a time (prebuild.sh may be building it in the background):
  # whoever comes second waits, then finds it cached.
  d=$( { flock 9; "build_${t}"; } 9>"${cdir}/.lock-${t}" | tail -1)
  [[ "${t}" == debs ]] || dirs+=("${d}")
done
if [[ "${#targets[@]}" -ge 6 ]]; then
  mkdir -p "${bindir}"
  for d in "${dirs[@]}"; do
    for b in "${d}"/*; do ln -sfn "$(readlink -f "${b}")" "${bindir}/$(basename "${b}")"; done
  done
  log "all binaries in ${bindir} ($(( $(date +%s) - t_all )) s)"
  echo "${bindir}"
elif [[ "${#targets[@]}" == 1 && "${targets[0]}" != debs ]]; then
  echo "${dirs[0]}"  # one set (containerd, nri, suite): its own bin directory
fi
