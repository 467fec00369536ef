#!/usr/bin/env bash
# The GPU run of record, in steps that each fit one lent command (10 minutes at most).
#
# Why a script: a lent GPU host starts bare, its minutes are few, and a run of record
# must be the same every time: the same suite, the same benchmark flags, every exit
# code kept, and every file written where it comes back. Each step sources
# gpu_host.sh (peer wheels, native bounce loop, tmpfs with 2 MiB pages at /mnt/h) and
# writes its log and JSON into DEST.
#
# Usage (on the GPU host, in the repository root; DEST defaults to $OUT or ./gpu-out):
#   CSI_PMEM_COMMIT=<sha> bash benchmarks/gpu_record.sh suite [DEST]
#       the GPU tests: the torch paths (five fresh processes per load path: bounce,
#       registered, hybrid, node), the checksum kernel, the native loop, the pipeline
#   bash benchmarks/gpu_record.sh ready [DEST]
#       bench_ready_model.py, 3 rounds, every default method (the package's
#       load_transformers among them), logits compared with from_pretrained's
#   bash benchmarks/gpu_record.sh fresh [DEST]
#       bench_fresh.py, 5 interleaved rounds, every method and peer, 14.7 GB model;
#       BUDGET_S (default 400) seconds of rounds at most, whole rounds only, the JSON
#       saved after each round
# Exit status: the step's own (pytest's or the benchmark's), so a failure is seen.
set -uo pipefail

step="${1:?usage: gpu_record.sh suite|ready|fresh [DEST]}"
dest="${2:-${OUT:-gpu-out}}"
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/gpu_host.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_host.sh" || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv >"$dest/gpu-$step.csv" 2>&1

case "$step" in
    suite)
        python3 -m pytest -q --noconftest -p no:cacheprovider \
            tests/test_loader_torch.py tests/unit/test_wsum.py tests/unit/test_wsum_kernel.py \
            tests/unit/test_loader_pipeline.py tests/unit/test_loader_native.py \
            --junitxml="$dest/gpu-suite.xml" 2>&1 | tee "$dest/gpu-suite.log"
        ;;
    ready)
        python3 benchmarks/bench_ready_model.py --work /mnt/h/ready --rounds 3 \
            --json "$dest/ready-model.json" 2>&1 | tee "$dest/ready-model.log"
        ;;
    fresh)
        python3 benchmarks/bench_fresh.py --size-gb 14.7 --rounds "${ROUNDS:-5}" \
            --timeout-s 90 --budget-s "${BUDGET_S:-400}" --volume /mnt/h/volume.img \
            --json "$dest/fresh.json" \
            2>&1 | tee "$dest/fresh.log"
        ;;
    *)
        echo "gpu_record: unknown step $step (suite, ready or fresh)" >&2
        exit 2
        ;;
esac
