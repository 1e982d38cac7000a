#!/usr/bin/env bash
# GPU readiness on one GPU, in under 10 minutes:
#   1. tests/gpu (the CUDA fused kernels against PyTorch);
#   2. benchmarks/bench_fused.py (fused softmax / layer norm against PyTorch);
#   3. benchmarks/bench_train_step.py --device cuda --bf16 on a ~1.3B GPT (24 layers,
#      hidden 2048, 16 heads, seq 2048, micro batch $MICRO_BATCH, default 4): our step against
#      transformers GPT-2 and the minimal GPT, and our MFU against the measured bf16 matmul
#      rate (goal: >= 50%).
#   bash benchmarks/gpu_check.sh
# GPU_CHECK_TOY=1 runs the same Python parts on the CPU at a toy size (the smoke test).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ "${GPU_CHECK_TOY:-0}" == 1 ]]; then
    STEP=(--device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 --vocab 512
          --reps 2 --steps 1 --warmup 1)
    FUSED=(--repeat 1 --threads 1 --max-seq 512)
    LIMIT=120
else
    STEP=(--device cuda --bf16 --layers 24 --hidden 2048 --heads 16 --seq 2048
          --batch "${MICRO_BATCH:-4}" --vocab 50304 --reps 5 --steps 1 --warmup 2)
    FUSED=(--repeat 10)
    LIMIT=300
fi

echo "== tests/gpu"
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
echo "== benchmarks/bench_fused.py ${FUSED[*]}"
timeout 120 "$PYTHON" benchmarks/bench_fused.py "${FUSED[@]}"
echo "== benchmarks/bench_train_step.py ${STEP[*]}"
timeout "$LIMIT" "$PYTHON" benchmarks/bench_train_step.py "${STEP[@]}"
