#!/usr/bin/env bash
# Install the S3 server the object-store staging tests run against (Versity's S3
# gateway, versitygw, Apache-2.0: a real S3 API server over a POSIX directory, one
# static binary) from the Go module proxy into a cache outside the repository, so the
# build (about a minute cold on 2 cores) happens once per machine.
#
# Why versitygw: MinIO's server is AGPL and not served here; SeaweedFS builds for many
# minutes. versitygw serves the S3 API the tests need (ListObjectsV2, ranged GET with
# If-Match, PUT, multipart upload, SigV4) from a plain directory, on loopback.
#
# Usage: scripts/install-s3-server.sh
# Env:   CSI_PMEM_CACHE   cache root (default: $HOME/.cache/csi-pmem)
# Output: the absolute path of the versitygw binary, as the last line of stdout.
set -euo pipefail

VERSITYGW_VERSION="v1.8.0"
VERSITYGW_MODULE="github.com/versity/versitygw/cmd/versitygw"

cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
install_dir="${cache_root}/versitygw-${VERSITYGW_VERSION}"
bin="${install_dir}/bin/versitygw"

if [[ -x "${bin}" ]]; then
    echo "versitygw ${VERSITYGW_VERSION} already installed" >&2
    echo "${bin}"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "error: go not found in PATH; versitygw ${VERSITYGW_VERSION} needs Go" >&2
    exit 1
fi

mkdir -p "${install_dir}/bin"
echo "building versitygw ${VERSITYGW_VERSION} into ${install_dir}/bin (about a minute)" >&2
start=$(date +%s)
# A temporary GOBIN, moved into place only once built: an interrupted build never
# leaves a binary that the check above would accept.
tmp_bin="$(mktemp -d "${install_dir}/bin.tmp.XXXXXX")"
trap 'rm -rf "${tmp_bin}"' EXIT
GOBIN="${tmp_bin}" GOFLAGS=-mod=mod CGO_ENABLED=0 \
    go install "${VERSITYGW_MODULE}@${VERSITYGW_VERSION}" >&2
mv -f "${tmp_bin}/versitygw" "${bin}"
echo "built in $(( $(date +%s) - start )) s" >&2
echo "${bin}"
