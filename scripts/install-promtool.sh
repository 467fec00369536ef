#!/usr/bin/env bash
# Install promtool (Prometheus' rule checker and unit-test runner) from the Go module
# proxy into a cache outside the repository, like scripts/install-helm.sh does for helm:
# there is no release tarball download on our machines (registries only), and the build
# (minutes on 2 cores) should happen once per machine and version, never be committed.
# tests/test_alerts.py runs `promtool check rules` and `promtool test rules` with it.
#
# Usage: scripts/install-promtool.sh
# Env:   PROMTOOL_VERSION  a Go module version of github.com/prometheus/prometheus
#                          (Prometheus 3.X.Y is v0.30X.Y; default: the pin below)
#        CSI_PMEM_CACHE    cache root (default: $HOME/.cache/csi-pmem)
#        GOPROXY           left as the environment's default
# Output: the absolute path of the promtool binary, as the last line of stdout.
# Exit:  0 installed; 3 the Go module proxy cannot provide promtool (callers may skip
#        on that); 1 anything else (no go, bad PROMTOOL_VERSION).
set -euo pipefail

# Prometheus v3.10.0's module version, the newest that resolved and built from the proxy
# when this was written.
PROMTOOL_PINNED="v0.310.0"
MODULE="github.com/prometheus/prometheus"
# Bump when the build flags below change: cached binaries of another recipe are rebuilt.
RECIPE="go-build-main-module-cgo0-version-2"

want="${PROMTOOL_VERSION:-${PROMTOOL_PINNED}}"
cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
dir="${cache_root}/promtool-${want}"
bin="${dir}/bin/promtool"

log() { echo "install-promtool: $*" >&2; }

if [[ ! "${want}" =~ ^v0\.[0-9]+\.[0-9]+$ ]]; then
    log "error: PROMTOOL_VERSION=${want}: want the module version v0.X.Y (Prometheus 3.10.0 is v0.310.0)"
    exit 1
fi
if [[ -x "${bin}" && "$(cat "${dir}/recipe" 2>/dev/null)" == "${RECIPE}" ]]; then
    log "promtool ${want} already installed"
    echo "${bin}"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    log "error: go not found in PATH; promtool needs Go >= 1.24"
    exit 1
fi

mkdir -p "${dir}/bin"
# Build into a temporary GOBIN and move into place only on success, so an interrupted
# build never leaves a binary the "already installed" check accepts.
tmp="$(mktemp -d "${dir}/bin.tmp.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT
log "building promtool ${want} into ${dir}/bin (cold: minutes)"
start=$(date +%s)
# Prometheus' go.mod carries replace and exclude directives, which `go install
# pkg@version` refuses; so the module is downloaded and built as the main module, from a
# writable copy (the module cache is read-only, and the build may add go.sum lines).
# Outside any workspace (GOWORK=off); CGO off, static, like the release builds.
src="$(go mod download -json "${MODULE}@${want}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')" || true
if [[ -z "${src}" || ! -d "${src}" ]]; then
    log "error: the Go module proxy could not provide ${MODULE}@${want}"
    exit 3
fi
# The version promtool --version prints, as release builds stamp it (Prometheus 3.X.Y is
# module v0.3XX.Y: v0.310.0 -> 3.10.0).
IFS=. read -r _ minor patch <<< "${want#v}"
release="$((minor / 100)).$((minor % 100)).${patch}"
ldflags="-s -w -X github.com/prometheus/common/version.Version=${release}"
ldflags+=" -X github.com/prometheus/common/version.Branch=module-proxy"
cp -r "${src}" "${tmp}/src"
chmod -R u+w "${tmp}/src"
if ! (cd "${tmp}/src" && GOWORK=off CGO_ENABLED=0 GOFLAGS="${GOFLAGS:+${GOFLAGS} }-mod=mod" \
    go build -trimpath -ldflags "${ldflags}" -o "${tmp}/promtool" ./cmd/promtool >&2); then
    log "error: promtool ${want} did not build from the module proxy's sources"
    exit 3
fi
mv -f "${tmp}/promtool" "${bin}"
echo "${RECIPE}" > "${dir}/recipe"
log "built promtool ${want} in $(( $(date +%s) - start )) s"
echo "${bin}"
