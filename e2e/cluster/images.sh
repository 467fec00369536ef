#!/usr/bin/env bash
# Build the test bed's container images as docker-archive tarballs, without Docker:
#   pause        Debian's static catatonit (-P: pause mode), the sandbox image
#   driver       debootstrap minbase + the packages in image-packages.txt + the project
#                (wheel and its dependencies in a venv at /opt/csi-pmem)
#   workload     the same layers, run as uid 1000 by default: the unprivileged test pods
#   provisioner, registrar, livenessprobe: one static Go binary each (from build.sh)
# Every tarball is cached under $CSI_PMEM_CACHE/cluster/images keyed by its inputs, so a
# warm run only checks. Prints the path of an env file with the image references.
#
# Usage: e2e/cluster/images.sh BIN_DIR     (BIN_DIR: the last line of build.sh)
set -euo pipefail
shopt -s inherit_errexit
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
bindir="${1:?usage: images.sh BIN_DIR}"
cache_root="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
idir="${cache_root}/cluster/images"
mkdir -p "${idir}"
log() { echo "images: $*" >&2; }
h() { sha256sum | cut -c1-12; }
PY=${PYTHON:-python3}
SUITE=bookworm
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
  || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

# One packages list for the driver image, shared with the Dockerfile when it reads it.
pkgfile="${here}/image-packages.txt"
pkgs=$(grep -v '^\s*#' "${pkgfile}" | xargs | tr ' ' ',')

# --- base layer: debootstrap minbase + packages ------------------------------------
base_key=$(printf '%s\n' "${SUITE}" "${MIRROR}" "${pkgs}" v2 | h)
base_dir="${idir}/base-${base_key}"
base_tar="${idir}/base-${base_key}.tar"
if [[ ! -f "${base_tar}" ]]; then
  log "debootstrap ${SUITE} minbase + ${pkgs} (about a minute)"
  t0=$(date +%s)
  rm -rf "${base_dir}.tmp"
  debootstrap --variant=minbase --include="${pkgs}" "${SUITE}" "${base_dir}.tmp" "${MIRROR}" \
    > "${idir}/base-${base_key}.log" 2>&1 || { tail -20 "${idir}/base-${base_key}.log" >&2; exit 1; }
  # Slim: no apt lists, no package cache, no docs; /dev, /proc, /sys come from the runtime.
  rm -rf "${base_dir}.tmp"/var/cache/apt/archives/*.deb "${base_dir}.tmp"/var/lib/apt/lists/* \
    "${base_dir}.tmp"/usr/share/doc/* "${base_dir}.tmp"/usr/share/man/* \
    "${base_dir}.tmp"/usr/share/locale/* "${base_dir}.tmp"/var/log/*.log
  find "${base_dir}.tmp/dev" -mindepth 1 -delete
  rm -rf "${base_dir}"; mv "${base_dir}.tmp" "${base_dir}"
  tar --numeric-owner --xattrs --xattrs-include='*' -C "${base_dir}" -cf "${base_tar}.tmp" .
  mv "${base_tar}.tmp" "${base_tar}"
  log "base layer $(du -h "${base_tar}" | cut -f1) in $(( $(date +%s) - t0 )) s"
fi

# --- project layer: /opt/csi-pmem venv with the wheel -----------------------------
src_key=$(cd "${repo}" && { find csi_pmem -name '*.py' -o -name '*.pyi' | LC_ALL=C sort \
  | xargs sha256sum; sha256sum pyproject.toml README.md; } | h)
app_key=$(printf '%s\n' "${base_key}" "${src_key}" v2 | h)
app_tar="${idir}/app-${app_key}.tar"
if [[ ! -f "${app_tar}" ]]; then
  log "project layer (wheel + dependencies into /opt/csi-pmem)"
  t0=$(date +%s)
  w=$(mktemp -d "${idir}/app-build.XXXXXX")
  cleanup_app() {
    umount "${w}/merged/proc" 2>/dev/null || true
    umount "${w}/merged" 2>/dev/null || true
    rm -rf "${w}"
  }
  trap cleanup_app EXIT
  # Build the wheel from a clean copy of the sources (no build/ or egg-info reuse).
  mkdir -p "${w}/src" "${w}/upper" "${w}/work" "${w}/merged"
  (cd "${repo}" && cp -r csi_pmem pyproject.toml README.md "${w}/src/")
  find "${w}/src" -name __pycache__ -prune -exec rm -rf {} +
  "${repo}/.venv/bin/python" -m pip wheel -q -w "${w}/upper/wheels" "${w}/src[driver]" \
    > "${idir}/app-${app_key}.log" 2>&1 || { tail -20 "${idir}/app-${app_key}.log" >&2; exit 1; }
  mount -t overlay overlay -o "lowerdir=${base_dir},upperdir=${w}/upper,workdir=${w}/work" \
    "${w}/merged"
  mount -t proc proc "${w}/merged/proc"
  chroot "${w}/merged" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /bin/sh -ec '
    cd /
    python3 -m venv /opt/csi-pmem
    /opt/csi-pmem/bin/pip install -q --no-cache-dir --no-index --find-links /wheels "csi-pmem[driver]"
    /opt/csi-pmem/bin/python -c "import csi_pmem.daxclient, grpc"
    ln -s /opt/csi-pmem/bin/csi-pmem /usr/local/bin/csi-pmem
    ln -s /opt/csi-pmem/bin/csi-pmem-weights /usr/local/bin/csi-pmem-weights' \
    >> "${idir}/app-${app_key}.log" 2>&1 || { tail -20 "${idir}/app-${app_key}.log" >&2; exit 1; }
  umount "${w}/merged/proc"
  umount "${w}/merged"
  rm -rf "${w}/upper/wheels" "${w}/upper/root" "${w}/upper/tmp" "${w}/upper/proc"
  if find "${w}/upper" -type c | grep -q .; then
    log "the install step deleted files of the base layer (overlay whiteouts):"
    find "${w}/upper" -type c >&2
    exit 1
  fi
  tar --numeric-owner --xattrs --xattrs-include='*' -C "${w}/upper" -cf "${app_tar}.tmp" .
  mv "${app_tar}.tmp" "${app_tar}"
  cleanup_app; trap - EXIT
  log "project layer $(du -h "${app_tar}" | cut -f1) in $(( $(date +%s) - t0 )) s"
fi

# --- single-binary layers -----------------------------------------------------------
bin_layer() {  # bin_layer NAME SRC_PATH -> path of a layer tar holding /NAME
  local name=$1 src; src=$(readlink -f "$2")
  local k; k=$(sha256sum "${src}" | h)
  local out="${idir}/bin-${name}-${k}.tar"
  if [[ ! -f "${out}" ]]; then
    local d; d=$(mktemp -d)
    install -m 0755 "${src}" "${d}/${name}"
    mkdir -p "${d}/tmp"; chmod 1777 "${d}/tmp"
    tar --numeric-owner --owner=0 --group=0 -C "${d}" -cf "${out}.tmp" .
    mv "${out}.tmp" "${out}"; rm -rf "${d}"
  fi
  echo "${out}"
}

env_file="${idir}/images-$(printf '%s\n' "${app_key}" "$(sha256sum "${bindir}"/* /usr/bin/catatonit 2>/dev/null)" | h).env"
: > "${env_file}.tmp"
image() {  # image VAR NAME TAG ARCHIVE_ARGS...
  local var=$1 name=$2 tag=$3; shift 3
  # The tag covers the image config too: changing an entry point makes a new image.
  tag="${tag}-$(printf '%s\n' "$@" | h | cut -c1-6)"
  local ref="localhost/csi-pmem-e2e/${name}:${tag}"
  local out="${idir}/${name}-${tag}.tar"
  [[ -f "${out}" ]] || "${PY}" "${here}/mkimage.py" -o "${out}" --tag "${ref}" "$@" >/dev/null
  echo "${var}=${ref}" >> "${env_file}.tmp"
  echo "${var}_ARCHIVE=${out}" >> "${env_file}.tmp"
}

pause_layer=$(bin_layer catatonit /usr/bin/catatonit)
image PAUSE_IMAGE pause "$(sha256sum "${pause_layer}" | h)" --layer "${pause_layer}" \
  --entrypoint '["/catatonit", "-P"]'
venv_path="PATH=/opt/csi-pmem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Same entry point and environment as the Dockerfile's final stage.
py_env=(--env "${venv_path}" --env PYTHONUNBUFFERED=1 --env PYTHONDONTWRITEBYTECODE=1)
image DRIVER_IMAGE driver "${app_key}" --layer "${base_tar}" --layer "${app_tar}" \
  "${py_env[@]}" --user 0:0 --entrypoint '["csi-pmem", "serve"]'
image WORKLOAD_IMAGE workload "${app_key}" --layer "${base_tar}" --layer "${app_tar}" \
  "${py_env[@]}" --user 1000:1000 --workdir /tmp --cmd '["python3"]'
for pair in PROVISIONER_IMAGE:csi-provisioner REGISTRAR_IMAGE:csi-node-driver-registrar \
    LIVENESSPROBE_IMAGE:livenessprobe; do
  var=${pair%%:*}; b=${pair#*:}
  layer=$(bin_layer "${b}" "${bindir}/${b}")
  image "${var}" "${b}" "$(sha256sum "${layer}" | h)" --layer "${layer}" \
    --entrypoint "[\"/${b}\"]"
done
mv "${env_file}.tmp" "${env_file}"
# Keep the cache from growing with every source change: drop archives and layers that
# the current env file does not use (the base layer and root file system stay).
keep=$(sed -n 's/^[A-Z_]*_ARCHIVE=//p' "${env_file}"; echo "${app_tar}" "${env_file}" \
  "${base_tar}")
for f in "${idir}"/*.tar "${idir}"/*.env "${idir}"/app-*.log; do
  [[ -e "${f}" ]] || continue
  case "$(basename "${f}")" in base-*|bin-*) continue ;; esac
  grep -qxF "${f}" <(printf '%s\n' ${keep}) || rm -f "${f}"
done
log "image archives ready: ${env_file}"
echo "${env_file}"
