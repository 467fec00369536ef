#!/usr/bin/env bash
# The images Kubernetes' storage e2e suite runs its pods with, built here because there
# is no registry: each is a docker-archive written by mkimage.py under the exact name the
# suite asks for (e2e.test --list-images), so containerd has it and kubelet's
# IfNotPresent (the default for a tagged image, and what the suite sets) never pulls.
#   busybox          Debian's busybox-static (/bin/busybox plus its applet links): the
#                    suite's default test image (e2epod.GetDefaultTestImage on Linux)
#   agnhost          k8s.io/kubernetes/test/images/agnhost at the cluster's version
#                    (built by build.sh suite) over the busybox layer, entry point
#                    /agnhost pause, as upstream's image
#   glibc-dns-testing  the multi-pod specs' image (GlibcDnsTesting): a glibc userland,
#                    here the driver image's Debian layers (shared with it in
#                    containerd's store) with sh as the command; the storage specs run
#                    shell, dd and md5sum in it, never DNS tools
#   nginx            the exec spec's image (volumes: "should allow exec of files on the
#                    volume"): the busybox image under that name; the spec replaces the
#                    command with a shell script and never starts nginx
# Archives are
# cached in $CSI_PMEM_CACHE/cluster/suite-images by their inputs (not cluster/images:
# ../images.sh prunes what it did not write there); older archives are pruned here.
#
# Usage: images.sh SUITE_BIN_DIR DRIVER_IMAGE_ARCHIVE
# Output: one line per image, "NAME ARCHIVE".
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
sbin="${1:?usage: images.sh SUITE_BIN_DIR DRIVER_IMAGE_ARCHIVE}"
driver_archive="${2:?usage: images.sh SUITE_BIN_DIR DRIVER_IMAGE_ARCHIVE}"
idir="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}/cluster/suite-images"
mkdir -p "${idir}"
PY=${PYTHON:-python3}
h() { sha256sum | cut -c1-12; }
log() { echo "storage-e2e images: $*" >&2; }
busybox=/bin/busybox
[[ -x "${busybox}" ]] || { log "${busybox} missing: apt-get install busybox-static"; exit 1; }

# The references the storage specs use, from test/utils/image/manifest.go of the pinned
# k8s.io/kubernetes (BusyBox, Agnhost, GlibcDnsTesting, Nginx); e2e.test --list-images also
# names older ones (busybox 1.36.1-1, agnhost 2.55) for other specs. Checked against
# the binary, so a Kubernetes bump that moves a tag fails here, not in a pod's pull.
BUSYBOX_REF=registry.k8s.io/e2e-test-images/busybox:1.37.0-1
AGNHOST_REF=registry.k8s.io/e2e-test-images/agnhost:2.63.0
GLIBC_REF=registry.k8s.io/e2e-test-images/glibc-dns-testing:2.0.0
NGINX_REF=registry.k8s.io/e2e-test-images/nginx:1.15-4
list=$("${sbin}/e2e.test" --list-images)
for r in "${BUSYBOX_REF}" "${AGNHOST_REF}" "${GLIBC_REF}" "${NGINX_REF}"; do
  grep -qxF "${r}" <<<"${list}" \
    || { log "e2e.test --list-images does not name ${r}: update images.sh"; exit 1; }
done

# A layer from a directory tree (numeric owners, fixed mtimes: same input, same layer).
layer_of() {  # layer_of NAME DIR
  local out="${idir}/$1.tar"
  [[ -f "${out}" ]] && { echo "${out}"; return; }
  tar --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -C "$2" -cf "${out}.tmp" .
  mv "${out}.tmp" "${out}"; echo "${out}"
}

bb_key=$(sha256sum "${busybox}" | h)
bb_layer="${idir}/suite-busybox-${bb_key}.tar"
if [[ ! -f "${bb_layer}" ]]; then
  d=$(mktemp -d)
  mkdir -p "${d}/bin" "${d}/tmp" "${d}/etc" "${d}/root"
  chmod 1777 "${d}/tmp"
  install -m 0755 "${busybox}" "${d}/bin/busybox"
  # Every applet busybox knows, at the path it names, as a link to /bin/busybox.
  while read -r applet; do
    [[ "${applet}" == bin/busybox ]] && continue
    mkdir -p "${d}/$(dirname "${applet}")"; ln -sfn /bin/busybox "${d}/${applet}"
  done < <("${busybox}" --list-full)
  printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/:/bin/false' \
    > "${d}/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' > "${d}/etc/group"
  layer_of "suite-busybox-${bb_key}" "${d}" >/dev/null
  rm -rf "${d}"
fi

agn_key=$(sha256sum "${sbin}/agnhost" | h)
agn_layer="${idir}/suite-agnhost-${agn_key}.tar"
if [[ ! -f "${agn_layer}" ]]; then
  d=$(mktemp -d)
  mkdir -p "${d}/uploads" "${d}/etc"
  install -m 0755 "${sbin}/agnhost" "${d}/agnhost"
  ln -s agnhost "${d}/agnhost-2"
  # upstream's image adds these (adduser / addgroup in its Dockerfile)
  printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/:/bin/false' \
    'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh' > "${d}/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' 'user-defined-in-image:x:1000:' \
    'group-defined-in-image:x:50000:user-defined-in-image' > "${d}/etc/group"
  layer_of "suite-agnhost-${agn_key}" "${d}" >/dev/null
  rm -rf "${d}"
fi

image() {  # image REF KEY MKIMAGE_ARGS... -> "REF ARCHIVE"
  local ref=$1 key=$2; shift 2
  local k; k=$(printf '%s\n' "${ref}" "${key}" "$@" | h)
  local out="${idir}/suite-$(basename "${ref%%:*}")-${k}.img.tar"
  [[ -f "${out}" ]] || "${PY}" "${here}/../mkimage.py" -o "${out}" --tag "${ref}" "$@" >/dev/null
  echo "${ref} ${out}"
  keep+=("${out}")
}
keep=("${bb_layer}" "${agn_layer}")
image "${BUSYBOX_REF}" "${bb_key}" --layer "${bb_layer}" --cmd '["sh"]' > "${idir}/list.tmp"
image "${NGINX_REF}" "${bb_key}" --layer "${bb_layer}" --cmd '["sh"]' >> "${idir}/list.tmp"
image "${AGNHOST_REF}" "${bb_key}${agn_key}" --layer "${bb_layer}" --layer "${agn_layer}" \
  --entrypoint '["/agnhost"]' --cmd '["pause"]' >> "${idir}/list.tmp"
image "${GLIBC_REF}" "$(sha256sum <<<"${driver_archive}" | h)" \
  --from "${driver_archive}" --workdir / --entrypoint '[]' --cmd '["sh"]' >> "${idir}/list.tmp"
# image() runs in this shell for the list, so keep holds all archives in use: drop the rest
# (the glibc-dns-testing stand-in is the driver image's size and follows its every change).
for f in "${idir}"/*.tar; do
  [[ " ${keep[*]} " == *" ${f} "* ]] || rm -f "${f}"
done
cat "${idir}/list.tmp"; rm -f "${idir}/list.tmp"
