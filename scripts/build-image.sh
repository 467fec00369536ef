#!/usr/bin/env bash
# make image: build the Dockerfile without a Docker daemon or a registry, with buildah, and
# write it as a docker-archive tarball (what `docker save` writes; `ctr images import`,
# `docker load` and `podman load` read it).
#
#   base     the image the Dockerfile's FROM names, debian:12-slim, made here with
#            `debootstrap --variant=minbase bookworm` (there is no registry to pull it
#            from) and committed into buildah's storage under docker.io/library/debian:
#            12-slim and its point release (12.N-slim). It is pinned by its cache key: made
#            once, then reused until the cache is cleared. base-KEY.packages lists every
#            package version in it and base-KEY.env the Debian release and the date of the
#            mirror's Release file (the snapshot it was made from).
#   image    `buildah bud` of the Dockerfile (RUN steps reach the Debian mirror and PyPI
#            over the host's network), OCI labels for the version, source and revision
#            (`git rev-parse HEAD`, "-dirty" when the inputs differ from it) and the time.
#
# Cached under $CSI_PMEM_CACHE/image by a key of the inputs (Dockerfile, .dockerignore,
# pyproject.toml, README.md, csi_pmem/, this script, the base): a warm run only checks.
# A commit that changes none of the inputs reuses the archive, whose revision label then
# names the commit it was built from; the label io.csi-pmem.inputs carries the key.
#
# Writes build/image/csi-pmem-VERSION.tar and build/image/csi-pmem.env (IMAGE, ARCHIVE,
# KEY, REVISION, BASE_IMAGE) and prints the env file's path last. Needs root, buildah and
# debootstrap (Debian 12: apt-get install buildah debootstrap).
#
# Env: CSI_PMEM_CACHE, IMAGE_OUT (default build/image), IMAGE_SOURCE (the source label),
#      PIP_CA (CA bundle for pip in the builder, default the host's),
#      BUILDAH_STORAGE_DRIVER (default: overlay where it works, else vfs).
set -euo pipefail
shopt -s inherit_errexit
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "${repo}"
cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
idir="${cache_root}/image"
out_dir="${IMAGE_OUT:-${repo}/build/image}"
mkdir -p "${idir}" "${out_dir}"
log() { echo "image: $*" >&2; }
die() { log "$*"; exit 1; }
h() { sha256sum | cut -c1-12; }

[[ "$(id -u)" == 0 ]] || die "run as root (debootstrap and buildah's storage need it)"
for tool in buildah debootstrap; do
  command -v "${tool}" >/dev/null || die "${tool} is not installed: apt-get install ${tool}"
done
version=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  pyproject.toml)
SUITE=bookworm
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
  || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

# --- buildah's storage: private to this cache, overlay where the kernel allows it ------
storage="${idir}/storage"
runroot=/run/csi-pmem-image
driver=${BUILDAH_STORAGE_DRIVER:-}
if [[ -z "${driver}" ]]; then
  driver=$(cat "${idir}/storage-driver" 2>/dev/null || true)
fi
if [[ -z "${driver}" ]]; then
  # Probe an overlay mount on the cache's file system (not every sandbox allows one).
  p=$(mktemp -d "${idir}/probe.XXXXXX")
  mkdir -p "${p}"/{l,u,w,m}
  if mount -t overlay overlay -o "lowerdir=${p}/l,upperdir=${p}/u,workdir=${p}/w" "${p}/m" \
      2>/dev/null; then
    umount "${p}/m"; driver=overlay
  else
    driver=vfs
  fi
  rm -rf "${p}"
  echo "${driver}" > "${idir}/storage-driver"
fi
B=(buildah --root "${storage}" --runroot "${runroot}" --storage-driver "${driver}")

# --- the base image: debootstrap minbase, as debian:12-slim ----------------------------
base_key=$(printf '%s\n' "${SUITE}" "${MIRROR}" minbase v1 | h)
base_tar="${idir}/base-${base_key}.tar"
base_env="${idir}/base-${base_key}.env"
if [[ ! -f "${base_env}" ]]; then
  log "debootstrap ${SUITE} minbase from ${MIRROR} (about a minute)"
  t0=$(date +%s)
  d="${idir}/base-${base_key}.tmp"
  rm -rf "${d}"
  debootstrap --variant=minbase "${SUITE}" "${d}" "${MIRROR}" \
    > "${idir}/base-${base_key}.log" 2>&1 || { tail -20 "${idir}/base-${base_key}.log" >&2; exit 1; }
  release_date=$(sed -n 's/^Date: //p' "${d}"/var/lib/apt/lists/*_InRelease 2>/dev/null | head -1)
  dpkg-query --admindir="${d}/var/lib/dpkg" -W -f '${Package}=${Version}\n' \
    > "${idir}/base-${base_key}.packages"
  debian_version=$(cat "${d}/etc/debian_version")
  [[ "${debian_version}" == 12.* ]] || die "debootstrap ${SUITE} made Debian ${debian_version}, not 12.x"
  # Slim like debian:12-slim: no apt lists or package cache, no docs; /dev from the runtime.
  rm -rf "${d}"/var/cache/apt/archives/*.deb "${d}"/var/lib/apt/lists/* \
    "${d}"/usr/share/doc/* "${d}"/usr/share/man/* "${d}"/usr/share/locale/* "${d}"/var/log/*.log
  find "${d}/dev" -mindepth 1 -delete
  tar --numeric-owner --xattrs --xattrs-include='*' -C "${d}" -cf "${base_tar}.tmp" .
  mv "${base_tar}.tmp" "${base_tar}"
  rm -rf "${d}"
  printf 'DEBIAN_VERSION=%s\nRELEASE_DATE="%s"\nSUITE=%s\nMIRROR=%s\n' \
    "${debian_version}" "${release_date}" "${SUITE}" "${MIRROR}" > "${base_env}.tmp"
  mv "${base_env}.tmp" "${base_env}"
  log "base $(du -h "${base_tar}" | cut -f1), Debian ${debian_version} (mirror of ${release_date})," \
    "in $(( $(date +%s) - t0 )) s"
fi
# shellcheck disable=SC1090
. "${base_env}"
base_ref="docker.io/library/debian:${DEBIAN_VERSION}-slim"
if ! "${B[@]}" inspect --type image "${base_ref}" >/dev/null 2>&1; then
  log "committing ${base_ref} into buildah's storage (${driver})"
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" add --quiet "${ctr}" "${base_tar}" / >/dev/null
  "${B[@]}" config --cmd '["bash"]' \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label "org.opencontainers.image.version=${DEBIAN_VERSION}" \
    --label "org.opencontainers.image.created=$(date -u -d "${RELEASE_DATE}" +%Y-%m-%dT%H:%M:%SZ)" \
    --label "io.csi-pmem.debootstrap=${SUITE} minbase ${MIRROR}" "${ctr}"
  "${B[@]}" commit --quiet --rm "${ctr}" "${base_ref}" >/dev/null
fi
"${B[@]}" tag "${base_ref}" docker.io/library/debian:12-slim
base_id=$("${B[@]}" inspect --type image --format '{{.FromImageDigest}}' "${base_ref}")

# --- the image ---------------------------------------------------------------------------
inputs=(Dockerfile .dockerignore pyproject.toml README.md scripts/build-image.sh)
src_key=$({ sha256sum "${inputs[@]}"
            find csi_pmem -name __pycache__ -prune -o -type f -print | LC_ALL=C sort \
              | xargs sha256sum; } | h)
key=$(printf '%s\n' "${src_key}" "${base_id}" "${version}" | h)
ref="localhost/csi-pmem/csi-pmem:${version}-${key}"
archive="${idir}/csi-pmem-${version}-${key}.tar"
if [[ ! -f "${archive}" ]]; then
  revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  if [[ "${revision}" != unknown ]] && { ! git diff --quiet HEAD -- "${inputs[@]}" csi_pmem \
      || [[ -n "$(git ls-files --others --exclude-standard -- csi_pmem)" ]]; }; then
    revision="${revision}-dirty"
  fi
  source_url=${IMAGE_SOURCE:-$(git config --get remote.origin.url 2>/dev/null \
    || echo https://example.com/csi-pmem/csi-pmem)}
  created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  # The host's CA bundle for pip in the builder stage (a TLS-intercepting proxy's CA is in
  # it where there is one); a secret, so it is in no layer and no cache key.
  ca=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
  secret=(); [[ -s "${ca}" ]] && secret=(--secret "id=pip-ca,src=${ca}")
  log "buildah bud ${ref} (revision ${revision}; a few minutes cold: apt, pip wheel)"
  t0=$(date +%s)
  "${B[@]}" bud --layers --network host --isolation chroot --format oci \
    --build-arg "DEBIAN_IMAGE=${base_ref}" --build-arg "VERSION=${version}" \
    --build-arg "REVISION=${revision}" --build-arg "SOURCE=${source_url}" \
    --build-arg "CREATED=${created}" --build-arg "BASE_DIGEST=${base_id}" \
    --label "io.csi-pmem.inputs=${key}" "${secret[@]}" \
    -t "${ref}" -f Dockerfile . > "${idir}/build-${key}.log" 2>&1 \
    || { tail -30 "${idir}/build-${key}.log" >&2; die "buildah bud failed (log: ${idir}/build-${key}.log)"; }
  rm -f "${archive}.tmp"
  "${B[@]}" push --quiet "${ref}" "docker-archive:${archive}.tmp:${ref}" >/dev/null
  mv "${archive}.tmp" "${archive}"
  log "built in $(( $(date +%s) - t0 )) s: $(du -h "${archive}" | cut -f1)"
  # Keep the cache from growing with every source change: older archives and images go
  # (the base and the layer cache of unchanged steps stay).
  for f in "${idir}"/csi-pmem-*.tar "${idir}"/build-*.log; do
    case "${f}" in "${archive}"|"${idir}/build-${key}.log") ;; *) rm -f "${f}" ;; esac
  done
  "${B[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/csi-pmem/csi-pmem:' \
    | grep -vxF "${ref}" | xargs -r "${B[@]}" rmi >/dev/null 2>&1 || true
else
  log "up to date: ${ref}"
fi
revision=$(python3 - "${archive}" <<'EOF'
import json, sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    manifest = json.load(t.extractfile("manifest.json"))
    config = json.load(t.extractfile(manifest[0]["Config"]))
print(config["config"]["Labels"]["org.opencontainers.image.revision"])
EOF
)
out="${out_dir}/csi-pmem-${version}.tar"
rm -f "${out}"
ln "${archive}" "${out}" 2>/dev/null || cp "${archive}" "${out}"
env_file="${out_dir}/csi-pmem.env"
printf 'IMAGE=%s\nARCHIVE=%s\nKEY=%s\nREVISION=%s\nBASE_IMAGE=%s\n' \
  "${ref}" "${out}" "${key}" "${revision}" "${base_ref}" > "${env_file}"
log "${ref} -> ${out}"
echo "${env_file}"
