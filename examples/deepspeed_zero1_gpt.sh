#!/usr/bin/env bash
# A DeepSpeed ZeRO-1 launch line in BigScience's style, run without DeepSpeed: the JSON's
# batch, clipping, fp16 and ZeRO stage keys become our flags (stage 1: the distributed optimizer).
# DATA=... VOCAB=... MERGE=... bash examples/deepspeed_zero1_gpt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt2_zero1}
GPUS=${GPUS:-8}
if command -v deepspeed >/dev/null; then
    LAUNCH=(deepspeed --num_gpus "$GPUS")
else
    echo "deepspeed launcher not found (pip install deepspeed, see README); launching with torchrun --nproc_per_node $GPUS instead" >&2
    LAUNCH=(torchrun --nproc_per_node "$GPUS")
fi

"${LAUNCH[@]}" pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 32 \
    --train-samples 10000000 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine \
    --lr-warmup-samples 200000 --lr-decay-samples 9000000 --weight-decay 0.1 --clip-grad 1.0 \
    --vocab-file "$VOCAB" --merge-file "$MERGE" --data-path "$DATA" --data-impl mmap \
    --split 949,50,1 --fp16 --checkpoint-activations \
    --deepspeed --deepspeed_config examples/ds_config_zero1.json --zero-stage 1 \
    --deepspeed-activation-checkpointing --partition-activations \
    --log-interval 10 --save-interval 1500 --eval-interval 1000 --eval-iters 5 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
