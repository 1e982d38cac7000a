#!/usr/bin/env bash
# A Megatron-LM-style GPT command with its recompute and attention flags, and --DDP-impl torch
# under pipelining as its distributed example writes it (falls back to --DDP-impl local).
# DATA=... VOCAB=... MERGE=... bash examples/megatron_lm_gpt_recompute.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt2_345m_lm}

torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --DDP-impl torch \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 16 \
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine \
    --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --use-flash-attn --no-query-key-layer-scaling --attention-softmax-in-fp32 \
    --vocab-file "$VOCAB" --merge-file "$MERGE" --tokenizer-type GPT2BPETokenizer \
    --data-path "$DATA" --split 949,50,1 \
    --log-interval 100 --log-params-norm --log-num-zeros-in-grad \
    --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
