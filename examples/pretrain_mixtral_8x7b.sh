#!/usr/bin/env bash
# Mixtral 8x7B (32 layers, hidden 4096, 32 heads in 8 key/value groups, 8 SwiGLU experts of
# width 14336, top-2 routing with a load-balancing loss, RoPE base 1e6, RMSNorm, untied
# embeddings, no biases) with Megatron-LM's flags and layout: TP 1, PP 4, EP 8 (experts
# split over 8 of the data-parallel ranks), alltoall token dispatch, grouped GEMM, bf16;
# 4 nodes of 8 GPUs (EP 8 x PP 4 needs 32 ranks). TOKENIZER is Mixtral's tokenizer.model.
# Launch once per node; set NODE_RANK and MASTER_ADDR.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the Mixtral tokenizer.model}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/mixtral_8x7b}

torchrun --nproc_per_node 8 --nnodes "${NNODES:-4}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 \
    --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel \
    --use-mcore-models --disable-bias-linear \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 \
    --seq-length 4096 --max-position-embeddings 32768 \
    --position-embedding-type rope --no-position-embedding --rotary-base 1000000 \
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights \
    --no-masked-softmax-fusion --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 \
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --overlap-param-gather --overlap-grad-reduce \
    --micro-batch-size 1 --global-batch-size 256 \
    --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine \
    --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 \
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER" \
    --data-path $DATA --split 99990,8,2 \
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --tensorboard-dir "$CHECKPOINTS/tensorboard" --save "$CHECKPOINTS" --load "$CHECKPOINTS" "$@"
