#!/usr/bin/env bash
# GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048) on 1024 GPUs: TP 8 x PP 16 x DP 8.
# Launch once per node (SLURM: srun sets the node rank; see examples/pretrain_gpt_distributed.sh).
# DATA may be a blend: DATA="0.3 prefixA 0.7 prefixB".
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
VOCAB=${VOCAB:?set VOCAB}
MERGE=${MERGE:?set MERGE}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt3_175b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-128}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 \
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 \
    --train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105 \
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 \
    --bf16 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce \
    --checkpoint-activations \
    --data-path $DATA --split 98,2,0 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
