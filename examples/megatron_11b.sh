#!/usr/bin/env bash
# Megatron-11b as fairseq trained it (examples/megatron_11b in fairseq: --arch
# transformer_lm_megatron_11b, model parallel 8): 72 pre-LN layers, hidden 3072, FFN 18432
# (6 x 3072), 32 heads, 1024 tokens per sample; fairseq's sinusoidal positions, embeddings
# scaled by sqrt(3072), the exact erf GeLU, a final layer norm and the output tied to the
# embeddings without a bias. Training as fairseq's command: --batch-size 2 per data-parallel
# replica, Adam (0.9, 0.98) eps 1e-8, lr 1.5e-4 with 3000 warm-up updates then inverse
# square root, weight decay 0.01, no gradient clipping (--clip-norm 0.0), dropout and
# attention dropout 0.1, fp16, 300000 updates. Every layer is split over 8 GPUs (TP 8); the
# world size is GPUS_PER_NODE x NNODES and the rest is data parallel.
# One node:   DATA=... VOCAB=... MERGE=... bash examples/megatron_11b.sh
# Many nodes: also set NNODES, NODE_RANK and MASTER_ADDR on every node.
# fairseq's released checkpoint converts with tools/convert_checkpoint.py --from fairseq
# (see examples/megatron_11b_wikitext103.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=8
DATA=${DATA:?set DATA}
VOCAB=${VOCAB:?set VOCAB}
MERGE=${MERGE:?set MERGE}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/megatron_11b}
DP=$(( GPUS_PER_NODE * NNODES / TP ))
if [ "$DP" -lt 1 ]; then
    echo "megatron_11b.sh: GPUS_PER_NODE x NNODES ($(( GPUS_PER_NODE * NNODES ))) must be a multiple of TP $TP" >&2
    exit 2
fi

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" \
    --num-layers 72 --hidden-size 3072 --ffn-hidden-size 18432 --num-attention-heads 32 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --position-embedding-type sinusoidal --scale-embeddings --exact-gelu \
    --micro-batch-size 2 --global-batch-size $(( 2 * DP )) \
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.98 --adam-eps 1e-8 \
    --lr 1.5e-4 --min-lr 0.0 --lr-decay-style inverse-square-root --lr-warmup-iters 3000 \
    --train-iters 300000 --weight-decay 0.01 --clip-grad 0.0 \
    --hidden-dropout 0.1 --attention-dropout 0.1 --fp16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGE" \
    --log-interval 100 --save-interval 5000 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
