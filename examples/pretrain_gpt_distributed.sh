#!/usr/bin/env bash
# GPT-2 345M-style pretraining with tensor (TP) and pipeline (PP) parallelism under torchrun.
# One node:   GPUS_PER_NODE=8 DATA=... VOCAB=... MERGE=... bash examples/pretrain_gpt_distributed.sh
# Many nodes: also set NNODES, NODE_RANK and MASTER_ADDR on every node.
# On CPUs it runs over gloo: GPUS_PER_NODE is then the number of processes.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-2}
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt2_345m_tp${TP}_pp${PP}}

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 16 \
    --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --train-iters 500000 --lr-decay-iters 320000 --weight-decay 1e-2 --clip-grad 1.0 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
