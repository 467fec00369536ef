#!/usr/bin/env bash
# Build the test bed's container images as docker-archive tarballs, without Docker:
#   pause        Debian's static catatonit (-P: pause mode), the sandbox image
#   driver       the Dockerfile's image, exactly the archive `make image` writes
#                (scripts/build-image.sh: buildah, base made with debootstrap)
#   workload     the driver image's layers, run as uid 1000 by default: the unprivileged
#                test pods
#   provisioner, registrar, livenessprobe: one static Go binary each (from build.sh)
#   csi-pmem-nri the NRI plugin, one static binary, only with E2E_NRI_BIN (its path:
#                build.sh nri's directory + /csi-pmem-nri)
#   model        a small safetensors model and nothing else (model_image.py: no entry
#                point, owned by root), the image volume of test_image_volume.py; only
#                with E2E_NRI_BIN, whose test bed runs containerd 2.x (image volumes
#                need containerd 2.1 or later)
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

# --- the driver image: the Dockerfile, built by `make image` (scripts/build-image.sh) --
# Exactly the archive make image writes (its own cache: a warm run only checks).
image_env=$(bash "${repo}/scripts/build-image.sh" | tail -1)
# shellcheck disable=SC1090
. "${image_env}"
app_key=${KEY}

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

env_file="${idir}/images-$(printf '%s\n' "${app_key}" "$(sha256sum "${bindir}"/* /usr/bin/catatonit ${E2E_NRI_BIN:+"${E2E_NRI_BIN}" "${here}/model_image.py"} 2>/dev/null)" | h).env"
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
# The driver image as built; the workload image is its layers and environment, as uid 1000.
echo "DRIVER_IMAGE=${IMAGE}" >> "${env_file}.tmp"
echo "DRIVER_IMAGE_ARCHIVE=${ARCHIVE}" >> "${env_file}.tmp"
image WORKLOAD_IMAGE workload "${app_key}" --from "${ARCHIVE}" \
  --user 1000:1000 --workdir /tmp --entrypoint '[]' --cmd '["python3"]'
for pair in PROVISIONER_IMAGE:csi-provisioner REGISTRAR_IMAGE:csi-node-driver-registrar \
    LIVENESSPROBE_IMAGE:livenessprobe; do
  var=${pair%%:*}; b=${pair#*:}
  layer=$(bin_layer "${b}" "${bindir}/${b}")
  image "${var}" "${b}" "$(sha256sum "${layer}" | h)" --layer "${layer}" \
    --entrypoint "[\"/${b}\"]"
done
if [[ -n "${E2E_NRI_BIN:-}" ]]; then
  layer=$(bin_layer csi-pmem-nri "${E2E_NRI_BIN}")
  image NRI_IMAGE csi-pmem-nri "$(sha256sum "${layer}" | h)" --layer "${layer}" \
    --entrypoint '["/csi-pmem-nri"]'
  # The model's one layer is written by model_image.py alone (the same bytes on every
  # machine), so the script's hash is the image's key.
  model_key=$(sha256sum "${here}/model_image.py" "${here}/mkimage.py" | h)
  model_ref="localhost/csi-pmem-e2e/model:${model_key}"
  model_out="${idir}/model-${model_key}.tar"
  if [[ ! -f "${model_out}" ]]; then
    d=$(mktemp -d)
    "${PY}" "${here}/model_image.py" layer "${d}/layer.tar"
    "${PY}" "${here}/mkimage.py" -o "${model_out}" --tag "${model_ref}" \
      --layer "${d}/layer.tar" --label org.opencontainers.image.title=csi-pmem-e2e-model \
      > /dev/null
    rm -rf "${d}"
  fi
  echo "MODEL_IMAGE=${model_ref}" >> "${env_file}.tmp"
  echo "MODEL_IMAGE_ARCHIVE=${model_out}" >> "${env_file}.tmp"
fi
mv "${env_file}.tmp" "${env_file}"
# Keep the cache from growing with every source change: drop archives and layers that
# the current env file does not use (the driver image lives in make image's cache; base-*
# is the driver image's former debootstrap layer, which other checkouts may still use).
keep=$(sed -n 's/^[A-Z_]*_ARCHIVE=//p' "${env_file}"; echo "${env_file}")
for f in "${idir}"/*.tar "${idir}"/*.env "${idir}"/app-*.log; do
  [[ -e "${f}" ]] || continue
  case "$(basename "${f}")" in base-*|bin-*) continue ;; esac
  grep -qxF "${f}" <(printf '%s\n' ${keep}) || rm -f "${f}"
done
log "image archives ready: ${env_file}"
echo "${env_file}"
