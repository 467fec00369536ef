#!/usr/bin/env bash
# Install csi-sanity (the CSI conformance suite, kubernetes-csi/csi-test) into a cache
# outside the repository, so the Go build (a few minutes on 2 cores) happens once per
# machine and the binary is never committed.
#
# Usage: scripts/install-csi-sanity.sh
# Env:   CSI_PMEM_CACHE   cache root (default: $HOME/.cache/csi-pmem)
#        GOPROXY          left as the environment's default (a partial mirror works as
#                         long as it carries csi-test v5.4.0 and its dependencies)
# Output: the absolute path of the csi-sanity binary, as the last line of stdout.
set -euo pipefail

CSI_SANITY_VERSION="v5.4.0"
CSI_SANITY_MODULE="github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity"

cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
install_dir="${cache_root}/csi-sanity-${CSI_SANITY_VERSION}"
bin="${install_dir}/bin/csi-sanity"

if [[ -x "${bin}" ]]; then
    echo "csi-sanity ${CSI_SANITY_VERSION} already installed" >&2
    echo "${bin}"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "error: go not found in PATH; csi-sanity ${CSI_SANITY_VERSION} needs Go >= 1.23" >&2
    exit 1
fi

mkdir -p "${install_dir}/bin"
echo "building csi-sanity ${CSI_SANITY_VERSION} into ${install_dir}/bin (takes minutes)" >&2
start=$(date +%s)
# Build into a temporary GOBIN and move the binary into place only when the build
# succeeded, so an interrupted build never leaves a half-written binary that the
# "already installed" check above would accept.
tmp_bin="$(mktemp -d "${install_dir}/bin.tmp.XXXXXX")"
trap 'rm -rf "${tmp_bin}"' EXIT
GOBIN="${tmp_bin}" GOFLAGS=-mod=mod \
    go install "${CSI_SANITY_MODULE}@${CSI_SANITY_VERSION}" >&2
mv -f "${tmp_bin}/csi-sanity" "${bin}"
echo "built in $(( $(date +%s) - start )) s" >&2
echo "${bin}"
