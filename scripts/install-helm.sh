#!/usr/bin/env bash
# Install helm v3 from the Go module proxy into a cache outside the repository: there is
# no release tarball download on our machines (registries only), and the build (a few
# minutes on 2 cores) should happen once per machine and version, never be committed.
#
# Usage: scripts/install-helm.sh [--latest]
#   default     the pinned HELM_VERSION below (deploy/ is rendered with it, so the
#               render check compares like with like, and a warm cache needs no network)
#   --latest    probe the proxy for the newest v3 tag that actually builds (the proxy
#               here is a partial mirror: a listed tag can still miss a dependency),
#               newest first, at most 3 tries; same as HELM_VERSION=latest
# Env:   HELM_VERSION     a v3 tag (v3.X.Y) or "latest" (default: the pin below)
#        CSI_PMEM_CACHE   cache root (default: $HOME/.cache/csi-pmem)
#        GOPROXY          left as the environment's default
# Output: the absolute path of the helm binary, as the last line of stdout.
# Exit:  0 installed; 3 the Go module proxy cannot provide helm (callers may skip on
#        that, e.g. tests/test_chart.py); 1 anything else (no go, bad HELM_VERSION).
set -euo pipefail

# Newest v3 tag that resolved and built from the proxy when this was written (probed
# with --latest; helm v4 exists too, but the e2e and users' CI still target v3).
HELM_PINNED="v3.22.0"
HELM_MODULE="helm.sh/helm/v3"
# Bump when the build flags below change: cached binaries of another recipe are rebuilt.
RECIPE="go-install-cgo0-ldflags-kubeversion-1"

want="${HELM_VERSION:-${HELM_PINNED}}"
[[ "${1:-}" == "--latest" ]] && want=latest
cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"

log() { echo "install-helm: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
    log "error: go not found in PATH; helm v3 needs Go >= 1.24"
    exit 1
fi
proxy="$(go env GOPROXY | tr ',|' '\n\n' | grep -E '^https?://' | head -n1 || true)"

candidates=()
if [[ "${want}" == latest ]]; then
    if [[ -z "${proxy}" ]]; then
        log "error: GOPROXY=$(go env GOPROXY) names no proxy to probe; set HELM_VERSION"
        exit 1
    fi
    # Newest first; only final releases (no -rc.N).
    mapfile -t candidates < <(curl -fsS --max-time 30 "${proxy}/${HELM_MODULE}/@v/list" \
        | grep -E '^v3\.[0-9]+\.[0-9]+$' | sort -rV | head -n 3 || true)
    if ((${#candidates[@]} == 0)); then
        log "error: ${proxy} lists no ${HELM_MODULE} v3 release"
        exit 3
    fi
else
    if [[ ! "${want}" =~ ^v3\.[0-9]+\.[0-9]+$ ]]; then
        log "error: HELM_VERSION=${want}: want v3.X.Y or latest"
        exit 1
    fi
    candidates=("${want}")
fi

# The link flags of helm's own release builds (its Makefile): the version, and the
# Kubernetes version of its client-go as the default .Capabilities.KubeVersion. Without
# the latter a source build claims Kubernetes 1.20, and `helm template` refuses every
# chart whose kubeVersion asks for more.
ldflags_for() {  # ldflags_for <version> -> prints the -ldflags value
    local v="$1" gomod kver major minor
    gomod="$(go mod download -json "${HELM_MODULE}@${v}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
    [[ -n "${gomod}" && -f "${gomod}" ]] || return 1
    kver="$(awk '$1 == "k8s.io/client-go" { print $2; exit }' "${gomod}")"  # v0.37.0
    # client-go v0.X.Y is Kubernetes 1.X (helm's Makefile does the same mapping).
    major=1
    minor="$(echo "${kver}" | cut -d. -f2)"
    [[ "${kver}" == v0.* && "${minor}" =~ ^[0-9]+$ ]] || return 1
    local flags="-s -w -X ${HELM_MODULE}/internal/version.version=${v}"
    for pkg in pkg/chartutil pkg/lint/rules; do
        flags+=" -X ${HELM_MODULE}/${pkg}.k8sVersionMajor=${major}"
        flags+=" -X ${HELM_MODULE}/${pkg}.k8sVersionMinor=${minor}"
    done
    echo "${flags}"
}

build() {  # build <version> -> installs into the cache, prints nothing on stdout
    local v="$1" dir="${cache_root}/helm-$1" tmp start ldflags
    mkdir -p "${dir}/bin"
    ldflags="$(ldflags_for "${v}")" || { log "cannot read ${HELM_MODULE}@${v}'s go.mod"; return 1; }
    # Build into a temporary GOBIN and move into place only on success, so an
    # interrupted build never leaves a binary the "already installed" check accepts.
    tmp="$(mktemp -d "${dir}/bin.tmp.XXXXXX")"
    log "building helm ${v} into ${dir}/bin (cold: minutes)"
    start=$(date +%s)
    # CGO off, static, like the release builds.
    if ! GOBIN="${tmp}" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:+${GOFLAGS} }-mod=mod" \
        go install -trimpath -ldflags "${ldflags}" "${HELM_MODULE}/cmd/helm@${v}" >&2; then
        rm -rf "${tmp}"
        return 1
    fi
    mv -f "${tmp}/helm" "${dir}/bin/helm"
    echo "${RECIPE}" > "${dir}/recipe"
    rm -rf "${tmp}"
    log "built helm ${v} in $(( $(date +%s) - start )) s"
}

for v in "${candidates[@]}"; do
    bin="${cache_root}/helm-${v}/bin/helm"
    # A binary from an older recipe of this script (other link flags) is rebuilt.
    if [[ -x "${bin}" && "$(cat "${cache_root}/helm-${v}/recipe" 2>/dev/null)" == "${RECIPE}" ]]; then
        log "helm ${v} already installed"
        echo "${bin}"
        exit 0
    fi
    if build "${v}"; then
        echo "${bin}"
        exit 0
    fi
    log "helm ${v} did not build from the module proxy"
done
log "error: the Go module proxy could not provide helm (${candidates[*]})"
exit 3
