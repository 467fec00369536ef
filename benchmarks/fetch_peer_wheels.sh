#!/usr/bin/env bash
# Download the wheels of the peer loaders that benchmarks/bench_fresh.py compares ours
# against, for the GPU host, into .whl/ at the repository root.
#
# Why a script and pinned versions: the GPU host has no network, so the wheels travel
# with the working tree (a 64 MiB limit in all), and a comparison is only repeatable
# against the same peer builds. The host is Python 3.12 x86-64 with torch, numpy,
# safetensors, typing-extensions, psutil, pyyaml, requests, cuda-bindings and xxhash
# already installed; only what it lacks is fetched here. Not fetched on purpose:
#   typer (fastsafetensors' Requires-Dist: no module of its wheel imports it),
#   boto3 (runai-model-streamer imports it only for object storage, not local files).
# runai-model-streamer 0.17.0 has no wheel for this platform on PyPI; 0.17.1 does.
#
# Usage: benchmarks/fetch_peer_wheels.sh      (run where pip can reach PyPI)
# On the GPU host:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${root}/.whl"
PYTHON="${PYTHON:-python3}"

# name==version; the file name prefix pip gives the wheel is the name with - as _.
PEERS=(
    "instanttensor==0.2.2"
    "fastsafetensors==0.5.0"
    "runai-model-streamer==0.17.1"
    "humanize==4.17.0"          # runai-model-streamer imports it at module level
)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64
           manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
LIMIT_MIB=48

# .whl/ must never be committed (also in .gitignore; exclude covers a changed one).
exclude="${root}/.git/info/exclude"
if [[ -d "${root}/.git" ]]; then
    mkdir -p "$(dirname "${exclude}")"
    grep -qxF "/.whl/" "${exclude}" 2>/dev/null || echo "/.whl/" >>"${exclude}"
fi

mkdir -p "${dest}"
platform_args=()
for p in "${PLATFORMS[@]}"; do
    platform_args+=(--platform "${p}")
done

for spec in "${PEERS[@]}"; do
    name="${spec%%==*}"
    version="${spec##*==}"
    prefix="${name//-/_}"
    # One version of each: drop wheels of this package at any other version.
    for old in "${dest}/${prefix}"-*.whl; do
        [[ -e "${old}" ]] || continue
        case "$(basename "${old}")" in
            "${prefix}-${version}-"*) ;;
            *) echo "removing $(basename "${old}") (not ${version})" >&2; rm -f "${old}" ;;
        esac
    done
    "${PYTHON}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platform_args[@]}" -d "${dest}" "${spec}"
done

total=0
for w in "${dest}"/*.whl; do
    size=$(stat -c %s "${w}")
    total=$((total + size))
    printf '%10d  %s\n' "${size}" "$(basename "${w}")"
done
printf '%10d  total (%d MiB)\n' "${total}" $((total >> 20))
if (( total > LIMIT_MIB << 20 )); then
    echo "error: wheels exceed ${LIMIT_MIB} MiB; they travel in a 64 MiB limit" >&2
    exit 1
fi
