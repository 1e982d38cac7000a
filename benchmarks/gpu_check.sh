#!/usr/bin/env bash
# GPU readiness on one GPU, in under 5 minutes (133 s on an H200):
#   0. build the fused kernels (CPU and CUDA extensions; MAX_JOBS defaults to the core count);
#   1. tests/gpu (the CUDA fused kernels against PyTorch);
#   2. benchmarks/bench_fused.py --only cuda (fused softmax / layer norm / RMSNorm against PyTorch);
#   3. benchmarks/bench_train_step.py --device cuda --bf16 on a ~1.3B GPT (24 layers,
#      hidden 2048, 16 heads, seq 2048, micro batch $MICRO_BATCH, default 4): our step against
#      transformers GPT-2 and the minimal GPT, and our MFU against the measured bf16 matmul
#      rate (goal: >= 50%).
# Each step has its own time limit, and a failed step does not stop the later ones.
#   bash benchmarks/gpu_check.sh
# GPU_CHECK_TOY=1 runs the same Python parts on the CPU at a toy size (the smoke test).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [[ "${GPU_CHECK_TOY:-0}" == 1 ]]; then
    STEP=(--device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 --vocab 512
          --reps 2 --steps 1 --warmup 1)
    FUSED=(--repeat 1 --threads 1 --max-seq 512)
    LIMIT=120
else
    STEP=(--device cuda --bf16 --layers 24 --hidden 2048 --heads 16 --seq 2048
          --batch "${MICRO_BATCH:-4}" --vocab 50304 --reps 5 --steps 1 --warmup 2)
    FUSED=(--repeat 10 --only cuda)
    LIMIT=240
fi

FAILED=()
step() {  # step LIMIT NAME COMMAND...: runs on after a failure, so that one call reports all
    local limit=$1 name=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" || { echo "== $name: FAILED (exit $?)"; FAILED+=("$name"); }
}
step 240 "build the fused kernels" "$PYTHON" -c "
import time; t = time.time()
from megatron.fused import kernels
print('built:', kernels.load_fused_kernels(verbose=True), f'in {time.time() - t:.0f} s')"
step 150 tests/gpu "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
step 90 "benchmarks/bench_fused.py ${FUSED[*]}" "$PYTHON" benchmarks/bench_fused.py "${FUSED[@]}"
step "$LIMIT" "benchmarks/bench_train_step.py ${STEP[*]}" \
    "$PYTHON" benchmarks/bench_train_step.py "${STEP[@]}"
if (( ${#FAILED[@]} )); then
    echo "gpu_check: failed: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all passed"
