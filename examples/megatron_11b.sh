#!/usr/bin/env bash
# Megatron-11b (fairseq's model-parallel LM: 72 layers, hidden 3072, FFN 18432, 32 heads,
# 1024 positions) with every layer split over 8 GPUs (TP 8) on each node, DP across nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
VOCAB=${VOCAB:?set VOCAB}
MERGE=${MERGE:?set MERGE}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/megatron_11b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 \
    --num-layers 72 --hidden-size 3072 --ffn-hidden-size 18432 --num-attention-heads 32 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 2 --global-batch-size 512 \
    --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style inverse-square-root --lr-warmup-iters 3000 \
    --train-iters 300000 --weight-decay 0.01 --clip-grad 1.0 --adam-beta2 0.98 \
    --hidden-dropout 0.1 --attention-dropout 0.1 --fp16 --checkpoint-activations \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 100 --save-interval 5000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
