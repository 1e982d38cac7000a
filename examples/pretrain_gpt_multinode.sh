#!/usr/bin/env bash
# GPT pretraining across several nodes: one torchrun agent per node, c10d rendezvous.
# Run the same command on every node (node ranks are assigned by the rendezvous):
#   NNODES=4 GPUS_PER_NODE=8 RDZV_ENDPOINT=node0:29400 DATA=... VOCAB=... MERGE=... \
#       bash examples/pretrain_gpt_multinode.sh [extra pretrain_gpt.py flags]
# Every agent must reach RDZV_ENDPOINT (host:port of any one node). On CPUs the ranks
# talk over gloo and GPUS_PER_NODE is the number of processes per node.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_ENDPOINT=${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of one node, e.g. node0:29400}
RDZV_ID=${RDZV_ID:-megatron-gpt}
TP=${TP:-8}
PP=${PP:-${NNODES}}
DATA=${DATA:?set DATA to a preprocessed prefix}
VOCAB=${VOCAB:?set VOCAB to a GPT-2 vocab.json}
MERGE=${MERGE:?set MERGE to a GPT-2 merges.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/gpt_multinode_tp${TP}_pp${PP}}

torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 4 --global-batch-size 256 \
    --lr 0.0002 --min-lr 2.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --train-iters 100000 --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 10 --log-throughput --save-interval 2000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
