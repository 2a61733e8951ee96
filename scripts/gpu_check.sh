#!/usr/bin/env bash
# The GPU check of docs/gpu.md, for one CUDA device (under 8 minutes on one H100):
#   1. the CUDA tests of every head, with torch's operations for the row math (eager rows,
#      LINEAR_CE_NATIVE_ROWS=0) and with the Triton row kernels (=1: an error if Triton is
#      missing), each in a process of its own;
#   2. the benchmark at N=8192, D=4096, V=128256 bf16 on CUDA: the three-GEMM floor, the
#      plain expression, torch.compile of it, torch's builtin, linear_ce (default and balanced:
#      bf16 GEMMs with fp32 results) with the Triton rows, Liger-Kernel and Cut
#      Cross-Entropy where installed (listed as unavailable otherwise); then linear_ce
#      with the eager rows; each run's JSON written into OUT.
# Usage: scripts/gpu_check.sh OUT          run it (OUT: a folder, created)
#        scripts/gpu_check.sh --dry-run    print the commands; collect the CUDA tests only
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python

DRY=0
OUT=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -*) echo "gpu_check.sh: unknown option $arg (expected --dry-run)" >&2; exit 2 ;;
        *) OUT="$arg" ;;
    esac
done
if [ "$DRY" = 0 ] && [ -z "$OUT" ]; then
    echo "usage: scripts/gpu_check.sh OUT | --dry-run" >&2
    exit 2
fi
OUT="${OUT:-gpu-check-out}"

CUDA_TESTS=(tests/test_cuda.py tests/test_cuda_rows.py)
SHAPE=8192,4096,128256
BENCH=(-m linear_ce.bench --device cuda --shapes "$SHAPE" --dtype bf16 --sweep none
       --ignored none --heads ce --repeats 3)
RUNS=(
    "1|floor,plain,plain-compile,torch,linear_ce,linear_ce-balanced,liger,cce|bench-triton-rows"
    "0|floor,linear_ce-balanced|bench-eager-rows"
)

run() {
    echo "+ $*"
    if [ "$DRY" = 0 ]; then
        "$@"
    fi
}

if [ "$DRY" = 1 ]; then
    # What the tests would run: collected, not run (no GPU needed).
    "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only "${CUDA_TESTS[@]}"
else
    mkdir -p "$OUT"
    "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
        | tee "$OUT/device.txt"
fi

for rows in 0 1; do
    run env LINEAR_CE_NATIVE_ROWS="$rows" TRITON_INTERPRET= "$PYTHON" -m pytest -q -x \
        -p no:cacheprovider "${CUDA_TESTS[@]}"
done

for spec in "${RUNS[@]}"; do
    IFS='|' read -r rows variants name <<< "$spec"
    run env LINEAR_CE_NATIVE_ROWS="$rows" "$PYTHON" "${BENCH[@]}" --variants "$variants" \
        --json "$OUT/$name.json" --plot "$OUT/$name.png"
done
