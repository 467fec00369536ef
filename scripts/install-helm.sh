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
# Exit:  0 installed; 1 no go or the proxy cannot provide the version (callers skip on it).
set -euo pipefail

# Newest v3 tag that resolved and built from the proxy when this was written (probed
# with --latest; helm v4 exists too, but the e2e and users' CI still target v3).
HELM_PINNED="v3.22.0"
HELM_MODULE="helm.sh/helm/v3"

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
        exit 1
    fi
else
    if [[ ! "${want}" =~ ^v3\.[0-9]+\.[0-9]+$ ]]; then
        log "error: HELM_VERSION=${want}: want v3.X.Y or latest"
        exit 1
    fi
    candidates=("${want}")
fi

build() {  # build <version> -> installs into the cache, prints nothing on stdout
    local v="$1" dir="${cache_root}/helm-$1" tmp start
    mkdir -p "${dir}/bin"
    # Build into a temporary GOBIN and move into place only on success, so an
    # interrupted build never leaves a binary the "already installed" check accepts.
    tmp="$(mktemp -d "${dir}/bin.tmp.XXXXXX")"
    log "building helm ${v} into ${dir}/bin (cold: minutes)"
    start=$(date +%s)
    # CGO off and the version stamped like the release builds do (`helm version`).
    if ! GOBIN="${tmp}" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:+${GOFLAGS} }-mod=mod" \
        go install -trimpath \
        -ldflags "-s -w -X ${HELM_MODULE}/internal/version.version=${v}" \
        "${HELM_MODULE}/cmd/helm@${v}" >&2; then
        rm -rf "${tmp}"
        return 1
    fi
    mv -f "${tmp}/helm" "${dir}/bin/helm"
    rm -rf "${tmp}"
    log "built helm ${v} in $(( $(date +%s) - start )) s"
}

for v in "${candidates[@]}"; do
    bin="${cache_root}/helm-${v}/bin/helm"
    if [[ -x "${bin}" ]]; then
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
exit 1
